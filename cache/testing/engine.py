"""`Engine`: a minimal scheduler on the public `BlockTrie` API, for end-to-end tests."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cache.testing.model import TinyHybridModel, _same_device, greedy
from spec.errors import OutOfBlocks

if TYPE_CHECKING:
    from cache.copies import Copy, ManualCopies
    from cache.sequence import Sequence as TrieSequence
    from cache.trie import BlockTrie


@dataclass
class RequestResult:
    """What one request produced in an `Engine` run.

    - ``chunks``: ``(start, logits)`` for every forward call the engine made
      for this request, in order; ``logits[i]`` are the logits at position
      ``start + i`` of ``prompt + generated``. After a preemption the
      recomputed positions appear again.
    - ``num_cached_tokens``: the cache hit of the first admission.
    - ``tokens_computed``: positions run through the model (recomputation
      after a preemption included).
    """

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    namespace: str = ""
    generated: list[int] = field(default_factory=list)
    chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    num_cached_tokens: int = 0
    tokens_computed: int = 0
    preemptions: int = 0
    finished: bool = False

    @property
    def tokens(self) -> list[int]:
        """``prompt + generated``."""
        return self.prompt + self.generated


@dataclass
class _Running:
    result: RequestResult
    seq: TrieSequence
    slot: int
    tokens: list[int]
    """The tokens ``seq`` holds: prompt, then the generated tokens appended so far."""
    computed: int
    """Positions whose KV and state are computed (``tokens[:computed]``)."""
    prefill_end: int
    """``len(tokens)`` at admission: the positions computed by (chunked) prefill."""
    waits: list[Copy] = field(default_factory=list)
    """Copies that read or write this request's state/KV and are not yet waited on."""


class _Retry(Exception):
    """Admission must wait: no room now, but running requests will free some."""


class EngineCapacityError(RuntimeError):
    """A single request does not fit in the cache even with nothing else running."""


