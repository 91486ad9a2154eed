"""Contract details of `cache.node` that the behaviour tests leave open (mutation survivors).

`Node.child` is the reference lookup that `match` and `commit` inline: it must
find a child by an equal key (not only the identical object) in both the
single-child and the dict shape, and miss on any other key. The shared
`NO_CHILDREN` refuses writes with a message that says why. A checkpoint keeps
its partial tail's extra identity, which decides whether a request hits it.
"""

from __future__ import annotations

import re

import pytest

from cache.keys import pack_tokens
from cache.node import NO_BLOCK, NO_CHILDREN, Node, child_of
from tests.helpers import detached_node, ssm_trie, state

MESSAGE = "NO_CHILDREN is shared by every leaf and is read-only"


def _root() -> Node:
    return detached_node()


def _child(parent: Node, tokens: list[int], serial: int) -> Node:
    key = pack_tokens(tokens)
    node = child_of(parent, key=key, block=serial, serial=serial, tick=0, block_hash=0, state="x")
    parent.attach_child(key, node)
    return node


def test_child_finds_the_single_child_by_an_equal_key_and_misses_others() -> None:
    root = _root()
    assert root.child(pack_tokens([1])) is None
    one = _child(root, [1, 2], 1)
    assert root.children is one
    assert root.child(one.key) is one
    equal = bytes(bytearray(pack_tokens([1, 2])))
    assert equal is not one.key
    assert root.child(equal) is one
    assert root.child(pack_tokens([1, 3])) is None


def test_child_finds_each_child_in_the_dict_shape() -> None:
    root = _root()
    a = _child(root, [1, 2], 1)
    b = _child(root, [3, 4], 2)
    assert isinstance(root.children, dict)
    assert root.child(bytes(bytearray(pack_tokens([1, 2])))) is a
    assert root.child(pack_tokens([3, 4])) is b
    assert root.child(pack_tokens([5, 6])) is None


@pytest.mark.parametrize(
    "write",
    [
        lambda d: d.__setitem__(b"k", None),
        lambda d: d.__delitem__(b"k"),
        lambda d: d.setdefault(b"k", None),
        lambda d: d.update({b"k": None}),
        lambda d: d.pop(b"k"),
        lambda d: d.popitem(),
        lambda d: d.clear(),
    ],
)
def test_no_children_refuses_every_write_and_says_why(write: object) -> None:
    with pytest.raises(TypeError, match=f"^{re.escape(MESSAGE)}$"):
        write(NO_CHILDREN)  # type: ignore[operator]
    assert len(NO_CHILDREN) == 0


def test_a_checkpoint_keeps_its_tail_identity_and_only_that_identity_hits_it() -> None:
    trie, copies = ssm_trie(num_blocks=16, slots=2)
    assert copies is not None
    seq = trie.match([1, 2, 3, 4, 5, 6], extra=("a", "b"))
    trie.allocate(seq, 6)
    trie.commit(seq, 6)
    trie.save(seq, 6, state(1.0))
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    (view,) = trie.snapshot()["checkpoints"].values()
    assert (view["tail"], view["tail_extra"]) == ((5, 6), "b")
    other = trie.match([1, 2, 3, 4, 5, 6, 7], extra=("a", "c"))
    assert other.restore is None
    trie.abort(other)
    same = trie.match([1, 2, 3, 4, 5, 6, 7], extra=("a", "b"))
    assert same.restore is not None and same.restore.step == 6
    trie.abort(same)
    trie.check()


def test_child_count_counts_every_shape() -> None:
    root = _root()
    assert root.child_count() == 0
    _child(root, [1, 2], 1)
    assert root.child_count() == 1
    _child(root, [3, 4], 2)
    _child(root, [5, 6], 3)
    assert root.child_count() == 3


def test_detach_the_single_child_by_an_equal_key_and_refuse_another() -> None:
    root = _root()
    one = _child(root, [1, 2], 1)
    missing = pack_tokens([9, 9])
    with pytest.raises(KeyError) as raised:
        root.detach_child(missing)
    assert raised.value.args == (missing,)
    assert root.children is one
    root.detach_child(bytes(bytearray(pack_tokens([1, 2]))))
    assert root.children is NO_CHILDREN  # type: ignore[comparison-overlap]


def test_the_keyword_constructor_links_its_parent() -> None:
    root = _root()
    node = Node(
        parent=root,
        key=(pack_tokens([1]), "e"),  # a block with an extra identity: it is in the key
        block=3,
        namespace="t",
        serial=4,
        tick=5,
        block_hash=6,
        state="s",
    )
    assert node.parent is root
    assert (node.extra, node.block, node.namespace, node.serial) == ("e", 3, "t", 4)
    assert (node.tick, node.block_hash, node.state, node.tokens) == (5, 6, "s", (1,))
    assert node.children is NO_CHILDREN and node.checkpoint is None
    assert (node.host, node.residency) == (NO_BLOCK, "device")


def test_the_keyword_constructor_and_child_of_build_the_same_record() -> None:
    root = detached_node(namespace="ns")
    key = pack_tokens([7, 8])
    fields = {"key": key, "block": 3, "serial": 2, "tick": 5, "block_hash": 9, "state": "cached"}
    built = Node(parent=root, namespace="ns", **fields)  # type: ignore[arg-type]
    fast = child_of(root, **fields)  # type: ignore[arg-type]
    assert {f: getattr(built, f) for f in Node.__slots__} == {
        f: getattr(fast, f) for f in Node.__slots__
    }
    assert (fast.host, fast.residency, fast.namespace) == (NO_BLOCK, "device", "ns")
