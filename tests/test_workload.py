"""Workload generators, trace loaders, the independent hit counter and the replay loop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import default_traces_dir
from cache.planner.policy import CheckpointPolicy
from cache.planner.replay import run_replay
from cache.planner.traces import (
    TraceError,
    detect_trace_format,
    load_mooncake,
    load_token_jsonl,
    load_trace,
)
from cache.planner.workload import (
    PrefixCount,
    Request,
    SyntheticParams,
    Workload,
    count_prefix_hits,
    synthetic_workload,
)

FIXTURES = Path(__file__).parent / "fixtures"
MOONCAKE = FIXTURES / "mooncake_small.jsonl"
TOKENS = FIXTURES / "tokens_small.jsonl"
SHARED_TRACES = default_traces_dir()
SMALL = SyntheticParams(
    users=8,
    turns=3,
    system_tokens=96,
    user_tokens=24,
    output_tokens=20,
    tool_result_tokens=40,
    tool_call_tokens=8,
    seed=5,
)


def naive_hits(workload: Workload[Any], block_size: int) -> tuple[int, int]:
    """Hit tokens and prompt tokens of an infinite cache, by brute force over prefixes."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    hits = total = 0
    b = block_size
    for req in workload:
        total += len(req.prompt)
        k = 0
        while (k + 1) * b <= len(req.prompt) - 1 and (
            req.namespace,
            tuple(req.prompt[: (k + 1) * b]),
        ) in seen:
            k += 1
        hits += k * b
        full = list(req.prompt) + list(req.output)
        for i in range(1, len(full) // b + 1):
            seen.add((req.namespace, tuple(full[: i * b])))
    return hits, total


# ---------------------------------------------------------------- synthetic


def test_synthetic_is_seeded_and_shaped() -> None:
    a = [(r.prompt, r.output) for r in synthetic_workload(SMALL)]
    b = [(r.prompt, r.output) for r in synthetic_workload(SMALL)]
    assert a == b
    other = SyntheticParams(**{**SMALL.__dict__, "seed": 6})
    assert [(r.prompt, r.output) for r in synthetic_workload(other)] != a
    w = synthetic_workload(SMALL)
    assert len(w) == len(a) >= SMALL.users * SMALL.turns
    assert w.prompt_tokens == sum(len(p) for p, _ in a)
    assert w.output_tokens == sum(len(o) for _, o in a)
    # Every later request of a session extends an earlier prompt + output.
    extends = 0
    for i, (p, _o) in enumerate(a):
        for q, o2 in a[:i]:
            if p[: len(q) + len(o2)] == [*q, *o2] and len(p) > len(q) + len(o2):
                extends += 1
                break
    assert extends >= len(a) - SMALL.users
    # Requests share system prompts across sessions.
    firsts = {tuple(p[:32]) for p, _ in a}
    assert len(firsts) <= SMALL.system_prompts


def test_synthetic_agentic_shape() -> None:
    chat = synthetic_workload(SyntheticParams(**{**SMALL.__dict__, "agentic": 0.0}))
    agent = synthetic_workload(SyntheticParams(**{**SMALL.__dict__, "agentic": 1.0}))
    assert len(chat) == SMALL.users * SMALL.turns
    assert len(agent) == SMALL.users * SMALL.turns * (SMALL.tool_calls + 1)


@pytest.mark.parametrize(
    "field,value",
    [("users", 0), ("turns", -1), ("agentic", 1.5), ("vocab", 1), ("system_tokens", -3)],
)
def test_synthetic_params_validated(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SyntheticParams(**{field: value})


# ---------------------------------------------------------------- mooncake


def test_mooncake_tokens_follow_hash_ids() -> None:
    w = load_mooncake(MOONCAKE, block_tokens=16)
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines() if line.strip()]
    reqs = list(w)
    assert len(w) == len(rows) == len(reqs)
    assert w.prompt_tokens == sum(r["input_length"] for r in rows)
    max_prompt = max(max(r.prompt) for r in reqs)
    for row, req in zip(rows, reqs, strict=True):
        assert len(req.prompt) == row["input_length"]
        assert len(req.output) == row["output_length"]
        assert all(t > max_prompt for t in req.output)
    outs = [set(r.output) for r in reqs if r.output]
    assert all(not (x & y) for i, x in enumerate(outs) for y in outs[i + 1 :])

    # Token prefixes are shared exactly as far as hash-id prefixes are.
    def common(x: list[int], y: list[int]) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    pairs = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            ids_a, ids_b = rows[i]["hash_ids"], rows[j]["hash_ids"]
            a, b = reqs[i].prompt, reqs[j].prompt
            c = common(ids_a, ids_b)
            if c < min(len(ids_a), len(ids_b)):
                assert common(a, b) == c * 16
            else:
                assert common(a, b) == min(len(a), len(b))
            pairs += c > 0
    assert pairs > 0


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = '{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [0, 1]}\n'


@pytest.mark.parametrize(
    "line,reason",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 20, "output_length": 2}', "missing field 'hash_ids'"),
        ('{"output_length": 2, "hash_ids": [0, 1]}', "missing field 'input_length'"),
        (
            '{"input_length": 20, "output_length": -1, "hash_ids": [0, 1]}',
            "'output_length' must be >= 0",
        ),
        ('{"input_length": "20", "output_length": 2, "hash_ids": [0, 1]}', "must be an integer"),
        ('{"input_length": 20, "output_length": 2, "hash_ids": [0, "x"]}', "hash_ids[1]"),
        ('{"input_length": 20, "output_length": 2, "hash_ids": []}', "hash_ids is empty"),
        (
            '{"input_length": 40, "output_length": 2, "hash_ids": [0, 1]}',
            "expected ceil(40/16) = 3",
        ),
        (
            '{"timestamp": "x", "input_length": 20, "output_length": 2, "hash_ids": [0, 1]}',
            "timestamp",
        ),
    ],
)
def test_mooncake_malformed_line_names_file_and_line(
    tmp_path: Path, line: str, reason: str
) -> None:
    path = write(tmp_path, "bad.jsonl", GOOD + "\n" + GOOD + line + "\n" + GOOD)
    with pytest.raises(TraceError) as info:
        load_mooncake(path, block_tokens=16)
    assert str(info.value).startswith(f"{path}:4: ")
    assert reason in str(info.value)
    assert info.value.line == 4 and info.value.path == str(path)


