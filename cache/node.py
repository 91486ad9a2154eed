"""Trie nodes and the checkpoints they anchor: plain slotted records.

The trie (`cache.trie`) owns every mutation; these classes hold state only.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NoReturn

from cache.keys import HashedKey, key_extra, key_tokens
from spec.lifecycle import Residency

__all__ = ["NO_BLOCK", "NO_CHILDREN", "Checkpoint", "HashedKey", "Node", "child_of"]


class _NoChildren(dict[Hashable, "Node"]):
    """The empty `children` every leaf shares (type of `NO_CHILDREN`); it refuses writes.

    Most nodes of a trie are leaves or chain links; one shared empty mapping
    instead of an empty `dict` per leaf saves its 64 bytes and one allocation
    (one garbage-collected object) per attached block. Reads are plain `dict`
    reads; a write raises `TypeError`, so a missed "give the parent its own
    dict first" cannot silently give every leaf a child.
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("NO_CHILDREN is shared by every leaf and is read-only")

    __setitem__ = __delitem__ = setdefault = update = pop = popitem = clear = _refuse
    __ior__ = _refuse  # type: ignore[assignment]


NO_CHILDREN: dict[Hashable, Node] = _NoChildren()
"""A leaf's `children`: the one shared, empty, read-only mapping (`Node.children`)."""


_new_object = object.__new__


NO_BLOCK = -1
"""`Node.block` of a node that owns no device block: a root, or an `offloaded` node."""
NO_SLOT = -1
"""`Checkpoint.slot` of a host-only checkpoint; `Checkpoint.host_slot` of one without a
host copy."""

_DEVICE = Residency.DEVICE.value  # a new node's residency


class Node:
    """One full KV block of one prefix, or a namespace root (`key is None`).

    `key` is what the parent's `children` dict is keyed by (`cache.keys`): the
    block's packed token ids, or `(packed, extra)` when the block has an extra
    identity (wrapped by `HashedKey` when a test injects a key hash); `tokens`
    unpacks them. `state` is the stored
    lifecycle state (`spec.lifecycle.NodeState` values; `ROOT` for roots).
    `block` is its device block, `NO_BLOCK` for a root or while its KV lives
    only on the host tier; `host` its host block (`NO_BLOCK` when none) and
    `residency` a `spec.lifecycle.Residency` value (always `device` without a
    host tier). `tick`/`serial` order eviction; `block_hash` is the chained hash that
    events carry. Built by keyword only.

    `children` has three shapes, kept by `attach_child` / `detach_child`
    only: `NO_CHILDREN` (shared, read-only, falsy) for a leaf; **the child
    itself** for a node with exactly one child (the chain links that make up
    most of a trie: no dict, about 220 bytes less per block); a dict from key
    to child for two or more. Read it through `child`, `child_nodes` and
    `child_count`, or, on a hot path, as `child` does. A node's depth is not
    stored: `cache.inspection` counts it while it walks from the roots.
    """

    __slots__ = (
        "block",
        "block_hash",
        "checkpoint",
        "children",
        "host",
        "key",
        "namespace",
        "parent",
        "residency",
        "serial",
        "state",
        "tick",
    )

    def __init__(
        self,
        *,
        parent: Node | None,
        key: Hashable,
        block: int,
        namespace: str,
        serial: int,
        tick: int,
        block_hash: int,
        state: str,
    ) -> None:
        self.parent = parent
        self.key = key
        self.block = block
        self.namespace = namespace
        self.serial = serial
        self.tick = tick
        self.block_hash = block_hash
        self.state = state
        self.children: Node | dict[Hashable, Node] = NO_CHILDREN
        self.checkpoint: Checkpoint | None = None
        self.host = NO_BLOCK
        self.residency = _DEVICE

    @property
    def tokens(self) -> tuple[int, ...]:
        """The block's token ids, unpacked from `key` (`()` for a root)."""
        return key_tokens(self.key)

    @property
    def extra(self) -> Hashable:
        """The block's extra identity, read from `key` (None for a plain block or a root)."""
        return key_extra(self.key)

    def child(self, key: Hashable) -> Node | None:
        """The child under `key`, or None (the lookup `match` and `commit` inline)."""
        children = self.children
        if type(children) is Node:
            k = children.key
            return children if k is key or k == key else None
        return children.get(key)  # type: ignore[union-attr]

    def child_nodes(self) -> list[Node]:
        """The children, in the order they were attached."""
        children = self.children
        if type(children) is Node:
            return [children]
        return list(children.values())  # type: ignore[union-attr]

    def child_count(self) -> int:
        """How many children the node has."""
        children = self.children
        return 1 if type(children) is Node else len(children)  # type: ignore[arg-type]

    def attach_child(self, key: Hashable, child: Node) -> None:
        """Make `child` (whose `key` is `key`) this node's child.

        A first child is held directly; a second one gives the node a dict.
        """
        children = self.children
        if children is NO_CHILDREN:
            self.children = child
        elif type(children) is Node:
            self.children = {children.key: children, key: child}
        else:
            children[key] = child  # type: ignore[index]

    def detach_child(self, key: Hashable) -> None:
        """Remove the child under `key` (`KeyError` if absent).

        The last one puts `NO_CHILDREN` back; a dict left with one child gives
        way to the child itself.
        """
        children = self.children
        if type(children) is Node:
            k = children.key
            if not (k is key or k == key):
                raise KeyError(key)
            self.children = NO_CHILDREN
            return
        del children[key]  # type: ignore[union-attr]
        if len(children) == 1:  # type: ignore[arg-type]
            (self.children,) = children.values()  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"<Node #{self.serial} ns={self.namespace!r} block={self.block} {self.state}>"


def child_of(
    parent: Node,
    *,
    key: Hashable,
    block: int,
    serial: int,
    tick: int,
    block_hash: int,
    state: str,
) -> Node:
    """A new node under `parent` (in its namespace), not yet linked in.

    The same record as `Node`'s keyword constructor builds, for the commit hot
    path: a module function (no bound classmethod per call) that takes the
    namespace from `parent` and skips `__init__`; together about half the cost
    of the constructor. Keyword-only, like the constructor: four of its
    arguments are ints.
    """
    node: Node = _new_object(Node)
    node.parent = parent
    node.key = key
    node.block = block
    node.namespace = parent.namespace
    node.serial = serial
    node.tick = tick
    node.block_hash = block_hash
    node.state = state
    node.children = NO_CHILDREN
    node.checkpoint = None
    node.host = NO_BLOCK
    node.residency = _DEVICE
    return node


class Checkpoint:
    """An SSM state snapshot after exactly `step` tokens, anchored at `anchor`.

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
