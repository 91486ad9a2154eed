"""Trie nodes as columns (`NodeTable`), and the checkpoints they anchor.

A node is an `int`: its row in the `NodeTable` of its trie. There is no Python
object per cached block: every fact about a node is one entry of a column
indexed by its id (`array`s of machine ints, a `bytearray` of token ids, one
byte of lifecycle state), so a cached block costs about 130 bytes of host
memory and nothing for the garbage collector to walk (issue 13).

The trie (`cache.trie`) and the modules it delegates to decide every change;
the table holds the columns and the few operations that keep its rows and
links consistent (`new`, `new_chain`, `attach_child`, `detach_child`,
`release`).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from cache.keys import HashedKey, key_extra, key_tokens
from spec.lifecycle import NodeState, Residency

__all__ = [
    "MANY",
    "NO_BLOCK",
    "NO_CHILD",
    "NO_NODE",
    "NO_SLOT",
    "Checkpoint",
    "HashedKey",
    "Node",
    "NodeTable",
    "state_code",
    "state_name",
]

Node = int
"""A node: its row in its trie's `NodeTable` (the type hints say which ints are nodes)."""

NO_NODE = -1
"""`NodeTable.parent` of a root or of a node no longer attached."""
NO_CHILD = -1
"""`NodeTable.child` of a leaf."""
MANY = -2
"""`NodeTable.child` of a node whose children are in `NodeTable.kids` (two or more,
and every root's)."""
NO_BLOCK = -1
"""`NodeTable.block` of a node that owns no device block: a root, or an `offloaded`
node; `NodeTable.host` of a node without a host block."""
NO_SLOT = -1
"""`Checkpoint.slot` of a host-only checkpoint; `Checkpoint.host_slot` of one without a
host copy."""

_DEVICE = Residency.DEVICE.value  # a new node's residency

STATE_NAMES: list[str] = [state.value for state in NodeState]
"""Node lifecycle states by code: `NodeTable.state` holds one byte per node."""
_STATE_CODES: dict[str, int] = {name: code for code, name in enumerate(STATE_NAMES)}


def state_code(name: str) -> int:
    """The byte `NodeTable.state` stores for the lifecycle state `name` (a state the
    spec does not name, as tests use, gets the next free code)."""
    code = _STATE_CODES.get(name)
    if code is None:
        if len(STATE_NAMES) == 256:
            raise ValueError(f"no state code left for {name!r}")
        code = _STATE_CODES[name] = len(STATE_NAMES)
        STATE_NAMES.append(name)
    return code


def state_name(code: int) -> str:
    """The lifecycle state whose code `NodeTable.state` holds."""
    return STATE_NAMES[code]


_FREE = state_code(NodeState.FREED.value)  # the state of a row no node uses
_ROOT = state_code(NodeState.ROOT.value)


T = TypeVar("T")


class Column(Protocol[T]):
    """What the table needs of a column: an `array`, a `list`, or a `Constant`."""

    def __getitem__(self, row: int, /) -> T: ...
    def __setitem__(self, row: int, value: T, /) -> None: ...
    def extend(self, values: Iterable[T], /) -> None: ...