def test_missing_and_empty_trace(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TraceError, match=f"{missing}: no such trace file"):
        load_trace(missing)
    empty = write(tmp_path, "empty.jsonl", "\n\n")
    with pytest.raises(TraceError, match="no requests"):
        load_mooncake(empty)
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(GOOD.encode() + b"\xff\xfe\n")
    with pytest.raises(TraceError, match=r":2: not UTF-8"):
        load_mooncake(binary, block_tokens=16)


# ---------------------------------------------------------------- token jsonl


def test_token_jsonl_formats() -> None:
    w = load_token_jsonl(TOKENS)
    rows = [json.loads(line) for line in TOKENS.read_text().splitlines() if line.strip()]
    reqs = list(w)
    assert len(reqs) == len(rows) == 16
    for row, req in zip(rows, reqs, strict=True):
        if isinstance(row, list):
            assert req.prompt == row and req.output == [] and req.namespace == ""
        else:
            assert req.prompt == row["tokens"]
            assert req.namespace == row.get("namespace", "")
            if "output" in row:
                assert req.output == row["output"]
            else:
                assert len(req.output) == row["output_length"]
    assert detect_trace_format(TOKENS) == "tokens"
    assert detect_trace_format(MOONCAKE) == "mooncake"
    assert len(load_trace(TOKENS)) == 16


