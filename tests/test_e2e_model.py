"""End to end: a tiny hybrid model served through the cache gives exactly the cold-run outputs.

Every request of random multi-turn chat workloads is served by `cache.testing.Engine`
(match -> restore -> allocate -> chunked prefill with saves -> commit -> decode
with append and periodic saves -> release, several requests interleaved, copies
completed late and out of order) over a deliberately tiny cache, and its logits
and generated tokens are compared with a cold run of the same prompt without
any cache: bit for bit in float64 on CPU, within a stated tolerance in float32
on CUDA.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cache import BlockTrie, ManualCopies
from cache.planner.demo import format_demo, run_demo
from cache.testing import (
    Engine,
    RequestResult,
    TinyHybridConfig,
    TinyHybridModel,
    Turn,
    compare_with_cold,
    run_chat,
)
from spec.snapshot import node_path

VOCAB = 6
CPU_MODEL = TinyHybridModel(TinyHybridConfig(vocab_size=VOCAB, seed=11))
CPU_MODELS = {
    "hybrid": CPU_MODEL,
    "ssm-first": TinyHybridModel(
        TinyHybridConfig(vocab_size=VOCAB, seed=12, layers=("ssm", "attn", "ssm"), conv_width=2)
    ),
    "attention-only": TinyHybridModel(
        TinyHybridConfig(vocab_size=VOCAB, seed=13, layers=("attn", "attn"))
    ),
}
CPU_MODEL_F32 = TinyHybridModel(TinyHybridConfig(vocab_size=VOCAB, seed=11, dtype=torch.float32))

CUDA_ATOL = 1e-4
"""float32 on CUDA: cached and cold logits agree within atol + rtol * |cold| (see below)."""
CUDA_RTOL = 1e-4

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# The `fuzz` profile (tests/conftest.py) sets its own, much larger, count.
EXAMPLES = (
    settings().max_examples
    if os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
    else (80 if CI else 150)
)


@dataclass(frozen=True)
class Scenario:
    """One end-to-end run: cache sizes, engine knobs and the chat workload."""

    block_size: int
    extra_blocks: int
    num_checkpoint_slots: int
    max_running: int
    chunk_size: int
    random_chunks: bool
    save_every_blocks: int
    save_on_finish: bool
    complete_prob: float
    manual_copies: bool
    seed: int
    conversations: tuple[tuple[Turn, ...], ...]
    namespaces: tuple[str, ...] | None = None
    """One cache namespace per conversation (None: all in the default one)."""
    abort_prob: float = 0.0
    host_blocks: int = 0
    """Blocks of the host-memory tier (0: none)."""
    write_back: bool = False
    """With a host tier and an attention-only model: `host_write="back"` ([R52])."""
    host_checkpoint_slots: int = 0
    """Host checkpoint slots, with SSM state ([R53]-[R56]; 0: none)."""

    def longest_conversation(self) -> int:
        return max(
            sum(len(user) + max_new for user, max_new in conv) for conv in self.conversations
        )


def _tokens(n_min: int, n_max: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, VOCAB - 1), min_size=n_min, max_size=n_max)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    # A shared "system prompt" makes conversations hit each other's cache.
    shared = draw(_tokens(0, 7))
    n_conv = draw(st.integers(1, 4))
    conversations = []
    for _ in range(n_conv):
        n_turns = draw(st.integers(1, 4))
        turns: list[Turn] = []
        for t in range(n_turns):
            user = draw(_tokens(1, 6))
            if t == 0:
                user = shared + user
            turns.append((tuple(user), draw(st.integers(1, 4))))
        conversations.append(tuple(turns))
    return Scenario(
        block_size=draw(st.integers(2, 4)),
        extra_blocks=draw(st.integers(1, 4)),
        num_checkpoint_slots=draw(st.integers(1, 4)),
        max_running=draw(st.integers(1, 3)),
        chunk_size=draw(st.integers(1, 7)),
        random_chunks=draw(st.booleans()),
        save_every_blocks=draw(st.integers(1, 2)),
        save_on_finish=draw(st.booleans()),
        complete_prob=draw(st.sampled_from([0.0, 0.2, 0.5, 0.8])),
        manual_copies=draw(st.sampled_from([True, True, False])),
        seed=draw(st.integers(0, 2**16)),
        conversations=tuple(conversations),
        namespaces=draw(
            st.none() | st.tuples(*[st.sampled_from(["", "tenant-b"]) for _ in conversations])
        ),
        abort_prob=draw(st.sampled_from([0.0, 0.0, 0.3])),
        host_blocks=draw(st.sampled_from([0, 0, 3, 32])),
        write_back=draw(st.booleans()),
        host_checkpoint_slots=draw(st.sampled_from([0, 0, 1, 8])),
    )


def serve(
    model: TinyHybridModel, sc: Scenario, device: str = "cpu"
) -> tuple[list[list[RequestResult]], Engine]:
    """Serve the scenario's chats through a tight cache; returns the results and the engine."""
    num_blocks = -(-sc.longest_conversation() // sc.block_size) + sc.extra_blocks
    config = model.cache_config(
        block_size=sc.block_size,
        num_blocks=num_blocks,
        # An attention-only model gets an attention-only cache.
        num_checkpoint_slots=sc.num_checkpoint_slots if model.state_shapes() else 0,
        device=device,
        num_host_blocks=sc.host_blocks,
        host_write="back" if sc.write_back and not model.state_shapes() else "through",
        num_host_checkpoint_slots=sc.host_checkpoint_slots if model.state_shapes() else 0,
    )
    copies = ManualCopies() if sc.manual_copies else None
    trie = BlockTrie(config, copies=copies)
    engine = Engine(
        model,
        trie,
        max_running=sc.max_running,
        chunk_size=sc.chunk_size,
        random_chunks=sc.random_chunks,
        save_every_blocks=sc.save_every_blocks,
        save_on_finish=sc.save_on_finish,
        copies=copies,
        complete_prob=sc.complete_prob,
        abort_prob=sc.abort_prob,
        seed=sc.seed,
        check=True,
    )
    namespaces = sc.namespaces if sc.namespaces is not None else ""
    results = run_chat(engine, [list(conv) for conv in sc.conversations], namespaces)
    return results, engine


def assert_identical_to_cold(
    model: TinyHybridModel,
    results: list[list[RequestResult]],
    atol: float = 0.0,
    rtol: float = 0.0,
) -> None:
    problems = [
        p
        for conv in results
        for r in conv
        for p in compare_with_cold(model, r, atol=atol, rtol=rtol)
    ]
    assert not problems, "\n".join(problems)


def assert_cache_returns_to_empty(engine: Engine) -> None:
    """With every request released and every copy reaped, evicting everything frees all."""
    trie = engine.trie
    engine.drain()
    trie.check()
    assert trie.stats.pins == 0
    trie.evict_checkpoints(trie.config.num_checkpoint_slots)
    while trie.evict(trie.config.num_blocks) or engine.drain():
        pass  # write-back ([R52]) frees a block once its store has finished
    trie.evict_host(trie.config.num_host_blocks)
    trie.check()
    assert trie.num_free_blocks == trie.config.num_blocks
    assert trie.num_free_checkpoint_slots == trie.config.num_checkpoint_slots
    assert trie.num_free_host_blocks == trie.config.num_host_blocks
    assert trie.num_free_host_checkpoint_slots == trie.config.num_host_checkpoint_slots


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(sc=scenarios(), kind=st.sampled_from(["hybrid", "hybrid", "ssm-first", "attention-only"]))
def test_cached_equals_cold_cpu_float64(sc: Scenario, kind: str) -> None:
    model = CPU_MODELS[kind]
    results, engine = serve(model, sc)
    _report(engine)
    assert_identical_to_cold(model, results)
    assert_cache_returns_to_empty(engine)


def test_demo_reports_identical_outputs() -> None:
    result = run_demo(0)
    assert result.identical, result.problems
    assert result.tokens_saved > 0 and 0.0 < result.hit_rate < 1.0
    text = format_demo(result)
    assert "outputs identical to cold runs: yes" in text
    assert "hit rate" in text and "tokens computed" in text and "tokens saved" in text


def _report(engine: Engine) -> None:
    """Label the example (see ``pytest --hypothesis-show-statistics``)."""
    stats = engine.trie.stats
    event(f"evicted blocks: {stats.evicted_blocks > 0}")
    event(f"evicted checkpoints: {stats.evicted_checkpoints > 0}")
    event(f"checkpoint hit: {stats.checkpoint_hits > 0}")
    event(f"partial-tail restore: {engine.partial_restores > 0}")
    event(f"late copy waited on: {engine.late_waits > 0}")
    event(f"preempted: {engine.preemptions > 0}")
    event(f"aborted a match: {engine.aborts > 0}")


def _pressure_scenario(seed: int, manual: bool = True) -> Scenario:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(6)]
    conversations = []
    for _ in range(4):
        turns: list[Turn] = [(tuple(system + [rng.randrange(VOCAB) for _ in range(3)]), 4)]
        for _ in range(2):
            turns.append((tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))), 3))
        conversations.append(tuple(turns))
    return Scenario(
        block_size=3,
        extra_blocks=2,
        num_checkpoint_slots=2,
        max_running=3,
        chunk_size=5,
        random_chunks=True,
        save_every_blocks=1,
        save_on_finish=True,
        complete_prob=0.4,
        manual_copies=manual,
        seed=seed,
        conversations=tuple(conversations),
    )