class Engine:
    """A minimal continuous-batching engine for `TinyHybridModel` over a `cache.BlockTrie`.

    It uses only the public cache API, in the order a real engine does:

    1. Admission (FCFS, at most ``max_running`` requests): ``match`` the
       request's tokens; with a host tier, ``load`` the part of the hit that
       lives in host memory (the load is waited on before the request reads
       its KV); if the match found a checkpoint, ``restore`` it into
       the request's runtime-state slot (the slot is zeroed first, and any
       copy still reading the slot from its previous owner is waited on).
    2. Each scheduler step (``step``): ``poll`` once, admit, then advance
       every running request by one chunk of prefill or one decode token:
       ``allocate`` the block table to cover the chunk, ``wait`` for the
       copies that touch this request's state or KV (a pending restore before
       reading them, a pending save before overwriting what it reads), run the
       model on ``trie.kv_cache`` through ``seq.block_ids``, then
       ``commit``. Prefill saves a checkpoint at every chunk boundary (chunks
       are cut at ``seq.branch_step`` too, so the shared prefix gets a
       checkpoint; other boundaries need not be block-aligned). Decode
       ``append``s each sampled token, commits when a block fills, and saves
       at every ``save_every_blocks``-th block boundary.
    3. Finish: ``commit`` everything computed, optionally ``save`` the final
       state (``save_on_finish``), ``release``.

    Memory pressure: when ``allocate`` (or a partial ``restore``) raises
    `OutOfBlocks`, the engine, in this order, waits for every outstanding
    copy and polls (copies hold block references), evicts one unpinned
    checkpoint (frozen tail blocks are only reclaimed that way when their node
    is not an evictable leaf), and finally preempts the newest running request
    (commit, release, re-queued at the front to be recomputed from whatever
    the cache then holds). The oldest request is never preempted by a newer
    one, so the engine always makes progress; a request that does not fit
    alone raises `EngineCapacityError`.

    Late copies: pass the trie's `ManualCopies` as ``copies`` and a
    ``complete_prob`` > 0, and after every step each pending copy is completed
    with that probability, in random order (``seed``), so copies finish late
    and out of order relative to the engine's work.

    Greedy sampling (`greedy`). The KV tensor is ``trie.kv_cache``; runtime
    state lives in an engine-owned pool of ``max_running`` slots.
    """

    def __init__(
        self,
        model: TinyHybridModel,
        trie: BlockTrie,
        *,
        max_running: int = 4,
        chunk_size: int = 8,
        random_chunks: bool = False,
        save_every_blocks: int = 1,
        save_on_finish: bool = True,
        copies: ManualCopies | None = None,
        complete_prob: float = 0.0,
        abort_prob: float = 0.0,
        seed: int = 0,
        check: bool = False,
    ) -> None:
        """Bind ``model`` to ``trie``.

        ``chunk_size``: prefill tokens per request per step (with
        ``random_chunks``, each chunk is uniformly 1..chunk_size).
        ``abort_prob``: probability that the scheduler rejects a tentative
        match (``abort``) and retries the request at the next step, as an
        engine does when it changes its mind about admitting a request.
        ``check``: call ``trie.check()`` after every step (slow; for tests).
        """
        kv = trie.kv_cache
        block_size = trie.config.block_size
        if kv is None:
            raise ValueError("Engine: the trie has no KV storage (kv_block_shape=None)")
        expected = (trie.config.num_blocks, *model.kv_block_shape(block_size))
        if tuple(kv.shape) != expected:
            raise ValueError(f"Engine: trie.kv_cache has shape {tuple(kv.shape)}, want {expected}")
        if kv.dtype != model.dtype or not _same_device(kv.device, model.device):
            raise ValueError(
                f"Engine: trie.kv_cache is {kv.dtype} on {kv.device}, the model runs "
                f"{model.dtype} on {model.device}"
            )
        if dict(trie.config.state_shapes) != model.state_shapes():
            raise ValueError(
                f"Engine: the trie's state_shapes {dict(trie.config.state_shapes)} do not match "
                f"the model's {model.state_shapes()}"
            )
        stored = {name: trie.config.state_dtype_of(name) for name in model.state_shapes()}
        if any(dtype != model.dtype for dtype in stored.values()):
            raise ValueError(
                f"Engine: checkpoints would be stored as {stored}, the model's "
                f"state is {model.dtype} (a restored state would not be the saved one)"
            )
        if model.state_shapes() and trie.config.num_checkpoint_slots == 0:
            raise ValueError(
                "Engine: the model has SSM layers but the trie has no checkpoint slots "
                "(an attention-only cache would serve KV without the matching state)"
            )
        if max_running < 1 or chunk_size < 1 or save_every_blocks < 1:
            raise ValueError("Engine: max_running, chunk_size, save_every_blocks must be >= 1")
        if not 0.0 <= complete_prob <= 1.0:
            raise ValueError(f"Engine: complete_prob must be in [0, 1], got {complete_prob}")
        if not 0.0 <= abort_prob < 1.0:
            raise ValueError(f"Engine: abort_prob must be in [0, 1), got {abort_prob}")
        self.model = model
        self.trie = trie
        self.kv = kv
        self.block_size = block_size
        self.ssm = trie.config.num_checkpoint_slots > 0
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.random_chunks = random_chunks
        self.save_every_blocks = save_every_blocks
        self.save_on_finish = save_on_finish
        self.copies = copies
        self.complete_prob = complete_prob
        self.abort_prob = abort_prob
        self.check = check
        self.rng = random.Random(seed)
        self._state = {
            name: torch.zeros((max_running, *shape), dtype=model.dtype, device=model.device)
            for name, shape in model.state_shapes().items()
        }
        self._free_slots = list(range(max_running - 1, -1, -1))
        self._slot_copies: list[list[Copy]] = [[] for _ in range(max_running)]
        self._outstanding: list[Copy] = []
        self._waiting: deque[RequestResult] = deque()
        self._running: list[_Running] = []
        self._next_id = 0
        self.results: dict[int, RequestResult] = {}
        self.steps = 0
        self.tokens_computed = 0
        self.preemptions = 0
        self.late_waits = 0
        """Copies the engine had to wait for (not yet done when it needed them)."""
        self.partial_restores = 0
        """Restores from a checkpoint inside a block (a frozen tail is restored too)."""
        self.aborts = 0
        """Tentative matches the scheduler rejected (``abort_prob``)."""
        self.loads = 0
        """Load copies queued for host-resident hits (a host tier only)."""

    # ------------------------------------------------------------------ public

    def submit(self, prompt: Sequence[int], max_new_tokens: int, namespace: str = "") -> int:
        """Queue a request; returns its id. Generation is greedy, ``max_new_tokens >= 1``."""
        toks = list(prompt)
        if not toks:
            raise ValueError("submit: the prompt must not be empty")
        if max_new_tokens < 1:
            raise ValueError(f"submit: max_new_tokens must be >= 1, got {max_new_tokens}")
        rid = self._next_id
        self._next_id += 1
        result = RequestResult(rid, toks, max_new_tokens, namespace)
        self.results[rid] = result
        self._waiting.append(result)
        return rid

    @property
    def has_work(self) -> bool:
        """Whether some request is waiting or running."""
        return bool(self._waiting or self._running)

    def step(self) -> list[RequestResult]:
        """One scheduler step; returns the requests that finished in it."""
        self.trie.poll()
        self._outstanding = [c for c in self._outstanding if not c.done]
        for i, copies in enumerate(self._slot_copies):
            self._slot_copies[i] = [c for c in copies if not c.done]
        self._admit()
        finished: list[RequestResult] = []
        for run in list(self._running):
            if run in self._running and self._advance(run):
                finished.append(run.result)
        self._complete_some_copies()
        if self.check:
            self.trie.check()
        self.steps += 1
        return finished

    def run(self, max_steps: int = 100_000) -> dict[int, RequestResult]:
        """Step until every submitted request finished; returns `results`."""
        for _ in range(max_steps):
            if not self.has_work:
                return self.results
            self.step()
        raise RuntimeError(f"Engine.run: still busy after {max_steps} steps")

    def drain(self) -> int:
        """Wait for every outstanding copy, then poll; returns the number of copies reaped.

        Afterwards the cache holds no pin or block reference for this engine's
        copies (a real engine would synchronise its copy stream).
        """
        for copy in self._outstanding:
            self._wait(copy)
        self._outstanding.clear()
        for copies in self._slot_copies:
            copies.clear()
        if self.copies is not None:  # the host tier's stores, which no request waits on
            self.copies.complete_all()
        return self.trie.poll()

    # ---------------------------------------------------------------- internals

    def _wait(self, copy: Copy) -> None:
        if not copy.done:
            self.late_waits += 1
        copy.wait()

    def _slot_state(self, slot: int) -> dict[str, torch.Tensor]:
        return {name: t[slot] for name, t in self._state.items()}

    def _track(self, run: _Running, copy: Copy) -> None:
        run.waits.append(copy)
        self._slot_copies[run.slot].append(copy)
        self._outstanding.append(copy)

    def _admit(self) -> None:
        while self._waiting and self._free_slots:
            result = self._waiting[0]
            slot = self._free_slots[-1]
            # A save from the slot's previous owner may still read it.
            for previous in self._slot_copies[slot]:
                self._wait(previous)
            self._slot_copies[slot].clear()
            state = self._slot_state(slot)
            for tensor in state.values():
                tensor.zero_()
            tokens = result.tokens
            seq = self.trie.match(tokens, namespace=result.namespace)
            if self.abort_prob > 0.0 and self.rng.random() < self.abort_prob:
                self.trie.abort(seq)
                self.aborts += 1
                return
            load: Copy | None = None
            if seq.num_host_tokens:
                try:
                    load = self._load(seq)
                except _Retry:
                    self.trie.abort(seq)
                    return  # no room to load into now: retry when requests have finished
            run = _Running(result, seq, slot, tokens, seq.num_cached_tokens, len(tokens))
            if load is not None:
                self._track(run, load)
                self.loads += 1
            if seq.restore is not None:
                restore = self._restore(run, state)
                if restore is None:
                    self.trie.abort(seq)
                    return  # retry at a later step, when running requests have finished
                self._track(run, restore)
                if seq.restore.step % self.block_size:
                    self.partial_restores += 1
            self._waiting.popleft()
            self._free_slots.pop()
            if result.preemptions == 0:
                result.num_cached_tokens = seq.num_cached_tokens
            self._running.append(run)

    def _load(self, seq: TrieSequence) -> Copy | None:
        """Queue the load of `seq`'s host-resident hit, reclaiming memory as for an
        allocation; raises `_Retry` when only finishing running requests would help."""
        while True:
            try:
                return self.trie.load(seq)
            except OutOfBlocks:
                if not self._reclaim_cheap():
                    if self._running:
                        raise _Retry from None
                    raise EngineCapacityError(
                        f"{seq!r}: no room to load its host-resident hit even with nothing running"
                    ) from None

    def _restore(self, run: _Running, state: dict[str, torch.Tensor]) -> Copy | None:
        while True:
            try:
                return self.trie.restore(run.seq, state)
            except OutOfBlocks:
                if not self._reclaim_cheap():
                    if self._running:
                        return None
                    raise EngineCapacityError(
                        f"request {run.result.request_id}: no block for the restored tail "
                        f"even with nothing running"
                    ) from None

    def _reclaim_cheap(self) -> bool:
        """Free memory without preempting: finish and reap copies, else evict one checkpoint."""
        had_copies = bool(self._outstanding)
        if self.drain() > 0 or had_copies:
            return True
        return self.ssm and self.trie.evict_checkpoints(1) > 0

    def _allocate(self, run: _Running, num_tokens: int) -> bool:
        """Cover ``num_tokens``; False when ``run`` itself had to be preempted."""
        while True:
            try:
                self.trie.allocate(run.seq, num_tokens)
                return True
            except OutOfBlocks:
                if self._reclaim_cheap():
                    continue
                victim = max(self._running, key=lambda r: r.result.request_id)
                if victim is run and len(self._running) == 1:
                    raise EngineCapacityError(
                        f"request {run.result.request_id}: {num_tokens} tokens do not fit in "
                        f"{self.trie.config.num_blocks} blocks of {self.block_size}"
                    ) from None
                self._preempt(victim)
                if victim is run:
                    return False

    def _preempt(self, run: _Running) -> None:
        self.trie.commit(run.seq, run.computed)
        self.trie.release(run.seq)
        self._running.remove(run)
        self._free_slots.append(run.slot)
        run.result.preemptions += 1
        self.preemptions += 1
        self._waiting.appendleft(run.result)

    def _chunk_end(self, run: _Running) -> int:
        start = run.computed
        if start >= run.prefill_end:
            return start + 1  # decode: the one token sampled last
        size = self.rng.randint(1, self.chunk_size) if self.random_chunks else self.chunk_size
        end = min(start + size, run.prefill_end)
        branch = run.seq.branch_step
        if start < branch < end:
            end = branch  # a checkpoint where the request leaves the cached path
        return end

    def _save(self, run: _Running, step: int) -> None:
        if not self.ssm:
            return
        copy = self.trie.save(run.seq, step, self._slot_state(run.slot))
        if copy is not None:
            self._track(run, copy)

    def _advance(self, run: _Running) -> bool:
        """One chunk or decode token for ``run``; True when the request finished."""
        start = run.computed
        end = self._chunk_end(run)
        if not self._allocate(run, end):
            return False
        # The compute "stream" waits for pending copies on this request's
        # state/KV: a restore before we read what it writes, a save before we
        # overwrite what it reads (the state, and the partial block's KV).
        for copy in run.waits:
            self._wait(copy)
        run.waits.clear()
        seq = run.seq
        logits = self.model.forward(
            run.tokens[start:end], start, self.kv, seq.block_ids, self._slot_state(run.slot)
        )
        run.result.chunks.append((start, logits))
        run.result.tokens_computed += end - start
        self.tokens_computed += end - start
        run.computed = end
        if end <= run.prefill_end:
            self.trie.commit(seq, end)
            self._save(run, end)
        elif end % self.block_size == 0:
            self.trie.commit(seq, end)
            if (end // self.block_size) % self.save_every_blocks == 0:
                self._save(run, end)
        if end < len(run.tokens):
            return False
        token = greedy(logits[-1])
        run.result.generated.append(token)
        if len(run.result.generated) == run.result.max_new_tokens:
            self._finish(run)
            return True
        run.tokens.append(token)
        self.trie.append(seq, [token])
        return False

    def _finish(self, run: _Running) -> None:
        self.trie.commit(run.seq, run.computed)
        if self.save_on_finish:
            self._save(run, run.computed)
        self.trie.release(run.seq)
        self._running.remove(run)
        self._free_slots.append(run.slot)
        run.result.finished = True

    def _complete_some_copies(self) -> None:
        copies = self.copies
        if copies is None or self.complete_prob <= 0.0:
            return
        pending = copies.pending()
        self.rng.shuffle(pending)
        for copy in pending:
            if not copy.done and self.rng.random() < self.complete_prob:
                copies.complete(copy)
