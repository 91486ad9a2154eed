"""The `blocktrie` command line: replay on the built-in workload and on trace fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cache.planner.cli import main
from cache.planner.traces import load_mooncake
from cache.planner.workload import SyntheticParams, count_prefix_hits, synthetic_workload
from tests.helpers import SMALL_WORKLOAD, run_cli

FIXTURES = Path(__file__).parent / "fixtures"
MOONCAKE = FIXTURES / "mooncake_small.jsonl"
TOKENS = FIXTURES / "tokens_small.jsonl"
SMALL = SMALL_WORKLOAD
REQUIRED = ("requests", "prompt_tokens", "hit_tokens", "hit_rate", "evicted_blocks")


run = run_cli


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)  # exactly one JSON object, nothing else
    assert err == ""
    return doc


def test_builtin_workload_json(capsys: pytest.CaptureFixture[str]) -> None:
    top = run_json(capsys, "replay", *SMALL)
    assert top["schema"] == 1 and len(top["runs"]) == 1
    doc = top["runs"][0]
    for key in REQUIRED:
        assert key in doc
    w = synthetic_workload(
        SyntheticParams(
            users=6,
            turns=2,
            system_tokens=64,
            user_tokens=16,
            output_tokens=12,
            tool_result_tokens=24,
        )
    )
    assert doc["requests"] == len(w)
    assert doc["prompt_tokens"] == w.prompt_tokens
    assert doc["hit_rate"] == pytest.approx(doc["hit_tokens"] / doc["prompt_tokens"])
    assert doc["hit_tokens"] == count_prefix_hits(w, 16).hit_tokens  # unbounded by default
    assert doc["evicted_blocks"] == 0 and doc["policy"] == "kv" and doc["never_evicts"]
    assert doc["capacity"] == top["workload"]["never_evict_blocks"]


def test_builtin_workload_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "replay", *SMALL, "--capacity", "64")
    assert code == 0, err
    for word in (
        "requests",
        "prompt tokens",
        "hit rate",
        "tokens saved",
        "evictions",
        "peak pins",
        "throughput",
    ):
        assert word in out
    assert err == ""  # no progress bar when stderr is not a terminal


def test_trace_fixture_infinite_capacity_matches_count(capsys: pytest.CaptureFixture[str]) -> None:
    top = run_json(
        capsys,
        "replay",
        "--trace",
        str(MOONCAKE),
        "--trace-block-tokens",
        "16",
        "--block-size",
        "4",
    )
    doc = top["runs"][0]
    count = count_prefix_hits(load_mooncake(MOONCAKE, 16), 4)
    assert doc["requests"] == count.requests == 27
    assert doc["hit_tokens"] == count.hit_tokens > 0
    assert doc["hit_rate"] == pytest.approx(count.hit_rate)
    assert top["workload"]["unbounded_hit_rate"] == pytest.approx(count.hit_rate)
    assert top["workload"]["format"] == "mooncake"
    top = run_json(capsys, "replay", "--trace", str(TOKENS), "--block-size", "4", "--check")
    assert top["runs"][0]["requests"] == 16 and top["runs"][0]["hit_tokens"] > 0


def test_sweep_with_ssm_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "sweep.png"
    doc = run_json(
        capsys,
        "replay",
        "--trace",
        str(MOONCAKE),
        "--trace-block-tokens",
        "16",
        "--block-size",
        "4",
        "--sweep",
        "20,40,400",
        "--ssm",
        "--ckpt-policy",
        "prompt-end,branch-points+prompt-end",
        "--sweep-blocks-per-slot",
        "4,8",
        "--plot",
        str(plot),
        "--concurrency",
        "2",
    )
    runs = doc["runs"]
    assert len(runs) == 3 * (1 + 2 * 2)
    assert {r["capacity"] for r in runs} == {20, 40, 400}
    assert {r["policy"] for r in runs} == {"kv", "prompt-end", "branch-points+prompt-end"}
    for r in runs:
        assert r["state_slots"] == (
            0 if r["policy"] == "kv" else r["capacity"] // r["blocks_per_slot"]
        )
        assert (r["hit_rate_vs_kv"] is None) == (r["policy"] == "kv")
    kv = [r for r in runs if r["policy"] == "kv"]
    assert kv[0]["hit_rate"] <= kv[-1]["hit_rate"]
    assert doc["recommended"]["among"] == "ssm"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.png"]  # no temp file left


def test_sweep_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "replay",
        *SMALL,
        "--sweep",
        "30,60,2k",
        "--ssm",
        "--kv-bytes-per-token",
        "131072",
        "--state-bytes-per-slot",
        "1048576",
    )
    assert code == 0, err
    assert "vs KV" in out and "ckpt hits" in out and "MiB" in out
    assert "capacity" in out


def test_malformed_trace_names_line_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.jsonl"
    lines = MOONCAKE.read_text().splitlines()
    lines.insert(
        5, '{"timestamp": 1, "input_length": 20, "output_length": 1, "hash_ids": [0, "x"]}'
    )
    bad.write_text("\n".join(lines) + "\n")
    plot = tmp_path / "out.png"
    code, out, err = run(
        capsys,
        "replay",
        "--trace",
        str(bad),
        "--trace-block-tokens",
        "16",
        "--plot",
        str(plot),
        "--sweep",
        "10,20",
        "--json",
    )
    assert code == 2
    assert out == ""
    assert f"{bad}:6:" in err and "hash_ids[1]" in err
    assert not plot.exists()


def test_missing_trace_and_bad_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    code, out, err = run(capsys, "replay", "--trace", str(missing))
    assert code == 2 and out == "" and f"{missing}: no such trace file" in err
    code, _out, err = run(
        capsys, "replay", "--plot", str(tmp_path / "nodir" / "p.png"), "--sweep", "1k,2k", *SMALL
    )
    assert code == 2 and "does not exist" in err
    code, _out, err = run(capsys, "replay", "--state-slots", "4")
    assert code == 2 and "--ssm" in err
    for argv in (
        ["replay", "--sweep", "1,x"],
        ["replay", "--capacity", "0"],
        ["replay", "--ssm", "--ckpt-policy", "nope"],
        ["replay", "--agentic", "2"],
        [],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        capsys.readouterr()


def test_console_script_module(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cache.planner.cli", "replay", *SMALL, "--json", "--progress"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["runs"][0]["requests"] > 0
    assert proc.stderr == ""  # --json never shows progress


def test_progress_bar_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    code, out, err = run(capsys, "replay", *SMALL, "--progress")
    assert code == 0 and "hit rate" in out
    assert "counting" in err and "replaying" in err  # tqdm wrote each phase to stderr


def test_demo_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("cache.planner.demo")
    code, out, _err = run(capsys, "demo")
    assert code == 0 and out.strip()
    assert "outputs identical to cold runs: yes" in out


def test_demo_fails_when_outputs_differ(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    import cache.planner.demo

    real = cache.planner.demo.run_demo

    def differing(seed: int = 0) -> cache.planner.demo.DemoResult:
        return dataclasses.replace(real(seed), identical=False)

    monkeypatch.setattr(cache.planner.demo, "run_demo", differing)
    code, out, _err = run(capsys, "demo")
    assert code == 1 and "outputs identical to cold runs: no" in out


@pytest.mark.parametrize(
    "params",
    [
        SyntheticParams(users=200),
        SyntheticParams(users=200, turns=10),
        SyntheticParams(users=200, agentic=0.0),
        SyntheticParams(users=100, agentic=1.0, system_tokens=3000),
    ],
)
def test_estimate_predicts_the_workload_it_refuses(params: SyntheticParams) -> None:
    """The up-front estimate (issue 43) from the parameters alone agrees with the workload
    they generate (means: within 25 %), and bounds its distinct blocks from above."""
    from cache.planner.resources import synthetic_shape, trace_shape

    predicted = synthetic_shape(params, 16)
    workload = synthetic_workload(params)
    actual = trace_shape(workload, 16)
    for field in ("requests", "prompt_tokens", "decode_tokens", "longest_tokens"):
        ratio = getattr(predicted, field) / getattr(actual, field)
        assert 0.75 <= ratio <= 1.25, (field, ratio)
    distinct = count_prefix_hits(workload, 16).unique_blocks
    assert distinct <= predicted.distinct_blocks <= 1.25 * distinct
    assert distinct <= actual.distinct_blocks


def test_available_memory_is_found() -> None:
    from cache.planner.resources import available_memory

    found = available_memory()
    assert found is not None  # Linux: /proc/meminfo
    assert found[0] > 0 and found[1]
