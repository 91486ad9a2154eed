"""`HFModel`: a Hugging Face ``transformers`` model seen the way blocktrie stores it.

Every use of ``transformers`` internals in blocktrie lives in this module; each
spot says the version it was checked against (``transformers 5.25``, and 5.23
where the two differ; `TESTED_VERSIONS`). What it relies on, all of it
discovered from the model at construction, never from a per-architecture table:

- ``model(input_ids=..., cache=..., use_cache=True[, position_ids=...])``
  returns the logits and the cache object (``out.cache``; the keyword and the
  field are ``past_key_values`` or ``cache_params`` in 5.23), a
  ``transformers.Cache`` whose ``layers`` hold, per decoder layer, any of:
  attention KV (``layer.keys`` / ``layer.values``, ``[batch, heads, tokens,
  head_dim]``, grown by ``layer.update(keys, values)``), and linear-attention
  state (``layer.conv_states`` / ``layer.recurrent_states``: dicts of
  ``[batch, ...]`` tensors, with ``layer.has_previous_state`` and the token
  count ``layer.cumulative_length_linear``). Layers holding neither (MLP-only
  layers) are skipped.
- ``cache.reset()`` empties a cache (keeping its state tensors, zeroed).

Layout in blocktrie's pools (`ModelLayout`):

- **KV** (`ModelLayout.kv_block_shape`): one KV block is ``[block_size,
  token_width]``. Row ``p % block_size`` of block ``block_table[p //
  block_size]`` holds position ``p``; a row is, for each attention layer in
  layer order, its keys then its values, each flattened ``heads x head_dim``
  (`AttentionSlot.offset` is where a layer starts). `HFModel.read_kv` and
  `HFModel.load_kv` convert between those rows and the cache object.
- **State**: one named state per tensor, ``"layer{i}.conv{j}"`` and
  ``"layer{i}.recurrent{j}"``, shaped like the cache's tensor without its batch
  axis. HF keeps conv state in the model's dtype and (for Mamba-2 style
  layers) the recurrent state in float32; blocktrie's checkpoint pool has one
  ``state_dtype``, so the layout stores every state in the *promoted* dtype of
  all of them (float64 for a float64 model, float32 for a bfloat16 one): the
  copies convert at the boundary, and every conversion is exact both ways.

Numerical traps, found by probes at construction (`Traps`); the engine adapts:

- a multi-token forward that does not continue exactly from a restored state
  (the pure-torch Mamba-1 scan ignores the incoming state on a multi-token
  forward): continue one token at a time after any state;
- a 1-token prefill piece that changes the numerics (HF switches to its decode
  kernel on one token): never cut a 1-token prefill piece;
- a model whose state lives outside the cache object (RecurrentGemma keeps it
  on its layers): refused with `UnsupportedModel`.

Always passed: ``position_ids`` (Bamba computes wrong positions after a cache
offset unless they are given).
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cache.config import CacheConfig
from cache.extras import requires_extra

__all__ = [
    "AttentionSlot",
    "HFModel",
    "ModelLayout",
    "StateSlot",
    "Traps",
    "UnsupportedModel",
]

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("5.23.0", "5.25.0")
"""The ``transformers`` releases this module was checked against (the ``hf`` extra
allows ``>=5.23,<6``)."""

_CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")
"""The names a forward's cache object goes by (newest first)."""

PROBE_TOKENS = 16
"""Tokens of the construction probes (a prefix, then its continuation)."""
PROBE_SPLIT = 7
"""Where the probes cut the probe tokens: the restored prefix's length."""


class UnsupportedModel(ValueError):
    """The model cannot be served through blocktrie; the message names why."""


@dataclass(frozen=True)
class AttentionSlot:
    """One attention layer's KV within a token row of a KV block."""

    layer: int
    """Index of the layer in the cache object's ``layers``."""
    heads: int
    key_dim: int
    value_dim: int
    offset: int
    """Column of this layer's keys in the row; its values follow them."""

    @property
    def width(self) -> int:
        """Columns this layer takes in a row: ``heads * (key_dim + value_dim)``."""
        return self.heads * (self.key_dim + self.value_dim)


