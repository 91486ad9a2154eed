"""Hugging Face hybrid models served through blocktrie equal cold runs (issue 46).

Tiny random-weight models built from configs (no hub access), float64 on the
CPU. On every request the tokens equal ``model.generate(..., do_sample=False)``
on the full prompt and the logits are within 1e-6 of a cold float64 forward;
``trie.check()`` passes after every request. Skipped without the ``hf`` extra.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import random
import re
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cache import ManualCopies  # noqa: E402
from cache.integrations.transformers import (  # noqa: E402
    GenerateOutput,
    HFEngine,
    HFModel,
    UnsupportedModel,
    compare_with_cold,
    random_model,
    tiny_model,
)
from cache.integrations.transformers import adapter as adapter_module  # noqa: E402
from cache.integrations.transformers import engine as engine_module  # noqa: E402
from cache.integrations.transformers.tiny import VOCAB_SIZE  # noqa: E402
from cache.testing import EngineCapacityError  # noqa: E402

SEVEN = ("mamba2", "bamba", "jamba", "zamba2", "falcon_h1", "nemotron_h", "qwen3_next")
TOLERANCE = 1e-6
BLOCK = 8
NEW_TOKENS = 4

# Architectures of the same kind (KV and state in the cache object) that nothing in
# blocktrie names: the module must serve them unchanged.
GRANITE_HYBRID = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "shared_intermediate_size": 32,
    "mamba_n_heads": 4,
    "mamba_n_groups": 1,
    "mamba_d_state": 8,
    "mamba_d_head": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 8,
    "layer_types": ["mamba", "attention", "mamba"],
}
FALCON_MAMBA = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "state_size": 8,
    "conv_kernel": 4,
    "intermediate_size": 64,
    "time_step_rank": 4,
}


@pytest.fixture(autouse=True, scope="module")
def _quiet_single_thread() -> Generator[None, None, None]:
    """Tiny models run fastest on one thread (more only contend on a shared machine);
    transformers' notices about falling back to its PyTorch kernels are noise here."""
    threads = torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(verbosity)


_MODELS: dict[str, Any] = {}


def model_of(name: str) -> Any:
    """The tiny model ``name``, built once per test session (tests do not change it)."""
    if name not in _MODELS:
        _MODELS[name] = tiny_model(name)
    return _MODELS[name]


@dataclass
class Served:
    prompt: list[int]
    out: GenerateOutput
    max_diff: float


