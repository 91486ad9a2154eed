"""The vLLM peer of the peers benchmark (`bench.vllm_peer`).

vLLM is not a dependency: finding an interpreter that has it must fail cleanly,
naming each one tried. Where one is found (``$BLOCKTRIE_VLLM_PYTHON``, or this
interpreter), vLLM's KVCacheManager, driven by the same replay loop, must hit
exactly as the naive dict trie does on a workload that never evicts: the
adapter calls vLLM the way its scheduler does, so any other hit count is a
driving bug, not a vLLM difference.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import pytest

from bench.peers import (
    IMPLS,
    Row,
    clock_overhead_ns,
    find_vllm_python,
    load_row,
    row_trace,
    run_once,
    run_vllm_child,
)


def _trace(path: Path, requests: int = 60, seed: int = 0) -> Path:
    """A Mooncake trace of conversations that share prefixes (512 tokens per hash id)."""
    rng = random.Random(seed)
    lines = []
    for i in range(requests):
        base = rng.randrange(8) * 100
        ids = [base + k for k in range(rng.randrange(1, 6))]
        if rng.random() < 0.5:
            ids.append(10_000 + i)  # a private tail block
        tokens = (len(ids) - 1) * 512 + rng.randrange(1, 513)
        lines.append({"timestamp": i, "input_length": tokens, "output_length": 40, "hash_ids": ids})
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    return path


def test_an_interpreter_without_vllm_is_refused_with_its_reason(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-python")
    python, why = find_vllm_python(missing)
    assert python is None
    assert missing in why


def test_this_interpreter_is_used_only_if_it_has_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLOCKTRIE_VLLM_PYTHON", raising=False)
    python, why = find_vllm_python(None)
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception:
        assert python is None
        assert sys.executable in why
    else:
        assert python == sys.executable


def _vllm_python() -> str:
    python, why = find_vllm_python(os.environ.get("BLOCKTRIE_VLLM_PYTHON"))
    if python is None:
        pytest.skip(f"no interpreter with vLLM ({why})")
    return python


def test_vllm_hits_as_the_dict_trie_when_nothing_is_evicted(tmp_path: Path) -> None:
    python = _vllm_python()
    _trace(tmp_path / "t.jsonl")
    row = Row("tiny", "t.jsonl", 4_096)
    path = row_trace(tmp_path, row, 16, tmp_path)
    workload = load_row(tmp_path, row, 16, tmp_path)
    assert path is not None and workload is not None
    overhead = clock_overhead_ns(time.thread_time_ns)
    naive = run_once(workload, IMPLS["dict-trie"], 16, row.capacity, overhead)
    assert naive["evicted_blocks"] == 0 and naive["hit_rate"] > 0.2
    vllm = run_vllm_child(python, ["--row", str(path), "16", str(row.capacity), "1", "0"])
    assert vllm["prompt_blocks"] == naive["prompt_blocks"]
    assert vllm["hit_rate"] == naive["hit_rate"]
    assert vllm["ns_per_block"] > 0


def test_vllm_memory_probe_counts_cached_blocks() -> None:
    m = run_vllm_child(_vllm_python(), ["--memory", "256"])
    assert m["impl"] == "vllm" and m["cached_blocks"] == 256
