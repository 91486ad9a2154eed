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


def test_members_are_compared_by_equality_so_node_ids_are_found_by_value() -> None:
    """Node ids are members by value: an equal `int` made elsewhere (another object
    above the small-int cache) is the same member, for `in` and `remove`, in a
    single-member bucket and in a shared one. Ticks and serials are read through
    the given functions, as from a node table's columns."""
    ticks = {10**12 + 1: 4, 10**12 + 2: 4, 10**12 + 3: 5}
    index: LRUIndex[int] = LRUIndex(ticks.__getitem__, lambda node: node)
    for node in ticks:
        index.add(node)
    again = [int(str(node)) for node in ticks]  # equal values, other objects
    assert all(a is not b and a == b for a, b in zip(again, ticks, strict=True))
    assert all(node in index for node in again)
    index.remove(again[1])  # from the shared bucket of tick 4
    index.remove(again[2])  # the single-member bucket of tick 5
    assert list(index) == [10**12 + 1] and len(index) == 1
    with pytest.raises(KeyError) as raised:
        index.remove(again[1])
    assert raised.value.args == (again[1],)
    assert raised.value.__context__ is None
