"""An O(log n) least-recently-used index keyed by a logical clock."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator, Sequence
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

    Layout: a bucket per tick, holding the object itself when it is the
    tick's only member (the usual case: a tick touches one root-to-leaf chain
    and only its deepest node can be a leaf) and a list kept in serial order
    otherwise; and a C `heapq` of plain int ticks with lazy deletion: a tick
    whose bucket emptied is skipped when it reaches the top, and the heap is
    rebuilt when stale ticks outnumber live ones. `add`, `remove` and
    `oldest` are O(log n) amortized with integer comparisons only; ordered
    iteration sorts, and is meant for inspection.
    """

    __slots__ = ("_buckets", "_size", "_ticks")

    def __init__(self) -> None:
        self._buckets: dict[int, T | list[T]] = {}
        self._ticks: list[int] = []  # a heap; may hold stale or repeated ticks
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, obj: T) -> bool:
        bucket = self._buckets.get(obj.tick)
        if type(bucket) is list:
            return any(o is obj for o in bucket)
        return bucket is obj

    def __iter__(self) -> Iterator[T]:
        """Members, oldest first."""
        for tick in sorted(self._buckets):
            yield from _members(self._buckets[tick])

    def unordered(self) -> Iterator[T]:
        """Members in no particular order (cheap)."""
        for bucket in self._buckets.values():
            yield from _members(bucket)

    def add(self, obj: T) -> None:
        """Insert `obj` (must not be present)."""
        tick = obj.tick
        buckets = self._buckets
        bucket = buckets.get(tick)
        if bucket is None:
            buckets[tick] = obj
            ticks = self._ticks
            heapq.heappush(ticks, tick)
            if len(ticks) > 2 * len(buckets) + 64:
                self._ticks = list(buckets)
                heapq.heapify(self._ticks)
        elif type(bucket) is list:
            bisect.insort(bucket, obj, key=_serial)
        else:
            buckets[tick] = sorted((bucket, obj), key=_serial)  # type: ignore[arg-type]
        self._size += 1

    def remove(self, obj: T) -> None:
        """Remove `obj`; `KeyError` when it is not a member."""
        tick = obj.tick
        buckets = self._buckets
        bucket = buckets[tick]
        if bucket is obj:
            del buckets[tick]
        elif type(bucket) is list:
            for i, member in enumerate(bucket):  # by identity, as `__contains__`
                if member is obj:
                    del bucket[i]
                    break
            else:
                raise KeyError(obj)
            if len(bucket) == 1:
                buckets[tick] = bucket[0]
        else:
            raise KeyError(obj)
        self._size -= 1

    def oldest(self) -> T:
        """The least recent object (index must not be empty)."""
        ticks = self._ticks
        buckets = self._buckets
        while True:
            bucket = buckets.get(ticks[0])
            if bucket is not None:
                return bucket[0] if type(bucket) is list else bucket  # type: ignore[return-value]
            heapq.heappop(ticks)


def older(a: _Ordered, b: _Ordered) -> bool:
    """Whether `a` comes before `b` in the index's order, `(tick, serial)`."""
    return a.tick < b.tick or (a.tick == b.tick and a.serial < b.serial)


def _members(bucket: T | list[T]) -> list[T]:
    return bucket if type(bucket) is list else [bucket]  # type: ignore[list-item]


def _serial(obj: _Ordered) -> int:
    return obj.serial


class NodeLRU:
    """`LRUIndex` for nodes that are ids in a `cache.node.NodeTable`: the same
    order, layout and costs, reading each node's `tick` and `serial` from the
    table's columns instead of from an object. A node's tick must not change
    while it is in the index (remove, change, add)."""

    __slots__ = ("_buckets", "_serials", "_size", "_tick_of", "_ticks")

    def __init__(self, ticks: Sequence[int], serials: Sequence[int]) -> None:
        self._tick_of = ticks  # the table's columns: they grow in place
        self._serials = serials
        self._buckets: dict[int, int | list[int]] = {}
        self._ticks: list[int] = []  # a heap; may hold stale or repeated ticks
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, node: int) -> bool:
        bucket = self._buckets.get(self._tick_of[node])
        if type(bucket) is list:
            return node in bucket
        return bucket == node

    def __iter__(self) -> Iterator[int]:
        """Members, oldest first."""
        for tick in sorted(self._buckets):
            yield from _node_members(self._buckets[tick])

    def unordered(self) -> Iterator[int]:
        """Members in no particular order (cheap)."""
        for bucket in self._buckets.values():
            yield from _node_members(bucket)

    def add(self, node: int) -> None:
        """Insert `node` (must not be present)."""
        tick = self._tick_of[node]
        buckets = self._buckets
        bucket = buckets.get(tick)
        if bucket is None:
            buckets[tick] = node
            ticks = self._ticks
            heapq.heappush(ticks, tick)
            if len(ticks) > 2 * len(buckets) + 64:
                self._ticks = list(buckets)
                heapq.heapify(self._ticks)
        elif type(bucket) is list:
            bisect.insort(bucket, node, key=self._serials.__getitem__)
        else:
            buckets[tick] = sorted((bucket, node), key=self._serials.__getitem__)  # type: ignore[arg-type]
        self._size += 1

    def remove(self, node: int) -> None:
        """Remove `node`; `KeyError` when it is not a member."""
        tick = self._tick_of[node]
        buckets = self._buckets
        bucket = buckets.get(tick)
        if bucket is None:
            raise KeyError(node)
        if type(bucket) is list:
            try:
                bucket.remove(node)
            except ValueError:
                raise KeyError(node) from None
            if len(bucket) == 1:
                buckets[tick] = bucket[0]
        elif bucket == node:
            del buckets[tick]
        else:
            raise KeyError(node)
        self._size -= 1

    def oldest(self) -> int:
        """The least recent node (index must not be empty)."""
        ticks = self._ticks
        buckets = self._buckets
        while True:
            bucket = buckets.get(ticks[0])
            if bucket is not None:
                return bucket[0] if type(bucket) is list else bucket  # type: ignore[return-value]
            heapq.heappop(ticks)


def _node_members(bucket: int | list[int]) -> list[int]:
    return bucket if type(bucket) is list else [bucket]  # type: ignore[list-item]
