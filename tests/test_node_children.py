"""`Node.children`'s three shapes (none, the one child itself, a dict of two or more)
behave as one mapping from key to child under any order of attach and detach."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.node import NO_CHILDREN, Node
from tests.helpers import detached_node


def _node(key: bytes | None, serial: int) -> Node:
    return detached_node(key, serial=serial, block=serial, state="cached")


KEYS = [b"a", b"b", b"c", b"d"]


@given(st.lists(st.tuples(st.booleans(), st.sampled_from(KEYS)), max_size=40))
def test_children_shapes_behave_as_one_mapping(ops: list[tuple[bool, bytes]]) -> None:
    parent = _node(None, 0)
    model: dict[bytes, Node] = {}
    for serial, (attach, key) in enumerate(ops, 1):
        if attach and key not in model:
            child = _node(key, serial)
            parent.attach_child(key, child)
            model[key] = child
        elif not attach and key in model:
            parent.detach_child(key)
            del model[key]
        elif not attach:
            with pytest.raises((KeyError, TypeError)):
                parent.detach_child(key)
        # the shape: nothing, the child itself, or a dict of two or more
        if not model:
            assert parent.children is NO_CHILDREN
        elif len(model) == 1:
            assert parent.children is next(iter(model.values()))
        else:
            assert isinstance(parent.children, dict) and len(parent.children) >= 2
        assert parent.child_count() == len(model)
        assert parent.child_nodes() == list(model.values())  # attach order, like a dict
        for k in KEYS:
            assert parent.child(k) is model.get(k)
            assert parent.child(bytes(k)) is model.get(k)  # equal key, another object


def test_detaching_from_a_leaf_or_a_wrong_key_changes_nothing() -> None:
    parent = _node(None, 0)
    with pytest.raises(TypeError, match="read-only"):
        parent.detach_child(b"a")  # NO_CHILDREN refuses writes
    only = _node(b"a", 1)
    parent.attach_child(b"a", only)
    with pytest.raises(KeyError):
        parent.detach_child(b"b")
    assert parent.children is only
