"""Contract details of `cache.faults.Faults` (mutation survivors).

`check` records every point (even the one that fails) and counts it; `points`
keeps only the last `RECENT_POINTS` names, oldest first, while `count` counts
them all. `arm(after=k)` lets exactly k checks pass and fails the next one,
once, naming its point; `disarm` stops that and keeps the record; `reset`
disarms and forgets the record and the count. `arm` takes only a non-negative
int (not a bool), and its errors name the argument and the value or type.
"""

from __future__ import annotations

import pytest

from cache.faults import RECENT_POINTS, Faults
from spec.errors import AllocationFailed


def test_a_fresh_injector_records_and_counts_every_check_and_never_fails() -> None:
    """Unarmed: no check raises; `points` lists them in order and `count` counts them."""
    faults = Faults()
    assert faults.points == [] and faults.count == 0
    for i in range(5):
        faults.check(f"p{i}")
    assert faults.points == ["p0", "p1", "p2", "p3", "p4"]
    assert faults.count == 5


def test_points_keeps_the_most_recent_only_while_count_counts_all() -> None:
    """Past `RECENT_POINTS` checks, the oldest names drop out; `count` does not cap."""
    assert RECENT_POINTS == 256
    faults = Faults()
    for i in range(RECENT_POINTS + 10):
        faults.check(str(i))
    assert faults.points == [str(i) for i in range(10, RECENT_POINTS + 10)]
    assert faults.count == RECENT_POINTS + 10


@pytest.mark.parametrize("after", [0, 1, 2, 5])
def test_arm_lets_exactly_after_checks_pass_then_fails_once(after: int) -> None:
    """The `after`-th following check (0-based) raises, naming its point; then no more."""
    faults = Faults()
    faults.arm(after=after)
    for i in range(after):
        faults.check(f"ok{i}")
    with pytest.raises(AllocationFailed) as raised:
        faults.check("boom")
    assert str(raised.value) == "injected allocation failure at boom"
    for i in range(after + 3):
        faults.check(f"later{i}")  # fired once: disarmed
    assert faults.count == 2 * after + 4
    assert faults.points[after] == "boom"  # the failing check is recorded too


def test_arming_again_replaces_the_countdown() -> None:
    """A second `arm` counts from the moment it is called, not from the first one."""
    faults = Faults()
    faults.arm(after=0)
    faults.arm(after=2)
    faults.check("a")
    faults.check("b")
    with pytest.raises(AllocationFailed, match=r"^injected allocation failure at c$"):
        faults.check("c")


def test_disarm_stops_failing_and_keeps_the_record() -> None:
    """After `disarm` the armed check passes; the points and the count stay."""
    faults = Faults()
    faults.check("a")
    faults.arm(after=1)
    faults.check("b")
    faults.disarm()
    faults.check("c")
    faults.check("d")
    assert faults.points == ["a", "b", "c", "d"] and faults.count == 4


def test_reset_disarms_and_forgets_points_and_count() -> None:
    """`reset` is a fresh injector: not armed, nothing recorded, the count at 0."""
    faults = Faults()
    faults.check("a")
    faults.check("b")
    faults.arm(after=0)
    faults.reset()
    assert faults.points == [] and faults.count == 0
    faults.check("c")  # would have failed had reset left it armed
    assert faults.points == ["c"] and faults.count == 1


@pytest.mark.parametrize(
    ("after", "message"),
    [
        (True, "after must be an int, got bool"),
        (False, "after must be an int, got bool"),
        (1.0, "after must be an int, got float"),
        ("1", "after must be an int, got str"),
        (None, "after must be an int, got NoneType"),
    ],
)
def test_arm_rejects_a_non_int_naming_its_type(after: object, message: str) -> None:
    """A bool or non-int `after` is a `TypeError` naming the argument and the type;
    the injector stays unarmed."""
    faults = Faults()
    with pytest.raises(TypeError) as raised:
        faults.arm(after=after)  # type: ignore[arg-type]
    assert str(raised.value) == message
    faults.check("a")  # not armed


def test_arm_rejects_a_negative_count_and_accepts_zero() -> None:
    """`after` must be >= 0: -1 is a `ValueError` naming the value; 0 arms the next check."""
    faults = Faults()
    with pytest.raises(ValueError) as raised:
        faults.arm(after=-1)
    assert str(raised.value) == "after must be >= 0, got -1"
    with pytest.raises(ValueError, match=r"^after must be >= 0, got -7$"):
        faults.arm(after=-7)
    faults.check("a")  # a rejected arm leaves it unarmed
    faults.arm(after=0)
    with pytest.raises(AllocationFailed, match=r"^injected allocation failure at b$"):
        faults.check("b")
