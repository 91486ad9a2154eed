"""The copy engine: checkpoint save / restore copies, the host tier's store / load
copies, and when they finish.

A `Copy` is a list of moves (each a `Move`: something with `run()`) plus what
keeps its source and destination alive: pin receipts on checkpoints and
references on KV blocks. The trie releases those only when the copy has
finished and is reaped (`BlockTrie.poll`, or at once for a copy that finished
when queued). Two kinds of move:

- `TensorMove(src, dst)`: one `dst.copy_(src)` (a checkpoint's runtime state to
  or from its slot, a partial block to or from the frozen tail);
- `BlockMove(src, src_ids, dst, dst_ids)`: many KV blocks between two pools
  (the host tier's store and load copies) as a few gathered operations, not
  one `copy_` per block (see `BlockMove`; built by `block_moves`).

- `DeviceCopies` (the default): on CPU a copy runs when queued; on CUDA it is
  queued on a side stream that first waits for the current stream, an event is
  recorded after it, and it finishes when that event has (polled with
  `Event.query`, never a device synchronisation). The temporaries a gathered
  move makes (index tensors, gathered blocks, page-locked staging) are made on
  the side stream and stay referenced by the move until that event has fired
  or the copy is reaped; freed earlier (a copy that failed) they are still
  safe: the caching allocators reuse them only in stream order. When queuing
  raises after the moves may have been queued (an interrupt before the event
  is recorded), the engine waits the side stream out before the error reaches
  the trie's undo, which frees the copy's blocks and slots ([R59]).
- `ManualCopies`: for tests. A queued copy moves its data only when the test
  completes it, as a late GPU copy would. Completing a copy first completes
  every earlier pending copy that touches one of its blocks or slots (a stream
  runs in order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from cache.completions import CompletionQueue
from cache.moves import BlockMove, Move, TensorMove, block_moves
from spec.errors import CacheError, CopyFailed, InvalidArgument, InvalidType
from spec.lifecycle import COPY, CopyKind, CopyState, CopyTrigger

_QUEUED = CopyState.QUEUED.value
_LOAD = CopyKind.LOAD.value

if TYPE_CHECKING:
    from cache.node import Node
    from cache.sequence import PinReceipt

__all__ = [
    "BlockMove",
    "Copy",
    "CopyEngine",
    "DeviceCopies",
    "ManualCopies",
    "Move",
    "Resource",
    "TensorMove",
    "block_moves",
]

Resource = tuple[str, int]
"""("block", id), ("host_block", id), ("slot", id) or ("host_slot", id): what a copy touches,
for ordering."""


class Copy:
    """One queued copy. `kind` is "save" or "restore" (a checkpoint's; `step` its step),
    or "store" / "load" (KV blocks to / from the host tier; `step` 0).

    `state` follows `spec.lifecycle.COPY`: `queued`, then `finished` (its data
    moved) or `failed`, then `reaped` once the trie released its pins and
    block references. `done` says whether it is no longer queued; `wait()`
    makes the caller's work wait for it (completes it under `ManualCopies`,
    makes the current CUDA stream wait on its event, returns at once on CPU).
    """

    __slots__ = (
        "_block_resources",
        "_engine",
        "_event",
        "_host_block_resources",
        "_on_fail",
        "_resources",
        "_slot_resources",
        "blocks",
        "failed",
        "host_blocks",
        "kind",
        "moves",
        "nodes",
        "receipts",
        "serial",
        "state",
        "step",
    )

    def __init__(
        self,
        kind: str,
        step: int,
        moves: list[Move],
        resources: Iterable[Resource],
        serial: int,
        *,
        blocks: Sequence[int] = (),
        host_blocks: Sequence[int] = (),
    ) -> None:
        """A copy of `moves` touching `resources`, plus the KV blocks `blocks` and the
        host-tier blocks `host_blocks` (a store's or load's many blocks, kept as id
        lists: `resources` builds their pairs only when asked); built by the trie
        (`cache.transfers`, `cache.host_tier`), not by users."""
        self.kind = kind
        """"save", "restore", "store" or "load"."""
        self.step = step
        """The checkpoint's step (tokens of state it carries)."""
        self.moves = moves
        """The moves, run in order (`cache.moves`): a `TensorMove` (unpacks as
        ``(src, dst)``) per checkpoint tensor and for the frozen tail; one `BlockMove`
        (pool tensors `src` / `dst`, block lists `src_ids` / `dst_ids`) for all the
        blocks of a store or load. Empty for ids-only pools."""
        self._slot_resources = tuple(resources)
        self._block_resources = blocks
        self._host_block_resources = host_blocks
        self._resources: frozenset[Resource] | None = None
        self.serial = serial
        """Per-trie creation counter."""
        self.receipts: list[PinReceipt] = []
        """The pins it holds until reaped (a save's producer pin, a restore's match pin)."""
        self.blocks: list[int] = []
        """The KV block references it holds until reaped."""
        self.host_blocks: list[int] = []
        """The host-tier block references it holds until reaped (store and load copies)."""
        self.nodes: list[Node] = []
        """The nodes whose KV a store or load copy moves (their residency changes when
        it is reaped)."""
        self.state: str = _QUEUED
        """Its `spec.lifecycle.COPY` state: queued, finished, failed, reaped."""
        self.failed = False
        """Whether the copy failed (its data never arrived); stays True once reaped."""
        self._on_fail: Callable[[Copy], None] | None = None
        self._event: torch.cuda.Event | None = None
        self._engine: CopyEngine | None = None

    @property
    def resources(self) -> frozenset[Resource]:
        """The blocks and slots it touches: copies sharing one run in queue order.
        Built on first use (most copies are never compared with another)."""
        resources = self._resources
        if resources is None:
            resources = frozenset(
                [
                    *self._slot_resources,
                    *(("block", b) for b in self._block_resources),
                    *(("host_block", b) for b in self._host_block_resources),
                ]
            )
            self._resources = resources
        return resources

    @property
    def done(self) -> bool:
        """Whether the copy is no longer queued (its data moved, or it failed).

        On CUDA, looking is what notices that its event fired; only the trie's
        owning thread then moves the copy to `finished` ([R58]): from another
        thread this says True and changes nothing.
        """
        if self.state == _QUEUED and self._event is not None and self._event.query():  # type: ignore[no-untyped-call]
            engine = self._engine
            completions = engine._completions if engine is not None else None
            if completions is not None and not completions.on_owner():
                return True
            self.fire(CopyTrigger.FINISH)
            self._drop_temporaries()
        return self.state != _QUEUED

    def fire(self, trigger: CopyTrigger) -> None:
        """Move to the next state through the spec's `COPY` table (illegal ones raise)."""
        self.state = COPY.step(trigger, self.state, self)
        if trigger is CopyTrigger.REAP:
            self._drop_temporaries()

    def _drop_temporaries(self) -> None:
        """Let the moves drop the temporaries of their last run. The engine calls it once
        the data has arrived (or never will): when the copy ran synchronously, when its
        CUDA event fired, and when it is reaped."""
        for move in self.moves:
            move.release()

    def wait(self) -> None:
        """Order the caller's later work after this copy (see class docstring).

        Raises `CopyFailed` when the copy failed: its data never arrived. On the
        trie's owning thread it first applies the completions and failures
        other threads reported ([R58]), so a failure reported before the wait
        is seen by it.
        """
        engine = self._engine
        if engine is not None and engine._completions is not None:
            engine._completions.flush()
        if not self.failed and engine is not None:
            engine.wait(self)
        if self.failed:
            raise CopyFailed(f"{self!r} failed: its data never arrived")

    def _set_failed(self) -> None:
        """Mark the copy failed (state `failed`) without telling the trie."""
        self.fire(CopyTrigger.FAIL)
        self.failed = True

    def _fail(self) -> None:
        """Mark the copy failed and let the trie withdraw what depended on it ([R46])."""
        self._set_failed()
        if self._on_fail is not None:
            self._on_fail(self)

    def run(self) -> None:
        """Move the data now, on the current stream, outside autograd.

        Copies never record an autograd graph: a runtime state that requires
        grad is read as plain data, and the pools never join a graph.
        """
        if not self.moves:  # ids-only pools: nothing to move
            return
        with torch.no_grad():
            for move in self.moves:
                move.run()

    def __repr__(self) -> str:
        return f"<Copy #{self.serial} {self.kind} step={self.step} {self.state}>"