def test_memory_pressure_evicts_kv_and_checkpoints_and_still_matches_cold() -> None:
    """A fixed workload that must evict blocks and checkpoints, hit, and finish copies late."""
    sc = _pressure_scenario(seed=1)
    results, engine = serve(CPU_MODEL, sc)
    stats = engine.trie.stats
    assert stats.evicted_blocks > 0, stats
    assert stats.evicted_checkpoints > 0, stats
    assert stats.checkpoint_hits > 0, stats
    assert stats.hit_tokens > 0, stats
    assert engine.late_waits > 0, "no copy was still pending when the engine needed it"
    assert_identical_to_cold(CPU_MODEL, results)
    assert_cache_returns_to_empty(engine)


def test_preemption_recomputes_and_still_matches_cold() -> None:
    """So little memory that running requests get preempted and recomputed."""
    rng = random.Random(7)
    conversations = tuple(
        (
            (tuple(rng.randrange(VOCAB) for _ in range(10)), 4),
            (tuple(rng.randrange(VOCAB) for _ in range(3)), 3),
        )
        for _ in range(3)
    )
    sc = Scenario(
        block_size=2,
        extra_blocks=1,
        num_checkpoint_slots=2,
        max_running=3,
        chunk_size=3,
        random_chunks=False,
        save_every_blocks=1,
        save_on_finish=True,
        complete_prob=0.3,
        manual_copies=True,
        seed=3,
        conversations=conversations,
    )
    results, engine = serve(CPU_MODEL, sc)
    assert engine.preemptions > 0
    assert_identical_to_cold(CPU_MODEL, results)
    assert_cache_returns_to_empty(engine)


