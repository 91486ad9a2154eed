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
    assert raised.value.__suppress_context__  # not chained to the list's ValueError
    assert list(index) == [a, b] and len(index) == 2