@pytest.mark.parametrize(
    "line,reason",
    [
        ('"hello"', "expected a list of token ids or an object"),
        ("[1, -2]", "[1] must be an integer in [0, 2**63)"),
        ("[]", "is empty"),
        ("[1, true]", "[1] must be an integer"),
        ('{"output": [1]}', "missing field 'tokens'"),
        ('{"tokens": [1], "namespace": 3}', "'namespace' must be a string"),
        ('{"tokens": [1], "output": "x"}', "'output' must be a list"),
    ],
)
def test_token_jsonl_malformed(tmp_path: Path, line: str, reason: str) -> None:
    path = write(tmp_path, "t.jsonl", "[1, 2, 3]\n" + line + "\n")
    with pytest.raises(TraceError) as info:
        load_token_jsonl(path)
    assert str(info.value).startswith(f"{path}:2: ") and reason in str(info.value)


# ---------------------------------------------------------------- counting


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_prefix_count_matches_brute_force(block_size: int) -> None:
    for w in (load_mooncake(MOONCAKE, 16), load_token_jsonl(TOKENS), synthetic_workload(SMALL)):
        count = count_prefix_hits(w, block_size)
        assert isinstance(count, PrefixCount)
        assert (count.hit_tokens, count.prompt_tokens) == naive_hits(w, block_size)
        assert count.requests == len(w)


def test_prefix_count_handles_namespaces() -> None:
    reqs = [
        Request([1, 2, 3, 4, 5], [], "a"),
        Request([1, 2, 3, 4, 5], [], "b"),
        Request([1, 2, 3, 4, 5, 6], [], "a"),
    ]
    w: Workload[Request] = Workload("ns", reqs, lambda _i, r: r, [5, 5, 6], [0, 0, 0])
    assert count_prefix_hits(w, 2).hit_tokens == 4  # only the third request hits (2 blocks)


def test_prefix_count_with_ids_past_32_bits_matches_brute_force() -> None:
    big = 1 << 40
    prompts = [[1, 2, 3, 4, 5], [1, 2, big, 4, 5, 6], [1, 2, big, 4, 7], [1, 2, 3, 4, 5, 6], [9]]
    reqs = [Request(p, [8, big + 1, 8], "") for p in prompts]
    w: Workload[Request] = Workload(
        "wide", reqs, lambda _i, r: r, [len(p) for p in prompts], [0] * len(prompts)
    )
    for block_size in (1, 2, 3):
        count = count_prefix_hits(w, block_size)
        assert (count.hit_tokens, count.prompt_tokens) == naive_hits(w, block_size)
        assert count.hit_tokens > 0


# ---------------------------------------------------------------- replay


def unbounded(count: PrefixCount, concurrency: int) -> int:
    return count.unique_blocks + (concurrency + 1) * (count.max_request_blocks + 1)


@pytest.mark.parametrize("block_size", [4, 16])
def test_infinite_capacity_replay_equals_independent_count(block_size: int) -> None:
    for w in (load_mooncake(MOONCAKE, 16), load_token_jsonl(TOKENS), synthetic_workload(SMALL)):
        count = count_prefix_hits(w, block_size)
        result = run_replay(
            w, block_size=block_size, capacity=unbounded(count, 4), concurrency=4, check=True
        )
        assert result.hit_tokens == count.hit_tokens
        assert result.prompt_tokens == count.prompt_tokens
        assert result.hit_rate == pytest.approx(count.hit_rate)
        assert result.evicted_blocks == 0 and result.rejected == 0
        assert result.peak_cached_blocks == count.unique_blocks


def test_decode_cap_counts_the_same_both_ways() -> None:
    w = synthetic_workload(SMALL)
    count = count_prefix_hits(w, 8, max_decode_tokens=5)
    result = run_replay(
        w, block_size=8, capacity=unbounded(count, 2), concurrency=2, max_decode_tokens=5
    )
    assert result.hit_tokens == count.hit_tokens
    assert count.hit_tokens < count_prefix_hits(w, 8).hit_tokens


