"""Every defect of issue 11 as a CLI test: exit code, one clear line on stderr, no
traceback, nothing half-written; and the machine interface (JSON schema, CSV)."""

from __future__ import annotations

import csv
import io
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cache.planner import cli
from cache.planner.cli import main
from cache.planner.report import RUN_KEYS, TIMING_KEYS, WORKLOAD_KEYS, render_text
from tests.helpers import SMALL_WORKLOAD, run_cli, run_cli_process

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
MOONCAKE = FIXTURES / "mooncake_small.jsonl"
TOKENS = FIXTURES / "tokens_small.jsonl"
BAILIAN = FIXTURES / "bailian_small.jsonl"
SMALL = SMALL_WORKLOAD


run = run_cli


def assert_error(code: int, out: str, err: str, expect: int, *words: str) -> None:
    assert code == expect, err
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err  # one line
    assert "Traceback" not in err and "error" in err
    for word in words:
        assert word in err, err


# ---------------------------------------------------------------- defect 2


@pytest.mark.parametrize("target", ["DIR", "", "/proc/x.png", "MISSING/x.png"])
def test_bad_plot_path_fails_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str, monkeypatch: Any
) -> None:
    path = target.replace("DIR", str(tmp_path)).replace("MISSING", str(tmp_path / "nope"))
    called: list[int] = []
    monkeypatch.setattr(cli, "run_all", lambda *a, **k: called.append(1))
    code, out, err = run(capsys, "replay", *SMALL, "--sweep", "1k,2k", "--plot", path)
    assert_error(code, out, err, 2, "--plot")
    assert not called  # checked before any replay
    assert list(tmp_path.iterdir()) == []


def test_plot_failing_after_the_run_keeps_the_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: Any
) -> None:
    pytest.importorskip("matplotlib")

    def broken(path: str, doc: dict[str, Any]) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli, "write_plot", broken)
    code, out, err = run(
        capsys, "replay", *SMALL, "--sweep", "1k,2k", "--plot", str(tmp_path / "p.png")
    )
    assert code == 1 and "hit rate" in out  # the table was printed first
    assert err.count("\n") == 1 and "Permission denied" in err and "Traceback" not in err


def test_token_id_too_large_is_caught_up_front(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text("[1, 2, 3, 4, 5]\n[1, 2, 18446744073709551616]\n")
    code, out, err = run(capsys, "replay", "--trace", str(bad), "--block-size", "2")
    assert_error(code, out, err, 2, f"{bad}:2:", "[2]")


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--sweep", "inf"], ["--sweep", "'inf'"]),
        (["--sweep", "1e30"], ["--sweep"]),
        (["--sweep", "-1k"], ["--sweep", "'-1k'"]),
        (["--sweep", "nan"], ["--sweep"]),
        (["--capacity", "1000000000000"], ["--capacity", "100,000,000"]),
        (["--concurrency", "1000000000000"], ["--concurrency"]),
        (["--capacity", "1.5"], ["whole number"]),
    ],
)
def test_out_of_range_numbers_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]
) -> None:
    code, out, err = run(capsys, "replay", *argv)
    assert_error(code, out, err, 2, *words)


