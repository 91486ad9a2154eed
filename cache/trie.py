"""`BlockTrie`: the prefix cache's public operations, and nothing else.

Read this module as the table of contents of the cache: each public method
validates its input ([R1]-[R5]), plans, takes resources, then mutates
([R6]). `BlockTrie.__init__` lists the parts; each lives in its own module
with its rules (docs/architecture.md, "Ownership map"):

- `cache.storage`: the pools (`cache.kv_pool`, `cache.state_pool`: KV blocks
  and checkpoint slots, counts and free lists) and the node table
  (`cache.node`), as the configuration sizes them;
- `cache.eviction.Evictor`: node lifecycle states, the eviction index, making
  room;
- `cache.checkpoints.CheckpointStore`: checkpoint lifecycle, pins, receipts;
- `cache.lookup.Lookup`: what `match` finds and takes ([R12]-[R14]);
- `cache.attach.Attach`: what `commit` attaches ([R18], [R19]), namespace
  roots ([R11]);
- `cache.transfers.Transfers`: copies until they are reaped, the copy engine;
- `cache.checkpointing.Checkpointing`: what `save` and `restore` decide and
  queue ([R25]-[R34]);
- `cache.host_tier.HostTier`: the host-memory tier, its eviction, and where
  each block's KV lives; `cache.offload.Offload`: the store and load copies
  between it and the device that operations queue ([R47]-[R54]);
- `cache.keys`: block keys and identities; `cache.event_log`: events;
- `cache.counts.TrieCounts` (a base class): the counts, pool tensors, clock;
- `cache.inspection`: `snapshot()` and `check()`.

The numbers in brackets cite the rules of the operational semantics
(docs/semantics.md), which the reference model `spec.model` cites too.

Single-threaded ([R45]): every operation (`snapshot()` and `check()`
included) holds the trie's gate while it runs; a second thread gets
`ConcurrentUse` before it changes anything (`cache.gate`). Copy completion
and failure may be reported from any thread: `cache.completions` records them
for the owning thread, which applies them in `poll()` ([R58]).

This module is longer than the ~400 lines the others keep to (about 700
lines: 390 of code, 250 of docstrings, 90 blank or comments): it holds
twenty-six public operations, their docstrings (the API reference), the copy
engine's property and `num_reclaimable_blocks` (a count that takes the gate).
Each operation takes the gate and checks its sequence; `allocate`, `release`
and `evict` plan here over the parts; `match`, `commit`, `load`, `save` and
`restore` hand theirs, with one call, to the module that owns them (one
Python call per operation, never per block).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from cache import eviction, inspection
from cache.attach import Attach
from cache.block_pins import BlockPinReceipt, BlockPins, block_hashes_arg
from cache.bounds import NO_SPANS, Spans
from cache.checkpointing import Checkpointing
from cache.checkpoints import CheckpointStore
from cache.completions import CompletionQueue
from cache.config import CacheConfig
from cache.copies import Copy, CopyEngine, DeviceCopies
from cache.counts import TrieCounts
from cache.event_log import EventLog, EventRecords
from cache.events import Event
from cache.eviction import Evictor
from cache.faults import Faults
from cache.gate import Exclusive, concurrent_use
from cache.host_tier import HostTier
from cache.lookup import Lookup
from cache.native import native_module, resolve_backend
from cache.node import (
    Node,
)
from cache.offload import Offload, refuse_unloaded
from cache.sequence import PinReceipt, Sequence, check_redeemable
from cache.stats import CacheStats
from cache.storage import allocate_storage
from cache.transfers import Transfers
from cache.validation import (
    TokenIds,
    extend_tokens,
    int_arg,
    namespace_arg,
    token_list,
)
from spec.errors import (
    CacheError,
    CheckpointError,
    InvalidArgument,
    InvalidType,
    SequenceNotLive,
)
from spec.lifecycle import CheckpointTrigger
from spec.snapshot import Snapshot


class BlockTrie(TrieCounts):
    """A prefix cache of KV blocks and SSM checkpoints (the contract page, "Public API").

    Every operation taking a sequence raises `InvalidType` when it is not a
    `Sequence` and `SequenceNotLive` when this trie does not hold it as live
    ([R3]); malformed counts raise `InvalidType` / `InvalidArgument` ([R1]).
    A failed operation changes nothing ([R6]).
    """

    def __init__(self, config: CacheConfig, copies: CopyEngine | None = None) -> None:
        """Build the pools described by `config` and bind the copy engine.

        `copies` defaults to `DeviceCopies()` (copies run on the pools' device
        as queued); pass `ManualCopies()` to decide in tests when copies
        finish. Raises `InvalidType` for arguments of the wrong type,
        `ConfigError` when the pools cannot be allocated, and `CacheError`
        when the engine is already bound to another trie.
        """
        if not isinstance(config, CacheConfig):
            raise InvalidType(f"config must be a CacheConfig, got {type(config).__name__}")
        if copies is not None and not isinstance(copies, CopyEngine):
            raise InvalidType(f"copies must be a CopyEngine, got {type(copies).__name__}")
        self.config = config
        """The configuration this trie was built from (frozen)."""
        self.device = torch.device(config.device)
        """Where the pools live."""
        self._block_size = config.block_size
        self._ssm = config.ssm
        self._key_hash = config.key_hash
        self.faults = Faults()
        """Allocation-point fault injection, for tests of transactional behaviour."""
        self.stats = CacheStats(config.stats_window, lambda: self._lookup._seq_serial)
        """Running counters: hits, evictions, checkpoints, copies (`CacheStats`)."""
        self.backend = resolve_backend(config.backend)
        """Which core runs this trie: "native" (the kernels of `cache._native`) or
        "python" (`CacheConfig.backend`, `BLOCKTRIE_BACKEND`; `cache.native`)."""
        native = native_module() if self.backend == "native" else None
        storage = allocate_storage(config, self.device, self.faults)
        self._kv, self._slots, self._nodes = storage.kv, storage.slots, storage.nodes
        self._kv.native = native
        self._host_pool, self._host_slots = storage.host_kv, storage.host_slots
        engine: CopyEngine = copies if copies is not None else DeviceCopies()
        engine.bind(self.device)
        self._events = EventLog(config.enable_events, config.block_hash, config.hash_seed)
        self._events.nodes = self._nodes
        self._checkpoints = CheckpointStore(
            self._nodes, self._slots, self._kv, self.stats, self._events, config.block_size, self
        )
        if config.host_checkpoints:
            self._checkpoints.host_slots = self._host_slots
        self._host = None
        if config.host_tier:
            self._host = HostTier(
                self._nodes,
                self._host_pool,
                self._kv,
                self.stats,
                self._events,
                duplicates_first=config.host_write == "back",  # [R71]
            )
        self._evictor = Evictor(
            self._nodes, self._kv, self._checkpoints, self.stats, self._events, self._host, native
        )
        if self._host is not None:
            self._host.bind(self._evictor)
        self._checkpoints.on_pins_changed = self._evictor.settle
        self._transfers = Transfers(
            engine, self._kv, self._slots, self._checkpoints, self._evictor, self.stats
        )
        self._block_pins = BlockPins(
            self._nodes,
            self._kv,
            self._evictor.settle,
            self._evictor.settle_block,
            config.enable_events,
        )
        self._roots: dict[str, Node] = {}
        self._clock = 0
        self._live: dict[int, Sequence] = {}
        self._write_back = self._host is not None and config.host_write == "back"
        self._offload = Offload(
            self._nodes, self._kv, self._host, self._evictor, self._checkpoints, self._transfers,
            self._events, self._live, self._roots, self._write_back,
        )  # fmt: skip
        self._checkpointing = Checkpointing(
            self, self._nodes, self._kv, self._slots, self._checkpoints, self._evictor,
            self._transfers, self._offload, self._roots, self.stats,
        )  # fmt: skip
        self._lookup = Lookup(
            self, self._nodes, self._kv, self._host, self._evictor, self._checkpoints,
            self._roots, self._live, self.stats,
        )  # fmt: skip
        self._attach = Attach(
            self, self._nodes, self._kv, self._host, self._evictor, self._events,
            self._block_pins, self._offload, self._roots, self._write_back,
        )  # fmt: skip
        self._explicit: dict[int, PinReceipt] = {}
        self._gate = threading.Lock()  # held while an operation runs ([R45])
        self._completions = CompletionQueue(self._gate)  # reports from other threads ([R58])
        self._fast = None  # the native core's release and allocate, when it runs
        if native is not None and self._host is None:
            self._fast = native.FastTrie(
                self._nodes, self._kv.refs, self._kv._free, Sequence, eviction._SETTLED,
                self.faults, self._kv._fault_point, config.block_size,
            )  # fmt: skip
        engine._completions = self._completions

    # ------------------------------------------------------------ properties
    # (the counts, the pools' tensors and the clock: `TrieCounts`)

    @property
    def num_reclaimable_blocks(self) -> int:
        """KV blocks an `allocate` could obtain right now ([R62]): the free ones plus
        every block making room could free ([R16]: the eviction cascade, parents
        left evictable included, and unpinned checkpoints' frozen tails). SGLang's
        `evictable_size` plus its free blocks; vLLM's free blocks counting the
        cached ones nobody uses.

        Computed when read (`Evictor.reclaimable`): O(reclaimable nodes + unpinned
        checkpoints), not a running count; for one admission decision,
        `can_allocate` is cheaper (it stops counting once the need is covered).
        """
        with Exclusive(self._gate, "num_reclaimable_blocks"):
            return self._kv.num_free + self._evictor.reclaimable()

    @property
    def copies(self) -> CopyEngine:
        """The copy engine that runs this trie's save and restore copies."""
        return self._transfers.engine

    @copies.setter
    def copies(self, engine: CopyEngine) -> None:
        """Queue later copies on `engine`, which this trie then binds (`CopyEngine.bind`).

        Refused with `CacheError`, changing nothing, while a copy is in flight on
        the current engine (only the current engine's copies are reaped by
        `poll`, so it would never be), or when `engine` already serves another
        trie. Setting the current engine again does nothing.
        """
        with Exclusive(self._gate, "copies"):
            self._transfers.use_engine(engine, self.device, self._completions)

    # ---------------------------------------------------------------- helpers

    def _check_live(self, seq: object) -> Sequence:
        """`seq` itself, if this trie's registry holds it as live ([R3])."""
        if not isinstance(seq, Sequence):
            raise InvalidType(f"expected a Sequence from this cache, got {type(seq).__name__}")
        if seq.owner is not self:
            raise SequenceNotLive(f"{seq!r} belongs to another cache")
        if self._live.get(seq.serial) is not seq:
            if not seq.live:
                raise SequenceNotLive(f"{seq!r} was already released or aborted")
            raise SequenceNotLive(
                f"{seq!r} is not live in this cache: not the object its match returned "
                "(a copy, or built by hand)"
            )
        return seq

    # ----------------------------------------------------------------- match

    def match(
        self,
        tokens: TokenIds,
        namespace: str = "",
        extra: object = None,
        *,
        cache_salt: str | None = None,
        max_hit_tokens: int | None = None,
        atomic_spans: Spans | list[tuple[int, int]] = NO_SPANS,
    ) -> Sequence:
        """Look up the longest usable cached prefix of `tokens`; takes refs (and a pin) at once.

        `cache_salt` (vLLM's): folded into block 0's extra identity as vLLM folds
        it into that block's extra keys ([R70]), so that salted requests share
        cache only with requests of the same salt, and under `block_hash="vllm"`
        publish vLLM's hashes where vLLM's layout names the block apart ([R61]);
        None or "" is no salt. `seq.extra` shows the fold.

        Returns a live `Sequence` whose `num_cached_tokens` is the hit ([R13]):
        attention-only, the longest cached full-block prefix; SSM, the step of
        the deepest published checkpoint whose prefix equals the request's. At
        least one token is left to compute. `max_hit_tokens` caps the hit
        ([R64]: 0 is vLLM's prompt-logprobs request, which hits nothing yet
        commits as usual); `atomic_spans`, `(start, end)` token ranges such as
        multimodal items, are hit whole or not at all ([R65]). Raises
        `InvalidType` / `InvalidArgument` on malformed input ([R1]), changing
        nothing. Keeps invariants 1, 2, 5 and 6; `abort` undoes it exactly
        (invariant 8).
        """
        if not self._gate.acquire(False):
            raise concurrent_use("match()")
        try:
            return self._lookup.match(
                tokens, namespace, extra, cache_salt, max_hit_tokens, atomic_spans
            )
        finally:
            self._gate.release()

    # ------------------------------------------------------- append/allocate

    def append(self, seq: Sequence, tokens: TokenIds) -> None:
        """Extend `seq.tokens` (decode) ([R4]). Raises `SequenceNotLive` for a dead sequence."""
        if not self._gate.acquire(False):
            raise concurrent_use("append()")
        try:
            self._check_live(seq)
            seq.token_list = extend_tokens(seq.token_list, token_list(tokens))
        finally:
            self._gate.release()

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table cover `tokens[:num_tokens]` ([R15]), evicting LRU
        leaves and then unpinned frozen tails if short ([R17]).

        Raises `OutOfBlocks` when even eviction cannot make room, having
        evicted nothing ([R16]). Keeps invariants 1, 3 and 9.
        """
        if not self._gate.acquire(False):
            raise concurrent_use("allocate()")
        try:
            fast = self._fast  # the native core's, when it runs: one call
            if fast is not None and fast.allocate(seq, num_tokens, self._live):
                return
            need = self._blocks_needed("allocate", seq, num_tokens)
            if seq.host_path or seq.load_failed:
                refuse_unloaded("allocate", seq)
            if need <= 0:
                return
            self._evictor.make_room(need)
            seq.blocks.extend(self._kv.take(need))
        finally:
            self._gate.release()

    def _blocks_needed(self, operation: str, seq: Sequence, num_tokens: int) -> int:
        """Validate an allocation of `num_tokens` ([R1]-[R3]); the blocks it adds ([R15])."""
        self._check_live(seq)
        n = int_arg("num_tokens", num_tokens)
        if not 0 <= n <= len(seq.token_list):
            raise InvalidArgument(
                f"{operation}: num_tokens={n} outside 0..{len(seq.token_list)} for {seq!r}"
            )
        return -(-n // self._block_size) - len(seq.blocks)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `allocate(seq, num_tokens)` would succeed now ([R63]); changes nothing.

        Validates as `allocate` does and raises what it would raise for a
        malformed call (`InvalidType`, `SequenceNotLive`, `InvalidArgument`);
        returns False where `allocate` would refuse on the cache's state
        (`OutOfBlocks`, or `HostTierError` for a hit still to be loaded). Costs
        O(1) when the free blocks or the evictable leaves cover the need, else
        at most what `num_reclaimable_blocks` costs. The one case it cannot
        foresee is [R52]'s: under write-back with an engine that cannot wait
        for its stores (`ManualCopies`), True means the room exists once the
        stores `allocate` queues have finished.
        """
        if not self._gate.acquire(False):
            raise concurrent_use("can_allocate()")
        try:
            need = self._blocks_needed("can_allocate", seq, num_tokens)
            if seq.host_path or seq.load_failed:
                return False
            short = need - self._kv.num_free
            return short <= 0 or self._evictor.room_possible(short)
        finally:
            self._gate.release()

    # ------------------------------------------------------------------ load

    def load(self, seq: Sequence) -> Copy | None:
        """Queue host -> device for the host-resident part of `seq`'s hit ([R50]).

        Takes a device block for each matched block that lives only on the
        host (making room as `allocate` does) and queues one copy for them; a
        block another request is already loading is shared: this request
        waits on that copy, never starts a second one. Returns the copy to wait
        on before prefill (it finishes after every load this request depends
        on), or None when nothing is left to load. Once it finishes,
        `seq.block_ids` cover the whole hit. Raises `OutOfBlocks` when no room
        can be made (nothing changed), `HostTierError` when a load it waited on
        failed.
        """
        if not self._gate.acquire(False):
            raise concurrent_use("load()")
        try:
            self._check_live(seq)
            return self._offload.load(seq)
        finally:
            self._gate.release()

    # ---------------------------------------------------------------- commit

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """`tokens[:num_tokens]` have computed KV: attach their full blocks to the trie.

        A block equal to an existing child is deduplicated ([R18]): the
        sequence switches to the cached block and its own copy is freed.
        Otherwise a node is attached owning the sequence's block ([R19]).
        Raises `InvalidArgument` outside `num_committed_tokens..covered`.
        Keeps invariants 1, 4, 5 and 10.
        """
        if not self._gate.acquire(False):
            raise concurrent_use("commit()")
        try:
            fast = self._attach.fast  # the native core's, when it runs: one call
            if fast is None or not fast.commit(
                seq, num_tokens, self, self._live, self._evictor, self._attach, self._block_pins
            ):
                self._check_live(seq)
                self._attach.commit(seq, num_tokens)
        finally:
            self._gate.release()

    # ------------------------------------------------------- release / abort

    def release(self, seq: Sequence) -> None:
        """The request is done: drop its references ([R20]); committed blocks stay cached.

        Raises `SequenceNotLive` for a sequence already released or aborted.
        """
        if not self._gate.acquire(False):
            raise concurrent_use("release()")
        try:
            fast = self._fast  # the native core's, when it runs: one call
            if fast is not None and fast.release(
                seq, self, self._live, self._evictor.index, self._evictor
            ):
                return
            self._check_live(seq)
            self._clock += 1
            tick = self._clock
            ticks = self._nodes.tick
            if self._kv.native is not None:
                self._kv.native.set_ticks(ticks, seq.path, tick)  # [R8], as below
            else:
                for node in seq.path:
                    ticks[node] = tick  # [R8]; held by seq, so in no index while it changes
            self._drop(seq)
        finally:
            self._gate.release()

    def abort(self, seq: Sequence) -> None:
        """Reject a tentative match: undo its references, pin and statistics ([R21]).

        `match` then `abort` leaves every count, pin, index and statistic as it
        was (invariant 8). Raises `SequenceNotLive` for a dead sequence.
        """
        with Exclusive(self._gate, "abort()"):
            self._check_live(seq)
            stats = self.stats
            if stats.forget_match(seq.serial):  # [R69]: unless reset since
                stats.queries -= 1
                stats.query_tokens -= seq.query_tokens
                stats.hit_tokens -= seq.num_cached_tokens
                stats.host_hit_tokens -= seq.num_host_tokens
                if seq.restore is not None:
                    stats.checkpoint_hits -= 1
            self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        if seq.match_receipt is not None:
            self._checkpoints.unpin(seq.match_receipt)
            seq.match_receipt = None
        if seq.host_path:
            self._host.unpin(seq.host_path)  # type: ignore[union-attr]
            seq.host_path = []
        seq.loads = []
        self._kv.decref_all(seq.blocks)
        if seq.path:
            # Every other path node has a child (the next one), so it stays
            # `cached` or `pinned`; only the deepest can have become a leaf
            # that nobody else holds.
            self._evictor.settle(seq.path[-1])
        seq.live = False
        del self._live[seq.serial]

    # ---------------------------------------------------------------- evict

    def evict(self, num_blocks: int) -> int:
        """Evict LRU evictable leaves until `num_blocks` KV blocks are freed ([R23]).

        Returns the blocks freed (node blocks plus frozen tails); fewer when
        nothing more is evictable. Pinned or shared nodes are never touched
        (invariant 3). Raises `InvalidArgument` for a negative count.
        """
        if not self._gate.acquire(False):
            raise concurrent_use("evict()")
        try:
            n = int_arg("num_blocks", num_blocks)
            if n < 0:
                raise InvalidArgument(f"evict: num_blocks must be >= 0, got {n}")
            return self._evictor.evict(n)
        finally:
            self._gate.release()

    def evict_host(self, n: int) -> int:
        """Free up to `n` host-tier blocks: LRU host-only leaves that no request reads
        ([R51]). Returns how many (0 without a host tier); device blocks and
        blocks a copy or a request holds are never touched. Raises
        `InvalidArgument` for a negative count."""
        with Exclusive(self._gate, "evict_host()"):
            count = int_arg("n", n)
            if count < 0:
                raise InvalidArgument(f"evict_host: n must be >= 0, got {count}")
            return 0 if self._host is None else self._host.evict(count)

    def evict_checkpoints(self, n: int) -> int:
        """Free the device slots of up to `n` LRU unpinned checkpoints (and their frozen
        tails); nodes stay ([R24]). A checkpoint already stored in a host slot stays
        there, host-only ([R54]); any other is released. Returns how many device
        slots were freed; pinned ones are never touched (invariant 2)."""
        with Exclusive(self._gate, "evict_checkpoints()"):
            count = int_arg("n", n)
            if count < 0:
                raise InvalidArgument(f"evict_checkpoints: n must be >= 0, got {count}")
            return self._checkpoints.evict_lru(count)

    def drop_checkpoint(self, seq: Sequence, step: int) -> bool:
        """Release the checkpoint after exactly `step` tokens of `seq`'s prefix ([R68]).

        lmdeploy keeps one rolling decode checkpoint per sequence: once a newer
        one is saved, the engine drops the old one. The checkpoint must sit on
        `seq`'s path (its anchor committed) and be the one for `seq`'s own
        tokens (tail included); its device slot, host slot and frozen tail go
        back to their pools, counted in `evicted_checkpoints`, with the events
        an eviction emits. Returns False when there is none there; raises
        `PinError` when it is pinned (a copy in flight, a match or an explicit
        pin hold it), `CheckpointError` when SSM is off, `InvalidArgument` for
        a step outside the sequence; a failure changes nothing.
        """
        with Exclusive(self._gate, "drop_checkpoint()"):
            self._check_live(seq)
            return self._checkpointing.drop(seq, step)

    def clear(self) -> None:
        """Drop every cached block and checkpoint ([R22]).

        Needs no live sequence, copy in flight or explicit pin (`CacheError`
        otherwise, nothing changed). Emits one `AllBlocksCleared`.
        """
        with Exclusive(self._gate, "clear()"):
            inflight = self._transfers.inflight
            block_pins = self._block_pins.receipts
            if self._live or inflight or self._explicit or block_pins:
                raise CacheError(
                    f"clear: {len(self._live)} live sequences, {len(inflight)} copies in "
                    f"flight, {len(self._explicit)} explicit pins and {len(block_pins)} "
                    "block pins must be finished first"
                )
            with self._events.muted():
                self._evictor.write_back = False  # dropped, not stored
                try:
                    self._evictor.evict(self._kv.capacity)
                finally:
                    self._evictor.write_back = self._write_back
                if self._host is not None:
                    self._host.evict(self._host_pool.capacity)
                anchored = self._nodes.checkpoint
                for root in self._roots.values():
                    if root in anchored:
                        self._checkpoints.drop(anchored[root], CheckpointTrigger.EVICT)
                        self.stats.evicted_checkpoints += 1
            self._events.cleared()

    # ----------------------------------------------------------- checkpoints

    def save(
        self, seq: Sequence, step: int, runtime_state: Mapping[str, torch.Tensor] | None
    ) -> Copy | None:
        """Checkpoint `seq`'s SSM state after exactly `step` tokens ([R25]-[R31]).

        `runtime_state` maps each configured state name to this sequence's
        tensor. Returns the queued copy, which holds a producer pin until it is
        reaped; or None when skipped (duplicate, pinned anchor, or no slot /
        frozen block even after eviction), counted in stats. Raises
        `CheckpointError` when SSM is off or the anchor is not committed,
        `InvalidArgument` for a step outside the sequence. Keeps invariants 1,
        2 and 7; a copy that fails is undone ([R38]).
        """
        if not self._gate.acquire(False):
            raise concurrent_use("save()")
        try:
            self._check_live(seq)
            return self._checkpointing.save(seq, step, runtime_state)
        finally:
            self._gate.release()

    def restore(self, seq: Sequence, runtime_state: Mapping[str, torch.Tensor] | None) -> Copy:
        """Queue checkpoint -> `runtime_state` (and frozen tail -> the sequence's block)
        ([R32]-[R34]).

        The match's pin moves to the copy and is released when the copy is
        reaped (invariant 2). Raises `CheckpointError` when the match found no
        checkpoint, the sequence was already restored, or its partial block is
        already committed; `OutOfBlocks` when a private block cannot be found.
        """
        if not self._gate.acquire(False):
            raise concurrent_use("restore()")
        try:
            self._check_live(seq)
            return self._checkpointing.restore(seq, runtime_state)
        finally:
            self._gate.release()

    def poll(self) -> int:
        """Reap finished copies, oldest first, releasing their pins and references
        ([R35]). Returns how many were reaped.

        First it applies, in the order they were made, the completions and
        failures other threads reported since ([R58]); the calling thread
        becomes the trie's owning thread.
        """
        if not self._gate.acquire(False):  # the inline gate: once per engine step
            raise concurrent_use("poll()")
        try:
            self._completions.claim_and_apply()
            return self._transfers.poll()
        finally:
            self._gate.release()

    def pin(self, seq: Sequence) -> PinReceipt:
        """Pin `seq`'s restore checkpoint; returns a single-use receipt for `unpin` ([R39]).

        Raises `CheckpointError` when the match found no checkpoint,
        `IllegalTransition` when that checkpoint has since been released ([R41]).
        """
        with Exclusive(self._gate, "pin()"):
            self._check_live(seq)
            if seq.restore is None:
                raise CheckpointError(f"pin: {seq!r} matched no checkpoint")
            receipt = self._checkpoints.pin(seq.restore.checkpoint)
            self._explicit[id(receipt)] = receipt
            return receipt

    def unpin(self, receipt: PinReceipt) -> None:
        """Redeem a receipt from `pin` ([R40]); a second use raises `PinError`."""
        with Exclusive(self._gate, "unpin()"):
            check_redeemable(receipt, PinReceipt, self, self._explicit, self.pin)
            del self._explicit[id(receipt)]
            self._checkpoints.unpin(receipt)

    def pin_blocks(self, block_hashes: list[int], namespace: str = "") -> BlockPinReceipt:
        """Pin the cached blocks of `namespace` that events published with these hashes
        ([R66]): no eviction frees them until `unpin_blocks(receipt)`.

        For a router or a disaggregated prefill that names blocks by the hash of
        their `BlockStored` event (compared by its low 64 bits, the wire value:
        the `vllm` scheme's full digest names the same block). Each block is pinned
        once, by one reference on its device block, as a request's block table
        holds it (so its ancestors stay too); hashes of blocks not cached on the
        device are skipped; `receipt.pinned` counts the blocks pinned. Needs
        `CacheConfig(enable_events=True)` (`ConfigError`). Raises `InvalidType` /
        `InvalidArgument` for malformed hashes or namespace.
        """
        with Exclusive(self._gate, "pin_blocks()"):
            hashes = block_hashes_arg(block_hashes)
            namespace = namespace_arg(namespace)  # [R57]
            return self._block_pins.pin(self, hashes, namespace)

    def unpin_blocks(self, receipt: BlockPinReceipt) -> None:
        """Redeem a receipt from `pin_blocks` ([R67]); a second use raises `PinError`."""
        with Exclusive(self._gate, "unpin_blocks()"):
            receipts = self._block_pins.receipts
            check_redeemable(receipt, BlockPinReceipt, self, receipts, self.pin_blocks)
            self._block_pins.unpin(receipt)

    # ---------------------------------------------------------------- events

    def bind_lora(self, namespace: str, lora_id: int | None) -> None:
        """Events of `namespace` carry `lora_id` from now on ([R70]): vLLM's integer
        adapter id (`LoRARequest.lora_int_id`, an int > 0), beside the namespace as
        `lora_name`; None unbinds (events carry `lora_id=None` again). Events
        already recorded keep the id they were recorded with. Changes nothing
        else: the namespace alone decides what is shared. Raises `InvalidType` /
        `InvalidArgument` for a namespace that is not a str or an id that is not
        an int > 0.
        """
        with Exclusive(self._gate, "bind_lora()"):
            namespace = namespace_arg(namespace)  # [R57]
            if lora_id is None:
                self._events.lora_ids.pop(namespace, None)
                return
            lora_id = int_arg("lora_id", lora_id)
            if not 0 < lora_id < 2**63:
                raise InvalidArgument(
                    f"bind_lora: lora_id must be in 1..2**63-1 (vLLM's ids are > 0), got {lora_id}"
                )
            self._events.lora_ids[namespace] = lora_id

    def drain_events(self) -> list[Event]:
        """Return and forget the events emitted since the last drain (invariant 10)."""
        with Exclusive(self._gate, "drain_events()"):
            return self._events.drain()

    def drain_event_records(self) -> EventRecords:
        """`drain_events` without building the events: an `EventRecords` whose
        `events()` are the events `drain_events` would have returned.

        What a publisher takes: `cache.kv_publisher.KVEventPublisher` and
        `cache.kv_events.encode_batch` encode a commit's record straight to the
        wire, and `cache.kv_publisher_process.ProcessEventPublisher` ships it to
        its encoder process, so no event object is built per commit. Neither
        drain changes what `check()` compares (invariant 10): the block set every
        recorded event replays to, drained or not, against the cached blocks.
        """
        if not self._gate.acquire(False):  # the inline gate: a publisher drains per batch
            raise concurrent_use("drain_event_records()")
        try:
            return self._events.drain_records()
        finally:
            self._gate.release()

    # ------------------------------------------------------------ inspection

    def snapshot(self) -> Snapshot:
        """The whole cache as plain data (`spec.snapshot.Snapshot`).

        Like every operation it holds the trie while it reads: from a monitor
        thread it is either consistent or refused with `ConcurrentUse` ([R58]).
        """
        with Exclusive(self._gate, "snapshot()"):
            return inspection.snapshot(self)

    def check(self) -> None:
        """Verify invariants 1-7, 9 and 10 (`spec.invariants.INVARIANTS`) on the live
        structure; raises `InvariantViolation` naming the first one broken, and
        `ConcurrentUse` while another thread's operation runs ([R58])."""
        with Exclusive(self._gate, "check()"):
            inspection.check(self)

    def __repr__(self) -> str:
        return (
            f"<BlockTrie B={self._block_size} blocks free={self.num_free_blocks} "
            f"cached={self.num_cached_blocks}/{self._kv.capacity} "
            f"slots free={self.num_free_checkpoint_slots}/{self._slots.capacity}>"
        )
