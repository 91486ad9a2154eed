"""The host-memory tier: its block pool, host eviction, and every residency change.

`HostTier` owns
- the host pool (a `KVBlockPool`, page-locked when the device is
  CUDA) and its reference counts: an attached node holds one on its host
  block, a request that matched it holds one until it loads it or ends
  (`BlockTrie.match`), and an in-flight store or load copy holds one until it
  is reaped;
- the host eviction indexes: with write-back, the *duplicates*, an `LRUIndex`
  holding exactly the `mirrored` nodes whose host block nobody else holds,
  newest-created first (a child before its parent), which host pressure
  reclaims first ([R71]); and an `LRUIndex` holding *exactly* the `offloaded`
  nodes with no children whose host block nobody else holds, by
  `(tick, serial)` ([R10]);
- every `spec.lifecycle.RESIDENCY` transition: a store queued at commit
  ([R47]), its outcome when reaped, device eviction of a mirrored leaf
  (`offload`, [R48]), a load ([R50]), a commit that computed a host-resident
  block itself (`adopt`, [R49]), host eviction ([R51]) and the reclaiming of
  a duplicate's host copy (`drop_copy`, [R71]).

The device side (the device block, the owner map, node states, the device
eviction index) stays the `Evictor`'s; this module asks it to attach or
detach a device block and to settle a node. Write-through only: each block
is queued to the host as it is committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache.copies import Copy, block_moves
from cache.event_log import EventLog
from cache.kv_pool import KVBlockPool
from cache.lru import LRUIndex
from cache.node import NO_BLOCK, NO_CHILD, NO_NODE, Node, NodeTable, state_code, state_name
from cache.stats import CacheStats
from spec.errors import CacheError, InvariantViolation
from spec.lifecycle import (
    NODE,
    RESIDENCY,
    CopyKind,
    NodeState,
    NodeTrigger,
    Residency,
    ResidencyTrigger,
)

if TYPE_CHECKING:
    from cache.eviction import Evictor

_OFFLOADED = state_code(NodeState.OFFLOADED.value)  # as `NodeTable.state` stores it
_STORED_FROM: dict[str, str] = {
    state: dest
    for (trigger, state), dest in RESIDENCY.table.items()
    if trigger == ResidencyTrigger.STORE.value
}
"""The `RESIDENCY` table's `store` row (only `device` has one): the commit hot path's
lookup; any other state goes through `RESIDENCY.step`, which raises."""
_FINISHED_STORE: dict[str, str] = {
    state: dest
    for (trigger, state), dest in RESIDENCY.table.items()
    if trigger == ResidencyTrigger.STORED.value
}
"""The `RESIDENCY` table's `stored` row (only `storing` has one), read the same way."""
_STORE = CopyKind.STORE.value
_LOADING = Residency.LOADING.value
_MIRRORED = Residency.MIRRORED.value
_DROP_COPY = ResidencyTrigger.DROP_COPY.value
# Plain-str triggers: table lookups skip the enum's Python __hash__ (the load hot path).
_LOAD = ResidencyTrigger.LOAD.value
_LOADED = ResidencyTrigger.LOADED.value
_LOAD_FAILED = ResidencyTrigger.LOAD_FAILED.value
_FREE = NodeTrigger.FREE.value


