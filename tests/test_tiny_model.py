"""The tiny hybrid model of `cache.testing`: chunking, paging and block size change nothing.

These properties are what make the end-to-end test meaningful: if a chunked,
paged run equals a one-shot run bit for bit, then any difference between a
cached run and a cold run comes from the cache, not from rounding.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.testing import TinyHybridConfig, TinyHybridModel, greedy

MODEL = TinyHybridModel(TinyHybridConfig(vocab_size=11, seed=3))


def _chunked_run(
    model: TinyHybridModel,
    tokens: list[int],
    cuts: list[int],
    block_size: int,
    rng: random.Random,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, list[int]]:
    """Run ``tokens`` in chunks ending at ``cuts`` over a shuffled, oversized block pool."""
    needed = -(-len(tokens) // block_size)
    pool = needed + 5
    kv = model.new_kv(pool, block_size)
    kv.normal_()  # garbage everywhere: the model must only read what it wrote
    table = rng.sample(range(pool), needed)
    state = model.new_state()
    outs = []
    start = 0
    for end in [*cuts, len(tokens)]:
        if end > start:
            outs.append(model.forward(tokens[start:end], start, kv, table, state))
            start = end
    return torch.cat(outs), state, kv, table


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 10), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=6),
    block_size=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_chunked_paged_equals_one_shot(
    tokens: list[int], cuts: list[int], block_size: int, seed: int
) -> None:
    cuts = sorted({c for c in cuts if c < len(tokens)})
    full = MODEL.cold_logits(tokens)
    logits, state, _, _ = _chunked_run(MODEL, tokens, cuts, block_size, random.Random(seed))
    assert torch.equal(logits, full)
    cold_state = MODEL.cold_state(tokens)
    assert state.keys() == cold_state.keys()
    for name in state:
        assert torch.equal(state[name], cold_state[name]), name


@settings(max_examples=20, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 10), min_size=2, max_size=30),
    n=st.integers(1, 30),
    bs_a=st.integers(1, 8),
    bs_b=st.integers(1, 8),
)
def test_state_and_kv_after_n_tokens_do_not_depend_on_chunking(
    tokens: list[int], n: int, bs_a: int, bs_b: int
) -> None:
    n = min(n, len(tokens))
    rng = random.Random(n)
    cuts_a = sorted(rng.sample(range(1, n), min(3, n - 1))) if n > 1 else []
    _, state_a, kv_a, table_a = _chunked_run(MODEL, tokens[:n], cuts_a, bs_a, rng)
    _, state_b, kv_b, table_b = _chunked_run(MODEL, tokens[:n], [], bs_b, rng)
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name])

    # K/V of every position, gathered through each block table, agree exactly.
    def gather(kv: torch.Tensor, table: list[int]) -> torch.Tensor:
        # [blocks, L, 2, B, H, D] -> [L, 2, positions, H, D]
        per_block = kv[table].permute(1, 2, 0, 3, 4, 5)
        shape = per_block.shape
        flat = per_block.reshape(shape[0], shape[1], shape[2] * shape[3], shape[4], shape[5])
        return flat[:, :, :n]

    assert torch.equal(gather(kv_a, table_a), gather(kv_b, table_b))


def test_cold_generate_is_consistent_with_cold_logits() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7]
    logits, generated = MODEL.cold_generate(prompt, 6)
    assert logits.shape == (6, MODEL.vocab_size)
    assert generated == [greedy(row) for row in logits]
    full = MODEL.cold_logits(prompt + generated[:-1])
    assert torch.equal(full[len(prompt) - 1 :], logits)


def test_model_reads_kv_and_state() -> None:
    """Stale KV or state would change the logits (so the end-to-end test can see it)."""
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    block_size = 4
    kv = MODEL.new_kv(3, block_size)
    state = MODEL.new_state()
    MODEL.forward(tokens[:8], 0, kv, [0, 1, 2], state)
    reference = MODEL.forward(
        tokens[8:], 8, kv.clone(), [0, 1, 2], {k: v.clone() for k, v in state.items()}
    )
    # A corrupted earlier KV block changes the output.
    bad_kv = kv.clone()
    bad_kv[0] += 0.5
    out = MODEL.forward(tokens[8:], 8, bad_kv, [0, 1, 2], {k: v.clone() for k, v in state.items()})
    assert not torch.equal(out, reference)
    # Each piece of state matters too.
    for name in state:
        bad_state = {k: v.clone() for k, v in state.items()}
        bad_state[name] += 0.5
        out = MODEL.forward(tokens[8:], 8, kv.clone(), [0, 1, 2], bad_state)
        assert not torch.equal(out, reference), name


def test_layout() -> None:
    cfg = MODEL.config
    assert MODEL.kv_block_shape(4) == (2, 2, 4, cfg.n_heads, cfg.head_dim)
    assert MODEL.state_shapes() == {
        "conv0": (cfg.conv_width - 1, cfg.d_model),
        "ssm0": (cfg.d_model, cfg.d_state),
        "conv1": (cfg.conv_width - 1, cfg.d_model),
        "ssm1": (cfg.d_model, cfg.d_state),
    }
    attn_only = TinyHybridModel(TinyHybridConfig(layers=("attn",)))
    assert attn_only.state_shapes() == {}
    assert attn_only.kv_block_shape(2)[0] == 1


def test_same_seed_same_model_other_seed_other_model() -> None:
    tokens = [1, 2, 3, 4]
    a = TinyHybridModel(TinyHybridConfig(seed=7)).cold_logits(tokens)
    b = TinyHybridModel(TinyHybridConfig(seed=7)).cold_logits(tokens)
    c = TinyHybridModel(TinyHybridConfig(seed=8)).cold_logits(tokens)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_forward_rejects_bad_input() -> None:
    kv = MODEL.new_kv(2, 4)
    state = MODEL.new_state()
    with pytest.raises(ValueError, match="block table"):
        MODEL.forward([1] * 9, 0, kv, [0, 1], state)
    with pytest.raises(ValueError, match="token"):
        MODEL.forward([MODEL.vocab_size], 0, kv, [0, 1], state)
    with pytest.raises(ValueError, match="empty"):
        MODEL.forward([], 0, kv, [0, 1], state)
    with pytest.raises(ValueError, match="state"):
        MODEL.forward([1], 0, kv, [0, 1], {})
    with pytest.raises(ValueError):
        TinyHybridConfig(layers=("mlp",))  # type: ignore[arg-type]