def draw(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def serve_and_compare(engine: HFEngine, model: Any, prompt: list[int]) -> Served:
    """One request, checked against a cold run and the trie's invariants."""
    out = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
    engine.trie.check()
    cold = compare_with_cold(model, prompt, out, NEW_TOKENS)
    assert out.tokens == cold.cold_tokens, f"tokens differ from model.generate: {cold}"
    assert out.logits.shape == (NEW_TOKENS, VOCAB_SIZE)
    assert cold.max_logit_diff <= TOLERANCE, f"max logit diff {cold.max_logit_diff:.3g}"
    return Served(prompt, out, cold.max_logit_diff)


def conversations(engine: HFEngine, model: Any, seed: int = 7) -> list[Served]:
    """A 3-turn conversation, then a 2-turn one sharing its 21-token system prompt."""
    rng = random.Random(seed)
    system = draw(rng, 21)
    served: list[Served] = []
    for turns in (3, 2):
        history = list(system)
        for _ in range(turns):
            prompt = history + draw(rng, rng.randint(3, 9))
            served.append(serve_and_compare(engine, model, prompt))
            history = prompt + served[-1].out.tokens
    return served


def check_hits(engine: HFEngine, served: list[Served]) -> None:
    """Where a later request hits, given where the engine places checkpoints."""
    first, second, third, other, other_second = served
    assert first.out.num_cached_tokens == 0
    # The next turn repeats the whole previous request: it hits at its last computed
    # position (prompt + generated tokens but the last, which never ran).
    assert second.out.num_cached_tokens == len(first.prompt) + NEW_TOKENS - 1
    assert third.out.num_cached_tokens == len(second.prompt) + NEW_TOKENS - 1
    # The second conversation shares the 21-token system prompt: it hits at the
    # deepest checkpoint inside it, the block boundary at 16.
    assert other.out.num_cached_tokens == 2 * BLOCK
    assert other_second.out.num_cached_tokens == len(other.prompt) + NEW_TOKENS - 1
    assert engine.trie.stats.hit_rate > 0


def new_engine(model: Any, **kw: Any) -> HFEngine:
    settings: dict[str, Any] = {
        "block_size": BLOCK,
        "num_blocks": 64,
        "num_checkpoint_slots": 16,
        "checkpoint_interval": 2,
    }
    settings.update(kw)
    return HFEngine(model, **settings)


@pytest.mark.parametrize("name", SEVEN)
def test_conversations_equal_cold_runs(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    model = model_of(name)
    engine = new_engine(model)
    served = conversations(engine, model)
    check_hits(engine, served)
    with capsys.disabled():
        print(f" [{name}: max logit diff {max(s.max_diff for s in served):.2g}]", end="")


@pytest.mark.parametrize(
    ("model_type", "fields"),
    [("granitemoehybrid", GRANITE_HYBRID), ("falcon_mamba", FALCON_MAMBA)],
)
def test_an_architecture_nothing_names_works_unchanged(
    model_type: str, fields: dict[str, Any]
) -> None:
    model = random_model(model_type, fields)
    engine = new_engine(model)
    check_hits(engine, conversations(engine, model))


def test_an_attention_only_model_is_served_from_kv_blocks() -> None:
    """No recurrent state: no checkpoint slots, and a hit is the longest full-block prefix."""
    model = random_model(
        "llama",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    )
    engine = new_engine(model)
    assert engine.trie.config.num_checkpoint_slots == 0 and not engine.hf.layout.states
    rng = random.Random(19)
    first = serve_and_compare(engine, model, draw(rng, 21))
    prompt = first.prompt + first.out.tokens + draw(rng, 5)
    second = serve_and_compare(engine, model, prompt)
    assert second.out.num_cached_tokens == 3 * BLOCK  # 24 of the 25 computed positions


def test_the_module_names_no_architecture() -> None:
    """No per-architecture table: no model type appears in the adapter's or engine's code
    (their docstrings and comments may tell the traps' history)."""
    auto = importlib.import_module("transformers.models.auto.configuration_auto")
    model_types = {t for t in auto.CONFIG_MAPPING_NAMES if len(t) >= 4}
    for module in (adapter_module, engine_module):
        tree = ast.parse(inspect.getsource(module))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        words: list[str] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) not in docstrings:
                    words.append(node.value.lower())
            elif isinstance(node, ast.Name):
                words.append(node.id.lower())
            elif isinstance(node, ast.Attribute):
                words.append(node.attr.lower())
        named = sorted({t for t in model_types for w in words if t in w})
        assert not named, f"{module.__name__} names architectures {named}"


def test_state_outside_the_cache_object_is_refused() -> None:
    model = random_model(
        "recurrent_gemma",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "lru_width": 32,
            "attention_window_size": 64,
            "block_types": ["recurrent", "attention", "recurrent"],
        },
    )
    with pytest.raises(UnsupportedModel, match="state lives outside the cache object"):
        HFEngine(model, block_size=BLOCK, num_blocks=16, num_checkpoint_slots=4)


def test_sliding_window_attention_is_refused() -> None:
    """A window longer than the probe: the layer's flag tells, not the positions it holds."""
    fields = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 4096,
    }
    with pytest.raises(UnsupportedModel, match="sliding window"):
        HFModel(random_model("mistral", fields))


def test_state_in_model_buffers_is_refused() -> None:
    model = tiny_model("bamba")
    model.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def count(module: Any, args: Any, kwargs: Any) -> None:
        module.seen += 1

    model.register_forward_pre_hook(count, with_kwargs=True)
    with pytest.raises(UnsupportedModel, match="buffer 'seen'"):
        HFModel(model)


def test_not_a_transformers_model_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="PreTrainedModel"):
        HFModel(torch.nn.Linear(2, 2))


def test_a_model_in_training_mode_is_refused() -> None:
    model = tiny_model("falcon_h1").train()
    with pytest.raises(ValueError, match=r"training mode .* model\.eval\(\)"):
        HFModel(model)


