"""The KV-event benchmark runs and reports consistent figures (tiny sizes)."""

from __future__ import annotations

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("xxhash")
pytest.importorskip("zmq")

from bench.events import bench_events, print_events


def test_bench_events_small() -> None:
    r = bench_events(chains=16, chain_blocks=4, block_size=4, commits_per_batch=4, repeat=1)
    assert r["blocks"] == 64
    for key in (
        "dict_insert",
        "blocktrie",
        "blocktrie_events",
        "blocktrie_events_process",
        "build",
        "encode",
        "publish",
        "publish_e2e",
    ):
        assert r[key] > 0, key
    assert set(r["hash"]) == {"xxh3", "vllm"} and all(v > 0 for v in r["hash"].values())
    total = r["hash"]["xxh3"] + r["build"] + r["publish_e2e"]
    assert r["events_per_block"] == pytest.approx(total)
    assert r["components_over_blocktrie"] == pytest.approx(total / r["blocktrie"])
    # one round of each: every ratio is that round's, events on over events off
    # (wall time, the process's CPU, the thread's CPU, the encoder process's CPU)
    ((t_off, t_on, t_cpu_off, t_cpu_on, t_thr_off, t_thr_on, t_enc),) = r["rounds"]["in_thread"]
    ((p_off, p_on, p_cpu_off, p_cpu_on, p_thr_off, p_thr_on, p_enc),) = r["rounds"]["in_process"]
    assert t_enc == 0 and p_enc > 0  # only the encoder process encodes elsewhere
    assert r["events_over_blocktrie"] == pytest.approx(t_on / t_off - 1.0)
    assert r["events_process_over_blocktrie"] == pytest.approx(p_on / p_off - 1.0)
    assert r["events_cpu_over_blocktrie"] == pytest.approx(t_cpu_on / t_cpu_off - 1.0)
    assert r["events_process_cpu_over_blocktrie"] == pytest.approx(p_cpu_on / p_cpu_off - 1.0)
    assert r["events_thread_over_blocktrie"] == pytest.approx(t_thr_on / t_thr_off - 1.0)
    assert r["events_process_thread_over_blocktrie"] == pytest.approx(p_thr_on / p_thr_off - 1.0)
    assert r["events_process_total_cpu_over_blocktrie"] == pytest.approx(
        (p_cpu_on + p_enc) / p_cpu_off - 1.0
    )
    assert t_cpu_off == t_thr_off and p_cpu_off == p_thr_off  # the off side: this thread only
    assert r["blocktrie"] == min(t_off, p_off) / 64
    assert r["blocktrie_events"] == t_on / 64 and r["blocktrie_events_process"] == p_on / 64
    assert r["bytes_per_block"] > 8  # at least the 64-bit hash per block
    lines: list[str] = []
    print_events(r, lines.append)
    assert any("events on costs" in line for line in lines)
    assert any("engine process's CPU" in line and "encoder process's" in line for line in lines)
    assert any("engine thread's CPU" in line for line in lines)
    assert r["cores"] is None  # not asked to pin
    with pytest.raises(ValueError, match="repeat"):
        bench_events(chains=1, chain_blocks=1, block_size=1, repeat=0)


def test_bench_events_on_separate_cores_gives_the_cores_back() -> None:
    """`separate_cores`: the engine thread on one core and the encoder process on
    another for the encoder-process rounds (where there are two), then the thread's
    cores as they were."""
    import os

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this OS")
    before = os.sched_getaffinity(0)
    r = bench_events(
        chains=8, chain_blocks=2, block_size=4, commits_per_batch=4, repeat=1, separate_cores=True
    )
    assert os.sched_getaffinity(0) == before
    if len(before) < 2:
        assert r["cores"] is None
    else:
        assert r["cores"] == sorted(before)[:2]
        lines: list[str] = []
        print_events(r, lines.append)
        engine, encoder = r["cores"]
        assert any(f"engine on core {engine}, encoder on {encoder}" in line for line in lines)
