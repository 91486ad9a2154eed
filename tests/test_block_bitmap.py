"""`cache.event_log.BlockBitmap`: the views `check()` replays events into.

It must mean exactly what the `set[int]` it replaced meant (invariant 10 is
checked against it), whatever order ids are added, removed and cleared in,
negative ids included; and it must cost about a byte per id, not a set's ~70.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cache.event_log import BlockBitmap
from cache.events import BlockRemoved, BlockStored, replay_views

_IDS = st.lists(st.integers(-3, 40), max_size=6)
_STEPS = st.lists(st.tuples(st.sampled_from(["update", "difference_update", "clear"]), _IDS))


@given(_STEPS)
@example([("update", [0, -1]), ("difference_update", [-1, 1])])  # past the end; a negative
@example([("update", [-2]), ("difference_update", [-2])])
# A negative id inside the bytes' range, after ids already set in the same call: the
# bytes must not wrap it around to their end.
@example([("update", [10]), ("update", [3, -1])])
@example([("update", [10, 9]), ("difference_update", [3, -1, 9]), ("update", [-2, 4])])
@example([("update", [0]), ("difference_update", [1, 0])])  # id 0 on the careful path
def test_a_bitmap_holds_what_a_set_holds(steps: list[tuple[str, list[int]]]) -> None:
    bitmap, reference = BlockBitmap(), set[int]()
    for op, ids in steps:
        if op == "clear":
            bitmap.clear()
            reference.clear()
        else:
            getattr(bitmap, op)(ids)
            getattr(reference, op)(ids)
        assert list(bitmap) == sorted(reference)
        assert len(bitmap) == len(reference)
        for i in range(-4, 42):
            assert (i in bitmap) == (i in reference)


def test_replay_views_applies_events_to_a_bitmap_as_to_a_set() -> None:
    events = [
        BlockStored((1, 2, 3), (7, 3, 9), None, (), 16, ""),
        BlockRemoved((2, 4), (3, 100), ""),
        BlockStored((5,), (0,), 3, (), 16, ""),
    ]
    bitmap, reference = BlockBitmap(), set[int]()
    replay_views(events, {(0, "GPU"): bitmap})
    replay_views(events, {(0, "GPU"): reference})
    assert list(bitmap) == sorted(reference) == [0, 7, 9]
    assert repr(bitmap) == "BlockBitmap([0, 7, 9])"
    assert "7" not in bitmap and 7.0 not in bitmap  # ids are ints


def test_a_bitmap_costs_about_a_byte_per_id() -> None:
    bitmap = BlockBitmap()
    n = 1 << 17
    for start in range(0, n, 16):
        bitmap.update(list(range(start, start + 16)))
    assert len(bitmap) == n
    assert sys.getsizeof(bitmap._bits) < 1.2 * n  # a set of as many ints: ~70 bytes each


@pytest.mark.parametrize(
    ("batches", "size"),
    [([[0]], 1), ([[5]], 6), ([[0], [1]], 2), ([[0], [1], [2]], 4), ([[3], [4], [20]], 21)],
)
def test_a_bitmap_grows_to_the_largest_id_or_doubles(batches: list[list[int]], size: int) -> None:
    bitmap = BlockBitmap()
    for ids in batches:
        bitmap.update(ids)
    assert len(bitmap._bits) == size