@dataclass(frozen=True)
class StateSlot:
    """One recurrent state tensor of one layer."""

    name: str
    """``"layer{i}.conv{j}"`` or ``"layer{i}.recurrent{j}"``."""
    layer: int
    kind: str
    """``"conv"`` or ``"recurrent"``."""
    index: int
    """The layer's state index ``j`` (HF allows several per layer)."""
    shape: tuple[int, ...]
    """Without the batch axis."""
    dtype: torch.dtype
    """The dtype HF keeps it in."""


@dataclass(frozen=True)
class ModelLayout:
    """What blocktrie stores for a model, discovered from a probe forward."""

    num_layers: int
    attention: tuple[AttentionSlot, ...]
    states: tuple[StateSlot, ...]
    kv_dtype: torch.dtype
    """The dtype of the attention KV (the model's dtype when there is none)."""
    state_dtype: torch.dtype
    """The promoted dtype of every state: each converts to it and back exactly."""

    @property
    def token_width(self) -> int:
        """Columns of one position's row: all attention layers' keys and values."""
        return sum(slot.width for slot in self.attention)

    def kv_block_shape(self, block_size: int) -> tuple[int, int] | None:
        """``(block_size, token_width)``, or None when the model has no attention KV."""
        return (block_size, self.token_width) if self.attention else None

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every state (empty for an attention-only model)."""
        return {slot.name: slot.shape for slot in self.states}

    def cache_config(
        self,
        *,
        block_size: int,
        num_blocks: int,
        num_checkpoint_slots: int,
        device: str | torch.device = "cpu",
        **extra: Any,
    ) -> CacheConfig:
        """A `CacheConfig` whose pools hold this layout (``extra``: other fields).

        An attention-only model gets no checkpoint slots, whatever is asked.
        """
        return CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            kv_block_shape=self.kv_block_shape(block_size),
            kv_dtype=self.kv_dtype,
            num_checkpoint_slots=num_checkpoint_slots if self.states else 0,
            state_shapes=self.state_shapes(),
            state_dtype=self.state_dtype,
            device=device,
            **extra,
        )


@dataclass(frozen=True)
class Traps:
    """What the construction probes found.

    The probes run `PROBE_TOKENS` random tokens once in one forward, then in
    pieces cut at `PROBE_SPLIT`; the ``*_diff`` fields are the largest
    absolute logit differences from the one forward.

    - ``multi_token_continuation``: a multi-token forward continues from a
      restored cache as well as one token at a time does. False when
      ``restored_diff`` is over ten times ``restored_one_token_diff`` and over
      the dtype's rounding (1000 eps at the logits' scale); the engine then
      continues one token at a time after any state.
    - ``one_token_pieces``: a 1-token piece in a prefill leaves the numerics
      as a cut into pieces of 2+ tokens does. False when
      ``one_token_piece_diff`` is over ten times ``split_diff`` and over the
      rounding; the engine then never cuts one.

    `HFModel` refuses a model for which neither way of continuing is within
    ``tolerance``.
    """

    multi_token_continuation: bool
    one_token_pieces: bool
    tolerance: float
    """The largest difference a continuation may show (`default_tolerance`)."""
    split_diff: float
    """A prefill cut in two pieces, same cache object."""
    restored_diff: float
    """The second piece after a round trip through blocktrie's layout."""
    restored_one_token_diff: float
    """The same, continued one token at a time."""
    one_token_piece_diff: float
    """A prefill with a 1-token piece in the middle."""

    def notes(self) -> list[str]:
        """One line per trap found, for logs and reports."""
        out: list[str] = []
        if not self.multi_token_continuation:
            out.append(
                f"a multi-token forward does not continue from a restored state (max logit "
                f"diff {self.restored_diff:.3g}, one token at a time: "
                f"{self.restored_one_token_diff:.3g}): continuing one token at a time "
                "after any state"
            )
        if not self.one_token_pieces:
            out.append(
                f"a 1-token prefill piece changes the numerics (max logit diff "
                f"{self.one_token_piece_diff:.3g}, two pieces: {self.split_diff:.3g}): "
                "no 1-token prefill pieces"
            )
        return out


def default_tolerance(dtype: torch.dtype) -> float:
    """Logit difference the probes take as rounding: well above the rounding of
    ``dtype`` (and of float32, which HF's recurrent states use), far below a wrong state."""
    if dtype == torch.float64:
        return 1e-6
    if dtype == torch.float32:
        return 1e-3
    return 5e-2


