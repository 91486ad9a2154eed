"""`HFEngine`: a reference engine serving a Hugging Face model through a `cache.BlockTrie`.

One request at a time, greedy. It uses only the public cache API and the
`HFModel` adapter (where every ``transformers`` internal lives); it is the
worked example of docs/transformers.md.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cache.copies import Copy
from cache.integrations.transformers.adapter import HFModel
from cache.testing.engine import EngineCapacityError
from cache.trie import BlockTrie
from spec.errors import OutOfBlocks

if TYPE_CHECKING:
    from cache.copies import CopyEngine
    from cache.sequence import Sequence as TrieSequence

__all__ = ["GenerateOutput", "HFEngine", "plan_pieces"]

log = logging.getLogger(__name__)


@dataclass
class GenerateOutput:
    """What `HFEngine.generate` produced for one request."""

    tokens: list[int]
    """The generated token ids (greedy; ends early at an end-of-sequence token)."""
    logits: torch.Tensor
    """``[len(tokens), vocab]``: row ``i`` is what ``tokens[i]`` was picked from."""
    num_cached_tokens: int
    """Prompt tokens served from the cache (not run through the model)."""
    num_computed_tokens: int
    """Positions run through the model (prefill and decode)."""
    forwards: int
    """Model forward calls (prefill pieces and decode steps)."""


def plan_pieces(
    start: int,
    end: int,
    cuts: Iterable[int],
    *,
    multi_token_continuation: bool = True,
    one_token_pieces: bool = True,
) -> list[tuple[int, int]]:
    """Split the prefill of positions ``start .. end - 1`` into forward calls ``(s, e)``.

    A piece ends at every cut inside ``(start, end)`` (where a checkpoint is
    saved: HF exposes the state only at the end of a forward), and at ``end``.

    - ``multi_token_continuation=False``: every piece that starts with some
      state (``s > 0``) is one token long.
    - ``one_token_pieces=False``: cuts that would leave a 1-token piece are
      dropped (the piece merges with its neighbour); a prefill of a single
      token is still one piece.
    """
    bounds = sorted({c for c in cuts if start < c < end})
    if not multi_token_continuation:
        # From an empty state a multi-token forward is exact: one piece up to the first cut.
        first = start + 1 if start > 0 else (bounds[0] if bounds else end)
        return [(start, first), *((p, p + 1) for p in range(first, end))]
    if not one_token_pieces:
        kept: list[int] = []
        for c in bounds:
            previous = kept[-1] if kept else start
            if c - previous >= 2 and end - c >= 2:
                kept.append(c)
        bounds = kept
    edges = [start, *bounds, end]
    return list(itertools.pairwise(edges))


class HFEngine:
    """Greedy generation for a ``transformers`` model, its prefixes served from a `BlockTrie`.

    Per request (`generate`): ``match`` the prompt; ``restore`` the
    checkpoint it hit into a new cache object and load the hit's KV from the
    blocks; prefill the rest in pieces that end where checkpoints are saved;
    decode one token at a time; ``commit`` each full block and ``release`` at
    the end. Checkpoints (``save``) go where a later request can hit them:

    - every ``checkpoint_interval`` blocks (block boundaries, prefill and decode);
    - ``seq.branch_step``, where the prompt leaves the cached path (a second
      conversation sharing a system prompt hits there);
    - the prompt end, even mid-block (the next turn of a conversation
      repeats this prompt);
    - the last computed position (the next turn also repeats the reply).

    The traps `HFModel` found at construction are kept: one token at a time
    after any state when a multi-token forward does not continue from one,
    no 1-token prefill piece when it changes the numerics.

    Memory: when ``allocate`` finds no block, finished copies are reaped and
    then one unpinned checkpoint at a time is evicted (freeing its frozen
    block); a request that still does not fit raises `EngineCapacityError`.

    ``copies``: the trie's copy engine (default: run on the model's device).
    ``check``: call ``trie.check()`` after every request.
    """

    def __init__(
        self,
        model: Any,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        num_checkpoint_slots: int = 64,
        checkpoint_interval: int = 4,
        copies: CopyEngine | None = None,
        tolerance: float | None = None,
        check: bool = False,
    ) -> None:
        if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int):
            raise TypeError(f"checkpoint_interval must be an int, got {checkpoint_interval!r}")
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1, got {checkpoint_interval}")
        self.hf = HFModel(model, tolerance=tolerance)
        layout = self.hf.layout
        config = layout.cache_config(
            block_size=block_size,
            num_blocks=num_blocks,
            num_checkpoint_slots=num_checkpoint_slots,
            device=self.hf.device,
        )
        self.trie = BlockTrie(config, copies=copies)
        self.block_size = block_size
        self.checkpoint_interval = checkpoint_interval
        self.check = check
        self.ssm = config.num_checkpoint_slots > 0
        self.kv = self.trie.kv_cache
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos: frozenset[int] = frozenset(
            () if eos is None else ([eos] if isinstance(eos, int) else eos)
        )
        self.traps = self.hf.traps
        self.tokens_computed = 0
        """Positions run through the model, over all requests."""

    # ---------------------------------------------------------------- public

    def generate(
        self, prompt_ids: Any, max_new_tokens: int = 16, *, namespace: str = ""
    ) -> GenerateOutput:
        """Greedy generation of up to ``max_new_tokens`` tokens after ``prompt_ids``.

        ``prompt_ids``: a sequence of ints or a 1-D (or ``[1, n]``) tensor. Stops
        early after an end-of-sequence token of the model's generation config,
        as ``model.generate`` does. Raises `ValueError` / `TypeError` for a bad
        request (before matching) and `EngineCapacityError` when the request
        does not fit. A request that fails before its first forward is aborted
        (the trie's statistics are as before); one that fails later is
        released (what it committed stays cached).
        """
        prompt = _token_list(prompt_ids)
        if not prompt:
            raise ValueError("generate: the prompt must hold at least one token")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"generate: max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        bad = [t for t in prompt if not 0 <= t < self.hf.vocab_size]
        if bad:
            raise ValueError(f"generate: token {bad[0]} outside [0, {self.hf.vocab_size})")
        seq = self.trie.match(prompt, namespace=namespace)
        run = _Request(seq, list(prompt), self.hf.new_cache())
        try:
            out = self._serve(run, max_new_tokens)
        finally:
            for copy in run.copies:
                copy.wait()  # nothing may still read or write the cache object we drop
            if seq.live and run.forwards == 0:
                self.trie.abort(seq)  # failed before any work: as if never matched
            elif seq.live:
                self.trie.release(seq)  # what it committed stays cached
            self.trie.poll()
        if self.check:
            self.trie.check()
        return out

    # ------------------------------------------------------------- internals

    def _serve(self, run: _Request, max_new_tokens: int) -> GenerateOutput:
        seq = run.seq
        start = seq.num_cached_tokens
        if seq.restore is not None:
            self._restore(run)
        if start and self.kv is not None:
            self.hf.load_kv(run.cache, self._gather(seq.block_ids, 0, start))
        prompt_end = len(run.tokens)
        traps = self.traps
        pieces = plan_pieces(
            start,
            prompt_end,
            self._cuts(start, prompt_end, seq.branch_step),
            multi_token_continuation=traps.multi_token_continuation,
            one_token_pieces=traps.one_token_pieces,
        )
        logits: torch.Tensor | None = None
        for s, e in pieces:
            logits = self._forward(run, s, e)
            self.trie.commit(seq, e)
            if self._save_here(e, seq.branch_step, prompt_end):
                self._save(run, e)
        assert logits is not None  # the prompt leaves at least one token to compute
        generated: list[int] = []
        rows: list[torch.Tensor] = []
        while True:
            row = logits[-1]
            token = int(torch.argmax(row).item())
            generated.append(token)
            rows.append(row)
            if len(generated) == max_new_tokens or token in self.eos:
                break
            position = len(run.tokens)
            run.tokens.append(token)
            self.trie.append(seq, [token])
            logits = self._forward(run, position, position + 1)
            if (position + 1) % self.block_size == 0:
                self.trie.commit(seq, position + 1)
                if self._on_interval(position + 1):
                    self._save(run, position + 1)
        computed = len(run.tokens)
        self.trie.commit(seq, computed)
        if run.saved_step != computed:
            self._save(run, computed)
        return GenerateOutput(
            tokens=generated,
            logits=torch.stack(rows),
            num_cached_tokens=seq.num_cached_tokens,
            num_computed_tokens=run.computed,
            forwards=run.forwards,
        )

    def _cuts(self, start: int, end: int, branch: int) -> list[int]:
        step = self.block_size * self.checkpoint_interval
        cuts = list(range((start // step + 1) * step, end, step)) if self.ssm else []
        if self.ssm and start < branch < end:
            cuts.append(branch)
        return cuts

    def _on_interval(self, step: int) -> bool:
        return step % (self.block_size * self.checkpoint_interval) == 0

    def _save_here(self, step: int, branch: int, prompt_end: int) -> bool:
        return step in (branch, prompt_end) or self._on_interval(step)

    def _restore(self, run: _Request) -> None:
        views = self.hf.state_views(run.cache)
        while True:
            try:
                copy = self.trie.restore(run.seq, views)
                break
            except OutOfBlocks:  # the frozen tail needs a block of its own
                self._reclaim(run, "the restored partial block")
        copy.wait()
        self.hf.mark_restored(run.cache, run.seq.num_cached_tokens)

    def _save(self, run: _Request, step: int) -> None:
        if not self.ssm:
            return
        copy = self.trie.save(run.seq, step, self.hf.state_views(run.cache))
        run.saved_step = step
        if copy is not None:
            run.copies.append(copy)

    def _forward(self, run: _Request, start: int, end: int) -> torch.Tensor:
        seq = run.seq
        while True:
            try:
                self.trie.allocate(seq, end)
                break
            except OutOfBlocks:
                self._reclaim(run, f"{end} tokens")
        # A save copy may still read the state (and the partial block's KV) that this
        # forward overwrites: order this work after it. Reaping the finished copies
        # releases their producer pins, so a later save may replace their checkpoint.
        for copy in run.copies:
            copy.wait()
        run.copies.clear()
        self.trie.poll()
        logits = self.hf.forward(run.cache, run.tokens[start:end], start)
        if self.kv is not None:
            self._scatter(seq.block_ids, start, self.hf.read_kv(run.cache, start, end))
        run.computed += end - start
        run.forwards += 1
        self.tokens_computed += end - start
        return logits

    def _reclaim(self, run: _Request, what: str) -> None:
        """Make room for one more block, or raise `EngineCapacityError`."""
        for copy in run.copies:
            copy.wait()
        if self.trie.poll() > 0:
            return
        if self.ssm and self.trie.evict_checkpoints(1) > 0:
            return
        raise EngineCapacityError(
            f"HFEngine: no room for {what} of a {len(run.tokens)}-token request in "
            f"{self.trie.config.num_blocks} blocks of {self.block_size}"
        )

    def _indices(
        self, block_ids: Sequence[int], start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv is not None
        positions = torch.arange(start, end, device=self.kv.device)
        table = torch.tensor(list(block_ids), dtype=torch.long, device=self.kv.device)
        return table[positions // self.block_size], positions % self.block_size

    def _gather(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """The KV rows of positions ``start .. end - 1`` from the blocks ``block_ids``."""
        assert self.kv is not None
        blocks, offsets = self._indices(block_ids, start, end)
        return self.kv[blocks, offsets]

    def _scatter(self, block_ids: Sequence[int], start: int, rows: torch.Tensor) -> None:
        """Write the KV rows of positions ``start ..`` into the blocks ``block_ids``."""
        assert self.kv is not None
        blocks, offsets = self._indices(block_ids, start, start + int(rows.shape[0]))
        self.kv[blocks, offsets] = rows.to(self.kv.dtype)


@dataclass
class _Request:
    seq: TrieSequence
    tokens: list[int]
    """The prompt, then the generated tokens appended as they are run."""
    cache: Any
    """The request's ``transformers`` cache object."""
    copies: list[Copy] = field(default_factory=list)
    """Save copies that may still read the cache object's state."""
    saved_step: int = 0
    """The step of the last checkpoint saved (0: none)."""
    computed: int = 0
    forwards: int = 0


def _token_list(prompt_ids: Any) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(
                f"generate: prompt_ids must be 1-D or [1, n], got shape {tuple(prompt_ids.shape)}"
            )
        return [int(t) for t in prompt_ids.tolist()]
    out: list[int] = []
    for t in prompt_ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"generate: token ids must be ints, got {t!r}")
        out.append(t)
    return out