class CopyEngine:
    """Queues copies and reports which have finished. Subclasses decide when."""

    def __init__(self) -> None:
        self._inflight: list[Copy] = []
        self._bound = False
        self._completions: CompletionQueue | None = None
        """The door reports from other threads come through ([R58]); the trie this
        engine serves sets it (None: no trie, reports apply at once)."""

    def bind(self, device: torch.device) -> None:
        """Called once by the trie that owns this engine, with its pools' device.

        An engine serves one trie: a second binding raises `CacheError` (its
        `poll` would reap the other trie's copies).
        """
        if self._bound:
            raise CacheError(f"{type(self).__name__} is already bound to another BlockTrie")
        self._bound = True
        self._bind(device)

    def _bind(self, device: torch.device) -> None:
        """Subclass hook: prepare for copies on `device`."""

    def queue(self, copy: Copy) -> None:
        """Start `copy` (it may finish at once). Called by the trie, not by users."""
        copy._engine = self
        self._inflight.append(copy)
        self._start(copy)

    def _start(self, copy: Copy) -> None:
        raise NotImplementedError

    def wait(self, copy: Copy) -> None:
        """Make the caller's later work wait for `copy`."""

    def collect(self) -> list[Copy]:
        """Remove and return the copies no longer queued, oldest first (the trie's
        `poll()` calls this, then reaps them)."""
        if not self._inflight:  # the usual poll of an attention-only engine step
            return []
        finished: list[Copy] = []
        pending: list[Copy] = []
        for copy in self._inflight:
            # One look at `done` per copy: on CUDA it can turn true between two
            # looks, and a copy dropped from both lists would never be reaped.
            (finished if copy.done else pending).append(copy)
        self._inflight = pending
        return finished

    def fail(self, copy: Copy) -> None:
        """Declare that a queued `copy` will never deliver its data ([R46]).

        For an engine that sees a copy go wrong (a CUDA error, a cancelled
        request) and for tests. The copy becomes `failed`; a failed save
        withdraws its checkpoint (no longer matchable; released when its last
        pin goes) and fails the queued restores that read it. Its pins and
        references are released when `poll()` reaps it. Failing a failed copy
        does nothing; raises `InvalidType` for a non-copy and `InvalidArgument`
        for a copy of another engine or one that already finished.

        May be called from any thread ([R58]): from a thread other than the
        trie's owner (or while an operation runs) it is recorded and applied by
        the owning thread at its next `poll()`; the checks of the copy's state
        are made then, and a failure of a copy that has finished by then is
        dropped.
        """
        self._report("fail()", copy, self._fail_now)

    def _report(self, call: str, copy: Copy, apply: Callable[[Copy, bool], None]) -> None:
        """Check `copy` is this engine's, then apply `apply(copy, deferred)` now or
        record it for the owning thread ([R58], `cache.completions`)."""
        if not isinstance(copy, Copy):
            raise InvalidType(f"{call} takes a Copy, got {type(copy).__name__}")
        if copy._engine is not self:
            raise InvalidArgument(f"{copy!r} was not queued on this {type(self).__name__}")
        completions = self._completions
        if completions is None:
            apply(copy, False)
        else:
            completions.submit(lambda deferred: apply(copy, deferred))

    @staticmethod
    def _fail_now(copy: Copy, deferred: bool) -> None:
        if copy.failed:
            return
        if copy.state != _QUEUED:
            if deferred:  # it finished before the report was applied: its data arrived
                return
            raise InvalidArgument(f"fail(): {copy!r} already finished; its data arrived")
        copy._fail()

    def forget(self, copy: Copy) -> None:
        """Stop tracking a copy the trie reaped itself (it finished when queued, or
        failed while being queued). Called by the trie, not by users."""
        if self._inflight and self._inflight[-1] is copy:
            self._inflight.pop()
        elif copy in self._inflight:
            self._inflight.remove(copy)


