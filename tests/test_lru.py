"""`LRUIndex` against a sorted list: every add / remove / oldest, ties at one tick included.

Ticks come from a tiny range so several members share a tick (list buckets) and
buckets shrink back to one member (the member held directly).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.lru import LRUIndex


@dataclass(eq=False)
class _Item:
    tick: int
    serial: int


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "oldest"]), st.integers(0, 3), st.integers(0, 30)),
    max_size=120,
)


@given(OPS)
def test_index_orders_like_a_sorted_list(ops: list[tuple[str, int, int]]) -> None:
    index: LRUIndex[_Item] = LRUIndex()
    members: list[_Item] = []
    serial = 0
    for op, tick, pick in ops:
        if op == "add":
            serial += 1
            item = _Item(tick, serial)
            index.add(item)
            members.append(item)
        elif op == "remove" and members:
            item = members.pop(pick % len(members))
            index.remove(item)
            assert item not in index
        elif op == "oldest" and members:
            assert index.oldest() is min(members, key=lambda m: (m.tick, m.serial))
        ordered = sorted(members, key=lambda m: (m.tick, m.serial))
        assert list(index) == ordered
        assert sorted(index.unordered(), key=lambda m: m.serial) == sorted(
            members, key=lambda m: m.serial
        )
        assert len(index) == len(members) and bool(index) == bool(members)
        assert all(m in index for m in members)


def test_removing_an_absent_member_raises_key_error() -> None:
    index: LRUIndex[_Item] = LRUIndex()
    a, b, c = _Item(1, 1), _Item(1, 2), _Item(1, 3)
    with pytest.raises(KeyError):
        index.remove(a)
    index.add(a)
    with pytest.raises(KeyError):
        index.remove(b)  # same tick, not a member: the single-member bucket holds `a`
    index.add(b)
    with pytest.raises(KeyError):
        index.remove(c)  # same tick, not a member of the two-member bucket
    assert list(index) == [a, b]
