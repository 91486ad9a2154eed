"""KV eviction: the one module that decides what leaves the trie and when.

`Evictor` owns
- the eviction index: an `LRUIndex` holding *exactly* the nodes in state
  `evictable` (invariant 7), ordered by `(tick, serial)` ([R10]);
- the block -> owning node map, so a reference dropped anywhere (a sequence
  release, a reaped copy) settles the right node;
- settling a node: its state changes only here, to the state
  `spec.lifecycle.implied_node_state` implies, through the spec's routes;
  entering or leaving `evictable` is what adds or removes it from the index;
- freeing a node (`NODE` trigger `free`, illegal from anything but
  `evictable`: evicting a pinned node raises, it is not a missed `if`), or,
  with a host tier, offloading it (`offload`: a mirrored leaf keeps its host
  copy and stays attached, `offloaded`; [R48]);
- with a host tier, which nodes are device leaves: a node whose children all
  live only on the host is one (`offloaded_children` counts them);
- making room for an allocation: the reclaim cascade ([R16], [R17]) — KV
  leaves first, the parents that become evictable on the way, then the
  frozen tails of unpinned checkpoints — with feasibility decided before
  anything is evicted.

It must not take blocks from the pool, touch sequences, or change a
checkpoint except by evicting it through the `CheckpointStore`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from cache.event_log import EventLog
from cache.kv_pool import KVBlockPool
from cache.lru import LRUIndex
from cache.node import NO_BLOCK, NO_CHILD, NO_NODE, Node, NodeTable, state_code, state_name
from cache.stats import CacheStats
from spec.errors import InvariantViolation, OutOfBlocks
from spec.lifecycle import (
    NODE,
    RESIDENCY,
    CheckpointTrigger,
    NodeState,
    NodeTrigger,
    Residency,
    ResidencyTrigger,
    implied_node_state,
)

if TYPE_CHECKING:
    from cache.checkpoints import CheckpointStore
    from cache.host_tier import HostTier


# Node states as `NodeTable.state` stores them (one-byte codes).
_EVICTABLE = state_code(NodeState.EVICTABLE.value)
_NONE_INDEXED = -2
"""`Evictor._evict`'s oldest indexed leaf when the index is empty (no node id)."""
_ROOT = state_code(NodeState.ROOT.value)
_EVICTABLE_NAME = NodeState.EVICTABLE.value
_FREE = NodeTrigger.FREE.value  # the plain str: table lookups skip the enum's Python __hash__
_OFFLOAD = NodeTrigger.OFFLOAD.value
_SHARE = NodeTrigger.SHARE.value
_RESIDENCY_OFFLOAD = ResidencyTrigger.OFFLOAD.value
_MIRRORED = Residency.MIRRORED.value
_DEVICE = Residency.DEVICE.value

_FREED_FROM: dict[int, int] = {
    state_code(state): state_code(dest)
    for (trigger, state), dest in NODE.table.items()
    if trigger == _FREE
}
"""The `NODE` table's `free` row, as state codes: state -> state after `free` (only
`evictable` has one)."""

_SETTLED: dict[tuple[int, bool, int, int, bool], int] = {}
"""(stored state's code, leaf, block refs, pins, on device) -> the code of the state
`settle` moves an attached node to.

A memo of `_settled`, which is a pure function of these facts (the spec's
`implied_node_state`, then every step of the spec's route to it): the hot
path is one dict lookup instead of the derivation and its enum hashing.
Bounded by the distinct facts seen (states x 2 x reference counts x pins).
"""


def _settled(
    describe: object, state: int, leaf: bool, refs: int, pins: int, on_device: bool
) -> int:
    """Derive (and memoize) where `settle` moves a node with these facts (its state
    as a code); raises `IllegalTransition` (memoizing nothing) when the spec has no
    route there. `describe` names the node in the error."""
    implied = implied_node_state(
        attached=True, leaf=leaf, block_refs=refs, pins=pins, on_device=on_device
    )
    dest = state_name(state)
    for trigger in NODE.route(dest, implied, describe):
        dest = NODE.step(trigger, dest, describe)
    code = state_code(str(NodeState(dest).value))
    _SETTLED[(state, leaf, refs, pins, on_device)] = code
    return code


