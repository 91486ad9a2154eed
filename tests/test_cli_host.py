"""`blocktrie replay --host-capacity`: the planner with a host-memory tier (issue 10, item 5).

The replay drives the host tier as an engine does (match, load, wait, poll, then
allocate); the report splits hit rate into device and host hits and gives the
host-to-device traffic per second of trace time.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from cache.planner.replay import make_cache, replay, run_replay
from cache.planner.report import RUN_KEYS, WORKLOAD_KEYS, render_text
from cache.planner.traces import load_bailian, load_mooncake, load_token_jsonl
from cache.planner.workload import (
    Request,
    SyntheticParams,
    Workload,
    count_prefix_hits,
    synthetic_workload,
)
from spec.errors import OutOfBlocks
from tests.helpers import SMALL_WORKLOAD, run_cli

FIXTURES = Path(__file__).parent / "fixtures"
MOONCAKE = FIXTURES / "mooncake_small.jsonl"
BAILIAN = FIXTURES / "bailian_small.jsonl"
TOKENS = FIXTURES / "tokens_small.jsonl"
SMALL = SMALL_WORKLOAD
HOST_KEYS = RUN_KEYS[RUN_KEYS.index("host_capacity") :]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "replay", *SMALL, *argv, "--json")
    assert code == 0, err
    assert err == ""
    doc: dict[str, Any] = json.loads(out)
    return doc


def small_workload() -> Workload[Any]:
    return synthetic_workload(
        SyntheticParams(
            users=6, turns=2, system_tokens=64, user_tokens=16, output_tokens=12,
            tool_result_tokens=24,
        )
    )  # fmt: skip


# ---------------------------------------------------------------- the split and the traffic


def test_host_tier_splits_hits_and_reports_the_traffic(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = run_json(
        capsys, "--capacity", "40", "--host-capacity", "1k", "--kv-bytes-per-token", "1024"
    )
    (run,) = doc["runs"]
    assert tuple(run) == RUN_KEYS and tuple(doc["workload"]) == WORKLOAD_KEYS
    assert run["host_capacity"] == 1000 and run["host_kv_bytes"] == 1000 * 16 * 1024
    assert run["host_hit_tokens"] > 0 and run["device_hit_tokens"] > 0  # a 40-block pool evicts
    assert run["device_hit_tokens"] + run["host_hit_tokens"] == run["hit_tokens"]
    prompt = run["prompt_tokens"]
    assert run["device_hit_rate"] == pytest.approx(run["device_hit_tokens"] / prompt)
    assert run["host_hit_rate"] == pytest.approx(run["host_hit_tokens"] / prompt)
    assert run["device_hit_rate"] + run["host_hit_rate"] == pytest.approx(run["hit_rate"])
    # Every host hit was loaded (a block per 16 host-hit tokens, shared loads aside).
    assert 0 < run["loaded_blocks"] <= run["host_hit_tokens"] // 16
    assert run["stored_blocks"] > 0 and run["host_evicted_blocks"] == 0  # 1k holds it all
    assert run["loaded_bytes"] == run["loaded_blocks"] * 16 * 1024
    duration = doc["workload"]["duration_s"]
    assert duration == pytest.approx(small_workload().duration_s) and duration > 0
    assert run["loaded_bytes_per_s"] == pytest.approx(run["loaded_bytes"] / duration)


def test_a_host_tier_that_holds_everything_reaches_the_ceiling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Whatever the device evicts stays on the host: a tiny pool hits what an unbounded one
    would (counted independently), and without the host tier it does not."""
    count = count_prefix_hits(small_workload(), 16)
    with_host = run_json(capsys, "--capacity", "40", "--host-capacity", "2k")["runs"][0]
    without = run_json(capsys, "--capacity", "40")["runs"][0]
    assert with_host["rejected"] == 0
    assert with_host["hit_tokens"] == count.hit_tokens
    assert without["hit_tokens"] < count.hit_tokens
    # The device part is no better than the device alone (the host hits are extra).
    assert with_host["device_hit_tokens"] <= without["hit_tokens"]


