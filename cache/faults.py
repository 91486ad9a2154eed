"""Fault injection at allocation points, for tests of transactional behaviour."""

from __future__ import annotations

from spec.errors import AllocationFailed


class Faults:
    """Counts allocation points and fails the chosen one.

    Every pool `take` calls `check(point)` before it changes anything. After
    `arm(after=k)` the k-th following check (0-based) raises `AllocationFailed`
    once; `points` records the names of every check seen since `reset()`.
    """

    __slots__ = ("_countdown", "points")

    def __init__(self) -> None:
        self._countdown: int | None = None
        self.points: list[str] = []

    def arm(self, after: int = 0) -> None:
        """Fail the allocation point `after` checks from now."""
        if after < 0:
            raise ValueError("after must be >= 0")
        self._countdown = after

    def disarm(self) -> None:
        """Stop failing."""
        self._countdown = None

    def reset(self) -> None:
        """Disarm and forget the points seen."""
        self._countdown = None
        self.points.clear()

    def check(self, point: str) -> None:
        """Record `point`; raise `AllocationFailed` if this is the armed one."""
        self.points.append(point)
        if self._countdown is None:
            return
        if self._countdown == 0:
            self._countdown = None
            raise AllocationFailed(f"injected allocation failure at {point}")
        self._countdown -= 1
