"""Fault injection at allocation points, for tests of transactional behaviour."""

from __future__ import annotations

from collections import deque

from spec.errors import AllocationFailed

RECENT_POINTS = 256
"""How many of the most recent allocation points `Faults.points` remembers."""


class Faults:
    """Counts allocation points and fails the chosen one.

    Every pool `take` calls `check(point)` before it changes anything. After
    `arm(after=k)` the k-th following check (0-based) raises `AllocationFailed`
    once. `points` lists the names of the last `RECENT_POINTS` checks since
    `reset()` and `count` counts them all: memory stays flat however long an
    engine runs (the checks are on every allocation).
    """

    __slots__ = ("_countdown", "_recent", "count")

    def __init__(self) -> None:
        self._countdown: int | None = None
        self._recent: deque[str] = deque(maxlen=RECENT_POINTS)
        self.count = 0

    @property
    def points(self) -> list[str]:
        """The most recent allocation points seen since `reset()`, oldest first."""
        return list(self._recent)

    def arm(self, after: int = 0) -> None:
        """Fail the allocation point `after` checks from now."""
        if isinstance(after, bool) or not isinstance(after, int):
            raise TypeError(f"after must be an int, got {type(after).__name__}")
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        self._countdown = after

    def disarm(self) -> None:
        """Stop failing."""
        self._countdown = None

    def reset(self) -> None:
        """Disarm and forget the points seen."""
        self._countdown = None
        self._recent.clear()
        self.count = 0

    def check(self, point: str) -> None:
        """Record `point`; raise `AllocationFailed` if this is the armed one."""
        self._recent.append(point)
        self.count += 1
        if self._countdown is None:
            return
        if self._countdown == 0:
            self._countdown = None
            raise AllocationFailed(f"injected allocation failure at {point}")
        self._countdown -= 1
