"""The peers benchmark's trace rewriting and its memory probe (tiny sizes, no shared traces)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.peers import IMPLS as PEER_IMPLS
from bench.peers import (
    Row,
    clock_overhead_ns,
    load_row,
    memory_child,
    rescale_trace,
    run_once,
)

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


def test_memory_probe_counts_cached_blocks() -> None:
    for name in ("blocktrie", "dict-trie", "column-trie"):
        m = memory_child(name, 64)
        assert m["impl"] == name and m["cached_blocks"] == 64
        assert m["bytes_per_block"] == m["rss_growth_bytes"] / 64
