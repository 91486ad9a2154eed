"""Contract details of `cache.lru.LRUIndex` (mutation survivors).

Membership is by identity: `obj in index` is True exactly for the objects
added and not yet removed, even when a stranger shares a member's tick; and
removing a non-member raises `KeyError` naming that object, whatever bucket its
tick falls in.
"""

from __future__ import annotations

import pytest

from cache.lru import LRUIndex


class _Item:
    def __init__(self, tick: int, serial: int) -> None:
        self.tick = tick
        self.serial = serial


def test_a_stranger_sharing_the_tick_of_several_members_is_not_a_member() -> None:
    index: LRUIndex[_Item] = LRUIndex()
    a, b, stranger = _Item(4, 1), _Item(4, 2), _Item(4, 3)
    index.add(a)
    index.add(b)
    assert a in index and b in index
    assert stranger not in index
    index.add(stranger)
    index.remove(a)
    assert a not in index and b in index and stranger in index


def test_removing_a_stranger_from_a_shared_tick_names_it_and_changes_nothing() -> None:
    index: LRUIndex[_Item] = LRUIndex()
    a, b, stranger = _Item(4, 1), _Item(4, 2), _Item(4, 3)
    index.add(a)
    index.add(b)
    with pytest.raises(KeyError) as raised:
        index.remove(stranger)
    assert raised.value.args == (stranger,)
    assert raised.value.__context__ is None  # raised on its own, not from another error
    assert list(index) == [a, b] and len(index) == 2


class _EqualToAll(_Item):
    """An object that claims equality with everything (a hostile or careless `__eq__`)."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


def test_remove_within_a_shared_tick_removes_that_very_object() -> None:
    """Membership is by identity, so removal is too: an earlier member of the bucket
    that compares equal to the one removed stays indexed."""
    index: LRUIndex[_Item] = LRUIndex()
    a, b, c = _EqualToAll(4, 1), _EqualToAll(4, 2), _EqualToAll(4, 3)
    for item in (a, b, c):
        index.add(item)
    index.remove(b)
    assert [x is y for x, y in zip(index, [a, c], strict=True)] == [True, True]
    assert a in index and b not in index and c in index and len(index) == 2
    with pytest.raises(KeyError) as raised:
        index.remove(b)
    assert raised.value.args[0] is b
    assert len(index) == 2
