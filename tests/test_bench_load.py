"""`bench.load`: the machine-load flag every benchmark section reports, and `--require-quiet`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import load
from bench.load import CpuSample, Load, measure, parse_proc_stat

STAT = """cpu  1000 200 300 5000 40 5 6 70 9 0
cpu0 500 100 150 2500 20 2 3 35 0 0
intr 12345
"""


def test_parse_reads_the_aggregate_line_only() -> None:
    busy, steal, total = parse_proc_stat(STAT, ticks_per_second=100)
    assert busy == pytest.approx((1000 + 200 + 300 + 5 + 6) / 100)  # guest is inside user
    assert steal == pytest.approx(0.70)
    assert total == pytest.approx((1000 + 200 + 300 + 5 + 6 + 5000 + 40 + 70) / 100)


def test_parse_old_kernels_without_the_later_fields() -> None:
    assert parse_proc_stat("cpu 10 0 10 80\n", 10) == (2.0, 0.0, 10.0)


@pytest.mark.parametrize("text", ["", "cpu0 1 2 3 4\n", "cpu 1 2 3\n", "intr 5\n"])
def test_parse_refuses_text_without_an_aggregate_line(text: str) -> None:
    with pytest.raises(ValueError, match="aggregate"):
        parse_proc_stat(text, 100)


def test_sample_reads_the_stat_file_and_survives_its_absence(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    got = load.sample(stat)
    assert got.busy is not None and got.busy > 0 and got.steal is not None and got.total
    assert got.own > 0  # this process has run
    missing = load.sample(tmp_path / "nothing")
    assert (missing.busy, missing.steal, missing.total) == (None, None, None)
    assert measure(missing, load.sample(tmp_path / "nothing")).noisy is False


def _pair(
    *, wall: float, busy: float, own: float, steal: float = 0.0, total: float = 100.0
) -> tuple[CpuSample, CpuSample]:
    return (
        CpuSample(wall=10.0, own=1.0, busy=50.0, steal=2.0, total=200.0),
        CpuSample(wall=10.0 + wall, own=1.0 + own, busy=50.0 + busy, steal=2.0 + steal,
                  total=200.0 + total),
    )  # fmt: skip


def test_other_cores_are_busy_seconds_not_ours_per_second() -> None:
    # 2 s of wall time; the machine was busy 3 s, 1 s of it ours: others kept 1 core busy.
    seen = measure(*_pair(wall=2.0, busy=3.0, own=1.0))
    assert seen == Load(seconds=2.0, other_cores=pytest.approx(1.0), steal=0.0, noisy=True)
    assert "1.00 cores" in seen.describe() and "NOISY" in seen.describe()


def test_a_quiet_section_is_not_flagged() -> None:
    seen = measure(*_pair(wall=2.0, busy=2.2, own=2.0))
    assert seen.other_cores == pytest.approx(0.1) and not seen.noisy
    assert "NOISY" not in seen.describe()
    # Clock ticks are coarser than rusage: "others" never goes negative.
    assert measure(*_pair(wall=2.0, busy=1.9, own=2.0)).other_cores == 0.0


def test_the_limits_decide() -> None:
    pair = _pair(wall=1.0, busy=1.3, own=1.0, steal=4.0, total=100.0)  # 0.3 cores, 4% steal
    assert measure(*pair).noisy  # 0.3 > the default 0.25
    assert not measure(*pair, max_other_cores=0.3).noisy
    assert measure(*pair, max_other_cores=0.3, max_steal=0.03).noisy  # steal past 3%
    assert measure(*pair).steal == pytest.approx(0.04)
    with pytest.raises(ValueError, match="max_other_cores=-1"):
        measure(*pair, max_other_cores=-1)
    with pytest.raises(ValueError, match=r"max_steal=-0\.5"):
        measure(*pair, max_steal=-0.5)


def test_no_figures_or_no_time_means_unknown_never_noisy() -> None:
    before, after = _pair(wall=1.0, busy=5.0, own=0.0)
    unknown = CpuSample(wall=after.wall, own=after.own)
    assert measure(before, unknown) == Load(1.0, None, None, False)
    assert "unknown" in measure(before, unknown).describe()
    assert measure(after, before).seconds == 0.0  # samples out of order: no figures
    assert measure(after, before).other_cores is None


def _fake_samples(busy_per_call: float) -> Iterator[CpuSample]:
    """Samples 1 s apart during which other processes used `busy_per_call` cores."""
    n = 0
    while True:
        yield CpuSample(wall=float(n), own=0.0, busy=n * busy_per_call, steal=0.0, total=n * 2.0)
        n += 1


@pytest.mark.parametrize(("busy", "quiet"), [(0.0, True), (1.5, False)])
def test_bench_run_reports_each_section_and_require_quiet_fails_a_noisy_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, busy: float, quiet: bool
) -> None:
    from bench import run

    samples = _fake_samples(busy)
    monkeypatch.setattr(load, "sample", lambda: next(samples))
    out = tmp_path / "b.json"
    argv = ["--sections", "evict", "--eviction-sizes", "64", "--evict-blocks", "32"]
    rc = run.main([*argv, "--json", str(out), "--require-quiet"])
    figures = json.loads(out.read_text())
    assert figures["load"]["evict"]["noisy"] is (not quiet)
    assert figures["load"]["evict"]["other_cores"] == pytest.approx(busy)
    assert rc == (0 if quiet else 3)
    assert run.main(argv) == 0  # flagged, but only --require-quiet fails the run


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "x"])
def test_bench_run_refuses_bad_limits(value: str) -> None:
    from bench import run

    with pytest.raises(SystemExit) as exc:
        run.build_parser().parse_args(["--max-other-cores", value])
    assert exc.value.code == 2


def test_eviction_sizes_take_turns_and_small_caches_are_built_again() -> None:
    """`bench.run._evict_round_robin`: every size evicts the blocks asked for, in
    turns (one `evict` call per size per turn, so drift lands on all alike); a
    cache that has given half its blocks is built again, and a cache with
    nothing to evict ends its size instead of looping."""
    from bench import run
    from bench.baseline import DictTrie

    calls: list[int] = []
    built: list[int] = []

    def make(b: int, capacity: int) -> DictTrie:
        built.append(capacity)
        cache = DictTrie(b, capacity)
        evict = cache.evict

        def spy(n: int) -> int:
            calls.append(capacity)
            return int(evict(n))

        cache.evict = spy  # type: ignore[method-assign,assignment]
        return cache

    timed = run._evict_round_robin(make, [64, 512, 8], 2, 16, 8, 96)
    assert {n: freed for n, (_, freed, _) in timed.items()} == {64: 96, 512: 96, 8: 0}
    assert all(per > 0 for n, (per, _, _) in timed.items() if n != 8)
    assert built.count(64 + 16) == 3  # 32 blocks per build: three builds for 96
    assert built.count(512 + 16) == 1 and built.count(8 + 16) == 1
    first_turns = calls[:3]
    assert sorted(first_turns) == sorted([64 + 16, 512 + 16, 8 + 16])  # one call each
