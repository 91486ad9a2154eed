"""An O(log n) least-recently-used index keyed by a logical clock."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Generic, TypeVar

T = TypeVar("T")

_tick = attrgetter("tick")
_serial = attrgetter("serial")


class LRUIndex(Generic[T]):
    """Members ordered by `(tick, serial)`, oldest first.

    `serial` is unique per member, so the order is total and the same in every
    implementation that uses the same clock (the documented tie-break: equal
    ticks go oldest-created first). A member's `tick` must not change while it
    is in the index (remove, change, add).

    Members are objects with `tick` and `serial` attributes (checkpoints), or
    anything else with `tick_of` / `serial_of` to read them (nodes: ids whose
    ticks and serials are columns of a `cache.node.NodeTable`, read by the
    columns' C-level `__getitem__`). Members are compared with `==` (objects
    without `__eq__`: identity).

    Layout: a bucket per tick, holding the member itself when it is the
    tick's only member (the usual case: a tick touches one root-to-leaf chain
    and only its deepest node can be a leaf) and a list kept in serial order
    otherwise; and a C `heapq` of plain int ticks with lazy deletion: a tick
    whose bucket emptied is skipped when it reaches the top, and the heap is
    rebuilt when stale ticks outnumber live ones. `add`, `remove` and
    `oldest` are O(log n) amortized with integer comparisons only; ordered
    iteration sorts, and is meant for inspection.
    """

    __slots__ = ("_buckets", "_serial_of", "_size", "_tick_of", "_ticks")

    def __init__(
        self,
        tick_of: Callable[[T], int] = _tick,
        serial_of: Callable[[T], int] = _serial,
    ) -> None:
        self._tick_of = tick_of
        self._serial_of = serial_of
        self._buckets: dict[int, T | list[T]] = {}
        self._ticks: list[int] = []  # a heap; may hold stale or repeated ticks
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, member: T) -> bool:
        bucket = self._buckets.get(self._tick_of(member))
        if type(bucket) is list:
            return member in bucket
        return bucket is not None and bucket == member

    def __iter__(self) -> Iterator[T]:
        """Members, oldest first."""
        for tick in sorted(self._buckets):
            yield from _members(self._buckets[tick])

    def unordered(self) -> Iterator[T]:
        """Members in no particular order (cheap)."""
        for bucket in self._buckets.values():
            yield from _members(bucket)

    def add(self, member: T) -> None:
        """Insert `member` (must not be present)."""
        tick = self._tick_of(member)
        buckets = self._buckets
        bucket = buckets.get(tick)
        if bucket is None:
            buckets[tick] = member
            ticks = self._ticks
            heapq.heappush(ticks, tick)
            if len(ticks) > 2 * len(buckets) + 64:
                self._ticks = list(buckets)
                heapq.heapify(self._ticks)
        elif type(bucket) is list:
            bisect.insort(bucket, member, key=self._serial_of)
        else:
            buckets[tick] = sorted((bucket, member), key=self._serial_of)  # type: ignore[arg-type]
        self._size += 1

    def remove(self, member: T) -> None:
        """Remove `member`; `KeyError` when it is not a member."""
        tick = self._tick_of(member)
        buckets = self._buckets
        bucket = buckets.get(tick)
        if type(bucket) is list:
            for i, other in enumerate(bucket):
                if other == member:
                    del bucket[i]
                    break
            else:
                raise KeyError(member)
            if len(bucket) == 1:
                buckets[tick] = bucket[0]
        elif bucket is not None and bucket == member:
            del buckets[tick]
        else:
            raise KeyError(member)
        self._size -= 1

    def oldest(self) -> T:
        """The least recent member (index must not be empty)."""
        ticks = self._ticks
        buckets = self._buckets
        while True:
            bucket = buckets.get(ticks[0])
            if bucket is not None:
                return bucket[0] if type(bucket) is list else bucket  # type: ignore[return-value]
            heapq.heappop(ticks)


def _members(bucket: T | list[T]) -> list[T]:
    return bucket if type(bucket) is list else [bucket]  # type: ignore[list-item]
