"""Test helpers for engines built on blocktrie: a tiny hybrid model and a minimal engine.

This module is shipped and documented (``docs/testing.md``) so that people who
write their own inference engine on top of `cache.BlockTrie` can test it the
same way blocktrie tests itself: run a real (tiny) model through the cache and
check that every output equals a cold run of the same prompt without any cache.

`TinyHybridModel`
    A deterministic hybrid attention + SSM language model. Attention layers
    read and write K/V through a *block table* into a paged KV tensor shaped
    ``[num_blocks, *model.kv_block_shape(block_size)]`` (the layout of
    ``BlockTrie.kv_cache``); SSM layers (a short causal convolution followed by
    a selective diagonal linear recurrence, Mamba style) keep their recurrent
    state in runtime tensors that `TinyHybridModel.forward` updates in place.
    The model depends on nothing but the tokens, their positions, the block
    table and the state: exactly what a paged-attention engine hands a model.

    Exactness contract: every position is computed with tensor operations
    whose shapes depend only on that position (never on how the tokens were
    split into chunks, on the block size, or on which physical blocks the
    block table names). On one device with one dtype, a chunked run therefore
    produces *bit-identical* logits, KV and state to a one-shot run. In
    float64 on CPU, any difference between a cached run and a cold run is a
    real bug, never rounding.

`Engine` (and `run_chat`)
    A minimal scheduler on the public `BlockTrie` API, written the way a real
    engine uses it: match -> restore -> allocate -> chunked prefill (saving
    checkpoints at chunk boundaries) -> commit -> decode with `append` and
    periodic block-aligned saves -> release, several requests interleaved, and
    copies waited on exactly where a real engine would make its compute
    stream wait on the copy event.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from spec.errors import OutOfBlocks

if TYPE_CHECKING:
    from cache.config import CacheConfig
    from cache.copies import Copy, ManualCopies
    from cache.sequence import Sequence as TrieSequence
    from cache.trie import BlockTrie

__all__ = [
    "ColdRun",
    "Engine",
    "EngineCapacityError",
    "LayerKind",
    "RequestResult",
    "TinyHybridConfig",
    "TinyHybridModel",
    "Turn",
    "compare_with_cold",
    "greedy",
    "run_chat",
]

LayerKind = Literal["attn", "ssm"]


@dataclass(frozen=True)
class TinyHybridConfig:
    """Shape and seed of a `TinyHybridModel`.

    Every field has a small default so that ``TinyHybridModel(TinyHybridConfig())``
    is a usable float64 CPU model. The weights depend only on ``seed`` (they are
    drawn in float64 on CPU and then cast to ``dtype``/``device``), so the same
    seed gives the same model, up to the cast, on every device.
    """

    vocab_size: int = 32
    d_model: int = 16
    n_heads: int = 2
    head_dim: int = 8
    d_state: int = 4
    """SSM state size per channel."""
    conv_width: int = 3
    """Causal convolution width (>= 2); the conv state keeps the last ``conv_width - 1`` inputs."""
    layers: tuple[LayerKind, ...] = ("attn", "ssm", "attn", "ssm")
    seed: int = 0
    dtype: torch.dtype = torch.float64
    device: str = "cpu"
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "head_dim": self.head_dim,
            "d_state": self.d_state,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TinyHybridConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"TinyHybridConfig.head_dim must be even (rotary), got {self.head_dim}"
            )
        if isinstance(self.conv_width, bool) or not isinstance(self.conv_width, int):
            raise ValueError(f"TinyHybridConfig.conv_width must be an int, got {self.conv_width!r}")
        if self.conv_width < 2:
            raise ValueError(
                f"TinyHybridConfig.conv_width must be >= 2 (the conv state keeps "
                f"conv_width - 1 inputs), got {self.conv_width}"
            )
        if not self.layers:
            raise ValueError("TinyHybridConfig.layers must name at least one layer")
        for kind in self.layers:
            if kind not in ("attn", "ssm"):
                raise ValueError(
                    f"TinyHybridConfig.layers: unknown layer kind {kind!r} (use 'attn' or 'ssm')"
                )


@dataclass
class _AttnWeights:
    norm: torch.Tensor  # [d_model]
    wq: torch.Tensor  # [d_model, n_heads * head_dim]
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor  # [n_heads * head_dim, d_model]


@dataclass
class _SsmWeights:
    norm: torch.Tensor  # [d_model]
    w_in: torch.Tensor  # [d_model, d_model]  (conv input)
    w_gate: torch.Tensor  # [d_model, d_model]
    conv_w: torch.Tensor  # [conv_width, d_model]
    conv_b: torch.Tensor  # [d_model]
    w_dt: torch.Tensor  # [d_model, d_model]
    dt_bias: torch.Tensor  # [d_model]
    a_log: torch.Tensor  # [d_model, d_state]
    w_b: torch.Tensor  # [d_model, d_state]
    w_c: torch.Tensor  # [d_model, d_state]
    d_skip: torch.Tensor  # [d_model]
    w_out: torch.Tensor  # [d_model, d_model]


@dataclass
class _Layer:
    kind: LayerKind
    index: int
    """Ordinal among the layers of the same kind (attention layer 0, 1, ...; SSM layer 0, ...)."""
    attn: _AttnWeights | None = None
    ssm: _SsmWeights | None = None


@dataclass
class _Cold:
    """Private buffers of a cold run."""

    kv: torch.Tensor
    block_table: list[int]
    state: dict[str, torch.Tensor]


class TinyHybridModel:
    """A tiny deterministic hybrid (attention + SSM) language model for cache tests.

    Storage layout (what an engine must provide):

    - KV: a tensor ``kv`` shaped ``[num_blocks, *kv_block_shape(block_size)]``
      with ``kv_block_shape(block_size) == (num_attn_layers, 2, block_size,
      n_heads, head_dim)``; index 0 of the second axis holds keys, 1 values.
      Token position ``p`` lives in block ``block_table[p // block_size]`` at
      offset ``p % block_size``. The block size is read from ``kv.shape[3]``.
    - State: a dict mapping each name of `state_shapes` to a tensor of that
      shape (one sequence's state). A fresh sequence starts from zeros
      (`new_state`).

    Causality: the logits, KV and state at position ``p`` depend only on
    ``tokens[: p + 1]``. See the module docstring for the exactness contract.
    """

    def __init__(self, config: TinyHybridConfig | None = None) -> None:
        self.config = config if config is not None else TinyHybridConfig()
        cfg = self.config
        gen = torch.Generator(device="cpu")
        gen.manual_seed(cfg.seed)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
            return t.to(dtype=cfg.dtype, device=cfg.device)

        def ones_ish(n: int) -> torch.Tensor:
            return rand(n, scale=0.1) + 1.0

        d = cfg.d_model
        hd = cfg.n_heads * cfg.head_dim
        self.embed = rand(cfg.vocab_size, d)
        self.layers: list[_Layer] = []
        n_attn = 0
        n_ssm = 0
        for kind in cfg.layers:
            if kind == "attn":
                attn = _AttnWeights(
                    norm=ones_ish(d),
                    wq=rand(d, hd, scale=d**-0.5),
                    wk=rand(d, hd, scale=d**-0.5),
                    wv=rand(d, hd, scale=d**-0.5),
                    wo=rand(hd, d, scale=hd**-0.5),
                )
                self.layers.append(_Layer("attn", n_attn, attn=attn))
                n_attn += 1
            else:
                ssm = _SsmWeights(
                    norm=ones_ish(d),
                    w_in=rand(d, d, scale=d**-0.5),
                    w_gate=rand(d, d, scale=d**-0.5),
                    conv_w=rand(cfg.conv_width, d, scale=cfg.conv_width**-0.5),
                    conv_b=rand(d, scale=0.1),
                    w_dt=rand(d, d, scale=d**-0.5),
                    dt_bias=rand(d, scale=0.5) - 1.0,
                    a_log=rand(d, cfg.d_state, scale=0.5),
                    w_b=rand(d, cfg.d_state, scale=d**-0.5),
                    w_c=rand(d, cfg.d_state, scale=d**-0.5),
                    d_skip=ones_ish(d),
                    w_out=rand(d, d, scale=d**-0.5),
                )
                self.layers.append(_Layer("ssm", n_ssm, ssm=ssm))
                n_ssm += 1
        self.num_attn_layers = n_attn
        self.num_ssm_layers = n_ssm
        self.final_norm = ones_ish(d)
        self.lm_head = rand(d, cfg.vocab_size, scale=d**-0.5)
        half = cfg.head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) * (2.0 / cfg.head_dim)
        self._inv_freq = (1.0 / (cfg.rope_base**exponents)).to(dtype=cfg.dtype, device=cfg.device)

    # ------------------------------------------------------------------ layout

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of weights, KV and state."""
        return self.config.dtype

    @property
    def device(self) -> torch.device:
        """The device of weights, KV and state."""
        return torch.device(self.config.device)

    @property
    def vocab_size(self) -> int:
        """Number of token ids; valid tokens are ``0 .. vocab_size - 1``."""
        return self.config.vocab_size

    def kv_block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        """Per-block KV storage: ``(num_attn_layers, 2, block_size, n_heads, head_dim)``."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        cfg = self.config
        return (self.num_attn_layers, 2, block_size, cfg.n_heads, cfg.head_dim)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-sequence recurrent state: ``conv{i}`` and ``ssm{i}`` for the i-th SSM layer.

        ``conv{i}`` is ``(conv_width - 1, d_model)`` (the last inputs of the causal
        convolution, oldest first); ``ssm{i}`` is ``(d_model, d_state)``.
        An attention-only model has no state (an empty dict).
        """
        cfg = self.config
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(self.num_ssm_layers):
            shapes[f"conv{i}"] = (cfg.conv_width - 1, cfg.d_model)
            shapes[f"ssm{i}"] = (cfg.d_model, cfg.d_state)
        return shapes

    def new_state(self) -> dict[str, torch.Tensor]:
        """A zero state (the state of an empty sequence), on the model's device."""
        return {
            name: torch.zeros(shape, dtype=self.dtype, device=self.device)
            for name, shape in self.state_shapes().items()
        }

    def new_kv(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """A zeroed KV tensor ``[num_blocks, *kv_block_shape(block_size)]``."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        shape = (num_blocks, *self.kv_block_shape(block_size))
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ----------------------------------------------------------------- forward

    def forward(
        self,
        tokens: Sequence[int],
        start_pos: int,
        kv: torch.Tensor,
        block_table: Sequence[int],
        state: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """Run ``tokens`` at positions ``start_pos ..``; return ``[len(tokens), vocab]`` logits.

        Preconditions (the caller's, as in a real engine):

        - positions ``< start_pos`` are already computed: their K/V are in
          ``kv`` at the blocks ``block_table`` names, and ``state`` holds the
          recurrent state after exactly ``start_pos`` tokens;
        - ``block_table`` covers every position of this chunk:
          ``len(block_table) * block_size >= start_pos + len(tokens)``.

        Effects: writes the K/V of the new positions into ``kv`` (only at the
        offsets of those positions) and updates ``state`` in place to the state
        after ``start_pos + len(tokens)`` tokens. Reads K/V only of positions
        ``< start_pos + len(tokens)``. Raises `ValueError` on a bad argument
        (before changing anything).
        """
        cfg = self.config
        toks = list(tokens)
        if not toks:
            raise ValueError("forward: tokens must not be empty")
        for t in toks:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < cfg.vocab_size:
                raise ValueError(f"forward: token {t!r} is not an int in [0, {cfg.vocab_size})")
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"forward: start_pos must be a non-negative int, got {start_pos!r}")
        if kv.dim() != 6 or tuple(kv.shape[1:]) != self.kv_block_shape(int(kv.shape[3])):
            raise ValueError(
                f"forward: kv has shape {tuple(kv.shape)}, expected "
                f"[num_blocks, *{self.kv_block_shape(int(kv.shape[3]) if kv.dim() > 3 else 1)}]"
            )
        block_size = int(kv.shape[3])
        table = [int(b) for b in block_table]
        end = start_pos + len(toks)
        if len(table) * block_size < end:
            raise ValueError(
                f"forward: block table of {len(table)} blocks covers {len(table) * block_size} "
                f"positions, the chunk ends at position {end}"
            )
        for b in table[: -(-end // block_size)]:
            if not 0 <= b < kv.shape[0]:
                raise ValueError(f"forward: block id {b} outside the KV tensor ({kv.shape[0]})")
        shapes = self.state_shapes()
        for name, shape in shapes.items():
            if name not in state:
                raise ValueError(f"forward: state lacks {name!r}")
            if tuple(state[name].shape) != shape:
                raise ValueError(
                    f"forward: state[{name!r}] has shape {tuple(state[name].shape)}, "
                    f"expected {shape}"
                )
        table_t = torch.tensor(table, dtype=torch.long, device=kv.device)
        out = torch.empty((len(toks), cfg.vocab_size), dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            for i, tok in enumerate(toks):
                out[i] = self._step(tok, start_pos + i, kv, table, table_t, block_size, state)
        return out

    def _step(
        self,
        token: int,
        pos: int,
        kv: torch.Tensor,
        table: list[int],
        table_t: torch.Tensor,
        block_size: int,
        state: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """One position through every layer; shapes depend only on ``pos``."""
        x = self.embed[token]
        for layer in self.layers:
            if layer.attn is not None:
                x = x + self._attention(
                    layer.attn, layer.index, x, pos, kv, table, table_t, block_size
                )
            elif layer.ssm is not None:
                x = x + self._ssm(layer.ssm, layer.index, x, state)
        h = _rms_norm(x, self.final_norm)
        return h @ self.lm_head

    def _rope(self, t: torch.Tensor, pos: int) -> torch.Tensor:
        """Rotary embedding of one position; ``t`` is ``[n_heads, head_dim]``."""
        angles = self._inv_freq * float(pos)
        cos = torch.cos(angles)
        sin = torch.sin(angles)
        half = t.shape[-1] // 2
        t1 = t[..., :half]
        t2 = t[..., half:]
        return torch.cat((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1)

    def _attention(
        self,
        w: _AttnWeights,
        index: int,
        x: torch.Tensor,
        pos: int,
        kv: torch.Tensor,
        table: list[int],
        table_t: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        cfg = self.config
        h = _rms_norm(x, w.norm)
        q = self._rope((h @ w.wq).view(cfg.n_heads, cfg.head_dim), pos)
        k = self._rope((h @ w.wk).view(cfg.n_heads, cfg.head_dim), pos)
        v = (h @ w.wv).view(cfg.n_heads, cfg.head_dim)
        block = table[pos // block_size]
        offset = pos % block_size
        kv[block, index, 0, offset] = k
        kv[block, index, 1, offset] = v
        n_blocks = pos // block_size + 1
        blocks = table_t[:n_blocks]
        # [n_blocks, block_size, H, D] -> [positions, H, D], positions 0 .. pos.
        keys = kv[blocks, index, 0].reshape(n_blocks * block_size, cfg.n_heads, cfg.head_dim)
        values = kv[blocks, index, 1].reshape(n_blocks * block_size, cfg.n_heads, cfg.head_dim)
        keys = keys[: pos + 1]
        values = values[: pos + 1]
        # Broadcast-and-sum instead of einsum/bmm: BLAS may go multithreaded,
        # and these tensors are far below the size where torch parallelises
        # an elementwise op or a reduction (so shapes alone fix the result).
        scores = (q.unsqueeze(1) * keys.transpose(0, 1)).sum(dim=-1) / math.sqrt(cfg.head_dim)
        # Softmax by hand: torch.softmax enters an OpenMP parallel region even
        # for a [heads, positions] input, which costs milliseconds per call on
        # a busy machine. Elementwise ops this small never go parallel.
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        probs = weights / weights.sum(dim=-1, keepdim=True)
        attended = (probs.unsqueeze(-1) * values.transpose(0, 1)).sum(dim=1).reshape(-1)
        return attended @ w.wo

    def _ssm(
        self, w: _SsmWeights, index: int, x: torch.Tensor, state: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        conv_state = state[f"conv{index}"]  # [conv_width - 1, d_model]
        ssm_state = state[f"ssm{index}"]  # [d_model, d_state]
        h = _rms_norm(x, w.norm)
        u = h @ w.w_in
        gate = h @ w.w_gate
        window = torch.cat((conv_state, u.unsqueeze(0)), dim=0)  # [conv_width, d_model]
        c = torch.nn.functional.silu((window * w.conv_w).sum(dim=0) + w.conv_b)
        conv_state.copy_(window[1:])
        dt = torch.nn.functional.softplus(c @ w.w_dt + w.dt_bias)  # [d_model]
        decay = torch.exp(dt.unsqueeze(1) * -torch.exp(w.a_log))  # [d_model, d_state]
        b = c @ w.w_b  # [d_state]
        cc = c @ w.w_c  # [d_state]
        new_state = decay * ssm_state + (dt * c).unsqueeze(1) * b.unsqueeze(0)
        ssm_state.copy_(new_state)
        y = new_state @ cc + w.d_skip * c
        y = y * torch.nn.functional.silu(gate)
        return y @ w.w_out

    # --------------------------------------------------------------- cold runs

    def _cold_buffers(self, num_tokens: int, block_size: int) -> _Cold:
        num_blocks = max(1, -(-num_tokens // block_size))
        return _Cold(
            kv=self.new_kv(num_blocks, block_size),
            block_table=list(range(num_blocks)),
            state=self.new_state(),
        )

    def cold_logits(self, tokens: Sequence[int], block_size: int = 16) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` of every position, in one pass, no cache.

        Private buffers; ``block_size`` changes nothing in the result (the
        exactness contract) and only exists so tests can check that.
        """
        toks = list(tokens)
        cold = self._cold_buffers(len(toks), block_size)
        return self.forward(toks, 0, cold.kv, cold.block_table, cold.state)

    def cold_state(self, tokens: Sequence[int], block_size: int = 16) -> dict[str, torch.Tensor]:
        """The recurrent state after running ``tokens`` from an empty sequence, no cache."""
        toks = list(tokens)
        cold = self._cold_buffers(len(toks), block_size)
        if toks:
            self.forward(toks, 0, cold.kv, cold.block_table, cold.state)
        return cold.state

    def cold_run(self, prompt: Sequence[int], max_new_tokens: int, block_size: int = 16) -> ColdRun:
        """Greedy generation without any cache, keeping the logits of every position.

        The prompt is computed in one forward call, then one decode step per
        generated token (the last generated token is not run through the
        model). Private buffers; ``block_size`` changes nothing in the result.
        """
        toks = list(prompt)
        if not toks:
            raise ValueError("cold_run: the prompt must not be empty")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"cold_run: max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"cold_run: max_new_tokens must be >= 1, got {max_new_tokens}")
        cold = self._cold_buffers(len(toks) + max_new_tokens - 1, block_size)
        rows = [self.forward(toks, 0, cold.kv, cold.block_table, cold.state)]
        generated = [greedy(rows[-1][-1])]
        while len(generated) < max_new_tokens:
            pos = len(toks) + len(generated) - 1
            rows.append(self.forward([generated[-1]], pos, cold.kv, cold.block_table, cold.state))
            generated.append(greedy(rows[-1][-1]))
        return ColdRun(prompt=toks, generated=generated, logits=torch.cat(rows))

    def cold_generate(
        self, prompt: Sequence[int], max_new_tokens: int, block_size: int = 16
    ) -> tuple[torch.Tensor, list[int]]:
        """Greedy generation without any cache: ``(logits [max_new_tokens, vocab], tokens)``.

        ``logits[i]`` is the distribution ``tokens[i]`` was picked from (by
        `greedy`): row 0 comes from the last prompt position, row ``i`` from the
        position of ``tokens[i - 1]``. See `cold_run`.
        """
        run = self.cold_run(prompt, max_new_tokens, block_size)
        return run.generation_logits, run.generated

    def cache_config(
        self,
        *,
        block_size: int,
        num_blocks: int,
        num_checkpoint_slots: int,
        device: str | torch.device | None = None,
    ) -> CacheConfig:
        """A `cache.CacheConfig` whose KV and state layouts fit this model.

        ``kv_block_shape``, ``state_shapes`` and both dtypes come from the
        model; ``device`` defaults to the model's.
        """
        from cache.config import CacheConfig

        return CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            kv_block_shape=self.kv_block_shape(block_size),
            kv_dtype=self.dtype,
            num_checkpoint_slots=num_checkpoint_slots,
            state_shapes=self.state_shapes(),
            state_dtype=self.dtype,
            device=self.config.device if device is None else device,
        )


@dataclass
class ColdRun:
    """The result of `TinyHybridModel.cold_run`.

    ``logits[p]`` are the logits at position ``p`` of ``prompt + generated``,
    for every computed position ``0 .. len(prompt) + len(generated) - 2``.
    """

    prompt: list[int]
    generated: list[int]
    logits: torch.Tensor

    @property
    def generation_logits(self) -> torch.Tensor:
        """``[len(generated), vocab]``: row ``i`` is what ``generated[i]`` was picked from."""
        return self.logits[len(self.prompt) - 1 :]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean() + eps) * weight


def _same_device(a: torch.device, b: torch.device) -> bool:
    """ "cuda" and "cuda:0" name the same device when one has no index."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def greedy(logits: torch.Tensor) -> int:
    """The greedy choice from one row of logits: the lowest index of the maximum."""
    return int(torch.argmax(logits).item())


# ---------------------------------------------------------------------------
# A minimal engine on the public BlockTrie API
# ---------------------------------------------------------------------------


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


class EngineCapacityError(RuntimeError):
    """A single request does not fit in the cache even with nothing else running."""


class Engine:
    """A minimal continuous-batching engine for `TinyHybridModel` over a `cache.BlockTrie`.

    It uses only the public cache API, in the order a real engine does:

    1. Admission (FCFS, at most ``max_running`` requests): ``match`` the
       request's tokens; if the match found a checkpoint, ``restore`` it into
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
        if model.state_shapes() and trie.config.state_dtype != model.dtype:
            raise ValueError(
                f"Engine: checkpoints would be stored as {trie.config.state_dtype}, the model's "
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
            run = _Running(result, seq, slot, tokens, seq.num_cached_tokens, len(tokens))
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


# ---------------------------------------------------------------------------
# Workloads and the cold-run comparison
# ---------------------------------------------------------------------------

Turn = tuple[Sequence[int], int]
"""One chat turn: (new user tokens, max_new_tokens)."""


def run_chat(
    engine: Engine,
    conversations: Sequence[Sequence[Turn]],
    namespace: str | Sequence[str] = "",
    max_steps: int = 100_000,
) -> list[list[RequestResult]]:
    """Serve multi-turn conversations through ``engine``; returns each one's turn results.

    Turn ``k`` of a conversation is a request whose prompt is turn ``k - 1``'s
    ``prompt + generated`` followed by turn ``k``'s user tokens (turn 0: just
    its user tokens). Every conversation's first turn is submitted at once;
    each next turn is submitted when the previous one finishes, so turns of
    different conversations interleave in the engine. ``namespace`` is one
    cache namespace for all, or one per conversation.
    """
    if isinstance(namespace, str):
        namespaces = [namespace] * len(conversations)
    else:
        namespaces = list(namespace)
        if len(namespaces) != len(conversations):
            raise ValueError(
                f"run_chat: {len(namespaces)} namespaces for {len(conversations)} conversations"
            )
    for conv in conversations:
        if not conv:
            raise ValueError("run_chat: a conversation needs at least one turn")
        if not list(conv[0][0]):
            raise ValueError("run_chat: the first turn needs user tokens")
    out: list[list[RequestResult]] = [[] for _ in conversations]
    owner: dict[int, int] = {}

    def submit(ci: int) -> None:
        turn = len(out[ci])
        user, max_new = conversations[ci][turn]
        prev = out[ci][-1].tokens if out[ci] else []
        rid = engine.submit(prev + list(user), max_new, namespaces[ci])
        owner[rid] = ci

    for ci in range(len(conversations)):
        submit(ci)
    for _ in range(max_steps):
        if not engine.has_work:
            return out
        for result in engine.step():
            index = owner.get(result.request_id)
            if index is None:
                continue
            out[index].append(result)
            if len(out[index]) < len(conversations[index]):
                submit(index)
    raise RuntimeError(f"run_chat: still busy after {max_steps} steps")


def compare_with_cold(
    model: TinyHybridModel,
    result: RequestResult,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    cold: ColdRun | None = None,
) -> list[str]:
    """Differences between a served request and a cold run of its prompt; [] when identical.

    The cold run is ``model.cold_run(result.prompt, result.max_new_tokens)``
    (pass ``cold`` to reuse one). Checks that the generated tokens are equal
    and that every logits row the engine computed equals the cold run's row at
    the same position: exactly with the default ``atol = rtol = 0`` (float64
    on CPU), else within ``torch.allclose(atol, rtol)``. With a tolerance, a
    generated token may differ only where the cold run's top two logits are
    within tolerance of each other (a near tie); the comparison then stops at
    that position, since the two runs continue from different tokens.
    """
    if cold is None:
        cold = model.cold_run(result.prompt, result.max_new_tokens)
    problems: list[str] = []
    exact = atol == 0.0 and rtol == 0.0
    prompt_len = len(result.prompt)
    limit = prompt_len + len(result.generated) - 1  # comparable positions: < limit
    if not result.finished:
        problems.append(f"request {result.request_id} did not finish")
    for i, (got, want) in enumerate(zip(result.generated, cold.generated, strict=False)):
        if got == want:
            continue
        row = cold.generation_logits[i]
        top2 = torch.topk(row, 2).values if row.numel() >= 2 else row
        gap = float(top2[0] - top2[-1])
        bound = atol + rtol * float(top2[0].abs())
        if exact or gap > bound:
            problems.append(
                f"request {result.request_id}: generated token {i} is {got}, cold run gives "
                f"{want} (top-2 gap {gap:.3g})"
            )
        limit = prompt_len + i
        break
    if len(result.generated) != len(cold.generated) and result.finished:
        problems.append(
            f"request {result.request_id}: generated {len(result.generated)} tokens, "
            f"cold run {len(cold.generated)}"
        )
    for start, logits in result.chunks:
        stop = min(start + logits.shape[0], limit)
        if stop <= start:
            continue
        got_rows = logits[: stop - start].to(cold.logits.device)
        want_rows = cold.logits[start:stop]
        same = (
            torch.equal(got_rows, want_rows)
            if exact
            else torch.allclose(got_rows, want_rows, atol=atol, rtol=rtol)
        )
        if not same:
            diff = (got_rows - want_rows).abs().max().item()
            bad = int((got_rows != want_rows).any(dim=-1).nonzero()[0].item()) + start
            problems.append(
                f"request {result.request_id}: logits at positions {start}..{stop - 1} differ "
                f"from the cold run (first at position {bad}, max |diff| {diff:.3g}; "
                f"cache hit was {result.num_cached_tokens} tokens)"
            )
    return problems