@pytest.mark.parametrize("host_write", ["through", "back"])
@pytest.mark.parametrize("manual", [False, True])
def test_host_tier_round_trip_is_bit_identical_and_outputs_match_cold(
    manual: bool, host_write: str
) -> None:
    """A device too small for the chats: evicted KV goes to the host tier and comes
    back on a hit. Every loaded block equals, bit for bit, what was computed, and
    every output equals a cold run."""
    model = CPU_MODELS["attention-only"]
    rng = random.Random(5)
    system = [rng.randrange(VOCAB) for _ in range(9)]
    chats = [
        [((*system, *(rng.randrange(VOCAB) for _ in range(4))), 3), ((1, 2, 3), 2)]
        for _ in range(4)
    ]
    config = model.cache_config(
        block_size=2,
        num_blocks=24,
        num_checkpoint_slots=0,
        num_host_blocks=256,
        host_write=host_write,
    )
    copies = ManualCopies() if manual else None
    trie = BlockTrie(config, copies=copies)
    engine = Engine(
        model, trie, max_running=2, chunk_size=3, copies=copies, complete_prob=0.5, seed=1,
        check=True,
    )  # fmt: skip
    first = run_chat(engine, chats)
    engine.drain()
    kv, host = trie.kv_cache, trie.host_cache
    assert kv is not None and host is not None
    snap = trie.snapshot()
    computed = {  # every cached block (by its prefix): its KV as computed, or as stored
        node_path(snap, nid): (
            kv[n["block"]] if n["block"] is not None else host[n["block_host"]]
        ).clone()
        for nid, n in snap["nodes"].items()
        if n["parent"] is not None
    }
    for n in snap["nodes"].values():
        if n["block"] is not None and n["block_host"] is not None and n["residency"] == "mirrored":
            assert torch.equal(host[n["block_host"]], kv[n["block"]]), "a store changed the KV"
    while trie.evict(trie.config.num_blocks) or engine.drain():
        pass  # write-back frees a block once its store finished: evict, finish, again
    assert trie.num_cached_blocks == 0
    snap = trie.snapshot()
    for nid, n in snap["nodes"].items():  # every stored block: bit for bit
        if n["block_host"] is not None:
            assert torch.equal(host[n["block_host"]], computed[node_path(snap, nid)])
    second = run_chat(engine, chats)  # served from the host tier
    engine.drain()
    stats = trie.stats
    assert stats.host_hit_tokens > 0 and stats.loaded_blocks > 0 and engine.loads > 0, stats
    snap = trie.snapshot()
    for nid, n in snap["nodes"].items():
        if n["block"] is not None and node_path(snap, nid) in computed:
            assert torch.equal(kv[n["block"]], computed[node_path(snap, nid)]), "a loaded block"
    assert [r.generated for c in first for r in c] == [r.generated for c in second for r in c]
    assert_identical_to_cold(model, first + second)
    assert_cache_returns_to_empty(engine)