class SideStream:
    """The CUDA side stream `DeviceCopies` queues copies on, and how it waits.

    A class of its own so that the window between queuing a copy's moves and
    recording its event is one method, which `DeviceCopies` guards ([R59]);
    tests/test_contract_copies.py drives it on a CPU-only machine through a
    fake CUDA runtime whose stream defers what it is given.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def queue(self, copy: Copy) -> torch.cuda.Event:
        """Queue `copy`'s moves after the current stream's work; returns the event
        recorded after them."""
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            copy.run()
            for move in copy.moves:
                # The engine's runtime tensors are used on our stream too: the
                # caching allocator must not hand their memory out before we finish.
                # (A move's temporaries are made on this stream and kept by the
                # move until the event below fires: `Copy.done` releases them.)
                for tensor in move.tensors():
                    if tensor.is_cuda:
                        tensor.record_stream(stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event

    def synchronize(self) -> None:
        """Return once everything queued on the stream so far has run."""
        self.stream.synchronize()  # type: ignore[no-untyped-call]


class DeviceCopies(CopyEngine):
    """Copies on the pools' device: synchronous on CPU, a side stream on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self._side: SideStream | None = None
        self._device: torch.device | None = None

    def _bind(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._device = device
            self._side = SideStream(device)

    def _start(self, copy: Copy) -> None:
        side = self._side
        if side is None:
            try:
                copy.run()
            finally:
                copy._drop_temporaries()
            copy.fire(CopyTrigger.FINISH)
            return
        try:
            copy._event = side.queue(copy)
        except BaseException:
            # Part of the copy may be queued already: the [R38] undo that follows
            # frees its blocks and slots, so first wait until the stream is past
            # it ([R59]), or another request's data could be overwritten.
            _wait_out(side)
            raise

    def wait(self, copy: Copy) -> None:
        event = copy._event
        if event is None:
            return
        if copy.kind != _LOAD and any(not t.is_cuda for move in copy.moves for t in move.tensors()):
            # A host tensor is read or written: the host itself must wait. (A load
            # reads the host tier only, which nothing but stream-ordered copies
            # write: the device stream waiting is enough.)
            event.synchronize()
        else:
            torch.cuda.current_stream(self._device).wait_event(event)


def _wait_out(side: SideStream) -> None:
    """`side.synchronize()`, retried while an interrupt (a `BaseException` that is
    not an `Exception`, e.g. `KeyboardInterrupt`) cuts it short: the caller is about
    to free what the stream may still write ([R59]). The interrupt being handled
    propagates after; an `Exception` from the device (it is broken) propagates now."""
    while True:
        try:
            side.synchronize()
        except Exception:
            raise
        except BaseException:
            continue
        return


class ManualCopies(CopyEngine):
    """Copies that move their data only when the test completes them."""

    def _start(self, copy: Copy) -> None:
        pass

    def pending(self) -> list[Copy]:
        """Queued copies not yet completed (`list[Copy]`), oldest first."""
        return [c for c in self._inflight if c.state == _QUEUED]

    def complete(self, copy: Copy) -> None:
        """Move `copy`'s data now, after the earlier pending copies that share a
        block or slot with it, transitively ([R36]). Completing releases no pin:
        the trie's `poll()` reaps the copy.

        Raises `InvalidType` for a non-copy, `InvalidArgument` for a copy not
        queued on this engine ([R3]), `CopyFailed` for a copy that failed
        (or fails now because a copy it reads failed, [R46], or is failed from
        inside its own run). A copy whose own data movement raises is failed,
        and the error propagates.

        May be called from any thread ([R58]): from a thread other than the
        trie's owner (or while an operation runs) it is recorded, and the owning
        thread moves the data at its next `poll()`, before reaping; what would
        have been raised is not (a copy that failed stays failed, and is reaped
        as such).
        """
        self._report("complete()", copy, self._complete_now)

    def _complete_now(self, copy: Copy, deferred: bool) -> None:
        if copy.failed:
            if deferred:
                return
            raise CopyFailed(f"complete(): {copy!r} failed; it can never complete")
        if copy.state != _QUEUED:
            return  # finished (or reaped) already
        for earlier in self._inflight:
            if earlier is copy:
                break
            if earlier.state == _QUEUED and earlier.resources & copy.resources:
                self._complete_now(earlier, deferred)
        if copy.failed:  # a copy it reads failed on the way
            if deferred:
                return
            raise CopyFailed(f"complete(): {copy!r} failed; it can never complete")
        completions = self._completions
        try:
            if completions is None:
                copy.run()
            else:
                with completions.running():
                    copy.run()
        except BaseException as exc:
            if not copy.failed:
                copy._fail()  # its data is partial: it never delivers
            if deferred and isinstance(exc, Exception):
                return  # failed, and reaped as such; nobody to raise it to
            raise
        finally:
            copy._drop_temporaries()  # ran on the current stream: what follows is ordered after it
        if copy.failed:  # failed from inside its own run: its data never arrived
            if deferred:
                return
            raise CopyFailed(f"complete(): {copy!r} failed while it ran; it can never complete")
        copy.fire(CopyTrigger.FINISH)

    def complete_all(self) -> None:
        """Complete every pending copy, oldest first (skipping copies that fail on the
        way). From another thread: recorded as one report ([R58])."""
        completions = self._completions
        if completions is None:
            self._complete_all_now(False)
        else:
            completions.submit(self._complete_all_now)

    def _complete_all_now(self, deferred: bool) -> None:
        for copy in self.pending():
            if copy.state == _QUEUED:
                self._complete_now(copy, deferred)

    def wait(self, copy: Copy) -> None:
        """Complete `copy` now, with the earlier copies it depends on ([R36])."""
        self.complete(copy)
