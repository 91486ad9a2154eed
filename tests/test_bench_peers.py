"""The peers benchmark's trace rewriting and its memory probe (tiny sizes, no shared traces)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.peers import (
    EVENT_MODES,
    Row,
    clock_overhead_ns,
    load_row,
    memory_child,
    rescale_trace,
    run_once,
    run_paired,
)
from bench.peers import IMPLS as PEER_IMPLS

LINES = [
    {"timestamp": 0, "input_length": 1100, "output_length": 600, "hash_ids": [0, 1, 2]},
    {"timestamp": 5, "input_length": 600, "output_length": 0, "hash_ids": [0, 1]},
]


def _write(path: Path) -> Path:
    path.write_text("".join(json.dumps(obj) + "\n" for obj in LINES))
    return path


def test_rescale_maps_one_hash_id_to_one_block(tmp_path: Path) -> None:
    src = _write(tmp_path / "t.jsonl")
    dst = tmp_path / "out.jsonl"
    rescale_trace(src, dst, block_size=16, passes=2)
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(out) == 4
    # 1100 tokens = 2 full ids + 76 tokens: 2 blocks of 16 + ceil(76 * 16 / 512) = 3 tokens.
    assert out[0]["input_length"] == 35 and out[0]["output_length"] == 19
    assert out[1]["input_length"] == 19 and out[1]["output_length"] == 0
    # The second pass shares nothing with the first: ids move by max id + 1.
    assert out[2]["hash_ids"] == [3, 4, 5] and out[3]["hash_ids"] == [3, 4]


def test_rows_replay_and_skip_missing_traces(tmp_path: Path) -> None:
    _write(tmp_path / "t.jsonl")
    assert load_row(tmp_path, Row("missing", "absent.jsonl", 64), 16, tmp_path) is None
    workload = load_row(tmp_path, Row("tiny", "t.jsonl", 64), 16, tmp_path)
    assert workload is not None and len(workload) == 2
    overhead = clock_overhead_ns(time.thread_time_ns)
    for name in ("blocktrie", "dict-trie", "column-trie"):
        r = run_once(workload, PEER_IMPLS[name], 16, 64, overhead)
        assert r["prompt_blocks"] == 2 + 1  # full prompt blocks looked up by match
        assert r["hit_rate"] > 0  # the second request's first block is cached
        assert r["ns_per_block"] > 0


def test_event_rows_hit_as_blocktrie_and_stop_their_encoder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The events-on variants (drained and encoded, drained only, published through
    an encoder process) replay exactly as blocktrie does; the encoder process is
    stopped when the run ends."""
    from cache import kv_publisher_process

    started: list[kv_publisher_process.ProcessEventPublisher] = []

    class Recorded(kv_publisher_process.ProcessEventPublisher):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            started.append(self)

    monkeypatch.setattr(kv_publisher_process, "ProcessEventPublisher", Recorded)
    _write(tmp_path / "t.jsonl")
    workload = load_row(tmp_path, Row("tiny", "t.jsonl", 64), 16, tmp_path)
    assert workload is not None
    base = run_once(workload, PEER_IMPLS["blocktrie"], 16, 64, 0.0)
    for name in EVENT_MODES:
        r = run_once(workload, PEER_IMPLS[name], 16, 64, 0.0)
        assert (r["hit_rate"], r["evicted_blocks"]) == (base["hit_rate"], base["evicted_blocks"])
    assert len(started) == sum(name.startswith("blocktrie+process") for name in EVENT_MODES)
    for publisher in started:
        assert publisher._closed
        assert publisher._proc is not None and publisher._proc.poll() is not None  # exited
        assert publisher.published_batches >= 1 and publisher.dropped_batches == 0
        with pytest.raises(RuntimeError, match="closed"):
            publisher.publish([])


def test_a_per_step_variant_drains_every_kth_poll_and_the_rest_when_closed() -> None:
    """`every=k` drains the events at every k-th poll (an engine stepping k requests
    at a time), and `close` drains what the last, partial step left."""
    from bench.peers import make_blocktrie

    trie = make_blocktrie(4, 16, events=True, mode="hash", every=3)
    drains: list[int] = []
    drain = trie._trie.drain_event_records

    def counted() -> object:
        records = drain()
        drains.append(len(records))
        return records

    trie._trie.drain_event_records = counted
    for i in range(7):
        seq = trie.match([i] * 4)
        trie.allocate(seq, 4)
        trie.commit(seq, 4)
        trie.release(seq)
        trie.poll()
    assert drains == [3, 3]  # a stored run per commit, drained at polls 3 and 6
    trie.close()
    assert drains == [3, 3, 1]
    with pytest.raises(ValueError, match="every must be >= 1"):
        make_blocktrie(4, 16, events=True, every=0)