@pytest.mark.parametrize("manual", [False, True])
def test_host_checkpoints_restore_offloaded_state_and_outputs_match_cold(manual: bool) -> None:
    """One device checkpoint slot for many chats: each save pushes the previous
    checkpoint to its host slot ([R54]); the second round restores those from the
    host ([R56]). Every output equals a cold run, and the host slots serve hits a
    device-only cache of the same size cannot."""
    model = CPU_MODELS["hybrid"]
    rng = random.Random(11)
    chats = [[(tuple(rng.randrange(VOCAB) for _ in range(9)), 2), ((1, 2, 3), 2)] for _ in range(4)]

    def serve_twice(host_slots: int) -> tuple[BlockTrie, list[list[RequestResult]]]:
        config = model.cache_config(
            block_size=2, num_blocks=96, num_checkpoint_slots=1,
            num_host_checkpoint_slots=host_slots,
        )  # fmt: skip
        copies = ManualCopies() if manual else None
        trie = BlockTrie(config, copies=copies)
        engine = Engine(
            model, trie, max_running=1, chunk_size=4, copies=copies, complete_prob=0.5, seed=3,
            check=True,
        )  # fmt: skip
        results = run_chat(engine, chats) + run_chat(engine, chats)
        assert_identical_to_cold(model, results)
        assert_cache_returns_to_empty(engine)
        return trie, results

    device_only, cold_results = serve_twice(0)
    with_host, results = serve_twice(16)
    stats = with_host.stats
    assert stats.checkpoints_stored > 0 and stats.checkpoints_offloaded > 0, stats
    assert stats.hit_tokens > device_only.stats.hit_tokens, (stats, device_only.stats)
    assert [r.generated for c in results for r in c] == [
        r.generated for c in cold_results for r in c
    ]


def test_second_identical_chat_is_served_from_cache() -> None:
    """Replaying a finished chat hits the checkpoints it left: fewer tokens computed."""
    model = CPU_MODEL
    config = model.cache_config(block_size=4, num_blocks=64, num_checkpoint_slots=16)
    trie = BlockTrie(config)
    engine = Engine(model, trie, max_running=2, chunk_size=4)
    chat: list[Turn] = [((1, 2, 3, 4, 5, 0, 1, 2, 3), 3), ((4, 5), 3)]
    first = run_chat(engine, [chat])
    computed_first = engine.tokens_computed
    second = run_chat(engine, [chat])
    computed_second = engine.tokens_computed - computed_first
    assert [r.generated for r in first[0]] == [r.generated for r in second[0]]
    assert computed_second < computed_first
    assert all(r.num_cached_tokens > 0 for r in second[0])
    assert_identical_to_cold(model, first + second)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_cached_equals_cold_cpu_float32_with_tolerance(sc: Scenario) -> None:
    """The tolerance path of the CUDA variant, exercised on CPU (float32)."""
    results, engine = serve(CPU_MODEL_F32, sc)
    assert_identical_to_cold(CPU_MODEL_F32, results, atol=CUDA_ATOL, rtol=CUDA_RTOL)
    assert_cache_returns_to_empty(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("manual", [False, True], ids=["device-copies", "manual-copies"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_cached_equals_cold_cuda_float32(manual: bool, sc: Scenario) -> None:
    """The same property on the GPU in float32.

    Tolerance: every logits row within ``atol=1e-4, rtol=1e-4`` of the cold
    run's; a generated token may differ only at a near tie of the cold run's
    top two logits (within the same tolerance), after which the two runs
    follow different tokens and are not compared further. With
    ``manual=False`` the copies are real side-stream copies ordered by events.
    """
    model = TinyHybridModel(
        TinyHybridConfig(vocab_size=VOCAB, seed=11, dtype=torch.float32, device="cuda")
    )
    sc = replace(sc, manual_copies=manual)
    results, engine = serve(model, sc, device="cuda")
    torch.cuda.synchronize()
    assert_identical_to_cold(model, results, atol=CUDA_ATOL, rtol=CUDA_RTOL)
    assert_cache_returns_to_empty(engine)