@pytest.mark.parametrize(
    ("name", "multi_token", "one_token_pieces"),
    [
        ("jamba", False, True),  # Mamba-1's torch scan ignores an incoming state
        ("bamba", True, False),  # a 1-token piece takes Mamba-2's decode kernel
        ("falcon_h1", True, True),
    ],
)
def test_probes_find_the_traps(name: str, multi_token: bool, one_token_pieces: bool) -> None:
    traps = HFModel(model_of(name)).traps
    assert traps.multi_token_continuation is multi_token
    if multi_token:  # with continuation broken the pieces probe measures that instead
        assert traps.one_token_pieces is one_token_pieces
    assert len(traps.notes()) == (not multi_token) + (not traps.one_token_pieces)


def test_ignoring_the_continuation_trap_breaks_cached_runs() -> None:
    """What the probe protects from: continuing a restored Mamba-1 state with a
    multi-token forward gives logits far from the cold run."""
    model = random_model("falcon_mamba", FALCON_MAMBA)
    engine = new_engine(model)
    engine.traps = dataclasses.replace(engine.traps, multi_token_continuation=True)
    rng = random.Random(3)
    first = draw(rng, 20)
    out = engine.generate(first, max_new_tokens=NEW_TOKENS)
    prompt = first + out.tokens + draw(rng, 9)
    out = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert out.num_cached_tokens > 0
    assert compare_with_cold(model, prompt, out, NEW_TOKENS).max_logit_diff > TOLERANCE


def test_position_ids_are_passed_because_bamba_gets_them_wrong_after_an_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hf = HFModel(model_of("bamba"))
    tokens = list(range(3, 19))
    reference = hf.forward(hf.new_cache(), tokens, 0)

    def continued() -> float:
        logits = hf.forward(hf._restored(tokens, 7), tokens[7:], 7)
        return float((logits - reference[7:]).abs().max())

    assert continued() <= TOLERANCE
    monkeypatch.setattr(hf, "_takes_positions", False)  # let the model pick them
    assert continued() > 100 * TOLERANCE


def test_no_one_token_prefill_piece_where_it_changes_the_numerics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = model_of("bamba")
    engine = new_engine(model, checkpoint_interval=1)
    assert not engine.traps.one_token_pieces
    calls: list[tuple[int, int]] = []
    real = engine.hf.forward

    def recording(cache: Any, tokens: list[int], start: int) -> torch.Tensor:
        calls.append((start, len(tokens)))
        return real(cache, tokens, start)

    monkeypatch.setattr(engine.hf, "forward", recording)
    rng = random.Random(5)
    prompt = draw(rng, 17)  # cuts at 8 and 16 would leave a 1-token piece at the end
    served = serve_and_compare(engine, model, prompt)
    prefill = [n for start, n in calls if start < len(prompt)]
    assert sum(prefill) == len(prompt) and min(prefill) >= 2, calls
    calls.clear()
    prompt = prompt + served.out.tokens + draw(rng, 8)  # 24 + 8: restore mid-block
    serve_and_compare(engine, model, prompt)
    prefill = [n for start, n in calls if start < len(prompt)]
    assert min(prefill) >= 2, calls


