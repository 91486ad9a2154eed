"""The soak benchmark's driver, run short: it must report zero failures and catch a broken cache."""

from __future__ import annotations

import pytest

from bench.soak import run_soak


def test_a_short_soak_runs_clean_and_reports_its_figures() -> None:
    result = run_soak(3000, seed=1, check_every=500, trace_memory=False)
    assert result["failures"] == 0, result["failure_samples"]
    assert result["steps"] == 3000 and result["checks"] == 7
    assert result["restores_verified"] > 0
    assert result["stats"]["evicted_blocks"] > 0 and result["stats"]["checkpoints_saved"] > 0
    assert result["stats"]["pins"] == 0, "drained at the end"
    assert set(result["ops"]) >= {"match", "save", "complete", "poll", "finish"}


def test_the_soak_reports_a_cache_that_restores_the_wrong_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cache.copies import Copy, TensorMove

    real_run = Copy.run

    def corrupt(self: Copy) -> None:
        real_run(self)
        if self.kind == "restore":
            for move in self.moves:
                assert isinstance(move, TensorMove)  # a restore's moves are tensor copies
                move.dst.add_(1.0)

    monkeypatch.setattr(Copy, "run", corrupt)
    result = run_soak(2000, seed=1, check_every=500, trace_memory=False)
    assert result["failures"] > 0
    assert "restore" in result["failure_samples"][0]


def test_the_soak_fails_cancels_and_interrupts_copies_and_stays_clean() -> None:
    """Copies fail (the engine sees it), requests are cancelled with copies in flight,
    and a `KeyboardInterrupt` tears copies while they run and while they are queued
    ([R38], [R46]); the restore-data oracle still finds every restore exact."""
    result = run_soak(6000, seed=2, check_every=500, trace_memory=False)
    assert result["failures"] == 0, result["failure_samples"]
    assert {"fail", "cancel", "interrupt"} <= set(result["ops"])
    assert result["interrupts"]["queued"] > 0 and result["interrupts"]["running"] > 0
    assert result["stats"]["copies_failed"] > 0 and result["restores_failed"] > 0
    assert result["restores_verified"] > 0
    assert result["stats"]["pins"] == 0, "drained at the end"


def test_the_soak_reports_a_cache_that_keeps_a_torn_save_matchable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed save's checkpoint must be withdrawn: a cache that keeps it matchable
    hands out the garbage a torn copy left in its slot, and the soak says so."""
    from cache.checkpoints import CheckpointStore

    monkeypatch.setattr(CheckpointStore, "withdraw", lambda self, ck: None)
    result = run_soak(6000, seed=2, check_every=500, trace_memory=False)
    assert result["failures"] > 0
    assert any("restore" in f and "-1.0" in f for f in result["failure_samples"]), result


def test_the_soak_reports_an_interrupt_swallowed_while_a_copy_is_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupt inside a copy being queued must come out of `save` / `restore`."""
    from cache.transfers import Transfers

    real = Transfers.launch

    def swallow(self: Transfers, *args: object, **kwargs: object) -> object:
        try:
            return real(self, *args, **kwargs)
        except KeyboardInterrupt:
            return None

    monkeypatch.setattr(Transfers, "launch", swallow)
    result = run_soak(3000, seed=2, check_every=500, trace_memory=False)
    assert any("did not come out" in f for f in result["failure_samples"]), result


def test_run_soak_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="steps"):
        run_soak(0)
