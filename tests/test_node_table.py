"""`cache.node.NodeTable`: nodes as rows of columns.

The children of a node have two shapes (the only child in `child[node]`, or
a dict in `kids[node]` for two or more and for every root); under any order
of attach and detach they behave as one mapping from key to child, found by
an *equal* key (not only the identical object). Plain keys live in the
`tokens` column and are compared there; any other key (an extra identity, a
64-bit id, an injected key hash) is kept whole in `wide` and compared with
`==`, so a plain key never matches it, nor it a plain key. Rows are reused
after `release`, and the table grows in place when every row is taken.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cache.node
from cache.keys import HashedKey, pack_tokens
from cache.node import (
    MANY,
    NO_BLOCK,
    NO_CHILD,
    NO_NODE,
    Constant,
    Node,
    NodeTable,
    state_name,
)

B = 2  # block size: plain keys are 8 bytes


def _table(capacity: int = 4) -> tuple[NodeTable, Node]:
    table = NodeTable(B, capacity)
    root = table.new(NO_NODE, None, NO_BLOCK, -1, 0, 0, "root", "")
    return table, root


def _child(table: NodeTable, parent: Node, key: object, serial: int) -> Node:
    node = table.new(parent, key, serial, serial, 0, 0, "cached", table.namespace_of(parent))
    table.attach_child(parent, key, node)
    return node


def _link(table: NodeTable, parent: Node) -> Node:
    """A non-root node under `parent` (roots keep a dict even for one child)."""
    return _child(table, parent, pack_tokens([9, 9]), 100)


KEYS = [pack_tokens([1, 2]), pack_tokens([3, 4]), pack_tokens([1, 3]), pack_tokens([2, 1])]


@given(st.lists(st.tuples(st.booleans(), st.sampled_from(range(len(KEYS)))), max_size=40))
def test_children_shapes_behave_as_one_mapping(ops: list[tuple[bool, int]]) -> None:
    table, root = _table()
    parent = _link(table, root)
    model: dict[bytes, Node] = {}
    for serial, (attach, k) in enumerate(ops, 1):
        key = KEYS[k]
        if attach and key not in model:
            model[key] = _child(table, parent, key, serial)
        elif not attach and key in model:
            table.detach_child(parent, model.pop(key))
        # the shape: a leaf, the only child in `child`, or a dict of two or more
        if not model:
            assert table.child[parent] == NO_CHILD and parent not in table.kids
        elif len(model) == 1:
            assert table.child[parent] == next(iter(model.values()))
            assert parent not in table.kids
        else:
            assert table.child[parent] == MANY and len(table.kids[parent]) >= 2
        assert table.child_count(parent) == len(model)
        assert table.is_leaf(parent) == (not model)
        assert table.child_nodes(parent) == list(model.values())  # attach order
        for key in KEYS:
            assert table.child_of(parent, key) == model.get(key, NO_NODE)
            equal = bytes(bytearray(key))  # an equal key, another object
            assert table.child_of(parent, equal) == model.get(key, NO_NODE)


def test_a_root_keeps_its_dict_for_one_child_and_for_none() -> None:
    table, root = _table()
    assert table.child[root] == MANY and table.kids[root] == {}
    assert table.is_leaf(root) and table.child_count(root) == 0
    one = _child(table, root, KEYS[0], 1)
    two = _child(table, root, KEYS[1], 2)
    table.detach_child(root, two)
    assert table.child[root] == MANY and table.kids[root] == {KEYS[0]: one}
    table.detach_child(root, one)
    assert table.kids[root] == {}


def test_detaching_a_node_that_is_not_a_child_raises_and_changes_nothing() -> None:
    table, root = _table()
    parent = _link(table, root)
    with pytest.raises(KeyError):
        table.detach_child(parent, 3)  # a leaf
    only = _child(table, parent, KEYS[0], 1)
    stranger = _child(table, root, KEYS[1], 2)
    with pytest.raises(KeyError):
        table.detach_child(parent, stranger)
    assert table.child[parent] == only
    _child(table, parent, KEYS[2], 3)
    with pytest.raises(KeyError):
        table.detach_child(parent, stranger)
    assert table.child_count(parent) == 2


@pytest.mark.parametrize(
    "key",
    [
        (pack_tokens([1, 2]), b"\x01\x00\x00\x00\x02\x00\x00\x00"),  # identity: bytes
        (pack_tokens([1, 2]), "img"),
        pack_tokens([1, 1 << 40]),  # a 64-bit id: another packing
        HashedKey(pack_tokens([1, 2]), 7),
    ],
    ids=["bytes-identity", "str-identity", "wide-ids", "hashed"],
)
def test_a_wide_key_is_kept_whole_and_never_equals_a_plain_key(key: object) -> None:
    table, root = _table()
    parent = _link(table, root)
    node = _child(table, parent, key, 1)
    assert table.wide[node] == key
    assert table.key(node) == key
    assert table.child_of(parent, key) == node
    assert table.child_of(parent, pack_tokens([1, 2])) == NO_NODE
    assert not table.has_key(node, pack_tokens([1, 2]))
    plain = _child(table, root, pack_tokens([1, 2]), 2)
    assert not table.has_key(plain, key)  # a tuple of bytes is not a prefix list
    assert table.tokens_of(node) in ((1, 2), (1, 1 << 40))


def test_a_row_reads_back_what_new_wrote_and_is_reused_after_release() -> None:
    table, root = _table(capacity=2)
    assert (table.key(root), table.tokens_of(root), table.extra_of(root)) == (None, (), None)
    assert table.is_root(root)
    node = table.new(root, (pack_tokens([5, 6]), "e"), 3, 4, 5, 6, "cached", "ns")
    assert (table.parent[node], table.block[node], table.serial[node]) == (root, 3, 4)
    assert (table.tick[node], table.block_hash[node], state_name(table.state[node])) == (
        5,
        6,
        "cached",
    )
    assert (table.namespace_of(node), table.host[node], table.residency[node]) == (
        "ns",
        NO_BLOCK,
        "device",
    )
    assert (table.tokens_of(node), table.extra_of(node)) == ((5, 6), "e")
    assert node not in table.checkpoint and table.child[node] == NO_CHILD
    assert table.num_used == 2
    table.release(node)
    assert node not in table.wide and state_name(table.state[node]) == "freed"
    assert table.num_used == 1
    again = table.new(root, pack_tokens([7, 8]), 1, 9, 0, 0, "cached", "")
    assert again == node and again not in table.wide
    assert table.tokens_of(again) == (7, 8)


def test_the_table_grows_in_place_when_every_row_is_taken() -> None:
    table, root = _table(capacity=1)
    columns = (table.parent, table.tick, table.serial, table.tokens)
    nodes = [_child(table, root, pack_tokens([i, i]), i + 1) for i in range(20)]
    assert table.capacity >= 21 and len(set(nodes)) == 20 and root not in nodes
    after = (table.parent, table.tick, table.serial, table.tokens)
    assert all(a is b for a, b in zip(columns, after, strict=True))
    assert [table.tokens_of(n) for n in nodes] == [(i, i) for i in range(20)]
    assert all(table.child_of(root, pack_tokens([i, i])) == n for i, n in enumerate(nodes))


def test_a_node_prints_as_its_serial_namespace_block_and_state() -> None:
    table, root = _table()
    node = _child(table, root, KEYS[0], 7)
    assert table.describe(node) == "<Node #7 ns='' block=7 cached>"
    assert str(table.named(node)) == table.describe(node)


def test_rows_are_made_as_needed_up_to_the_capacity_then_past_it_only_when_asked() -> None:
    """A table for a large pool makes `initial` rows, doubles as nodes need more,
    stops at `capacity` (what the trie can hold), and grows past it only for a row
    asked beyond it (a new namespace's root)."""
    table = NodeTable(B, 100, initial=8)
    assert (table.capacity, table.limit) == (8, 100)
    sizes = []
    for row in range(100):
        assert table._take(1) == [row]
        sizes.append(table.capacity)
    assert sorted(set(sizes)) == [8, 16, 32, 64, 100]
    assert table._take(1) == [100] and table.capacity == 200  # past the capacity
    assert len(table.tokens) == 200 * table.width and len(table.serial) == 200
    assert len(table.state) == len(table.tick) == len(table.parent) == 200


def test_new_chain_refuses_a_hash_count_that_is_not_one_per_block() -> None:
    """`new_chain` checks its hashes against its blocks before writing any row (its
    loop is indexed, not a strict zip, so the check is its own)."""
    table = NodeTable(B, 8, hashes="u64")
    root = table.new(NO_NODE, None, NO_BLOCK, -1, 0, 0, "root", "")
    keys = [pack_tokens([1, 2]), pack_tokens([3, 4])]
    used = table.num_used
    with pytest.raises(ValueError, match="1 hashes for 2 blocks"):
        table.new_chain(root, keys, 0, [5, 6], 1, 1, [11], "cached")
    assert table.num_used == used and table.child_nodes(root) == []
    a, b = table.new_chain(root, keys, 0, [5, 6], 1, 1, [11, 12], "cached")
    assert (table.block_hash[a], table.block_hash[b]) == (11, 12)
    assert (table.block[a], table.block[b]) == (5, 6) and table.parent[b] == a


def test_a_plain_key_is_written_in_its_own_row_and_nowhere_else() -> None:
    """`new` writes a plain key over its row's bytes of the `tokens` column: the
    column keeps its length and every other row keeps its tokens."""
    table, root = _table()
    first = _child(table, root, KEYS[0], 1)
    second = _child(table, root, KEYS[1], 2)
    size = len(table.tokens)
    table.detach_child(root, first)
    table.release(first)
    again = _child(table, root, KEYS[2], 3)
    assert again == first
    assert len(table.tokens) == size
    assert (table.tokens_of(again), table.tokens_of(second)) == ((1, 3), (3, 4))


def test_a_namespace_is_named_once_however_many_nodes_it_holds() -> None:
    table, root = _table()
    other = table.new(NO_NODE, None, NO_BLOCK, -2, 0, 0, "root", "tenant")
    for serial in (1, 2, 3):
        _child(table, other, KEYS[serial], serial)
    _child(table, root, KEYS[0], 4)
    assert table.names == ["", "tenant"]
    spaces = [table.namespace_of(n) for n in table.used()]
    assert spaces == ["", "tenant", "tenant", "tenant", "tenant", ""]


def test_used_lists_the_rows_holding_a_node_in_id_order() -> None:
    table, root = _table()
    nodes = [_child(table, root, KEYS[i], i) for i in range(3)]
    assert table.used() == [root, *nodes]
    table.detach_child(root, nodes[1])
    table.release(nodes[1])
    assert table.used() == [root, nodes[0], nodes[2]]


def test_a_released_root_leaves_no_children_dict_and_reads_as_a_free_leaf() -> None:
    """A root's row, given back, is what `new_chain` expects of a free row: a leaf
    (`NO_CHILD`) with no children dict left behind. Releasing a row whose node
    held no wide key leaves the other rows' wide keys alone."""
    table, root = _table()
    wide = _child(table, root, (KEYS[0], "identity"), 1)
    other = table.new(NO_NODE, None, NO_BLOCK, -2, 0, 0, "root", "tenant")
    assert table.child[other] == MANY and other in table.kids
    table.release(other)
    assert table.child[other] == NO_CHILD and other not in table.kids
    plain = _child(table, root, KEYS[1], 2)
    table.detach_child(root, plain)
    table.release(plain)  # no wide key of its own
    assert table.key(wide) == (KEYS[0], "identity")


def test_errors_name_what_was_refused() -> None:
    from cache.node import Constant

    with pytest.raises(ValueError, match="hashes must be 'u64', 'wide' or 'none', got 'md5'"):
        NodeTable(B, 4, hashes="md5")
    with pytest.raises(ValueError, match=r"^row 3: this column is constant 0, not 1$"):
        Constant(0)[3] = 1
    table, root = _table()
    parent = _link(table, root)
    with pytest.raises(KeyError, match=r"^3$"):
        table.detach_child(parent, 3)  # `parent` has no child
    only = _child(table, parent, KEYS[0], 1)
    with pytest.raises(KeyError, match=rf"^{only + 1}$"):
        table.detach_child(parent, only + 1)  # not its one child
    _child(table, parent, KEYS[1], 2)
    with pytest.raises(KeyError, match=rf"^{root}$"):
        table.detach_child(parent, root)  # not among its children


def test_row_zero_reused_as_an_only_child_is_a_child_like_any_other() -> None:
    """Row 0 (the first root's) given back and reused for a node: as the only child
    of a non-root parent it is found, listed, counted, joined by a sibling and
    detached like a child in any other row."""
    table, first_root = _table()
    second_root = table.new(NO_NODE, None, NO_BLOCK, -2, 0, 0, "root", "")
    parent = _link(table, second_root)
    table.release(first_root)
    child = _child(table, parent, KEYS[0], 1)
    assert child == 0
    assert table.child[parent] == 0
    assert table.child_of(parent, KEYS[0]) == 0
    assert table.child_nodes(parent) == [0]
    assert table.child_count(parent) == 1
    sibling = _child(table, parent, KEYS[1], 2)
    assert sorted(table.child_nodes(parent)) == [0, sibling]
    table.detach_child(parent, sibling)
    assert table.child[parent] == 0
    table.detach_child(parent, 0)
    assert table.child[parent] == NO_CHILD and table.child_count(parent) == 0


def test_a_state_the_spec_does_not_name_gets_a_code_that_reads_back() -> None:
    from cache.node import state_code

    code = state_code("test-only-state")
    assert state_name(code) == "test-only-state"
    assert state_code("test-only-state") == code


def test_a_table_makes_at_least_one_row_and_no_more_than_asked() -> None:
    for capacity, initial in ((0, None), (1, None), (8, 1), (8, 0)):
        table = NodeTable(B, capacity, initial=initial)
        assert table.capacity == 1 and len(table.tick) == len(table.state) == 1
        assert table.limit == max(capacity, 1)


def test_state_codes_stop_at_one_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """`state` holds one byte per node: a 257th state name is refused, saying which."""
    node = cache.node
    names = list(node.STATE_NAMES)
    names += [f"filler-{i}" for i in range(255 - len(names))]
    monkeypatch.setattr(node, "STATE_NAMES", names)
    monkeypatch.setattr(node, "_STATE_CODES", {name: code for code, name in enumerate(names)})
    assert node.state_code("the-256th") == 255  # the last code a byte holds
    with pytest.raises(ValueError, match="no state code left for 'the-257th'"):
        node.state_code("the-257th")
    assert len(names) == 256 and node.state_code("the-256th") == 255


def test_a_fact_the_configuration_never_varies_keeps_no_column() -> None:
    """Events off keeps no hash column; no host tier keeps no host or residency
    column: each is one `Constant` (what a cached block costs, issue 13)."""
    lean = NodeTable(B, 64, hashes="none", host_tier=False)
    assert isinstance(lean.block_hash, Constant) and lean.block_hash.value == 0
    assert isinstance(lean.host, Constant) and lean.host.value == NO_BLOCK
    assert isinstance(lean.residency, Constant) and lean.residency.value == "device"
    full = NodeTable(B, 64, hashes="u64", host_tier=True)
    for column in (full.block_hash, full.host, full.residency):
        assert len(column) == 64  # type: ignore[arg-type]
    assert len(NodeTable(B, 64, hashes="wide").block_hash) == 64  # type: ignore[arg-type]
