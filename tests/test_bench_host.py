"""The host-tier benchmark runs and reports consistent figures (tiny sizes, no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.host import bench_copy, bench_loop, print_host
from bench.run import main as bench_main

BASELINES = ("move", "plain_blocks", "gathered", "plain_whole")
COPY_KEYS = (
    "bytes_per_s",
    *(f"{b}_bytes_per_s" for b in BASELINES),
    *(f"vs_{b}" for b in BASELINES),
    *(f"vs_{b}_median" for b in BASELINES),
)


def test_bench_loop_small() -> None:
    r = bench_loop(users=6, repeat=1)
    assert r["repeat"] == 1 and r["blocks"] > 0
    never, evicting = r["no_host"], r["evicting"]
    # The no-host workload writes every block through and reads none back.
    assert never["evicted_blocks"] == 0 == never["loaded_blocks"] and never["stored_blocks"] > 0
    assert never["on_hit_rate"] == never["off_hit_rate"]
    # The evicting one loads from the host, which raises its hit rate.
    assert evicting["capacity"] < never["capacity"] and evicting["loaded_blocks"] > 0
    assert evicting["on_hit_rate"] > evicting["off_hit_rate"]
    assert evicting["host_hit_rate"] > 0
    for case in (never, evicting):  # one round: the ratio is exactly that round's
        assert case["off_ns_per_block"] > 0 and case["on_ns_per_block"] > 0
        assert case["ratio"] == pytest.approx(case["on_ns_per_block"] / case["off_ns_per_block"])
    with pytest.raises(ValueError, match="repeat"):
        bench_loop(users=1, repeat=0)


@pytest.mark.parametrize("layout", ["fresh", "scattered"])
def test_bench_copy_small(layout: str) -> None:
    r = bench_copy(blocks=8, block_shape=(16, 2, 4), repeat=1, layout=layout)
    assert r["block_bytes"] == 16 * 2 * 4 * 2 and r["bytes"] == 8 * r["block_bytes"]
    assert r["device"] == "cpu" and not r["pinned"] and r["dtype"] == "float16"
    assert r["layout"] == layout and r["threads"] >= 1
    if layout == "fresh":  # a new trie hands out consecutive blocks on both tiers
        assert r["device_runs"] == r["host_runs"] == 1
    else:  # shuffled free lists (seeded): 8 blocks out of 17 and 16 are scattered
        assert r["device_runs"] > 1 and r["host_runs"] > 1
    for direction in ("store", "load"):
        d = r[direction]
        assert all(d[k] > 0 for k in COPY_KEYS), d
        for b in BASELINES:  # one round: the median ratio is that round's, the best's too
            assert d[f"vs_{b}"] == pytest.approx(d["bytes_per_s"] / d[f"{b}_bytes_per_s"])
            assert d[f"vs_{b}_median"] == pytest.approx(d[f"vs_{b}"])
            assert d[f"vs_{b}_range"] == [pytest.approx(d[f"vs_{b}"])] * 2
    with pytest.raises(ValueError, match="blocks"):
        bench_copy(blocks=0)
    with pytest.raises(ValueError, match="layout"):
        bench_copy(blocks=1, layout="sideways")


def test_bench_run_has_a_host_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["--sections", "host", "--host-users", "6", "--host-blocks", "8"]
    argv += ["--host-block-shape", "16,2,4", "--repeats", "1", "--json", str(out)]
    argv += ["--host-model-blocks", "4", "--host-model-block-shape", "16,2,2,2,4"]
    assert bench_main(argv) == 0
    figures = json.loads(out.read_text())
    host, model = figures["host"], figures["host_model"]
    assert set(model) == {"copy", "copy_scattered"}
    assert model["copy"]["blocks"] == 4 and model["copy"]["block_shape"] == [16, 2, 2, 2, 4]
    assert set(host) == {"loop", "copy", "copy_scattered"}
    assert host["copy"]["layout"] == "fresh" and host["copy_scattered"]["layout"] == "scattered"
    assert host["copy"]["blocks"] == 8 and host["loop"]["no_host"]["ratio"] > 0
    lines: list[str] = []
    print_host(host, lines.append)
    assert any("goal <= 1.3x" in line for line in lines)
    assert any(line.lstrip().startswith("load") and "API" in line for line in lines)
    assert sum("vs copy_ per block" in line and "x [" in line for line in lines) == 4