class HFModel:
    """A ``transformers`` causal LM, its layout and traps discovered at construction.

    Batch size 1 (one sequence per cache object). Raises `UnsupportedModel`
    when the model's KV and recurrent state do not all live in the cache
    object a forward returns (e.g. RecurrentGemma), or when restoring that
    cache from blocktrie's layout does not continue a forward correctly.
    ``tolerance``: see `default_tolerance`.
    """

    def __init__(self, model: Any, *, tolerance: float | None = None) -> None:
        with requires_extra("hf", "cache.integrations.transformers"):
            import transformers

        if not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(
                f"HFModel: expected a transformers PreTrainedModel, got {type(model).__name__}"
            )
        if model.training:
            raise ValueError(
                f"HFModel: {type(model).__name__} is in training mode (dropout would make "
                "every forward differ); call model.eval() first"
            )
        lm: Any = model  # transformers is untyped to mypy
        self.model = lm
        self.name = type(model).__name__
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self.dtype: torch.dtype = model.dtype
        self.vocab_size = int(lm.get_output_embeddings().weight.shape[0])
        keywords = inspect.signature(lm.forward).parameters
        # transformers 5.25: `position_ids` is a keyword of every hybrid model's forward
        # except the pure SSMs (Mamba, Mamba2), which have no positions.
        self._takes_positions = "position_ids" in keywords
        # transformers 5.25 passes the cache object as `cache=`; 5.23 as
        # `past_key_values=` (`cache_params=` for the pure SSMs). The output field has
        # the same name.
        names = [name for name in _CACHE_KEYWORDS if name in keywords]
        if not names:
            raise UnsupportedModel(
                f"{self.name}: its forward takes no cache object (none of {_CACHE_KEYWORDS})"
            )
        self._cache_keyword = names[0]
        self.tolerance = default_tolerance(self.dtype) if tolerance is None else tolerance
        gen = torch.Generator().manual_seed(0)
        probe = torch.randint(0, self.vocab_size, (PROBE_TOKENS,), generator=gen).tolist()
        with torch.no_grad():
            self._check_buffers_still(probe)
            reference, cache = self._forward_new(probe)
            self.layout = self._discover(cache, len(probe))
            cache.reset()  # transformers 5.25: empties KV, zeroes the states in place
            self._empty = cache
            self.traps = self._probe_traps(probe, reference)
        for note in self.traps.notes():
            log.info("%s: %s", self.name, note)

    # ----------------------------------------------------------- forward

    def new_cache(self) -> Any:
        """An empty cache object for one sequence."""
        return copy.deepcopy(self._empty)

    def forward(self, cache: Any, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Run ``tokens`` at positions ``start ..`` on ``cache``; ``[len(tokens), vocab]`` logits.

        ``cache`` must hold exactly the first ``start`` positions.
        """
        logits: torch.Tensor = self._run(cache, tokens, start).logits[0]
        return logits

    def _run(self, cache: Any, tokens: Sequence[int], start: int) -> Any:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {self._cache_keyword: cache}
        if self._takes_positions:
            positions = torch.arange(start, start + len(tokens), device=self.device)
            kwargs["position_ids"] = positions.unsqueeze(0)
        with torch.no_grad():
            return self.model(input_ids=ids, use_cache=True, **kwargs)

    def _forward_new(self, tokens: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """One forward from nothing, letting the model build its own cache object."""
        out = self._run(None, tokens, 0)
        cache = getattr(out, self._cache_keyword, None)
        if cache is None or not isinstance(getattr(cache, "layers", None), list):
            raise UnsupportedModel(
                f"{self.name}: a forward with use_cache=True returned no transformers Cache "
                "object with per-layer state, so its state lives outside the cache object "
                "(e.g. on the model's layers) where blocktrie cannot save or restore it"
            )
        return out.logits[0], cache

    def _check_buffers_still(self, probe: Sequence[int]) -> None:
        """Refuse a model that keeps state in its own buffers (a forward changes them)."""
        before = {name: b.clone() for name, b in self.model.named_buffers()}
        self._forward_new(probe[:2])
        for name, b in self.model.named_buffers():
            if name in before and not torch.equal(before[name], b):
                raise UnsupportedModel(
                    f"{self.name}: a forward changed the model buffer {name!r}, so its "
                    "state lives outside the cache object, where blocktrie cannot save "
                    "or restore it"
                )

    # ------------------------------------------------------------ layout

    def _discover(self, cache: Any, num_tokens: int) -> ModelLayout:
        attention: list[AttentionSlot] = []
        states: list[StateSlot] = []
        kv_dtypes: set[torch.dtype] = set()
        offset = 0
        for i, layer in enumerate(cache.layers):
            keys = getattr(layer, "keys", None)  # transformers 5.25: attention layers
            values = getattr(layer, "values", None)
            if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
                if keys.dim() != 4 or values.dim() != 4 or keys.shape[0] != 1:
                    raise UnsupportedModel(
                        f"{self.name}: cache layer {i} holds keys {tuple(keys.shape)}, values "
                        f"{tuple(values.shape)}; expected [1, heads, tokens, head_dim]"
                    )
                # transformers 5.25: sliding-window layers say so in `is_sliding`; a
                # window longer than the probe would otherwise pass the length check.
                sliding = bool(getattr(layer, "is_sliding", False))
                if sliding or keys.shape[2] != num_tokens or values.shape[2] != num_tokens:
                    raise UnsupportedModel(
                        f"{self.name}: cache layer {i} ({type(layer).__name__}) holds "
                        f"{keys.shape[2]} positions after {num_tokens} tokens (a sliding "
                        "window or preallocated cache): blocktrie's KV blocks hold every "
                        "position of a prefix"
                    )
                slot = AttentionSlot(
                    i, int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3]), offset
                )
                if values.shape[1] != keys.shape[1]:
                    raise UnsupportedModel(
                        f"{self.name}: cache layer {i} has {keys.shape[1]} key heads and "
                        f"{values.shape[1]} value heads"
                    )
                attention.append(slot)
                offset += slot.width
                kv_dtypes.update((keys.dtype, values.dtype))
            for kind in ("conv", "recurrent"):
                # transformers 5.25: linear-attention layers keep {state_idx: tensor | None}
                found = getattr(layer, f"{kind}_states", None)
                if not isinstance(found, Mapping):
                    continue
                for j, tensor in sorted(found.items()):
                    if not isinstance(tensor, torch.Tensor):
                        continue
                    if tensor.dim() < 2 or tensor.shape[0] != 1:
                        raise UnsupportedModel(
                            f"{self.name}: cache layer {i}'s {kind} state {j} has shape "
                            f"{tuple(tensor.shape)}; expected a batch axis of 1 first"
                        )
                    states.append(
                        StateSlot(
                            f"layer{i}.{kind}{j}",
                            i,
                            kind,
                            int(j),
                            tuple(int(d) for d in tensor.shape[1:]),
                            tensor.dtype,
                        )
                    )
        if not attention and not states:
            raise UnsupportedModel(
                f"{self.name}: its cache object holds neither attention KV nor recurrent "
                "state after a forward"
            )
        if len(kv_dtypes) > 1:
            raise UnsupportedModel(
                f"{self.name}: attention KV in several dtypes {sorted(map(str, kv_dtypes))}"
            )
        kv_dtype = kv_dtypes.pop() if kv_dtypes else self.dtype
        state_dtype = self.dtype
        for state in states:
            state_dtype = torch.promote_types(state_dtype, state.dtype)
        if not states:
            state_dtype = torch.float32
        return ModelLayout(
            len(cache.layers), tuple(attention), tuple(states), kv_dtype, state_dtype
        )

    # ------------------------------------------------------- state and KV

    def state_views(self, cache: Any) -> dict[str, torch.Tensor]:
        """Name -> the cache's own state tensor without its batch axis (a view).

        Pass it to `BlockTrie.save` (the copy reads it) and `BlockTrie.restore`
        (the copy writes it), then `mark_restored`.
        """
        out: dict[str, torch.Tensor] = {}
        for slot in self.layout.states:
            # transformers 5.25: conv_states / recurrent_states, dicts by state index
            tensors = getattr(cache.layers[slot.layer], f"{slot.kind}_states")
            out[slot.name] = tensors[slot.index][0]
        return out

    def mark_restored(self, cache: Any, num_tokens: int) -> None:
        """Tell an empty cache that its state tensors now hold ``num_tokens`` tokens of state."""
        done: set[int] = set()
        for slot in self.layout.states:
            layer = cache.layers[slot.layer]
            # transformers 5.25: a layer with has_previous_state False treats the next
            # forward as a prefill (ignoring its conv state); the token count of a
            # linear-attention layer is `cumulative_length_linear` (a 0-d tensor; 5.23
            # keeps none).
            layer.has_previous_state[slot.index] = True
            count = getattr(layer, "cumulative_length_linear", None)
            if isinstance(count, torch.Tensor) and slot.layer not in done:
                count.fill_(num_tokens)
                done.add(slot.layer)

    def read_kv(self, cache: Any, start: int, end: int) -> torch.Tensor:
        """The KV rows ``[end - start, token_width]`` of positions ``start .. end - 1``."""
        parts: list[torch.Tensor] = []
        for slot in self.layout.attention:
            layer = cache.layers[slot.layer]
            for t in (layer.keys, layer.values):  # transformers 5.25: [1, H, T, D]
                parts.append(t[0, :, start:end].transpose(0, 1).reshape(end - start, -1))
        return torch.cat(parts, dim=1)

    def load_kv(self, cache: Any, rows: torch.Tensor) -> None:
        """Put the KV rows of positions ``0 .. len(rows) - 1`` into an empty cache."""
        n = int(rows.shape[0])
        for slot in self.layout.attention:
            layer = cache.layers[slot.layer]
            k_cols = slot.heads * slot.key_dim
            keys = rows[:, slot.offset : slot.offset + k_cols]
            values = rows[:, slot.offset + k_cols : slot.offset + slot.width]
            keys = keys.reshape(n, slot.heads, slot.key_dim).transpose(0, 1).unsqueeze(0)
            values = values.reshape(n, slot.heads, slot.value_dim).transpose(0, 1).unsqueeze(0)
            # transformers 5.25: `update` lazily initialises the layer and appends.
            layer.update(keys.contiguous(), values.contiguous())

    # ------------------------------------------------------------- probes

    def _restored(self, tokens: Sequence[int], split: int) -> Any:
        """A new cache holding ``tokens[:split]``, moved through blocktrie's layout and dtypes."""
        source = self.new_cache()
        self.forward(source, tokens[:split], 0)
        cache = self.new_cache()
        saved = {n: t.to(self.layout.state_dtype) for n, t in self.state_views(source).items()}
        for name, tensor in self.state_views(cache).items():
            tensor.copy_(saved[name])
        self.mark_restored(cache, split)
        if self.layout.attention:
            self.load_kv(cache, self.read_kv(source, 0, split).to(self.layout.kv_dtype))
        return cache

    def _probe_traps(self, tokens: list[int], reference: torch.Tensor) -> Traps:
        a = PROBE_SPLIT

        def diff(rows: list[torch.Tensor], start: int) -> float:
            got = torch.cat(rows)
            return float((got - reference[start:]).abs().max())

        cache = self.new_cache()
        split = diff([self.forward(cache, tokens[:a], 0), self.forward(cache, tokens[a:], a)], 0)
        cache = self.new_cache()
        pieces = [self.forward(cache, tokens[:a], 0), self.forward(cache, tokens[a : a + 1], a)]
        pieces.append(self.forward(cache, tokens[a + 1 :], a + 1))
        one_piece = diff(pieces, 0)
        restored = diff([self.forward(self._restored(tokens, a), tokens[a:], a)], a)
        cache = self._restored(tokens, a)
        stepped = diff([self.forward(cache, [t], a + i) for i, t in enumerate(tokens[a:])], a)
        tol = self.tolerance
        if min(restored, stepped) > tol:
            raise UnsupportedModel(
                f"{self.name}: continuing from a cache restored from blocktrie's layout does "
                f"not reproduce one forward (max logit diff {restored:.3g}; one token at a "
                f"time {stepped:.3g}; tolerance {tol:.3g}): part of its state lives outside "
                "the cache object"
            )
        # Rounding of the model's dtype at the logits' scale: differences below it are noise.
        floor = 1000 * torch.finfo(reference.dtype).eps * max(1.0, float(reference.abs().max()))
        return Traps(
            # A trap is a difference an order of magnitude above what the alternative
            # gives (and above rounding): one token at a time, or pieces of 2+ tokens.
            multi_token_continuation=restored <= max(floor, 10 * stepped),
            one_token_pieces=one_piece <= max(floor, 10 * split),
            tolerance=tol,
            split_diff=split,
            restored_diff=restored,
            restored_one_token_diff=stepped,
            one_token_piece_diff=one_piece,
        )
