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


def test_run_soak_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="steps"):
        run_soak(0)
