"""The per-call benchmark runs on every core that runs here, and reports each one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cache.native as native
from bench.op_costs import OPS, bench_op_costs, main


def test_bench_op_costs_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.ENV, raising=False)  # each trie runs the core it names
    r = bench_op_costs(blocks=3, block_size=4, prompts=5, calls=10, repeat=2)
    cores = ["native", "python"] if native.native_module() is not None else ["python"]
    assert list(r["ns_per_call"]) == cores
    for figures in r["ns_per_call"].values():
        assert set(figures) == {*OPS, "per_block"}
        assert all(figures[op] > 0 for op in OPS), figures
        assert figures["per_block"] == pytest.approx(figures["match"] / 3)
    assert (r["blocks"], r["block_size"], r["calls"], r["repeat"]) == (3, 4, 10, 2)


def test_bench_op_costs_refuses_empty_runs() -> None:
    with pytest.raises(ValueError, match="calls >= 2"):
        bench_op_costs(calls=1)
    with pytest.raises(ValueError, match="must be >= 1"):
        bench_op_costs(blocks=0)


def test_bench_op_costs_command_writes_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(native.ENV, raising=False)
    out = tmp_path / "ops.json"
    argv = ["--blocks", "2", "--block-size", "2", "--prompts", "3", "--calls", "4"]
    assert main([*argv, "--repeat", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "match/block" in table and "python" in table
    assert json.loads(out.read_text())["blocks"] == 2
