"""`TinyHybridModel`: a deterministic hybrid attention + SSM model on a paged KV tensor.

See `cache.testing` for the exactness contract.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from cache.config import CacheConfig

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
        num_host_blocks: int = 0,
        host_write: str = "through",
        num_host_checkpoint_slots: int = 0,
    ) -> CacheConfig:
        """A `cache.CacheConfig` whose KV and state layouts fit this model.

        ``kv_block_shape``, ``state_shapes`` and both dtypes come from the
        model; ``device`` defaults to the model's; ``num_host_blocks`` > 0
        adds a host-memory tier, ``num_host_checkpoint_slots`` > 0 host
        checkpoint slots.
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
            num_host_blocks=num_host_blocks,
            host_write=host_write,
            num_host_checkpoint_slots=num_host_checkpoint_slots,
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