def test_small_capacity_evicts_and_rejects() -> None:
    w = synthetic_workload(SMALL)
    full = run_replay(w, block_size=8, capacity=100_000, concurrency=4)
    small = run_replay(w, block_size=8, capacity=140, concurrency=4, check=True)
    assert small.evicted_blocks > 0
    assert small.hit_rate < full.hit_rate
    assert small.peak_used_blocks <= 140
    tiny = run_replay(w, block_size=8, capacity=20, concurrency=4, check=True)
    assert tiny.rejected > 0 and tiny.requests == len(w)
    assert tiny.prompt_tokens == w.prompt_tokens


# ---------------------------------------------------------------- policies


def test_policy_steps() -> None:
    p = CheckpointPolicy.parse("every-block")
    assert p.prefill_steps(40, 8, 16, 8) == [16, 24, 32, 40]
    assert CheckpointPolicy.parse("every-n", interval=12).prefill_steps(40, 8, 0, 8) == [12, 24, 36]
    assert CheckpointPolicy.parse("chunk-boundaries", chunk=10).prefill_steps(35, 3, 0, 8) == [
        13,
        23,
        33,
        35,
    ]
    assert CheckpointPolicy.parse("prompt-end").prefill_steps(45, 8, 0, 8) == [40]
    assert CheckpointPolicy.parse("branch-points").prefill_steps(45, 8, 24, 8) == [24]
    assert CheckpointPolicy.parse("branch-points").prefill_steps(45, 24, 24, 8) == []
    combo = CheckpointPolicy.parse("branch-points+prompt-end+decode-end")
    assert combo.prefill_steps(45, 0, 24, 8) == [24, 40] and combo.decode_end
    assert combo.name == "branch-points+prompt-end+decode-end"
    with pytest.raises(ValueError, match="unknown checkpoint placement"):
        CheckpointPolicy.parse("sometimes")


def test_ssm_every_block_equals_kv_without_decode() -> None:
    """With a checkpoint at every prompt block and room for all, SSM hits what KV hits."""
    w = synthetic_workload(SMALL)
    count = count_prefix_hits(w, 8, max_decode_tokens=0)
    cap = unbounded(count, 4)
    ssm = run_replay(
        w,
        block_size=8,
        capacity=cap,
        concurrency=4,
        max_decode_tokens=0,
        policy=CheckpointPolicy.parse("every-block"),
        state_slots=cap,
        check=True,
    )
    assert ssm.hit_tokens == count.hit_tokens
    assert ssm.checkpoint_hits > 0


def test_ssm_policies_never_beat_kv_when_block_aligned() -> None:
    w = synthetic_workload(SMALL)
    kv = run_replay(w, block_size=8, capacity=100_000, concurrency=4)
    rates = {}
    for spec in (
        "prompt-end",
        "branch-points+prompt-end",
        "branch-points+prompt-end+decode-end+every-n",
    ):
        r = run_replay(
            w,
            block_size=8,
            capacity=100_000,
            concurrency=4,
            policy=CheckpointPolicy.parse(spec, interval=64),
            state_slots=100_000 // 8,
        )
        assert r.hit_tokens <= kv.hit_tokens
        rates[spec] = r.hit_rate
    assert rates["prompt-end"] < rates["branch-points+prompt-end+decode-end+every-n"]


def test_ssm_small_budget_with_partial_checkpoints() -> None:
    w = synthetic_workload(SMALL)
    r = run_replay(
        w,
        block_size=8,
        capacity=300,
        concurrency=4,
        policy=CheckpointPolicy.parse("chunk-boundaries+branch-points", chunk=20),
        state_slots=4,
        check=True,
    )
    assert r.checkpoints_saved > 0 and r.evicted_checkpoints > 0
    assert r.state_slots == 4


