"""An O(log n) least-recently-used index keyed by a logical clock."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from sortedcontainers import SortedList


class _Ordered(Protocol):
    tick: int
    serial: int


T = TypeVar("T", bound=_Ordered)


class LRUIndex(Generic[T]):
    """Objects ordered by `(tick, serial)`, oldest first.

    An object's `tick` must not change while it is in the index (remove, change,
    add). `serial` is unique per object, so the order is total and the same in
    every implementation that uses the same clock (the documented tie-break:
    equal ticks go oldest-created first). Entries are `(tick, serial, obj)`
    tuples in a `SortedList`; `serial` is unique, so `obj` is never compared.
    """

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: SortedList = SortedList()

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, obj: T) -> bool:
        return (obj.tick, obj.serial, obj) in self._items

    def __iter__(self) -> Iterator[T]:
        return (entry[2] for entry in self._items)

    def add(self, obj: T) -> None:
        """Insert `obj` (must not be present)."""
        self._items.add((obj.tick, obj.serial, obj))

    def remove(self, obj: T) -> None:
        """Remove `obj` (must be present)."""
        self._items.remove((obj.tick, obj.serial, obj))

    def oldest(self) -> T:
        """The least recent object (index must not be empty)."""
        entry: tuple[int, int, T] = self._items[0]
        return entry[2]