def test_huge_output_length_with_a_decode_cap_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "m.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 40, "output_length": 100000000000,'
        ' "hash_ids": [1, 2, 3]}\n'
        '{"timestamp": 1, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 4]}\n'
    )
    code, out, err = run(
        capsys, "replay", "--trace", str(trace), "--trace-block-tokens", "16",
        "--max-decode-tokens", "10", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["runs"][0]["decode_tokens"] == 13
    # Without the cap the request is refused up front, not replayed until memory runs out.
    code, out, err = run(capsys, "replay", "--trace", str(trace), "--trace-block-tokens", "16")
    assert_error(code, out, err, 2, "request 1 has 100,000,000,040 tokens", "--max-decode-tokens")


def test_deeply_nested_json_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "deep.jsonl"
    bad.write_text("[1, 2, 3]\n" + "[" * 200_000 + "]" * 200_000 + "\n")
    code, out, err = run(capsys, "replay", "--trace", str(bad))
    assert_error(code, out, err, 2, f"{bad}:2:", "nested too deeply")


def test_interrupt_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_all", interrupted)
    code, out, err = run(capsys, "replay", *SMALL)
    assert code == 130 and out == "" and err == "blocktrie: interrupted\n"


def test_broken_pipe_exits_zero_quietly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache.planner.cli", "replay", *SMALL, "--sweep", "1k,2k"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head -0`: the reader is gone before the report
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == ""


# ---------------------------------------------------------------- defect 6


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--ckpt-policy", "prompt-end"], ["--ckpt-policy", "--ssm"]),
        (["--ckpt-interval", "64"], ["--ckpt-interval", "--ssm"]),
        (["--chunk-size", "64"], ["--chunk-size", "--ssm"]),
        (["--state-bytes-per-slot", "64"], ["--state-bytes-per-slot", "--ssm"]),
        (["--ssm", "--chunk-size", "64"], ["--chunk-size", "chunk-boundaries"]),
        (["--ssm", "--ckpt-policy", "prompt-end", "--ckpt-interval", "64"], ["every-n"]),
        (["--trace", str(MOONCAKE), "--users", "3"], ["--users", "built-in"]),
        (["--trace", str(TOKENS), "--trace-block-tokens", "16"], ["--trace-block-tokens"]),
        (["--trace-block-tokens", "16"], ["needs --trace"]),
        (["--ssm", "--ckpt-policy", "prompt-end+"], ["empty placement"]),
        (["--plot", "x.png"], ["--sweep"]),  # one run draws one dot (defect 8)
    ],
)
def test_flags_that_would_be_ignored_are_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]
) -> None:
    code, out, err = run(capsys, "replay", *argv)
    assert_error(code, out, err, 2, *words)


def test_counts_take_suffixes_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "replay", *SMALL, "--capacity", "1.5k", "--json")
    assert code == 0, err
    assert json.loads(out)["runs"][0]["capacity"] == 1500


# ---------------------------------------------------------------- defect 7: the schema


def _check_schema(doc: dict[str, Any]) -> None:
    assert list(doc) == ["schema", "workload", "runs", "recommended", "fleet"]
    assert doc["schema"] == 1
    assert tuple(doc["workload"]) == WORKLOAD_KEYS
    for row in doc["runs"]:
        assert tuple(row) == RUN_KEYS
    rec = doc["recommended"]
    assert list(rec) == [
        "ceiling", "among", "within_1_point", "within_99_percent", "reached", "best"
    ]  # fmt: skip
    for key in ("within_1_point", "within_99_percent", "best"):
        if rec[key] is not None:
            assert list(rec[key]) == [
                "run", "capacity", "policy", "state_slots", "kv_bytes", "state_bytes", "hit_rate"
            ]  # fmt: skip
            run_row = doc["runs"][rec[key]["run"]]
            assert rec[key]["capacity"] == run_row["capacity"]


def test_json_has_one_schema_whatever_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    one = json.loads(run(capsys, "replay", *SMALL, "--json")[1])
    many = json.loads(
        run(
            capsys, "replay", *SMALL, "--json", "--sweep", "100,2k", "--ssm",
            "--kv-bytes-per-token", "1024", "--state-bytes-per-slot", "4096",
        )[1]
    )  # fmt: skip
    for doc in (one, many):
        _check_schema(doc)
        assert doc["fleet"] is None  # only with --replicas / --publish (tests/test_fleet_cli.py)
    assert one["runs"][0]["kv_bytes"] is None and one["runs"][0]["kv_hit_rate"] is None
    assert one["workload"]["kv_bytes_per_token"] is None
    ssm = [r for r in many["runs"] if r["policy"] != "kv"]
    assert all(r["state_bytes"] == r["state_slots"] * 4096 for r in ssm)
    assert all(r["kv_bytes"] == r["capacity"] * 16 * 1024 for r in many["runs"])
    assert all(r["kv_hit_rate"] is not None for r in ssm)
    assert many["recommended"]["among"] == "ssm"


def test_csv_one_row_per_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "replay", *SMALL, "--csv", "--sweep", "100,200,2k", "--ssm")
    assert code == 0 and err == ""
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 6 and tuple(rows[0]) == RUN_KEYS
    assert [r["policy"] for r in rows].count("kv") == 3
    assert rows[0]["kv_hit_rate"] == ""  # null


# ---------------------------------------------------------------- defect 8