def test_memory_probe_counts_cached_blocks() -> None:
    for name in ("blocktrie", "dict-trie", "column-trie"):
        m = memory_child(name, 64)
        assert m["impl"] == name and m["cached_blocks"] == 64
        assert m["bytes_per_block"] == m["rss_growth_bytes"] / 64


def test_a_paired_run_replays_both_tries_alike_and_times_each_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_paired` drives blocktrie with events off and an events-on variant through
    one replay: the same hits and evictions as blocktrie alone, a cost per block for
    each side, and the encoder process stopped at the end."""
    _write(tmp_path / "t.jsonl")
    workload = load_row(tmp_path, Row("tiny", "t.jsonl", 64), 16, tmp_path)
    assert workload is not None
    base = run_once(workload, PEER_IMPLS["blocktrie"], 16, 3, 0.0)  # 3 blocks: it evicts
    assert base["evicted_blocks"] > 0
    for name in EVENT_MODES:
        r = run_paired(workload, PEER_IMPLS[name], 16, 3, 0.0)
        assert (r["hit_rate"], r["evicted_blocks"]) == (base["hit_rate"], base["evicted_blocks"])
        assert r["off_ns_per_block"] > 0 and r["on_ns_per_block"] > 0
        assert r["ratio"] == r["on_ns_per_block"] / r["off_ns_per_block"]


def test_the_section_reports_every_row_it_has_a_trace_for_and_the_paired_events_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench_peers` end to end on a tiny stand-in for the conversation trace: its rows,
    the events row (each variant paired with events off), and the missing
    shared-prefix trace skipped."""
    import argparse

    from bench import peers

    monkeypatch.setattr(peers, "find_vllm_python", lambda explicit: (None, "not here"))
    _write(tmp_path / peers.CONVERSATION)
    args = argparse.Namespace(
        block_size=16, traces_dir=str(tmp_path), repeats=2, quick=True, memory=False
    )
    out: dict[str, object] = {}
    lines: list[str] = []
    peers.bench_peers(args, out, lambda *a: lines.append(" ".join(map(str, a))))
    report = out["peers"]
    assert isinstance(report, dict)
    assert [r["capacity"] for r in report["rows"]] == [20_000, 60_000, 200_000, 200_000]
    events = report["events"]
    assert events["row"] == "conversation, 60k" and events["runs"] == 2
    for key in EVENT_MODES.values():
        cell = events[key]
        assert cell["off_ns_per_block"] > 0 and cell["on_ns_per_block"] > 0 and cell["ratio"] > 0
    text = "\n".join(lines)
    assert "shared-prefix trace, 100k (no eviction): skipped" in text
    assert "events on vs off, conversation, 60k" in text and "median of 2 runs" in text
    assert "Drained once per 8 requests (an engine step of 8)" in text
    reads = report["read_ns"]
    assert set(reads) == {"array", "list", "slot"} and all(v > 0 for v in reads.values())
    assert f"array item {reads['array']:.1f} ns" in text


def test_read_costs_time_each_statement_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each figure is its own statement's best time over its runs, per read (no speed
    is asserted: that would be a timed test)."""
    import timeit

    from bench.peers import read_costs_ns

    timed: list[str] = []

    def fake_repeat(stmt: str, setup: str, *, number: int, repeat: int) -> list[float]:
        exec(setup + "\n" + stmt, {})  # the statement runs against its setup
        timed.append(stmt)
        return [3.0 * number / 1e9, 2.0 * number / 1e9] + [9.0] * (repeat - 2)

    monkeypatch.setattr(timeit, "repeat", fake_repeat)
    costs = read_costs_ns()
    assert timed == ["column[54_321]", "items[54_321]", "node.parent"]
    assert costs == pytest.approx({"array": 2.0, "list": 2.0, "slot": 2.0})
