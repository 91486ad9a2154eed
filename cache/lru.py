"""An O(log n) least-recently-used index keyed by a logical clock."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class _Ordered(Protocol):
    tick: int
    serial: int


T = TypeVar("T", bound=_Ordered)


class LRUIndex(Generic[T]):
    """Objects ordered by `(tick, serial)`, oldest first.

    `serial` is unique per object, so the order is total and the same in every
    implementation that uses the same clock (the documented tie-break: equal
    ticks go oldest-created first). An object's `tick` must not change while it
    is in the index (remove, change, add).

    Layout: a bucket per tick (a list kept in serial order; one object in
    practice, since a tick touches one root-to-leaf chain and only its deepest
    node can be a leaf) and a C `heapq` of plain int ticks with lazy deletion:
    a tick whose bucket emptied is skipped when it reaches the top, and the
    heap is rebuilt when stale ticks outnumber live ones. `add`, `remove` and
    `oldest` are O(log n) amortized with integer comparisons only; ordered
    iteration sorts, and is meant for inspection.
    """

    __slots__ = ("_buckets", "_size", "_ticks")

    def __init__(self) -> None:
        self._buckets: dict[int, list[T]] = {}
        self._ticks: list[int] = []  # a heap; may hold stale or repeated ticks
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, obj: T) -> bool:
        bucket = self._buckets.get(obj.tick)
        return bucket is not None and any(o is obj for o in bucket)

    def __iter__(self) -> Iterator[T]:
        """Members, oldest first."""
        for tick in sorted(self._buckets):
            yield from self._buckets[tick]

    def unordered(self) -> Iterator[T]:
        """Members in no particular order (cheap)."""
        for bucket in self._buckets.values():
            yield from bucket

    def add(self, obj: T) -> None:
        """Insert `obj` (must not be present)."""
        tick = obj.tick
        bucket = self._buckets.get(tick)
        if bucket is None:
            self._buckets[tick] = [obj]
            heapq.heappush(self._ticks, tick)
            if len(self._ticks) > 2 * len(self._buckets) + 64:
                self._ticks = list(self._buckets)
                heapq.heapify(self._ticks)
        else:
            bisect.insort(bucket, obj, key=_serial)
        self._size += 1

    def remove(self, obj: T) -> None:
        """Remove `obj` (must be present)."""
        tick = obj.tick
        bucket = self._buckets[tick]
        if len(bucket) == 1:
            if bucket[0] is not obj:
                raise KeyError(obj)
            del self._buckets[tick]
        else:
            bucket.remove(obj)
        self._size -= 1

    def oldest(self) -> T:
        """The least recent object (index must not be empty)."""
        ticks = self._ticks
        buckets = self._buckets
        while True:
            bucket = buckets.get(ticks[0])
            if bucket is not None:
                return bucket[0]
            heapq.heappop(ticks)


def _serial(obj: _Ordered) -> int:
    return obj.serial