def test_plot_mode_follows_the_umask(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "p.png"
    old = os.umask(0o022)
    try:
        assert main(["replay", *SMALL, "--sweep", "100,2k", "--plot", str(plot), "--json"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(plot.stat().st_mode) == 0o644


# ---------------------------------------------------------------- defect 9


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("blocktrie ")
    code, out, _ = run(capsys, "replay", "--help")
    assert code == 0
    assert "(default: False)" not in out and "(default: None)" not in out
    assert "['" not in out  # no Python lists
    assert "(default: 16)" in out


def test_help_is_fast_and_loads_no_torch() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); from cache.planner.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(time.perf_counter() - t, 'torch' in sys.modules, file=sys.stderr)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    seconds, torch_loaded = proc.stderr.split()
    assert torch_loaded == "False"
    assert float(seconds) < 2.0  # ~0.1 s; generous for a loaded CI machine


# ---------------------------------------------------------------- defect 5: one vocabulary


def test_numbers_agree(capsys: pytest.CaptureFixture[str]) -> None:
    for extra in ([], ["--ssm"]):
        doc = json.loads(run(capsys, "replay", *SMALL, "--json", *extra)[1])
        never = doc["workload"]["never_evict_blocks"]
        assert all(r["capacity"] == never and r["never_evicts"] for r in doc["runs"])
        assert all(r["evicted_blocks"] == 0 for r in doc["runs"] if r["policy"] == "kv")
        _code, out, _ = run(capsys, "replay", *SMALL, *extra)
        assert f"never-evict capacity: {never:,} blocks" in out
        assert f"{never:,} blocks (never evicts)" in out or f"{never:,} " in out


def test_recommendation_considers_ssm_runs(capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(
        run(capsys, "replay", *SMALL, "--json", "--ssm", "--sweep", "100,400,2k,4k")[1]
    )
    rec = doc["recommended"]
    assert rec["among"] == "ssm"
    best = max(r["hit_rate"] for r in doc["runs"] if r["policy"] != "kv")
    assert rec["ceiling"] == best < doc["workload"]["unbounded_hit_rate"]
    for key, threshold in (
        ("within_1_point", rec["ceiling"] - 0.01),
        ("within_99_percent", rec["ceiling"] * 0.99),
    ):
        eligible = [
            (r["capacity"], r["state_slots"], i)
            for i, r in enumerate(doc["runs"])
            if r["policy"] != "kv" and r["hit_rate"] >= threshold
        ]
        pick = rec[key]
        assert pick is not None and pick["run"] == min(eligible)[2] and pick["policy"] != "kv"


def test_demo_hit_rate_is_saved_over_prompt_tokens() -> None:
    from cache.planner.demo import format_demo, run_demo

    result = run_demo()
    assert result.hit_rate == pytest.approx(result.tokens_saved / result.prompt_tokens)
    assert f"({result.tokens_saved} / {result.prompt_tokens};" in format_demo(result)


# ---------------------------------------------------------------- defect 1: fits the terminal


@pytest.mark.parametrize("width", [60, 80, 160])
def test_report_fits_and_never_cuts_a_number(
    capsys: pytest.CaptureFixture[str], width: int
) -> None:
    doc = json.loads(
        run(
            capsys, "replay", *SMALL, "--json", "--ssm", "--ckpt-policy", "all",
            "--sweep", "100,2k", "--kv-bytes-per-token", "131072",
        )[1]
    )  # fmt: skip
    text = render_text(doc, width)
    table = [line for line in text.splitlines() if line[:1] == " " and "," in line[:12]]
    assert table
    for line in text.splitlines():
        assert len(line) <= width, line
    for row in doc["runs"]:
        assert f"{row['hit_rate']:.2%}" in text
        assert "…" not in text
    # Nine policies, told apart: the abbreviations are distinct and explained.
    assert "BP+PE+DE+N+SS" in text and "SS = spare-slots" in text


# ---------------------------------------------------------------- traces, jobs


def test_three_trace_formats_replay(capsys: pytest.CaptureFixture[str]) -> None:
    for path, fmt in ((MOONCAKE, "mooncake"), (TOKENS, "tokens"), (BAILIAN, "bailian")):
        extra = ["--trace-block-tokens", "16"] if fmt == "mooncake" else []
        code, out, err = run(
            capsys, "replay", "--trace", str(path), *extra, "--block-size", "4", "--json",
            "--ssm", "--ckpt-policy", "branch-points",
        )  # fmt: skip
        assert code == 0, err
        doc = json.loads(out)
        assert doc["workload"]["format"] == fmt and doc["runs"][1]["hit_tokens"] > 0


def _without_timing(doc: dict[str, Any]) -> dict[str, Any]:
    for row in doc["runs"]:
        for key in TIMING_KEYS:
            row.pop(key)
    return doc


def test_jobs_give_identical_results(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", *SMALL, "--json", "--ssm", "--sweep", "100,400,2k"]
    one = json.loads(run(capsys, *argv, "--jobs", "1")[1])
    two = json.loads(run(capsys, *argv, "--jobs", "2")[1])
    assert _without_timing(one) == _without_timing(two)


_FORK_PROBE = """
import json, os, sys, threading
from cache.planner.cli import main
seen = []
fork = os.fork
def recording_fork():
    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    seen.append({"threads": sorted(t.name for t in threading.enumerate()), "tasks": tasks})
    return fork()
os.fork = recording_fork
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "forks": seen}, out)
"""


def test_sweep_workers_are_forked_from_a_single_thread(tmp_path: Path) -> None:
    """`--jobs` forks its workers while the CLI has no other thread, progress bars on.

    A fork copies whatever lock another thread holds at that instant into the
    child, still locked (tqdm's monitor thread, refreshing a bar, holds
    stderr's): the child would hang at its first write to stderr or at exit.
    The CLI's bars start no monitor thread (`cli._Progress`).
    """
    pytest.importorskip("tqdm")
    record = tmp_path / "forks.json"
    argv = ["replay", *SMALL, "--sweep", "100,2k", "--jobs", "2", "--progress"]
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_PROBE, str(record), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "replaying (2 jobs)" in proc.stderr  # the bar was on while the workers forked
    doc = json.loads(record.read_text())
    assert doc["code"] == 0
    assert len(doc["forks"]) == 2  # one per worker
    for fork in doc["forks"]:
        assert fork["threads"] == ["MainThread"]
        assert fork["tasks"] in (1, None)  # no native thread either (None: no /proc)


def test_ray_executor_gives_identical_results(capsys: pytest.CaptureFixture[str]) -> None:
    """A local two-CPU Ray cluster gives what one process gives.

    CI's install step brings the `ray` extra, so under `CI=true` a missing Ray
    fails here instead of skipping (the test would otherwise never run there).
    """
    if os.environ.get("CI"):
        import ray
    else:
        ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        argv = ["replay", *SMALL, "--json", "--sweep", "100,2k"]
        local = json.loads(run(capsys, *argv, "--jobs", "1")[1])
        remote = json.loads(run(capsys, *argv, "--executor", "ray")[1])
        assert _without_timing(local) == _without_timing(remote)
    finally:
        ray.shutdown()


def test_progress_from_the_first_phase(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    start = time.perf_counter()
    code, _out, err = run(capsys, "replay", "--trace", str(MOONCAKE), "--progress",
                          "--trace-block-tokens", "16")  # fmt: skip
    assert code == 0 and time.perf_counter() - start < 60
    assert err.index("loading") < err.index("counting") < err.index("replaying")


# ---------------------------------------------------------------- issue 43: the planner and CLI


@pytest.mark.parametrize(
    "flag", [["--users", "100000000"], ["--turns", "1000000"], ["--system-tokens", "100000000"]]
)
def test_unbounded_workload_is_refused_up_front(flag: list[str]) -> None:
    done = run_cli_process("replay", *flag)
    assert_error(done.code, done.out, done.err, 2, "needs about", "available", "--max-memory")
    assert "TiB" in done.err or "GiB" in done.err
    assert done.seconds < 30  # no workload drawn: the start-up of Python alone (about 0.3 s)


@pytest.mark.parametrize(
    "flag", [["--users", "100000000"], ["--turns", "1000000"], ["--system-tokens", "100000000"]]
)
def test_unbounded_workload_is_refused_before_a_token_is_drawn(
    capsys: pytest.CaptureFixture[str], monkeypatch: Any, flag: list[str]
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the workload was generated")

    monkeypatch.setattr(cli, "synthetic_workload", never)
    start = time.perf_counter()
    code, out, err = run(capsys, "replay", *flag, "--max-memory", "64G")
    assert time.perf_counter() - start < 1.0
    assert_error(code, out, err, 2, "more than --max-memory (64.00 GiB)", "--max-memory")


def test_max_memory_overrides_the_available_memory(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "replay", *SMALL, "--max-memory", "1M")
    assert_error(code, out, err, 2, "more than --max-memory (1.00 MiB)", "--max-memory 1G")
    code, out, err = run(capsys, "replay", *SMALL, "--max-memory", "1G", "--json")
    assert code == 0 and err == "" and json.loads(out)["runs"]
    for bad in ("12x", "0", "-1G", "G"):
        code, out, err = run(capsys, "replay", *SMALL, "--max-memory", bad)
        assert_error(code, out, err, 2, "--max-memory", "size")


def test_a_trace_too_big_for_memory_is_refused_before_counting(
    capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("counted")

    monkeypatch.setattr(cli, "count_prefix_hits", never)
    code, out, err = run(
        capsys, "replay", "--trace", str(MOONCAKE), "--trace-block-tokens", "16",
        "--max-memory", "10M",
    )  # fmt: skip
    assert_error(code, out, err, 2, "needs about", "--limit", "--max-memory")


@pytest.mark.parametrize("mode", [[], ["--ssm"]])
def test_a_sweep_that_stops_short_recommends_nothing(mode: list[str]) -> None:
    short = ["replay", *SMALL, *mode, "--sweep", "10,20", "--jobs", "1"]
    done = run_cli_process(*short)
    assert done.code == 0, done.err
    assert "recommended: none: no" in done.out and "reaches" in done.out
    assert "the cheapest of the" not in done.out
    doc = json.loads(run_cli_process(*short, "--json").out)
    rec = doc["recommended"]
    assert rec["reached"] is False
    assert rec["within_1_point"] is None and rec["within_99_percent"] is None
    kind = [r for r in doc["runs"] if (r["policy"] != "kv") == bool(mode)]
    assert rec["best"]["hit_rate"] == max(r["hit_rate"] for r in kind)
    assert rec["best"]["hit_rate"] < doc["workload"]["unbounded_hit_rate"] - 0.01
    # A sweep that reaches the ceiling still recommends.
    doc = json.loads(run_cli_process(*short[:-4], "--sweep", "10,4k", "--json").out)
    assert doc["recommended"]["reached"] is True
    assert doc["recommended"]["within_1_point"]["capacity"] == 4000


def test_jobs_default_is_documented_and_measured(monkeypatch: Any) -> None:
    done = run_cli_process("replay", "--help", env={**os.environ, "COLUMNS": "200"})
    assert done.code == 0
    text = " ".join(done.out.split())
    assert "one per run on the idle cores" in text and "repay a worker" in text
    from cache.planner.execute import WORKER_START_S, default_jobs

    assert default_jobs(1, 1000.0, cores=8) == 1  # one run: nothing to share
    assert default_jobs(6, WORKER_START_S, cores=8) == 1  # runs too short to repay a worker
    assert default_jobs(6, 60.0, cores=8) == 6
    assert default_jobs(6, 60.0, cores=2) == 2
    assert default_jobs(6, 60.0, cores=1) == 1
    from cache.planner import execute

    monkeypatch.setattr(execute, "available_cores", lambda: 2)
    for load, idle in ((0.0, 2), (0.4, 2), (0.6, 1), (1.6, 1), (7.5, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert default_jobs(6, 60.0) == idle, load  # the busy machine of issue 43: 1


def test_csv_trace_names_the_formats_read(tmp_path: Path) -> None:
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,4808,10\n")
    other = tmp_path / "x.csv"
    other.write_text("a,b\n1,2\n")
    for path, words in ((azure, ["Azure", "no token"]), (other, ["a CSV file"])):
        for fmt in ([], ["--trace-format", "mooncake"]):
            done = run_cli_process("replay", "--trace", str(path), *fmt)
            assert_error(done.code, done.out, done.err, 2, *words, "Mooncake", "Bailian", "token")
            assert "not valid JSON" not in done.err


def test_shared_azure_trace_is_named(traces_dir: Path) -> None:
    done = run_cli_process("replay", "--trace", str(traces_dir / "AzureLLMInferenceTrace_conv.csv"))
    assert_error(done.code, done.out, done.err, 2, "Azure", "Mooncake, Bailian (Qwen) or token ids")


@pytest.mark.parametrize(
    "line,words",
    [
        ('{"a": "x', ["unterminated string starting at column 7"]),
        ('{"a": 1,}', ["expecting property name enclosed in double quotes (column 9)"]),
    ],
)
def test_json_errors_read_as_one_sentence(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, line: str, words: list[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(line + "\n")
    code, out, err = run(capsys, "replay", "--trace", str(trace))
    assert_error(code, out, err, 2, ":1: not valid JSON: ", *words)
    assert "at at" not in err


@pytest.mark.parametrize("name,why", [("out.jpg", ".jpg images"), ("noext", "no suffix")])
def test_plot_suffix_without_a_format_is_refused(tmp_path: Path, name: str, why: str) -> None:
    target = tmp_path / name
    done = run_cli_process("replay", *SMALL, "--sweep", "1k,2k", "--plot", str(target))
    assert_error(done.code, done.out, done.err, 2, "--plot", why, ".png, .svg or .pdf")
    assert not target.exists()


def test_plot_writes_the_format_its_suffix_names(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    magic = {"png": b"\x89PNG", "svg": b"<?xml", "pdf": b"%PDF", "PDF": b"%PDF"}
    for suffix, head in magic.items():
        target = tmp_path / f"sweep.{suffix}"
        done = run_cli_process("replay", *SMALL, "--sweep", "1k,2k", "--plot", str(target))
        assert done.code == 0, done.err
        assert target.read_bytes().startswith(head), suffix


@pytest.mark.parametrize(
    "flag,value,words",
    [
        ("--sweep", "1k,,2k", ["empty value"]),
        ("--sweep", "1k,2k,", ["empty value"]),
        ("--sweep", "1k,1k", ["same value"]),
        ("--sweep", "1k,1000", ["'1k' and '1000'", "same value"]),
        ("--sweep-blocks-per-slot", "4,,8", ["empty value"]),
        ("--sweep-blocks-per-slot", "8,8", ["same value"]),
    ],
)
def test_sweep_lists_are_not_silently_changed(flag: str, value: str, words: list[str]) -> None:
    done = run_cli_process("replay", *SMALL, "--ssm", flag, value)
    assert_error(done.code, done.out, done.err, 2, flag, *words)


def test_piped_output_is_not_wrapped() -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = run_cli_process("replay", *SMALL, "--sweep", "1k,2k", "--ssm", env=env)
    assert done.code == 0, done.err
    footnote = [line for line in done.out.splitlines() if line.startswith("hit rate = ")]
    assert len(footnote) == 1 and footnote[0].endswith("it alone does not fit.")
    assert not any(line.startswith("  ") and "evictable" in line for line in done.out.splitlines())
    done = run_cli_process("replay", *SMALL, "--sweep", "1k,2k", env={**env, "COLUMNS": "80"})
    assert max(len(line) for line in done.out.splitlines()) <= 80  # $COLUMNS still applies


def test_progress_counts_requests_within_runs_and_leaves_no_stale_bar() -> None:
    pytest.importorskip("tqdm")
    done = run_cli_process("replay", *SMALL, "--sweep", "100,200,300", "--jobs", "2", "--progress")
    assert done.code == 0, done.err
    frames = [f.strip() for f in done.err.replace("\r", "\n").splitlines() if f.strip()]
    replaying = [f for f in frames if f.startswith("replaying")]
    assert replaying and "90/90" in replaying[-1] and "req" in replaying[-1]  # 30 req x 3 runs
    assert "3/3 runs done" in replaying[-1]
    assert all("%|" in f for f in frames), frames  # every bar has a total (none "0req [...]")
    generating = [f for f in frames if f.startswith("generating")]
    assert generating and "6/6" in generating[-1] and "session" in generating[-1]


@pytest.mark.parametrize(
    "argv,text",
    [
        (["--chunk-size", "64"], "--chunk-size applies only with --ssm"),
        (["--chunk-size", "64", "--ckpt-interval", "8"], "--chunk-size apply only with --ssm"),
        (["--trace", str(MOONCAKE), "--users", "3"], "--users describes the built-in workload"),
        (
            ["--trace", str(MOONCAKE), "--users", "3", "--turns", "2"],
            "--users, --turns describe the built-in workload",
        ),
    ],
)
def test_messages_agree_with_their_flags(
    capsys: pytest.CaptureFixture[str], argv: list[str], text: str
) -> None:
    code, out, err = run(capsys, "replay", *argv)
    assert_error(code, out, err, 2, text)


def test_a_long_workload_says_its_estimate_before_it_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    def stop(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # what the user would do after reading the estimate

    monkeypatch.setattr(cli, "synthetic_workload", stop)
    code, out, err = run(capsys, "replay", "--users", "1", "--turns", "3000", "--max-memory", "64G")
    assert code == 130 and out == ""
    first = err.splitlines()[0]
    assert first.startswith("blocktrie replay: estimated about ") and "at the peak" in first