class Evictor:
    """The eviction index and everything that changes a node's lifecycle state."""

    __slots__ = (
        "_events",
        "_kv",
        "_native",
        "_stats",
        "checkpoints",
        "host",
        "index",
        "nodes",
        "num_cached",
        "offloaded_children",
        "owner",
        "queue_write_back",
        "wait_write_back",
        "write_back",
    )

    def __init__(
        self,
        nodes: NodeTable,
        kv: KVBlockPool,
        checkpoints: CheckpointStore,
        stats: CacheStats,
        events: EventLog,
        host: HostTier | None = None,
        native: ModuleType | None = None,
    ) -> None:
        self.nodes = nodes
        """The trie's nodes (`cache.node.NodeTable`)."""
        self._kv = kv
        self._stats = stats
        self._events = events
        self.checkpoints = checkpoints
        self.host = host
        """The host tier, or None (then no node is ever offloaded)."""
        self._native = native
        # The native core's `NodeLRU` has `LRUIndex`'s API and order ([R10]); the
        # native make-room loop (`_evict`) works on it directly.
        self.index: LRUIndex[Node] = (
            native.NodeLRU(nodes.tick, nodes.serial)
            if native is not None
            else LRUIndex(nodes.tick.__getitem__, nodes.serial.__getitem__)
        )
        self.owner = array("i", [NO_NODE]) * kv.capacity
        """Device block -> the node owning it (`NO_NODE` when none)."""
        self.num_cached = 0
        self.offloaded_children: dict[Node, int] = {}
        """Per attached node with any, how many of its children are `offloaded`."""
        self.write_back = False
        """Host tier in write-back mode ([R52]): evicting a `device` leaf stores it first."""
        self.queue_write_back: Callable[[list[Node]], None] = _no_write_back
        """Queues one store copy for leaves an eviction chose to write back (the trie's)."""
        self.wait_write_back: Callable[[], None] = _no_wait
        """Waits for and reaps the write-back stores in flight, where the copy engine
        can wait (`DeviceCopies`); does nothing with `ManualCopies` (the trie's)."""

    # ------------------------------------------------------------ lifecycle

    def adopt_all(self, nodes: list[Node], blocks: list[int]) -> None:
        """`nodes` were just attached owning `blocks` (state `cached`)."""
        if len(nodes) != len(blocks):
            raise ValueError(f"adopt_all: {len(nodes)} nodes for {len(blocks)} blocks")
        owner = self.owner
        for j, block in enumerate(blocks):  # indexed: a strict zip costs ~40 ns more a block
            owner[block] = nodes[j]
        self.num_cached += len(nodes)

    def settle(self, node: Node) -> None:
        """Move `node` to the state its facts imply, through the spec's routes."""
        t = self.nodes
        if t.state[node] == _ROOT:
            return  # always `root`
        dest = self._implied(node)
        if dest != t.state[node]:
            self._enter(node, dest)

    def _implied(self, node: Node) -> int:
        """Where `settle` moves the attached, non-root `node` (no change made)."""
        t = self.nodes
        only = t.child[node]
        leaf = only == NO_CHILD  # a non-root node keeps no empty `kids` dict
        if not leaf and self.offloaded_children:
            leaf = self.offloaded_children.get(node, 0) == t.child_count(node)
        ck = t.checkpoint.get(node) if t.checkpoint else None
        pins = ck.pins if ck is not None else 0
        block = t.block[node]
        if block == NO_BLOCK:
            facts = (t.state[node], leaf, 0, pins, False)
        else:
            facts = (t.state[node], leaf, self._kv.refs[block], pins, True)
        dest = _SETTLED.get(facts)
        if dest is None:
            dest = _settled(t.named(node), *facts)
        return dest

    def _enter(self, node: Node, dest: int) -> None:
        """Set `node`'s state to `dest` (a new one), keeping the index to exactly the
        evictable nodes (invariant 7)."""
        state = self.nodes.state
        if state[node] == _EVICTABLE:
            self.index.remove(node)
        state[node] = dest
        if dest == _EVICTABLE:
            self.index.add(node)

    def attach_block(self, node: Node, block: int) -> None:
        """Give `node`, offloaded, the device `block` the caller took (a load, or a
        commit that computed it: [R49], [R50]); the trie's reference is the one
        `take` gave. The caller settles it once its references are in place."""
        t = self.nodes
        t.block[node] = block
        self.owner[block] = node
        self.num_cached += 1
        self._offloaded_child_gone(t.parent[node])

    def detach_block(self, node: Node) -> None:
        """Take the device block from `node`, whose load failed: the node is `offloaded`
        again, and the block is private to whoever else holds it."""
        t = self.nodes
        block = t.block[node]
        self.owner[block] = NO_NODE
        self.num_cached -= 1
        t.block[node] = NO_BLOCK
        self._kv.decref(block)
        parent = t.parent[node]
        self._offloaded_child_added(parent)
        self.settle(node)
        if parent != NO_NODE:
            self.settle(parent)  # may be a device leaf now

    def detach_offloaded(self, parent: Node, node: Node) -> None:
        """Unlink `node`, an offloaded child of `parent` that host eviction frees."""
        self.nodes.detach_child(parent, node)
        self._offloaded_child_gone(parent)

    def _offloaded_child_added(self, parent: Node) -> None:
        if parent != NO_NODE:
            counts = self.offloaded_children
            counts[parent] = counts.get(parent, 0) + 1

    def _offloaded_child_gone(self, parent: Node) -> None:
        if parent == NO_NODE:
            return
        counts = self.offloaded_children
        left = counts[parent] - 1
        if left:
            counts[parent] = left
        else:
            del counts[parent]

    def settle_block(self, block: int) -> None:
        """Settle the node owning `block`, if any (a reference to it was dropped)."""
        owner = self.owner[block]
        if owner != NO_NODE:
            self.settle(owner)

    # ------------------------------------------------------------- eviction

    def evict(self, n: int) -> int:
        """Evict LRU evictable leaves until `n` KV blocks are freed ([R23]).

        Returns the blocks freed (node blocks plus frozen tails of their
        checkpoints), counted in `stats.evicted_blocks`.

        Each step frees the oldest evictable leaf by `(tick, serial)`
        ([R10]). A parent that the step leaves evictable and that is older
        than every indexed leaf is the next step's leaf: it is freed at once,
        without entering and leaving the index (an idle chain goes in one
        pass), which frees exactly what the step-by-step order would.
        """
        return self._evict(n)[0]

    def _evict(self, n: int) -> tuple[int, int]:
        """`evict(n)`; returns (blocks freed, blocks still to be freed by write-back
        stores this call queued that have not finished)."""
        if self._native is not None and self.host is None and not self.nodes.checkpoint:
            # the loop below for a trie without a host tier or checkpoints, as one call
            removed: tuple[list[int], list[int], list[str]] | None = None
            if self._events.enabled:
                removed = ([], [], [])
            freed = self._native.evict_inline(
                n, self.index, self, self.nodes, self._kv, removed, _SETTLED
            )
            if removed is not None and removed[0]:
                self._events.removed(*removed)
            self._stats.evicted_blocks += freed
            return freed, 0
        freed = 0  # freed directly by this call (write-back frees are counted apart)
        written = 0  # freed by write-back stores that finished when queued
        pending = 0  # to be freed by write-back stores still in flight
        t = self.nodes
        state = t.state
        ticks = t.tick
        serials = t.serial
        parents = t.parent
        residency = t.residency
        index = self.index
        # With events on, what each freed node's `BlockRemoved` needs, in eviction
        # order, as three columns (no tuple, no method call per block).
        removed_hashes: list[int] | None = [] if self._events.enabled else None
        removed_blocks: list[int] = []
        removed_spaces: list[str] = []
        block_hash = t.block_hash
        namespaces = t.namespace
        names = t.names
        tiered = self.host is not None  # else every node is `device`
        write_back = self.write_back
        backing: list[Node] = []
        # Device only, no checkpoint (an attention-only trie without a host tier:
        # none appears while this runs): `_free` and `_implied` are inlined below
        # for the node the step frees and its parent, with their checks; a fact
        # the inlined form does not cover goes to the method, which decides it.
        inline = not tiered and not t.checkpoint
        child = t.child
        blocks = t.block
        owner = self.owner
        free_rows = t.free_rows
        refs = self._kv.refs
        decref = self._kv.decref
        freed_from = _FREED_FROM
        settled = _SETTLED
        while True:
            while freed + written + pending + len(backing) < n and index:
                node = index.oldest()
                index.remove(node)
                oldest = NO_NODE  # the index's oldest (or `_NONE_INDEXED`), read once
                # when first needed: nothing enters or leaves the index while this
                # chain is freed
                while True:
                    parent = parents[node]
                    if tiered and residency[node] != _DEVICE:
                        freed += self._offload(node)
                    elif write_back and self._begin_write_back(node):
                        backing.append(node)  # [R52]: freed when its store has finished
                        break
                    else:
                        if removed_hashes is not None:
                            removed_hashes.append(block_hash[node])
                            removed_blocks.append(blocks[node])
                            removed_spaces.append(names[namespaces[node]])
                        freed_state = freed_from.get(state[node]) if inline else None
                        if freed_state is None or parent == NO_NODE:
                            freed += self._free(node)  # all of it, or its error
                        else:  # `_free`, inlined: a device leaf, no checkpoint
                            if child[parent] == node:
                                child[parent] = NO_CHILD
                            else:
                                t.detach_child(parent, node)
                            block = blocks[node]
                            owner[block] = NO_NODE
                            self.num_cached -= 1
                            state[node] = freed_state
                            parents[node] = NO_NODE
                            if t.wide:
                                t.wide.pop(node, None)
                            free_rows.append(node)
                            if decref(block):
                                freed += 1
                    if parent == NO_NODE or state[parent] == _ROOT:
                        break
                    dest = -1
                    if inline:  # `_implied`, inlined: no offloaded child, no checkpoint
                        block = blocks[parent]
                        leaf = child[parent] == NO_CHILD
                        dest = settled.get(
                            (state[parent], leaf, refs[block], 0, True)
                            if block != NO_BLOCK
                            else (state[parent], leaf, 0, 0, False),
                            -1,
                        )
                    if dest < 0:
                        dest = self._implied(parent)  # derives (and memoizes) or refuses
                    if dest == state[parent]:
                        break
                    if (
                        dest == _EVICTABLE
                        and freed + written + pending + len(backing) < n
                        and state[parent] != _EVICTABLE
                    ):
                        if oldest == NO_NODE:  # [R10]: only if older than every indexed leaf
                            oldest = index.oldest() if index else _NONE_INDEXED
                        older = oldest == _NONE_INDEXED or (
                            ticks[parent] < ticks[oldest]
                            or (
                                ticks[parent] == ticks[oldest] and serials[parent] < serials[oldest]
                            )
                        )
                        if older:
                            state[parent] = dest
                            node = parent
                            continue
                    self._enter(parent, dest)
                    break
            if not backing:
                break
            before = self._kv.num_free
            self.queue_write_back(backing)  # a store that finished when queued frees now
            done = self._kv.num_free - before
            written += done
            pending += len(backing) - done
            backing = []  # their parents may be evictable now: go on
        if removed_hashes:
            self._events.removed(removed_hashes, removed_blocks, removed_spaces)
        self._stats.evicted_blocks += freed
        return freed + written, pending

    def _begin_write_back(self, node: Node) -> bool:
        """Give `node`, an evictable `device` leaf out of the index, a host block and
        make it `storing` ([R52]); False when the host tier has no block for it."""
        host = self.host
        if host is None:
            return False
        host_block = host.reserve_for_store()
        if host_block is None:
            return False
        host.begin_store(node, host_block)
        # The store's references, taken now (the copy is built when the round
        # ends): nothing settles it back into an index meanwhile.
        t = self.nodes
        self._kv.incref(t.block[node])
        host.pool.incref(host_block)
        held = NODE.step(_SHARE, state_name(t.state[node]), t.named(node))
        t.state[node] = state_code(held)  # held: `cached`
        return True

    def offload_written_back(self, node: Node) -> None:
        """`node`'s write-back store finished ([R52]): offload it now if it is still an
        evictable leaf (a request may have matched it meanwhile: then it stays)."""
        t = self.nodes
        if t.state[node] != _EVICTABLE or t.residency[node] != _MIRRORED:
            return
        self.index.remove(node)
        parent = t.parent[node]
        freed = self._offload(node)
        self._stats.evicted_blocks += freed
        if parent != NO_NODE:
            self.settle(parent)

    def _free(self, node: Node) -> int:
        """Detach `node`, a `device` evictable leaf already out of the index, release
        its block and checkpoint, and give its row back (`NodeTable.release`);
        returns the blocks freed. The caller settles the parent.

        With a host tier, a leaf without a host copy takes the host-only nodes
        below it along ([R48]).
        """
        t = self.nodes
        freed_state = _FREED_FROM.get(t.state[node])
        if freed_state is None:  # the spec's IllegalTransition, naming the node
            freed_state = state_code(NODE.step(_FREE, state_name(t.state[node]), t.named(node)))
        child = t.child
        if self.host is not None and child[node] != NO_CHILD:
            self.host.drop_below(node)
        freed = self._drop_checkpoint(node) if t.checkpoint else 0
        parent = t.parent[node]
        if parent == NO_NODE:
            raise InvariantViolation("topology", f"evictable {t.describe(node)} has no parent")
        if child[parent] == node:  # its only child: `NodeTable.detach_child`, inlined
            child[parent] = NO_CHILD
        else:
            t.detach_child(parent, node)
        block = t.block[node]
        self.owner[block] = NO_NODE
        self.num_cached -= 1
        # `NodeTable.release`, inlined: a `device` leaf needs only these reset.
        t.state[node] = freed_state
        t.parent[node] = NO_NODE
        if t.wide:
            t.wide.pop(node, None)
        t.free_rows.append(node)
        if self._kv.decref(block):
            freed += 1
        return freed

    def _offload(self, node: Node) -> int:
        """Free the device block of `node`, an evictable mirrored leaf already out of
        the index; the node stays attached, `offloaded` ([R48]). Returns the
        blocks freed (its checkpoint's frozen tail too: checkpoints live on the
        device only, so an offloaded node holds none)."""
        t = self.nodes
        state = state_code(NODE.step(_OFFLOAD, state_name(t.state[node]), t.named(node)))
        # from `mirrored`
        residency = RESIDENCY.step(_RESIDENCY_OFFLOAD, t.residency[node], t.named(node))
        host = self.host
        if host is None:
            raise InvariantViolation(
                "residency", f"{t.describe(node)} is offloaded without a host tier"
            )
        freed = self._drop_checkpoint(node)
        block = t.block[node]
        self._events.removed_blocks(node, block)
        t.state[node] = state
        t.residency[node] = residency
        t.block[node] = NO_BLOCK
        self.owner[block] = NO_NODE
        self.num_cached -= 1
        self._offloaded_child_added(t.parent[node])
        if self._kv.decref(block):
            freed += 1
        host.offloaded(node)
        return freed

    def _drop_checkpoint(self, node: Node) -> int:
        """Evict the checkpoint of `node` (leaving the device), if any; the blocks freed."""
        ck = self.nodes.checkpoint.get(node)
        if ck is None:
            return 0
        self._stats.evicted_checkpoints += 1
        return self.checkpoints.drop(ck, CheckpointTrigger.EVICT)

    # ------------------------------------------------------------ make room

    def make_room(self, need: int) -> None:
        """Make `need` blocks free ([R17]): KV eviction first, then the frozen
        tails of unpinned checkpoints. Raises `OutOfBlocks`, changing nothing,
        when even that cannot free enough ([R16])."""
        kv = self._kv
        short = need - kv.num_free
        if short <= 0:
            return
        if not self.room_possible(short):
            backing = 0 if self.host is None else self.host.num_written_back()
            raise OutOfBlocks(
                f"need {need} KV blocks: {kv.num_free} free and fewer than {short} "
                f"reclaimable by eviction (capacity {kv.capacity})"
                + (
                    f"; {backing} more are freed when the write-back stores in flight finish"
                    if backing
                    else ""
                )
            )
        freed, pending = self._evict(short)
        if freed + pending < short:
            self._stats.evicted_blocks += self.checkpoints.evict_frozen_tails(
                short - freed - pending
            )
        if kv.num_free < need:
            if pending:
                self.wait_write_back()
            if kv.num_free < need:  # [R52]: the stores stay queued
                raise OutOfBlocks(
                    f"need {need} KV blocks: {kv.num_free} free; {pending} more are freed "
                    "when the write-back stores in flight finish (complete them, poll, retry)"
                )

    def room_possible(self, short: int) -> bool:
        """Whether `make_room` can free `short` more blocks (no change made)."""
        # Each evictable leaf frees at least its own block; count deeper only when short.
        if len(self.index) >= short or self._reclaimable(short) >= short:
            return True
        return self.reclaimable() >= short

    def reclaimable(self) -> int:
        """Every block `make_room` could free ([R16], [R62]; no change made): the
        eviction cascade's node blocks and their frozen tails, then the frozen
        tails of the other unpinned checkpoints. A write-back store it would
        queue counts as finished ([R52]).

        Not kept as a running count (that would cost every reference change on
        the hot path a walk up the trie): it walks the evictable leaves, the
        parents they leave evictable and the unpinned checkpoints, so it costs
        O(reclaimable nodes + unpinned checkpoints), never the cached nodes
        that are held.
        """
        if not self.index and not self.checkpoints.lru:
            return 0
        doomed: set[Node] = set()
        total = self._reclaimable(self._kv.capacity + 1, doomed)
        return total + sum(1 for ck in self.checkpoints.frozen_tails() if ck.anchor not in doomed)

    def _reclaimable(self, limit: int, doomed: set[Node] | None = None) -> int:
        """KV blocks that evictions could free, counted up to `limit` (no change made).

        With `doomed`, the nodes counted are added to it.
        """
        t = self.nodes
        refs = self._kv.refs
        checkpoints = t.checkpoint
        count = 0
        gone: dict[Node, int] = {}
        for leaf in self.index.unordered():  # any order counts the same cascade
            node = leaf
            while count < limit:
                count += 1
                if doomed is not None:
                    doomed.add(node)
                ck = checkpoints.get(node)
                if ck is not None and ck.frozen_block is not None:
                    count += 1
                parent = t.parent[node]
                if parent == NO_NODE or t.state[parent] == _ROOT:
                    break
                seen = gone.get(parent, 0) + 1
                gone[parent] = seen
                pck = checkpoints.get(parent)
                # Would the parent be evictable once all counted children are gone?
                after = implied_node_state(
                    attached=True,
                    leaf=seen + self.offloaded_children.get(parent, 0) == t.child_count(parent),
                    block_refs=refs[t.block[parent]],
                    pins=pck.pins if pck is not None else 0,
                )
                if after != _EVICTABLE_NAME:
                    break
                node = parent
            if count >= limit:
                break
        return count


def _no_write_back(nodes: list[Node]) -> None:
    raise InvariantViolation("host tier", "a write-back store with no host tier to queue it")


def _no_wait() -> None:
    """Without write-back there is nothing to wait for."""
