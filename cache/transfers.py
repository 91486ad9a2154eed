"""Copy orchestration: build, launch and reap the copies of saves and restores.

`Transfers` owns the registry of in-flight copies (queued, not yet reaped) and
is the only place a copy's pins and block references are released ([R35]):
when the copy is reaped, never before. One builder serves both directions:
a save copies runtime state into a checkpoint slot (and the sequence's
partial block into the frozen tail), a restore the other way.

Launching is transactional ([R38]): if queuing a copy raises (a copy that runs
at once failed, or an interrupt — any `BaseException` — arrived inside it),
the operation's `undo` puts back everything it changed before the error
propagates, so no half-done checkpoint is ever published.

It must not evict, take blocks or slots, or change node state except by
settling a block's owner when a reaped copy drops its reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from cache.checkpoints import CheckpointStore
from cache.copies import Copy, CopyEngine, Resource
from cache.eviction import Evictor
from cache.kv_pool import KVBlockPool
from cache.state_pool import CheckpointSlotPool
from cache.stats import CacheStats
from spec.errors import CacheError
from spec.lifecycle import CopyState, CopyTrigger

_QUEUED = CopyState.QUEUED.value


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
        "inflight",
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
    ) -> Copy:
        """A copy between `runtime` and checkpoint `slot` (and, for a partial
        checkpoint, between the sequence's block and the frozen tail block).

        `into_checkpoint` is True for a save, False for a restore. For a
        partial checkpoint the copy takes a reference on `seq_block`, which
        it reads (save) or writes (restore) until reaped.
        """
        moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, view in self._slots.views(slot).items():
            moves.append((runtime[name], view) if into_checkpoint else (view, runtime[name]))
        resources: list[Resource] = [("slot", slot)]
        if frozen_block is not None:
            src, dst = (seq_block, frozen_block) if into_checkpoint else (frozen_block, seq_block)
            resources += [("block", src), ("block", dst)]
            src_view, dst_view = self._kv.view(src), self._kv.view(dst)
            if src_view is not None and dst_view is not None:
                moves.append((src_view, dst_view))
        self._serial += 1
        copy = Copy(kind, step, moves, resources, self._serial)
        if frozen_block is not None:
            self._kv.incref(seq_block)
            copy.blocks.append(seq_block)
        return copy

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
                copy.fire(CopyTrigger.FAIL)
            copy.fire(CopyTrigger.REAP)
            for block in copy.blocks:
                self._kv.decref(block)
            copy.blocks.clear()
            undo()
            if isinstance(exc, Exception):
                raise CacheError(f"{copy.kind}: the copy failed and was undone: {exc}") from exc
            raise
        if copy.done:
            self.engine.forget(copy)
            self.reap(copy)

    def reap(self, copy: Copy) -> None:
        """Release a finished copy's pins and block references ([R35])."""
        del self.inflight[copy.serial]
        copy.fire(CopyTrigger.REAP)
        checkpoints = self._checkpoints
        for receipt in copy.receipts:
            checkpoints.unpin(receipt)
        kv = self._kv
        evictor = self._evictor
        for block in copy.blocks:
            kv.decref(block)
            evictor.settle_block(block)
        self._stats.copies_reaped += 1

    def poll(self) -> int:
        """Reap every finished copy, oldest first; returns how many."""
        finished = self.engine.collect()
        for copy in finished:
            self.reap(copy)
        return len(finished)
