"""`Offload`: the copies between the device and the host tier that trie operations queue.

`cache.host_tier.HostTier` owns the host tier itself (its pool, its eviction
index, every residency transition); this module owns the orchestration that
plans its copies around a request ([R47]-[R54]):

- `load`: host -> device for the host-resident part of a match, sharing a
  load another request already queued ([R50]);
- `store` (write-through, [R47]) and `_queue_write_back` / `_wait_write_back`
  (write-back, [R52], hooked into the `Evictor`'s make-room);
- `store_checkpoint`: a just-saved checkpoint into a host slot ([R53]);
- `check_loads_done` and `adopt`: what `commit` needs when the blocks it
  attaches are being loaded or live only on the host ([R49], [R50]);
- `_cut_failed_loads`: the requests a failed load leaves unable to go on.

`BlockTrie` validates and takes its operation lock, then calls these; they
keep the trie's rules: a queued copy that fails is undone ([R38]), and a
refusal changes nothing ([R6]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable

from cache.checkpoints import CheckpointStore
from cache.copies import Copy, ManualCopies
from cache.event_log import EventLog
from cache.eviction import Evictor
from cache.host_tier import HostTier
from cache.kv_pool import KVBlockPool
from cache.node import NO_BLOCK, NO_NODE, Checkpoint, Node, NodeTable
from cache.sequence import Sequence
from cache.transfers import Transfers
from spec.errors import CacheError, HostTierError
from spec.lifecycle import RESIDENCY, CopyKind, Residency, ResidencyTrigger

_LOADING = Residency.LOADING.value
_LOAD_FAILED = ResidencyTrigger.LOAD_FAILED.value  # a copy undone never delivered
_STORE_FAILED = ResidencyTrigger.STORE_FAILED.value


def refuse_unloaded(operation: str, seq: Sequence) -> None:
    """Raise for an operation that needs `seq`'s whole hit on the device ([R50])."""
    if seq.load_failed:
        raise HostTierError(
            f"{operation}: the load of {seq!r}'s host-resident blocks failed; abort it"
        )
    raise HostTierError(
        f"{operation}: {seq!r} has {len(seq.host_path)} matched blocks in the host tier; "
        "call load(seq) first"
    )