class HostTier:
    """The host pool, the host eviction index, and the residency of every node."""

    __slots__ = (
        "_events",
        "_evictor",
        "_kv",
        "_stats",
        "duplicates",
        "duplicates_first",
        "index",
        "loading",
        "nodes",
        "pool",
        "write_backs",
    )

    def __init__(
        self,
        nodes: NodeTable,
        pool: KVBlockPool,
        kv: KVBlockPool,
        stats: CacheStats,
        events: EventLog,
        *,
        duplicates_first: bool = False,
    ) -> None:
        self.nodes = nodes
        """The trie's nodes (`cache.node.NodeTable`)."""
        self.pool = pool
        self._kv = kv
        self._stats = stats
        self._events = events
        self._evictor: Evictor | None = None
        self.index: LRUIndex[Node] = LRUIndex(nodes.tick.__getitem__, nodes.serial.__getitem__)
        serial = nodes.serial.__getitem__
        self.duplicates: LRUIndex[Node] = LRUIndex(lambda node: -serial(node), serial)
        """With write-back, the `mirrored` nodes whose host block only they hold,
        newest-created first (a child before its parent) ([R71]): keyed by what
        never changes, so a tick set while one is held needs no re-indexing.
        Empty with write-through."""
        self.duplicates_first = duplicates_first
        """Whether host pressure reclaims duplicates first (write-back, [R71])."""
        self.loading: dict[Node, Copy] = {}
        """Each `loading` node's load copy, until it is reaped."""
        self.write_backs: dict[int, Copy] = {}
        """Write-back store copies in flight, by serial ([R52])."""

    def bind(self, evictor: Evictor) -> None:
        """Called once by the trie: the evictor whose device blocks this tier mirrors."""
        self._evictor = evictor

    @property
    def evictor(self) -> Evictor:
        evictor = self._evictor
        if evictor is None:
            raise InvariantViolation("host tier", "used before it was bound to an evictor")
        return evictor

    @property
    def num_cached(self) -> int:
        """Host blocks owned by attached nodes (storing, mirrored, host or loading): every
        host block in use is owned by one; requests and copies only add references."""
        return self.pool.capacity - self.pool.num_free

    def num_written_back(self) -> int:
        """Device blocks that write-back stores in flight will free ([R52])."""
        return sum(len(copy.nodes) for copy in self.write_backs.values())

    # ---------------------------------------------------------------- match

    def split(self, path: list[Node], usable: int) -> tuple[int, list[Node], list[Copy], int]:
        """Split the first `usable` nodes of a matched path ([R50]).

        Returns the length of its device part (nodes owning a device block; the
        device-resident nodes of a prefix always precede its host-only ones),
        the host-only nodes after it, the queued load copies the device part
        still waits on, and how many of its nodes those copies are loading. A
        node whose load failed (not yet reaped) ends the usable hit: neither it
        nor anything below it can be read.
        """
        depth = 0
        waits: list[Copy] = []
        waiting = 0
        loading = self.loading
        block = self.nodes.block
        if not loading:  # the usual case: no scan for loads to wait on
            if not usable or block[path[usable - 1]] != NO_BLOCK:
                return usable, [], waits, 0  # all on the device (a prefix is closed)
            low, high = 0, usable - 1  # the first host-only node, by bisection
            while low < high:
                mid = (low + high) // 2
                if block[path[mid]] == NO_BLOCK:
                    high = mid
                else:
                    low = mid + 1
            return low, path[low:usable], waits, 0
        residency = self.nodes.residency
        for node in path:
            if depth == usable or block[node] == NO_BLOCK:
                break
            if loading and residency[node] == _LOADING:
                copy = loading[node]
                if copy.failed:
                    return depth, [], waits, waiting
                if not copy.done:
                    waiting += 1
                    if copy not in waits:
                        waits.append(copy)
            depth += 1
        return depth, path[depth:usable], waits, waiting

    # ------------------------------------------------------------ the index

    def settle(self, node: Node) -> None:
        """Put `node` in the host eviction index iff it is eligible (an `offloaded`
        leaf whose host block only the trie holds), keeping invariant 7; and in
        the duplicates iff it is `mirrored` and only it holds its host block ([R71]).

        A node that is not `offloaded` is never in the host index (every way out
        of `offloaded` leaves the index first: a match's `pin`, `adopt`,
        eviction), so it needs no look there."""
        self._settle_duplicate(node)
        t = self.nodes
        if t.state[node] != _OFFLOADED:
            return
        eligible = t.child[node] == NO_CHILD and self.pool.refs[t.host[node]] == 1
        if eligible != (node in self.index):
            if eligible:
                self.index.add(node)
            else:
                self.index.remove(node)

    def _settle_duplicate(self, node: Node) -> None:
        """Put `node` in the duplicates iff it is `mirrored` and only it holds its
        host block ([R71])."""
        if not self.duplicates_first:
            return
        t = self.nodes
        duplicate = t.residency[node] == _MIRRORED and self.pool.refs[t.host[node]] == 1
        duplicates = self.duplicates
        if duplicate != (node in duplicates):
            if duplicate:
                duplicates.add(node)
            else:
                duplicates.remove(node)

    def _unindex(self, node: Node) -> None:
        if node in self.index:
            self.index.remove(node)

    # ---------------------------------------------------------------- store

    def reserve_for_store(self) -> int | None:
        """A host block for a new store, evicting one if none is free ([R47], [R71]);
        None when the host tier is full of blocks it may not evict."""
        blocks = self.reserve_for_stores(1)
        return blocks[0] if blocks else None

    def reserve_for_stores(self, n: int) -> list[int]:
        """Up to `n` host blocks for new stores, in one take, evicting (`evict`) for
        the ones not free ([R47]); fewer when the host tier has no more, none
        when taking them fails (a store is best effort: the commit or eviction
        that asked stands)."""
        pool = self.pool
        short = n - pool.num_free
        if short > 0 and (self.duplicates or self.index):
            self.evict(short)
        try:
            return pool.take(min(n, pool.num_free))
        except CacheError:  # an allocation failure: the blocks stay device-only
            return []

    def store_moves(self, nodes: list[Node]) -> Copy:
        """The store copy for `nodes`, just committed (device -> host).

        Each node takes its host block (reserved by `reserve_for_store`) and
        becomes `storing`; the copy holds a reference on both blocks of each
        until it is reaped.
        """
        t = self.nodes
        blocks = [t.block[n] for n in nodes]
        host_blocks = [t.host[n] for n in nodes]
        moves = block_moves(self._kv.tensor, blocks, self.pool.tensor, host_blocks)
        return Copy(_STORE, 0, moves, (), 0, blocks=blocks, host_blocks=host_blocks)

    def begin_store(self, node: Node, host_block: int) -> None:
        """`node` (residency `device`) will be copied into `host_block`."""
        t = self.nodes
        t.residency[node] = _STORED_FROM.get(t.residency[node]) or RESIDENCY.step(
            ResidencyTrigger.STORE, t.residency[node], t.named(node)
        )
        t.host[node] = host_block

    def stored(self, copy: Copy) -> None:
        """A store copy was reaped (its references already dropped): its nodes are
        `mirrored`, or back to `device` if it failed (their host blocks freed)."""
        pool = self.pool
        t = self.nodes
        residency = t.residency
        if not copy.failed:
            for node in copy.nodes:
                residency[node] = _FINISHED_STORE.get(residency[node]) or RESIDENCY.step(
                    ResidencyTrigger.STORED, residency[node], t.named(node)
                )
            self._stats.stored_blocks += len(copy.nodes)
            self._events.host_stored(copy.nodes)
            for node in copy.nodes:
                self._settle_duplicate(node)
            return
        for node in copy.nodes:
            residency[node] = RESIDENCY.step(
                ResidencyTrigger.STORE_FAILED, residency[node], t.named(node)
            )
            pool.decref(t.host[node])
            t.host[node] = NO_BLOCK

    # -------------------------------------------------------------- offload

    def offloaded(self, node: Node) -> None:
        """Device eviction freed the device block of `node`, a mirrored leaf, and moved
        it to residency `host` ([R48]): it may be a host eviction candidate now."""
        self.settle(node)

    # ----------------------------------------------------------------- load

    def begin_load(self, node: Node) -> None:
        """`node` (residency `host`, a request's match holding its host block, so out
        of the host index since `pin`) is being loaded into the device block the
        evictor just attached ([R50])."""
        t = self.nodes
        t.residency[node] = RESIDENCY.step(_LOAD, t.residency[node], t.named(node))

    def load_moves(self, nodes: list[Node], waits_on: list[int]) -> Copy:
        """The load copy for `nodes` (host -> their new device blocks), ordered after
        the copies loading the device blocks `waits_on`."""
        t = self.nodes
        blocks = [t.block[n] for n in nodes]
        host_blocks = [t.host[n] for n in nodes]
        moves = block_moves(self.pool.tensor, host_blocks, self._kv.tensor, blocks)
        return Copy(
            CopyKind.LOAD.value, 0, moves, (), 0, blocks=waits_on + blocks, host_blocks=host_blocks
        )

    def loaded(self, copy: Copy) -> list[Node]:
        """A load copy was reaped: its nodes are `mirrored`, or, if it failed, `host`
        again with their device blocks detached (returned: the caller cuts the
        paths of the requests that held them). Its references are already dropped."""
        failed_nodes: list[Node] = []
        evictor = self.evictor
        t = self.nodes
        residency = t.residency
        for node in copy.nodes:
            del self.loading[node]
            if copy.failed:
                residency[node] = RESIDENCY.step(_LOAD_FAILED, residency[node], t.named(node))
                evictor.detach_block(node)
                failed_nodes.append(node)
            else:
                residency[node] = RESIDENCY.step(_LOADED, residency[node], t.named(node))
                self._stats.loaded_blocks += 1
            self.settle(node)
        if not copy.failed:
            self._events.back_on_device(copy.nodes)
        return failed_nodes

    # ---------------------------------------------------------------- adopt

    def adopt(self, node: Node) -> None:
        """A commit computed `node`'s block itself while it was host-only ([R49]):
        its block is now the device copy; the host copy stays (`mirrored`)."""
        t = self.nodes
        t.residency[node] = RESIDENCY.step(ResidencyTrigger.ADOPT, t.residency[node], t.named(node))
        self._unindex(node)
        self._settle_duplicate(node)  # unless a request still holds its host block

    # ------------------------------------------------------------- unpin

    def unpin(self, nodes: list[Node]) -> None:
        """Drop a request's match references on the host blocks of `nodes`."""
        pool = self.pool
        host = self.nodes.host
        for node in nodes:
            pool.decref(host[node])
            self.settle(node)

    def pin(self, nodes: list[Node]) -> None:
        """Take a request's match reference on the host blocks of `nodes` ([R50])."""
        host = self.nodes.host
        self.pool.incref_all([host[node] for node in nodes])
        for node in nodes:
            self._unindex(node)

    # ------------------------------------------------------------ eviction

    def evict(self, n: int) -> int:
        """Free up to `n` host blocks: with write-back, the host copies of duplicates
        first ([R71]: `mirrored` blocks, still on the device, stored again if the
        device evicts them: nothing is lost), newest-created first; then LRU
        host-only leaves ([R51]). Returns how many. A parent left an offloaded
        leaf is evictable next."""
        freed = self._drop_copies(n) if self.duplicates else 0
        index = self.index
        t = self.nodes
        removed: list[Node] = []
        while freed < n and index:
            node = index.oldest()
            index.remove(node)
            parent = self._free(node)
            removed.append(node)
            freed += 1
            if not t.is_root(parent):
                if t.state[parent] == _OFFLOADED:
                    self.settle(parent)
                else:
                    self.evictor.settle(parent)
        self._events.host_removed(removed)
        for node in removed:
            t.release(node)
        self._stats.host_evicted_blocks += len(removed)
        return freed

    def _drop_copies(self, n: int) -> int:
        """Reclaim the host blocks of up to `n` duplicates, newest first ([R71]): each
        node stays attached with its device block, residency `device`. Counted in
        `host_evicted_blocks`, announced as removed from the host (medium CPU)."""
        duplicates = self.duplicates
        dropped: list[Node] = []
        while len(dropped) < n and duplicates:
            node = duplicates.oldest()
            duplicates.remove(node)
            dropped.append(node)
        self._events.host_removed(dropped)
        t = self.nodes
        pool = self.pool
        residency = t.residency
        for node in dropped:
            residency[node] = RESIDENCY.step(_DROP_COPY, residency[node], t.named(node))
            if not pool.decref(t.host[node]):
                raise InvariantViolation(
                    "host conservation", f"dropped the host copy of {t.describe(node)}: still held"
                )
            t.host[node] = NO_BLOCK
        self._stats.host_evicted_blocks += len(dropped)
        return len(dropped)

    def _free(self, node: Node) -> Node:
        """Detach `node`, an offloaded leaf out of the index, freeing its host block;
        returns its former parent (to be settled by the caller). The caller
        releases the node's row once its removal is recorded."""
        t = self.nodes
        t.state[node] = state_code(NODE.step(_FREE, state_name(t.state[node]), t.named(node)))
        parent = t.parent[node]
        if parent == NO_NODE:
            raise InvariantViolation("topology", f"offloaded {t.describe(node)} has no parent")
        self.evictor.detach_offloaded(parent, node)
        t.parent[node] = NO_NODE
        if not self.pool.decref(t.host[node]):
            raise InvariantViolation(
                "host conservation", f"freed {t.describe(node)}: its host block is still held"
            )
        return parent

    def drop_below(self, node: Node) -> None:
        """Device eviction is freeing `node` outright (no host copy of its own): free its
        host-only descendants first, deepest first ([R48])."""
        t = self.nodes
        doomed: list[Node] = []
        stack = t.child_nodes(node)
        while stack:
            child = stack.pop()
            if t.state[child] != _OFFLOADED:
                raise InvariantViolation(
                    "residency", f"{t.describe(child)} below a device leaf owns a device block"
                )
            doomed.append(child)
            stack.extend(t.child_nodes(child))
        for child in reversed(doomed):  # children before their parents
            self._unindex(child)
            self._free(child)
        self._events.host_removed(doomed)
        for child in doomed:
            t.release(child)
        self._stats.host_evicted_blocks += len(doomed)


__all__ = ["HostTier"]