def test_kv_blocks_hold_each_position_in_the_documented_row() -> None:
    """Row ``p % B`` of block ``block_ids[p // B]``: each attention layer's keys, then
    its values, heads x head_dim, at the layer's offset."""
    model = model_of("zamba2")  # KV and state in the same cache layer
    engine = new_engine(model)
    rng = random.Random(11)
    prompt = draw(rng, 27)
    out = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
    hf = engine.hf
    cache = hf.new_cache()
    hf.forward(cache, prompt + out.tokens[:-1], 0)
    seq = engine.trie.match(prompt + out.tokens[:-1] + [0])
    try:
        assert seq.num_cached_tokens == len(prompt) + NEW_TOKENS - 1
        full = len(seq.block_ids) * BLOCK  # the matched full blocks (the tail is frozen)
        assert full == 3 * BLOCK
        assert engine.kv is not None
        for slot in hf.layout.attention:
            layer = cache.layers[slot.layer]
            keys = slot.heads * slot.key_dim
            for p in range(full):
                row = engine.kv[seq.block_ids[p // BLOCK], p % BLOCK]
                want_k = layer.keys[0, :, p].reshape(-1)
                want_v = layer.values[0, :, p].reshape(-1)
                got_k = row[slot.offset : slot.offset + keys]
                got_v = row[slot.offset + keys : slot.offset + slot.width]
                assert torch.allclose(got_k, want_k, atol=1e-12, rtol=0)
                assert torch.allclose(got_v, want_v, atol=1e-12, rtol=0)
    finally:
        engine.trie.abort(seq)
    engine.trie.check()


def test_layout_stores_every_state_in_its_promoted_dtype() -> None:
    layout = HFModel(model_of("mamba2")).layout
    dtypes = {slot.kind: slot.dtype for slot in layout.states}
    assert dtypes == {"conv": torch.float64, "recurrent": torch.float32}  # as HF keeps them
    assert layout.state_dtype == torch.float64  # each converts to it and back exactly
    assert layout.attention == () and layout.kv_block_shape(BLOCK) is None


def test_late_copies_are_waited_for() -> None:
    """With copies that finish only when completed, the engine still waits for each
    restore before reading its state and each save before overwriting it."""
    model = model_of("bamba")
    copies = ManualCopies()
    engine = new_engine(model, copies=copies)
    served = conversations(engine, model, seed=9)
    check_hits(engine, served)
    assert not copies.pending()


def test_eviction_under_memory_pressure_keeps_outputs_cold_equal() -> None:
    model = model_of("nemotron_h")
    engine = new_engine(model, num_blocks=10, num_checkpoint_slots=3)
    rng = random.Random(13)
    for _ in range(4):
        serve_and_compare(engine, model, draw(rng, rng.randint(20, 40)))
    stats = engine.trie.stats
    assert stats.evicted_blocks > 0
    queries = stats.queries
    with pytest.raises(EngineCapacityError, match="no room"):
        engine.generate(draw(rng, 10 * BLOCK + 1), max_new_tokens=2)
    assert stats.queries == queries + 1  # released: its first pieces ran and stay cached
    engine.trie.check()
    assert engine.trie.num_free_blocks + engine.trie.num_cached_blocks == 10


def test_generation_stops_at_the_end_of_sequence_token_as_generate_does() -> None:
    model = tiny_model("falcon_h1")
    prompt = draw(random.Random(17), 12)
    engine = new_engine(model)
    free_run = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
    model.generation_config.eos_token_id = free_run.tokens[1]
    engine = new_engine(model)
    out = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert out.tokens == free_run.tokens[: free_run.tokens.index(free_run.tokens[1]) + 1]
    assert out.logits.shape == (len(out.tokens), VOCAB_SIZE)
    cold = compare_with_cold(model, prompt, out, NEW_TOKENS)
    assert cold.tokens_equal and cold.max_logit_diff <= TOLERANCE


def test_bad_requests_raise_and_change_nothing() -> None:
    engine = new_engine(model_of("falcon_h1"))
    before = engine.trie.stats.queries
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([1, VOCAB_SIZE], max_new_tokens=1)
    with pytest.raises(TypeError, match="ints"):
        engine.generate([1, "2"], max_new_tokens=1)  # type: ignore[list-item]
    assert engine.trie.stats.queries == before
    out = engine.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=1)  # [1, n] accepted
    assert len(out.tokens) == 1 and out.num_cached_tokens == 0
    engine.trie.check()


def test_demo_with_a_hugging_face_model(capsys: pytest.CaptureFixture[str]) -> None:
    from cache.planner.cli import main

    code = main(["demo", "--model", "bamba"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "identical to cold runs: yes" in out
    assert "hit rate:" in out and "tokens saved:" in out


def test_the_docs_examples_run() -> None:
    """docs/transformers.md's code blocks run as written (their asserts included), and
    the hand-written engine there serves what `model.generate` would."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "transformers.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    for code in blocks:
        namespace: dict[str, Any] = {}
        exec(compile(code, "docs/transformers.md", "exec"), namespace)
    serve = namespace["serve"]
    model = namespace["model"]
    prompt = list(range(50, 80))
    generated, _ = serve(prompt, NEW_TOKENS)
    ids = torch.tensor([prompt])
    want = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt) :]
    assert generated == want.tolist()