class Constant(Generic[T]):
    """A column whose every row holds `value`, stored once: what the table keeps for a
    fact its trie never varies (no host tier: every node `device` with no host
    block; events off: every hash 0). Reads cost a Python call, so only paths
    that the feature enables read it on the hot path; writing any other value is
    a bug (`ValueError`)."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __getitem__(self, row: int, /) -> T:
        return self.value

    def __setitem__(self, row: int, value: T, /) -> None:
        if value != self.value:
            raise ValueError(f"row {row}: this column is constant {self.value!r}, not {value!r}")

    def extend(self, values: Iterable[T], /) -> None:
        """Growing the table: nothing to store."""


class NodeTable:
    """Every node of one trie, stored as columns indexed by node id.

    Columns (`t.column[node]`):

    - `parent`: the parent's id, `NO_NODE` for a root or a detached node;
    - `child`: the only child, `NO_CHILD` for a leaf, `MANY` when the children
      are in `kids[node]` (a dict from key to child; roots always use it);
    - `block` / `host`: the device / host block (`NO_BLOCK` when none);
    - `tick` / `serial`: the eviction order `(tick, serial)` ([R10]); the
      serial is also the node's id in snapshots ([R43]), unique for the trie's
      life (rows are reused, serials are not);
    - `block_hash`: the chained hash that events carry (0 with events off);
    - `state`: the lifecycle state, one byte (`state_code` / `state_name`);
    - `residency`: a `spec.lifecycle.Residency` value (a plain `str`);
    - `namespace`: the namespace of the node's root, as an index into `names`
      (`namespace_of`);
    - `tokens`: the block's token ids, native uint32, `width` bytes per row,
      for a node whose key is its packed token bytes (a *plain* key, the
      usual case); a node with any other key (extra identity, a token id past
      32 bits, an injected key hash: `cache.keys`) has it in `wide` instead;
    - `checkpoint`: the node's checkpoint, for the nodes that anchor one.

    A key is compared exactly (`has_key`): the token bytes in place, or the
    `wide` key with `==`. Rows are handed out by `new` / `new_chain` and
    returned by `release`; the table grows (doubling) when every row is in use.
    A column the trie's configuration never varies is a `Constant` (no host
    tier: `host`, `residency`; events off: `block_hash`): about 110 bytes a
    row then (the KV pool's counts and the evictor's owner map add about 12
    per block).
    """

    __slots__ = (
        "_name_index",
        "block",
        "block_hash",
        "capacity",
        "checkpoint",
        "child",
        "free_rows",
        "fresh",
        "host",
        "kids",
        "limit",
        "names",
        "namespace",
        "parent",
        "residency",
        "serial",
        "state",
        "tick",
        "tokens",
        "wide",
        "width",
    )

    def __init__(
        self,
        block_size: int,
        capacity: int,
        hashes: str = "u64",
        host_tier: bool = True,
        initial: int | None = None,
    ) -> None:
        """Rows for `capacity` nodes (what the trie can hold: the table grows past it
        only when asked for more, as for a new namespace's root); `initial` of them
        are made now (default: all), the rest as nodes need them, doubling, so a
        large pool that is never filled costs what it holds. `hashes`: `"u64"` (an `array("Q")`),
        `"wide"` (a list of ints: a scheme whose chain runs on digests wider than 64
        bits, vLLM's) or `"none"` (events off: every hash is 0, and no column is
        kept). Without `host_tier` every node is `device` with no host block, and
        neither column is kept."""
        if hashes not in ("u64", "wide", "none"):
            raise ValueError(f"hashes must be 'u64', 'wide' or 'none', got {hashes!r}")
        self.limit = max(capacity, 1)
        """Rows the table grows to in doubling steps (`capacity`); past it, as needed."""
        capacity = self.limit if initial is None else max(1, min(initial, self.limit))
        self.width = 4 * block_size
        """Bytes of one plain key (`block_size` uint32 token ids)."""
        # Every column is built at its exact size (growing one by `extend` would
        # over-allocate it by an eighth).
        self.capacity = capacity
        self.parent = array("i", [NO_NODE]) * capacity
        self.child = array("i", [NO_CHILD]) * capacity
        self.block = array("i", [NO_BLOCK]) * capacity
        self.host: Column[int] = (
            array("i", [NO_BLOCK]) * capacity if host_tier else Constant(NO_BLOCK)
        )
        # A list: the nodes one operation touches share its tick's `int` object, so
        # it costs a pointer per node, and lists are read and written faster.
        self.tick: list[int] = [0] * capacity
        self.serial = array("q", bytes(8 * capacity))
        self.block_hash: Column[int] = (
            array("Q", bytes(8 * capacity))
            if hashes == "u64"
            else [0] * capacity
            if hashes == "wide"
            else Constant(0)
        )
        self.state = bytearray([_FREE]) * capacity
        self.residency: Column[str] = [_DEVICE] * capacity if host_tier else Constant(_DEVICE)
        self.namespace = array("i", bytes(4 * capacity))
        """Each node's namespace, as an index into `names`."""
        self.names: list[str] = [""]
        """The namespaces seen, by index (`namespace_of`)."""
        self._name_index: dict[str, int] = {"": 0}
        self.tokens = bytearray(self.width * capacity)
        self.kids: dict[Node, dict[Hashable, Node]] = {}
        self.wide: dict[Node, Hashable] = {}
        self.checkpoint: dict[Node, Checkpoint] = {}
        self.free_rows = array("i")
        """Rows given back (`release`), reused last-in first-out."""
        self.fresh = 0
        """Rows `fresh ..` have never held a node (handed out in order, after the
        given-back ones)."""

    def _grow(self, more: int) -> None:
        """Add `more` rows (the columns grow in place: references to them stay valid)."""
        self.parent.extend(array("i", [NO_NODE]) * more)
        self.child.extend(array("i", [NO_CHILD]) * more)
        self.block.extend(array("i", [NO_BLOCK]) * more)
        self.host.extend(array("i", [NO_BLOCK]) * more)
        self.tick.extend([0] * more)
        self.serial.extend(array("q", bytes(8 * more)))
        self.block_hash.extend(array("Q", bytes(8 * more)))
        self.state.extend(bytearray([_FREE]) * more)
        self.residency.extend([_DEVICE] * more)
        self.namespace.extend(array("i", bytes(4 * more)))
        self.tokens.extend(bytes(self.width * more))
        self.capacity += more

    def _take(self, count: int) -> list[Node]:
        """`count` free rows: given-back ones first (most recent first), then fresh ones."""
        free = self.free_rows
        reused = min(count, len(free))
        rows = free[len(free) - reused :].tolist()
        del free[len(free) - reused :]
        rows.reverse()
        if reused < count:
            fresh = self.fresh
            need = count - reused
            if fresh + need > self.capacity:
                more = max(self.capacity, need)  # doubling
                if self.capacity < self.limit:  # but not past the limit unless needed
                    more = min(more, max(self.limit - self.capacity, need))
                self._grow(more)
            rows.extend(range(fresh, fresh + need))
            self.fresh = fresh + need
        return rows

    # ------------------------------------------------------------ rows

    @property
    def num_used(self) -> int:
        """Rows holding a node (attached or root)."""
        return self.fresh - len(self.free_rows)

    def new(
        self,
        parent: Node,
        key: Hashable,
        block: int,
        serial: int,
        tick: int,
        block_hash: int,
        state: str,
        namespace: str,
    ) -> Node:
        """A fresh row for a node under `parent` (`NO_NODE` for a root, whose `key` is
        None), with these facts, `device` residency, no children and no host block;
        not linked into `parent`'s children (`attach_child` does that)."""
        (node,) = self._take(1)
        self.parent[node] = parent
        self.child[node] = MANY if key is None else NO_CHILD
        self.block[node] = block
        self.host[node] = NO_BLOCK
        self.tick[node] = tick
        self.serial[node] = serial
        self.block_hash[node] = block_hash
        self.state[node] = state_code(state)
        self.residency[node] = _DEVICE
        index = self._name_index.get(namespace)
        if index is None:
            index = self._name_index[namespace] = len(self.names)
            self.names.append(namespace)
        self.namespace[node] = index
        if key is None:
            self.kids[node] = {}
        elif type(key) is bytes and len(key) == self.width:
            at = node * self.width
            self.tokens[at : at + self.width] = key
        else:
            self.wide[node] = key
        return node

    def new_chain(
        self,
        parent: Node,
        keys: Sequence[Hashable],
        start: int,
        blocks: Sequence[int],
        serial: int,
        tick: int,
        hashes: Sequence[int] | None,
        state: str,
    ) -> list[Node]:
        """Rows for a chain of new nodes under `parent` (the commit hot path), linked
        in: node `j` has key `keys[start + j]`, block `blocks[j]`, serial
        `serial + j`, hash `hashes[j]` (0 when `hashes` is None: events off), and
        is the only child of node `j - 1` (the first one is `parent`'s newest
        child). Each is in state `state`, `device` residency with no host block,
        in `parent`'s namespace, at `tick`; the last one is a leaf."""
        if hashes is not None and len(hashes) != len(blocks):
            raise ValueError(f"new_chain: {len(hashes)} hashes for {len(blocks)} blocks")
        nodes = self._take(len(blocks))
        code = state_code(state)
        namespace = self.namespace[parent]  # its index in `names`
        parents = self.parent
        child = self.child
        block = self.block
        ticks = self.tick
        serials = self.serial
        block_hash = self.block_hash
        states = self.state
        namespaces = self.namespace
        tokens = self.tokens
        width = self.width
        wide = self.wide
        prev = parent
        # A free row is a leaf with no host block and `device` residency (`release`),
        # and every hash is 0 with events off: only what differs is written.
        for j, node in enumerate(nodes):
            parents[node] = prev
            block[node] = blocks[j]
            ticks[node] = tick
            serials[node] = serial + j
            states[node] = code
            namespaces[node] = namespace
            key = keys[start + j]
            if type(key) is bytes and len(key) == width:
                at = node * width
                tokens[at : at + width] = key
            else:
                wide[node] = key
            if j:
                child[prev] = node
            prev = node
        if hashes is not None:
            # Indexed, not `zip(..., strict=True)`: CPython 3.11 runs a strict
            # zip's loop ~40 ns slower per item, and this runs once per block.
            for j, node in enumerate(nodes):
                block_hash[node] = hashes[j]
        self.attach_child(parent, keys[start], nodes[0])
        return nodes

    def release(self, node: Node) -> None:
        """Return `node`'s row (detached, no children left, no checkpoint) for reuse: it
        reads as `freed` with no parent until it is handed out again, and is reset to
        what `new_chain` expects of a free row (a leaf, no host block, `device`,
        no wide key). Eviction's hot path (`Evictor._free`) does the same
        inline for the device leaves it frees."""
        self.parent[node] = NO_NODE
        self.state[node] = _FREE
        if self.child[node] != NO_CHILD:  # a root
            self.child[node] = NO_CHILD
            self.kids.pop(node, None)
        if self.residency[node] != _DEVICE:
            self.residency[node] = _DEVICE
            self.host[node] = NO_BLOCK
        if self.wide:
            self.wide.pop(node, None)
        self.free_rows.append(node)

    def used(self) -> list[Node]:
        """Every row holding a node, in id order (for inspection)."""
        free = set(self.free_rows)
        return [n for n in range(self.fresh) if n not in free]

    # ------------------------------------------------------------ keys

    def key(self, node: Node) -> Hashable:
        """`node`'s key as its parent's children are keyed (None for a root)."""
        if self.state[node] == _ROOT:
            return None
        wide = self.wide.get(node)
        if wide is not None:
            return wide
        at = node * self.width
        return bytes(self.tokens[at : at + self.width])

    def has_key(self, node: Node, key: Hashable) -> bool:
        """Whether `node`'s key equals `key` (exactly)."""
        wide = self.wide
        if wide and node in wide:
            return wide[node] == key
        if type(key) is not bytes or len(key) != self.width:
            return False
        at = node * self.width
        return self.tokens.startswith(key, at, at + self.width)

    def namespace_of(self, node: Node) -> str:
        """The namespace of `node`'s root."""
        return self.names[self.namespace[node]]

    def is_root(self, node: Node) -> bool:
        """Whether `node` is a namespace root."""
        return self.state[node] == _ROOT

    def tokens_of(self, node: Node) -> tuple[int, ...]:
        """The block's token ids (`()` for a root)."""
        if self.is_root(node):
            return ()
        return key_tokens(self.key(node))

    def extra_of(self, node: Node) -> Hashable:
        """The block's extra identity (None for a plain block or a root)."""
        wide = self.wide.get(node)
        return None if wide is None else key_extra(wide)

    # -------------------------------------------------------- children

    def child_of(self, node: Node, key: Hashable) -> Node:
        """The child of `node` under `key`, or `NO_NODE` (the lookup `match` and
        `commit` inline)."""
        only = self.child[node]
        if only >= 0:
            return only if self.has_key(only, key) else NO_NODE
        if only == NO_CHILD:
            return NO_NODE
        return self.kids[node].get(key, NO_NODE)

    def child_nodes(self, node: Node) -> list[Node]:
        """The children of `node`, in the order they were attached."""
        only = self.child[node]
        if only >= 0:
            return [only]
        if only == NO_CHILD:
            return []
        return list(self.kids[node].values())

    def child_count(self, node: Node) -> int:
        """How many children `node` has."""
        only = self.child[node]
        if only >= 0:
            return 1
        if only == NO_CHILD:
            return 0
        return len(self.kids[node])

    def is_leaf(self, node: Node) -> bool:
        """Whether `node` has no child (a root without children is one too)."""
        only = self.child[node]
        return only == NO_CHILD or (only == MANY and not self.kids[node])

    def attach_child(self, parent: Node, key: Hashable, child: Node) -> None:
        """Make `child` (whose key is `key`) a child of `parent`: a first child is
        held in `child[parent]`, a second moves both into `kids[parent]`."""
        only = self.child[parent]
        if only == NO_CHILD:
            self.child[parent] = child
        elif only >= 0:
            self.kids[parent] = {self.key(only): only, key: child}
            self.child[parent] = MANY
        else:
            self.kids[parent][key] = child

    def detach_child(self, parent: Node, child: Node) -> None:
        """Remove `child` from `parent`'s children (`KeyError` if it is not one).

        A non-root parent left with one child holds it in `child[parent]` again.
        """
        only = self.child[parent]
        if only >= 0:
            if only != child:
                raise KeyError(child)
            self.child[parent] = NO_CHILD
            return
        if only == NO_CHILD:
            raise KeyError(child)
        kids = self.kids[parent]
        key = self.key(child)
        if kids.get(key) != child:
            raise KeyError(child)
        del kids[key]
        if len(kids) == 1 and self.state[parent] != _ROOT:
            (self.child[parent],) = kids.values()
            del self.kids[parent]

    def describe(self, node: Node) -> str:
        """`node` as error messages name it."""
        return (
            f"<Node #{self.serial[node]} ns={self.namespace_of(node)!r} "
            f"block={self.block[node]} {STATE_NAMES[self.state[node]]}>"
        )

    def named(self, node: Node) -> NodeName:
        """`node` as a transition's subject: named (`describe`) only if it is printed."""
        return NodeName(self, node)


class NodeName:
    """A node that prints as `NodeTable.describe` says, when (and as it is when) printed."""

    __slots__ = ("node", "table")

    def __init__(self, table: NodeTable, node: Node) -> None:
        self.table = table
        self.node = node

    def __str__(self) -> str:
        return self.table.describe(self.node)

    __repr__ = __str__


class Checkpoint:
    """An SSM state snapshot after exactly `step` tokens, anchored at node `anchor`.

    `tail`/`tail_extra` are the tokens and identity of the partial block past
    the anchor (empty / None for a block-aligned step); `frozen_block` holds a
    private copy of that partial block. `pins` counts outstanding receipts.
    `slot` is its device checkpoint slot (`NO_SLOT` once it is host-only),
    `host_slot` its host slot (`NO_SLOT` without one), and `residency` where
    its state lives (`spec.lifecycle.Residency`: device, storing, mirrored or
    host; [R53]-[R54]).
    """

    __slots__ = (
        "anchor",
        "block_hash",
        "frozen_block",
        "host_slot",
        "pins",
        "residency",
        "serial",
        "slot",
        "state",
        "step",
        "tail",
        "tail_extra",
        "tick",
    )

    def __init__(
        self,
        *,
        anchor: Node,
        step: int,
        tail: tuple[int, ...],
        tail_extra: Hashable,
        slot: int,
        frozen_block: int | None,
        serial: int,
        tick: int,
        state: str,
    ) -> None:
        self.anchor = anchor
        self.step = step
        self.tail = tail
        self.tail_extra = tail_extra
        self.slot = slot
        self.frozen_block = frozen_block
        self.serial = serial
        self.tick = tick
        self.state = state
        self.pins = 0
        self.block_hash = 0  # set when published with events on
        self.host_slot = NO_SLOT
        self.residency = _DEVICE

    def __repr__(self) -> str:
        return (
            f"<Checkpoint #{self.serial} step={self.step} slot={self.slot} "
            f"{self.state} {self.residency} pins={self.pins}>"
        )
