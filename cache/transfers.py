"""Copy orchestration: build, launch and reap the copies of saves and restores, and
reap the host tier's store and load copies.

`Transfers` owns the registry of in-flight copies (queued, not yet reaped) and
is the only place a copy's pins and block references are released ([R35]):
when the copy is reaped, never before. One builder serves both directions:
a save copies runtime state into a checkpoint slot (and the sequence's
partial block into the frozen tail), a restore the other way, one `TensorMove`
per tensor (nothing to gather). The host tier builds its store and load copies
itself, one gathered `BlockMove` each (`cache.moves`).

Launching is transactional ([R38]): if queuing a copy raises (a copy that runs
at once failed, or an interrupt — any `BaseException` — arrived inside it),
the operation's `undo` puts back everything it changed before the error
propagates, so no half-done checkpoint is ever published.

It must not evict, take blocks or slots, or change node state except by
settling a block's owner when a reaped copy drops its reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from cache.checkpoints import CheckpointStore
from cache.copies import Copy, CopyEngine, Move, Resource, TensorMove
from cache.eviction import Evictor
from cache.kv_pool import KVBlockPool
from cache.state_pool import CheckpointSlotPool
from cache.stats import CacheStats
from spec.errors import CacheError, InvalidType
from spec.lifecycle import CopyKind, CopyState, CopyTrigger

if TYPE_CHECKING:
    from cache.completions import CompletionQueue
    from cache.host_tier import HostTier
    from cache.node import Checkpoint, Node

_QUEUED = CopyState.QUEUED.value
_LOAD = CopyKind.LOAD.value
_STORE = CopyKind.STORE.value


class Transfers:
    """In-flight copies: built here, queued on the engine, reaped here."""

    __slots__ = (
        "_checkpoints",
        "_evictor",
        "_kv",
        "_serial",
        "_slots",
        "_stats",
        "engine",
        "host",
        "inflight",
        "on_load_failed",
    )

    def __init__(
        self,
        engine: CopyEngine,
        kv: KVBlockPool,
        slots: CheckpointSlotPool,
        checkpoints: CheckpointStore,
        evictor: Evictor,
        stats: CacheStats,
    ) -> None:
        self.engine = engine
        self._kv = kv
        self._slots = slots
        self._checkpoints = checkpoints
        self._evictor = evictor
        self._stats = stats
        self._serial = 0
        self.inflight: dict[int, Copy] = {}
        self.host: HostTier | None = None
        """The host tier whose store and load copies this reaps (None without one)."""
        self.on_load_failed: Callable[[list[Node]], None] = _ignore
        """Called with the nodes of a failed load once it is reaped (the trie cuts
        the requests that read them)."""

    def use_engine(
        self, engine: CopyEngine, device: torch.device, completions: CompletionQueue
    ) -> None:
        """Queue later copies on `engine`, binding it to `device` (`CopyEngine.bind`)
        and to the trie's `completions` (reports from other threads, [R58]).

        Refused with `CacheError`, changing nothing, while a copy is in flight on
        the current engine (only its copies are reaped by `poll`, so it would
        never be), or when `engine` already serves another trie. The current
        engine again does nothing.
        """
        if not isinstance(engine, CopyEngine):
            raise InvalidType(f"copies must be a CopyEngine, got {type(engine).__name__}")
        if engine is self.engine:
            return
        if self.inflight:
            raise CacheError(
                f"copies: {len(self.inflight)} copies in flight on the current engine; "
                "complete and poll() them before swapping engines"
            )
        engine.bind(device)
        engine._completions = completions
        self.engine = engine

    def number(self, copy: Copy) -> Copy:
        """Give a copy built elsewhere (the host tier's) this trie's next serial."""
        self._serial += 1
        copy.serial = self._serial
        copy._on_fail = self._failed
        return copy

    def build(
        self,
        kind: str,
        step: int,
        slot: int,
        runtime: Mapping[str, torch.Tensor],
        *,
        into_checkpoint: bool,
        frozen_block: int | None,
        seq_block: int,
        from_host: bool = False,
    ) -> Copy:
        """A copy between `runtime` and checkpoint `slot` (and, for a partial
        checkpoint, between the sequence's block and the frozen tail block).

        `into_checkpoint` is True for a save, False for a restore; `from_host`
        makes `slot` a host checkpoint slot a restore reads ([R56]). For a
        partial checkpoint the copy takes a reference on `seq_block`, which it
        reads (save) or writes (restore) until reaped.
        """
        pool = self._slots
        resources: list[Resource] = [("slot", slot)]
        if from_host:
            pool = self._checkpoints._host_pool()
            resources = [("host_slot", slot)]
        moves: list[Move] = []
        for name, view in pool.views(slot).items():
            state = runtime[name]
            moves.append(TensorMove(state, view) if into_checkpoint else TensorMove(view, state))
        if frozen_block is not None:
            src, dst = (seq_block, frozen_block) if into_checkpoint else (frozen_block, seq_block)
            resources += [("block", src), ("block", dst)]
            src_view, dst_view = self._kv.view(src), self._kv.view(dst)
            if src_view is not None and dst_view is not None:
                moves.append(TensorMove(src_view, dst_view))
        self._serial += 1
        copy = Copy(kind, step, moves, resources, self._serial)
        copy._on_fail = self._failed
        if frozen_block is not None:
            self._kv.incref(seq_block)
            copy.blocks.append(seq_block)
        return copy

    def build_checkpoint_store(self, ck: Checkpoint) -> Copy:
        """The store copy of `ck` (device slot -> its host slot, [R53]); the caller
        pins `ck` for it (the pin is released when it is reaped)."""
        host = self._checkpoints._host_pool()
        moves: list[Move] = [
            TensorMove(view, host.tensors[name][ck.host_slot])
            for name, view in self._slots.views(ck.slot).items()
        ]
        self._serial += 1
        copy = Copy(
            _STORE, ck.step, moves, [("slot", ck.slot), ("host_slot", ck.host_slot)], self._serial
        )
        copy._on_fail = self._failed
        return copy

    def hold(self, copy: Copy, blocks: list[int], host_blocks: list[int]) -> None:
        """`copy` takes a reference on each device and host block it reads or writes;
        they are released when it is reaped, never before ([R35])."""
        self._kv.incref_all(blocks)
        copy.blocks.extend(blocks)
        if host_blocks:
            host = self.host
            if host is None:
                raise CacheError(f"{copy!r} holds host blocks, but there is no host tier")
            host.pool.incref_all(host_blocks)
            copy.host_blocks.extend(host_blocks)

    def _release_host_blocks(self, copy: Copy) -> None:
        if copy.host_blocks and self.host is not None:
            self.host.pool.decref_all(copy.host_blocks)
        copy.host_blocks.clear()

    def launch(self, copy: Copy, undo: Callable[[], None]) -> None:
        """Queue `copy`; reap it at once if it finished when queued ([R37]).

        If queuing raises, the copy's own references are dropped, `undo`
        reverts the operation, and the error propagates: an `Exception` as
        `CacheError`, any other `BaseException` (KeyboardInterrupt, a
        cancelled task) unchanged ([R38]).
        """
        self.inflight[copy.serial] = copy
        try:
            self.engine.queue(copy)
        except BaseException as exc:
            self.engine.forget(copy)
            del self.inflight[copy.serial]
            if copy.state == _QUEUED:
                copy._set_failed()
            copy.fire(CopyTrigger.REAP)
            for block in copy.blocks:
                self._kv.decref(block)
            copy.blocks.clear()
            self._release_host_blocks(copy)
            undo()
            if isinstance(exc, Exception):
                raise CacheError(f"{copy.kind}: the copy failed and was undone: {exc}") from exc
            raise
        if copy.done:
            self.engine.forget(copy)
            self.reap(copy)

    def _failed(self, copy: Copy) -> None:
        """A queued copy failed ([R46]): a save's checkpoint will never hold its
        data, so it is withdrawn, and the queued restores that read it fail too;
        a load's blocks will never arrive, so the queued loads ordered after it
        fail too ([R50])."""
        if copy.kind == _LOAD:
            for other in list(self.inflight.values()):
                if (
                    other is not copy
                    and other.kind == _LOAD
                    and other.state == _QUEUED
                    and other.resources & copy.resources
                ):
                    other._fail()
            return
        if copy.kind != "save" or not copy.receipts:
            return
        ck = copy.receipts[0].checkpoint
        self._checkpoints.withdraw(ck)
        for other in list(self.inflight.values()):  # restores and its store ([R53]) read it
            if (
                other.kind != "save"
                and other.state == _QUEUED
                and any(r.checkpoint is ck for r in other.receipts)
            ):
                other._fail()

    def reap(self, copy: Copy) -> None:
        """Release a finished or failed copy's pins and block references ([R35])."""
        del self.inflight[copy.serial]
        copy.fire(CopyTrigger.REAP)
        if copy.failed:
            self._stats.copies_failed += 1
        failed_loads: list[Node] = []
        host = self.host
        self._release_host_blocks(copy)
        if host is not None and copy.nodes:
            if copy.kind == _STORE:
                host.stored(copy)
            else:
                failed_loads = host.loaded(copy)
        checkpoints = self._checkpoints
        if copy.kind == _STORE and copy.receipts:  # a checkpoint's store ([R53])
            checkpoints.stored(copy.receipts[0].checkpoint, copy.failed)
        for receipt in copy.receipts:
            checkpoints.unpin(receipt)
        kv = self._kv
        refs = kv.refs
        evictor = self._evictor
        for block in copy.blocks:
            kv.decref(block)
            if refs[block] == 1:  # the only count at which a node's state can change
                evictor.settle_block(block)
        self._stats.copies_reaped += 1
        if failed_loads:
            self.on_load_failed(failed_loads)
        if host is not None and host.write_backs.pop(copy.serial, None) is not None:
            for node in copy.nodes:  # [R52]: the store was for an eviction
                evictor.offload_written_back(node)

    def poll(self) -> int:
        """Reap every finished copy, oldest first; returns how many."""
        finished = self.engine.collect()
        for copy in finished:
            self.reap(copy)
        return len(finished)


def _ignore(nodes: list[Node]) -> None:
    """The default `on_load_failed`: no requests to cut."""