@pytest.mark.skipif(
    not (SHARED_TRACES / "conversation_trace.jsonl").exists(), reason="shared traces absent"
)
def test_real_mooncake_trace_loads() -> None:
    w = load_mooncake(SHARED_TRACES / "conversation_trace.jsonl")
    assert len(w) == 12031
    first = w[0]
    assert len(first.prompt) == 6758 and len(first.output) == 500


# ---------------------------------------------------------------- bailian

BAILIAN = FIXTURES / "bailian_small.jsonl"


def test_bailian_trace_loads_with_conversation_branch_points() -> None:
    assert detect_trace_format(BAILIAN) == "bailian"
    w = load_trace(BAILIAN)  # 16 tokens per hash id by default
    rows = [json.loads(line) for line in BAILIAN.read_text().splitlines() if line.strip()]
    reqs = list(w)
    assert len(reqs) == len(rows) == 24
    by_chat = {r["chat_id"]: r for r in rows}
    for row, req in zip(rows, reqs, strict=True):
        assert len(req.prompt) == row["input_length"] and len(req.output) == row["output_length"]
        parent = by_chat.get(row["parent_chat_id"])
        if parent is None:
            assert req.branch_steps == ()
            continue
        shared = 0
        while parent["hash_ids"][shared] == row["hash_ids"][shared]:
            shared += 1
        assert req.branch_steps == (shared * 16,)
        assert req.prompt[: shared * 16] == reqs[rows.index(parent)].prompt[: shared * 16]
    # Siblings (two turns answering the same parent) fork at the same step.
    first, second = reqs[1], reqs[2]
    assert first.branch_steps == second.branch_steps == (144,)
    count = count_prefix_hits(w, 16)
    assert count.requests == 24 and count.hit_tokens > 0


def test_branch_points_placement_uses_known_branches() -> None:
    policy = CheckpointPolicy.parse("branch-points")
    assert policy.prefill_steps(200, 16, 32, 16) == [32]
    assert sorted(policy.plan(200, 16, 32, 16, (144,))) == [32, 144]
    assert sorted(policy.plan(200, 160, 32, 16, (144,))) == []  # already computed


@pytest.mark.parametrize(
    "line,reason",
    [
        (
            '{"chat_id": 0, "parent_chat_id": -1, "turn": 1, "type": "text", "timestamp": 0,'
            ' "input_length": 20, "output_length": 1, "hash_ids": [1]}',
            "1 hash_ids for input_length 20",
        ),
        (
            '{"chat_id": -3, "parent_chat_id": -1, "turn": 1, "type": "text", "timestamp": 0,'
            ' "input_length": 16, "output_length": 1, "hash_ids": [1]}',
            "'chat_id' must be >= 0",
        ),
        (
            '{"chat_id": 0, "parent_chat_id": -1, "turn": 1, "type": 5, "timestamp": 0,'
            ' "input_length": 16, "output_length": 1, "hash_ids": [1]}',
            "'type' must be a string",
        ),
        (
            '{"chat_id": 0, "parent_chat_id": -1, "turn": 1, "type": "t", "timestamp": 0,'
            ' "input_length": 16, "output_length": 1, "hash_ids": [18446744073709551616]}',
            "[0, 2**63)",
        ),
    ],
)
def test_bailian_bad_lines_name_the_line(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(BAILIAN.read_text().splitlines()[0] + "\n" + line + "\n")
    if 'chat_id": 0' in line:
        path.write_text(line + "\n")
        where = f"{path}:1:"
    else:
        where = f"{path}:2:"
    with pytest.raises(TraceError) as info:
        load_trace(path, "bailian")
    assert where in str(info.value) and reason in str(info.value)


def test_duplicate_chat_id_and_deep_json(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    first = BAILIAN.read_text().splitlines()[0]
    path.write_text(first + "\n" + first + "\n")
    with pytest.raises(TraceError, match=r":2: chat_id 0 appears twice"):
        load_trace(path)
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(TraceError, match=r":1: JSON nested too deeply"):
        load_trace(deep, "tokens")