def test_no_host_tier_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """--host-capacity 0 is the default: the same replay, host keys zero."""
    timing = {"wall_s", "requests_per_s", "tokens_per_s", "us_per_block"}
    plain = run_json(capsys, "--sweep", "40,2k")
    zero = run_json(capsys, "--sweep", "40,2k", "--host-capacity", "0")
    for a, b in zip(plain["runs"], zero["runs"], strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {
            k: v for k, v in b.items() if k not in timing
        }
        assert a["host_capacity"] == 0 and a["host_hit_tokens"] == 0 == a["loaded_blocks"]
        assert a["stored_blocks"] == 0 and a["device_hit_tokens"] == a["hit_tokens"]
        assert a["loaded_bytes"] is None and a["loaded_bytes_per_s"] is None  # no kv bytes
    code, out, _ = run_cli(capsys, "replay", *SMALL, "--sweep", "40,2k")
    assert code == 0
    for word in ("host", "load/s", "device"):
        assert word not in out  # the table is today's


def test_bytes_per_second_is_na_without_timestamps_or_kv_bytes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(
        capsys, "replay", "--trace", str(TOKENS), "--block-size", "4", "--capacity", "8",
        "--host-capacity", "1k", "--kv-bytes-per-token", "64", "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert doc["workload"]["duration_s"] is None  # a token trace has no timestamps
    run = doc["runs"][0]
    assert run["loaded_blocks"] > 0 and run["loaded_bytes"] == run["loaded_blocks"] * 4 * 64
    assert run["loaded_bytes_per_s"] is None
    words = " ".join(render_text(doc, 80).split())
    assert "load/s n/a" in words and "the trace has no timestamps" in words
    code, out, _ = run_cli(capsys, "replay", *SMALL, "--capacity", "40", "--host-capacity", "1k")
    assert code == 0 and "needs --kv-bytes-per-token" in " ".join(out.split())


def test_table_csv_and_single_view(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--sweep", "40,64,2k", "--host-capacity", "1k", "--kv-bytes-per-token", "131072"]
    doc = run_json(capsys, *argv)
    text = render_text(doc, 80)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    for word in ("host tier: 1,000 blocks (1.95 GiB)", "device", "host", "loaded", "load/s"):
        assert word in text
    code, out, err = run_cli(capsys, "replay", *SMALL, *argv, "--csv")
    assert code == 0 and err == ""
    rows = list(csv.DictReader(io.StringIO(out)))
    assert tuple(rows[0]) == RUN_KEYS and len(rows) == 3
    for row, run in zip(rows, doc["runs"], strict=True):
        assert int(row["host_hit_tokens"]) == run["host_hit_tokens"]
        assert int(row["loaded_blocks"]) == run["loaded_blocks"]
    code, out, _ = run_cli(capsys, "replay", *SMALL, "--capacity", "40", "--host-capacity", "1k")
    assert code == 0
    assert "host tier           1,000 blocks" in out
    assert "on device" in out and "loaded from host" in out and "blocks loaded" in out


def test_trace_durations_in_seconds() -> None:
    """Mooncake timestamps are milliseconds, Bailian's seconds: both become seconds."""
    mooncake = load_mooncake(MOONCAKE, 16)
    stamps = [json.loads(line)["timestamp"] for line in MOONCAKE.read_text().splitlines()]
    assert mooncake.duration_s == pytest.approx((max(stamps) - min(stamps)) / 1000)
    assert mooncake.head(2).duration_s == pytest.approx((stamps[1] - stamps[0]) / 1000)
    assert mooncake[1].arrival_ms == stamps[1]
    bailian = load_bailian(BAILIAN)
    stamps = [json.loads(line)["timestamp"] for line in BAILIAN.read_text().splitlines()]
    assert bailian.duration_s == pytest.approx(max(stamps) - min(stamps))
    assert bailian[1].arrival_ms == pytest.approx(stamps[1] * 1000)
    assert load_token_jsonl(TOKENS).duration_s is None
    assert mooncake.head(1).duration_s is None  # one request spans no time


def test_check_with_a_host_tier(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--sweep", "40,64", "--host-capacity", "60", "--check", "--jobs", "1")
    assert all(r["host_evicted_blocks"] > 0 for r in doc["runs"])  # a 60-block host evicts too
    assert all(r["host_hit_tokens"] > 0 for r in doc["runs"])


# ---------------------------------------------------------------- the replay loop


class _LoadShort:
    """A trie whose first `fail` loads raise OutOfBlocks (a pool short of room)."""

    def __init__(self, trie: Any, fail: int) -> None:
        self._trie = trie
        self.fail = fail
        self.loads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trie, name)

    def load(self, seq: Any) -> Any:
        self.loads += 1
        if self.fail:
            self.fail -= 1
            raise OutOfBlocks("short")
        return self._trie.load(seq)


def _revisit() -> Workload[Any]:
    """A, then B (which pushes A to the host), then A again (a host hit)."""
    a = list(range(100, 100 + 33))
    b = list(range(500, 500 + 33))
    reqs = [Request(a, []), Request(b, []), Request(a, [])]
    return Workload("revisit", reqs, lambda _i, r: r, [33] * 3, [0] * 3)


@pytest.mark.parametrize(
    ("concurrency", "fail", "loads", "rejected"),
    [
        (1, 0, 1, 0),  # B was released before A came back: room for the load at once
        (1, 1, 1, 1),  # short with nothing live to release: rejected
        (2, 0, 2, 0),  # B is live and holds the pool: the load is retried once B is released
        (2, 1, 2, 0),  # the same when the first try is short for another reason
        (2, 9, 2, 1),  # short even with the window released: rejected
    ],
)
def test_replay_loads_host_hits_and_retries_like_allocate(
    concurrency: int, fail: int, loads: int, rejected: int
) -> None:
    trie = make_cache(16, 3, host_capacity=8)
    cache = _LoadShort(trie, fail)
    r = replay(
        _revisit(), cache, block_size=16, capacity=3, concurrency=concurrency, host_capacity=8
    )
    trie.check()
    assert (cache.loads, r.rejected) == (loads, rejected)
    if not rejected:  # A's two full blocks came back from the host
        assert r.host_hit_tokens == 32 == r.hit_tokens and r.device_hit_tokens == 0
        assert r.loaded_blocks == 2 and r.stored_blocks == 4
    else:  # its host hit is taken back with the abort ([R50])
        assert r.host_hit_tokens == 0 == r.hit_tokens and r.loaded_blocks == 0
    assert trie.num_free_blocks + trie.num_cached_blocks == 3  # nothing left held


def test_run_replay_with_a_host_tier_matches_the_cli() -> None:
    r = run_replay(small_workload(), block_size=16, capacity=40, host_capacity=1000, check=True)
    assert r.host_capacity == 1000 and r.host_hit_tokens > 0
    assert r.to_dict()["host_hit_tokens"] == r.host_hit_tokens


# ---------------------------------------------------------------- usage errors


def _one_line_error(code: int, out: str, err: str, *words: str) -> None:
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err and "error" in err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("value", ["-1", "1.5", "abc", "200m", "", "1e3"])
def test_bad_host_capacity_is_one_line(capsys: pytest.CaptureFixture[str], value: str) -> None:
    code, out, err = run_cli(capsys, "replay", *SMALL, "--host-capacity", value)
    _one_line_error(code, out, err, "--host-capacity")


def test_host_capacity_takes_suffixes(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--capacity", "40", "--host-capacity", "1.5k")
    assert doc["runs"][0]["host_capacity"] == 1500


def test_host_capacity_with_ssm_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """SSM hits are never served from the host tier (docs/host-tier.md): refused, not ignored."""
    code, out, err = run_cli(capsys, "replay", *SMALL, "--ssm", "--host-capacity", "1k")
    _one_line_error(code, out, err, "--host-capacity", "SSM", "host tier", "device only")
    code, _, err = run_cli(capsys, "replay", *SMALL, "--ssm", "--host-capacity", "0", "--json")
    assert code == 0, err  # 0 is no host tier


def test_host_capacity_with_a_fleet_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "replay", *SMALL, "--replicas", "2", "--capacity", "1k", "--host-capacity", "1k"
    )
    _one_line_error(code, out, err, "--host-capacity", "--replicas")