class Offload:
    """The device <-> host copies of one `BlockTrie` (its parts, shared, not copied).

    `host` is None without a host tier: then `load` only waits on nothing and
    the rest is never called. `live` and `roots` are the trie's own registry
    and namespace roots (read, never changed here). With `write_back`, the
    evictor's make-room queues stores through this object instead of freeing.
    """

    def __init__(
        self,
        nodes: NodeTable,
        kv: KVBlockPool,
        host: HostTier | None,
        evictor: Evictor,
        checkpoints: CheckpointStore,
        transfers: Transfers,
        events: EventLog,
        live: dict[int, Sequence],
        roots: dict[str, Node],
        write_back: bool,
    ) -> None:
        self._nodes = nodes
        self._kv = kv
        self._host = host
        self._evictor = evictor
        self._checkpoints = checkpoints
        self._transfers = transfers
        self._events = events
        self._live = live
        self._roots = roots
        transfers.host = host
        transfers.on_load_failed = self._cut_failed_loads
        if write_back:
            evictor.write_back = True
            evictor.queue_write_back = self._queue_write_back
            evictor.wait_write_back = self._wait_write_back

    # ------------------------------------------------------------------ load

    def load(self, seq: Sequence) -> Copy | None:
        """`BlockTrie.load` past its checks (`seq` is live): queue host -> device for
        the host-resident part of `seq`'s hit, or wait on the loads it shares."""
        if seq.load_failed:
            refuse_unloaded(CopyKind.LOAD.value, seq)
        host = self._host
        nodes = seq.host_path
        if any(c.failed for c in seq.loads):
            raise HostTierError(f"load: a load {seq!r} waits on failed; abort it")
        pending = [c for c in seq.loads if not c.done]
        if host is None or not nodes:
            if len(pending) <= 1:
                return pending[0] if pending else None
            return self._launch_load(seq, [], [], pending)
        t = self._nodes
        own = [node for node in nodes if t.block[node] == NO_BLOCK]
        shared = [node for node in nodes if t.block[node] != NO_BLOCK]
        for node in shared:
            if t.residency[node] == _LOADING and host.loading[node].failed:
                raise HostTierError(
                    f"load: {host.loading[node]!r}, loading a block {seq!r} reads, "
                    "failed; poll() and load again (it will be loaded anew)"
                )
        blocks = self._blocks_for_load(shared, len(own))
        for node, block in zip(own, blocks, strict=True):
            self._evictor.attach_block(node, block)
        for node in shared:
            if t.residency[node] == _LOADING:
                copy = host.loading[node]
                if not copy.done and copy not in pending:
                    pending.append(copy)
        return self._launch_load(seq, own, shared, pending)

    def _blocks_for_load(self, shared: list[Node], need: int) -> list[int]:
        """Hold the device blocks of `shared` for the request, then take `need` free
        blocks (making room as `allocate` does). Holding first is what keeps
        room-making from evicting a block this very load will read; on failure
        nothing is held."""
        kv = self._kv
        evictor = self._evictor
        block = self._nodes.block
        kv.incref_all([block[node] for node in shared])
        for node in shared:
            evictor.settle(node)  # held now: out of the eviction index
        try:
            evictor.make_room(need)
            return kv.take(need)
        except BaseException:
            kv.decref_all([block[node] for node in shared])
            for node in shared:
                evictor.settle(node)
            raise

    def _launch_load(
        self, seq: Sequence, own: list[Node], shared: list[Node], pending: list[Copy]
    ) -> Copy | None:
        """Queue the load of `own` (device blocks attached already) after `pending`,
        moving `seq`'s host part onto its path; undone if queuing fails.

        Returns the copy to wait on: the new one; or, with nothing of its own
        to load, the one pending copy (shared, not repeated), an empty copy
        ordered after several, or None."""
        host = self._host
        if host is None:  # `load` without a host tier waits on nothing it queues
            raise HostTierError("load: this cache has no host tier")
        kv = self._kv
        t = self._nodes
        block = t.block
        if not own and len(pending) <= 1:
            host.unpin(shared)  # their device blocks are the request's now
            seq.path.extend(seq.host_path)
            seq.blocks.extend(block[node] for node in seq.host_path)
            seq.host_path = []
            seq.loads = pending
            return pending[0] if pending else None
        waits_on = [b for c in pending for kind, b in c.resources if kind == "block"]
        copy = self._transfers.number(host.load_moves(own, waits_on))
        for node in own:
            host.begin_load(node)
            kv.incref(block[node])  # the request's reference
            host.loading[node] = copy
            copy.nodes.append(node)
        self._transfers.hold(copy, [block[n] for n in own], [])
        copy.host_blocks.extend(t.host[n] for n in own)  # the request's host references
        host.unpin(shared)  # their device blocks are the request's now
        for node in own:
            self._evictor.settle(node)
        nodes = seq.host_path
        old_loads = seq.loads
        seq.path.extend(nodes)
        seq.blocks.extend(block[node] for node in nodes)
        seq.host_path = []
        seq.loads = [*pending, copy] if own else pending

        def undo() -> None:
            del seq.path[len(seq.path) - len(nodes) :]
            del seq.blocks[len(seq.blocks) - len(nodes) :]
            seq.host_path = nodes
            seq.loads = old_loads
            host.pin(nodes)  # the request's host references, as after match
            for node in shared:
                kv.decref(block[node])
            for node in own:
                del host.loading[node]
                kv.decref(block[node])  # the request's (the copy's went with the copy)
                t.residency[node] = RESIDENCY.step(_LOAD_FAILED, t.residency[node], t.named(node))
                self._evictor.detach_block(node)
                host.settle(node)

        self._transfers.launch(copy, undo)
        return copy

    # ---------------------------------------------------------------- commit

    def check_loads_done(self, seq: Sequence, keys: list[Hashable], start: int, full: int) -> None:
        """Refuse (changing nothing) a commit that would read or share a block whose
        load has not finished ([R50]): the request's own loads, or a block another
        request is loading that this commit would deduplicate against."""
        for copy in seq.loads:
            if copy.failed or not copy.done:
                raise HostTierError(
                    f"commit: {seq!r} reads blocks that {copy!r} is loading"
                    + ("; it failed: abort the request" if copy.failed else "; wait for it")
                )
        node = seq.path[-1] if seq.path else self._roots.get(seq.namespace, NO_NODE)
        host = self._host
        t = self._nodes
        for i in range(start, full):
            if node == NO_NODE:
                break
            node = t.child_of(node, keys[i])
            if node != NO_NODE and t.residency[node] == _LOADING and host is not None:
                copy = host.loading[node]
                if copy.failed:
                    raise HostTierError(
                        f"commit: block {i} of {seq!r} equals a block whose load {copy!r} "
                        "failed; poll() and commit again (the computed block is adopted)"
                    )
                if not copy.done:
                    raise HostTierError(
                        f"commit: block {i} of {seq!r} is being loaded by {copy!r}; "
                        "commit it once that copy is done"
                    )
        seq.loads = []  # all done: nothing left to wait on (not before: [R6])

    def adopt(self, node: Node, block: int, tick: int) -> None:
        """A commit computed `node`'s block while its KV lived only on the host
        ([R49]): the request's block becomes its device copy."""
        host = self._host
        if host is None:
            raise HostTierError(
                f"commit: {self._nodes.describe(node)} has no device block and no host tier"
            )
        self._kv.incref(block)  # the trie's reference; the request keeps its own
        self._evictor.attach_block(node, block)
        host.adopt(node)
        self._nodes.tick[node] = tick  # [R8]
        self._evictor.settle(node)
        self._events.back_on_device([node])

    # ---------------------------------------------------------------- stores

    def store(self, nodes: list[Node]) -> None:
        """Write-through ([R47]): queue one copy of the blocks just attached to the
        host tier, each into a host block (evicting host LRU leaves for room;
        the blocks past the last one that finds room stay device-only)."""
        host = self._host
        if host is None:
            return
        host_blocks = host.reserve_for_stores(len(nodes))
        if not host_blocks:
            return
        storing = nodes[: len(host_blocks)]
        for node, host_block in zip(storing, host_blocks, strict=True):
            host.begin_store(node, host_block)
        t = self._nodes
        copy = self._transfers.number(host.store_moves(storing))
        # It reads each device block and writes each host block until reaped.
        self._transfers.hold(copy, [t.block[n] for n in storing], [t.host[n] for n in storing])
        copy.nodes = storing

        def undo() -> None:
            for node in storing:
                t.residency[node] = RESIDENCY.step(_STORE_FAILED, t.residency[node], t.named(node))
                host.pool.decref(t.host[node])  # the node's: the block is free again
                t.host[node] = NO_BLOCK

        with contextlib.suppress(CacheError):  # a failed store is undone: device-only
            self._transfers.launch(copy, undo)

    def _queue_write_back(self, nodes: list[Node]) -> None:
        """Write-back ([R52]): eviction chose `nodes` (given host blocks, `storing`,
        the store's references on both blocks taken); queue their store. Each is
        offloaded when it finishes; if queuing fails they are `device` leaves
        again, their host blocks freed."""
        host = self._host
        if host is None:
            raise HostTierError("write-back without a host tier")
        t = self._nodes
        copy = self._transfers.number(host.store_moves(nodes))
        copy.blocks = [t.block[n] for n in nodes]  # references taken by the evictor
        copy.host_blocks = [t.host[n] for n in nodes]
        copy.nodes = list(nodes)
        host.write_backs[copy.serial] = copy
        for node in nodes:
            self._evictor.settle(node)  # held by the copy: cached, out of the index

        def undo() -> None:
            del host.write_backs[copy.serial]
            for node in nodes:
                t.residency[node] = RESIDENCY.step(_STORE_FAILED, t.residency[node], t.named(node))
                host.pool.decref(t.host[node])  # the node's: the block is free again
                t.host[node] = NO_BLOCK
                self._evictor.settle(node)

        with contextlib.suppress(CacheError):  # a failed store is undone: device-only
            self._transfers.launch(copy, undo)

    def _wait_write_back(self) -> None:
        """Make room waits for the write-back stores in flight ([R52]): with an engine
        that can wait (`DeviceCopies`), wait for each and reap it; `ManualCopies`
        cannot (its copies finish when the test says), so nothing happens."""
        host = self._host
        engine = self._transfers.engine
        if host is None or isinstance(engine, ManualCopies):
            return
        for copy in list(host.write_backs.values()):
            engine.wait(copy)
            if copy.done:
                engine.forget(copy)
                self._transfers.reap(copy)

    def store_checkpoint(self, ck: Checkpoint) -> None:
        """Write-through ([R53]): queue the copy of a just-saved, block-aligned
        checkpoint into a host slot, ordered after its save copy (both touch its
        slot), pinning it until reaped. Best effort: with no host slot to be had,
        or a copy that fails when queued, it stays device-only."""
        checkpoints = self._checkpoints
        host_slot = checkpoints.reserve_host_slot()
        if host_slot is None:
            return
        checkpoints.begin_store(ck, host_slot)
        copy = self._transfers.build_checkpoint_store(ck)
        copy.receipts.append(checkpoints.pin(ck))

        def undo() -> None:
            checkpoints.stored(ck, failed=True)
            checkpoints.unpin(copy.receipts[0])

        with contextlib.suppress(CacheError):  # a failed store is undone: device-only
            self._transfers.launch(copy, undo)

    # ------------------------------------------------------------- failures

    def _cut_failed_loads(self, nodes: list[Node]) -> None:
        """A load failed ([R50]): every live request whose path reads one of `nodes`
        loses its path from there and can only be released or aborted."""
        failed = set(nodes)
        for seq in self._live.values():
            for i, node in enumerate(seq.path):
                if node in failed:
                    del seq.path[i:]
                    seq.load_failed = True
                    break
