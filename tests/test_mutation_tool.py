"""`tools.mutation`: which files it mutates, how it scores them, and the gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import mutation


def test_core_paths_are_the_core_modules_and_spec_lifecycle() -> None:
    paths = mutation.core_paths()
    assert "cache/trie.py" in paths and "cache/lru.py" in paths
    assert "spec/lifecycle.py" in paths and "spec/model.py" not in paths
    for excluded in ("cache/cli.py", "cache/replay.py", "cache/workload.py", "cache/demo.py"):
        assert excluded not in paths
    assert not any(p.startswith("cache/testing/") for p in paths)


def test_mutant_glob_names_every_mutant_of_a_file() -> None:
    assert mutation.mutant_glob("cache/lru.py") == "cache.lru.*"
    assert mutation.mutant_glob("spec/lifecycle.py") == "spec.lifecycle.*"
    with pytest.raises(ValueError, match="not a Python file"):
        mutation.mutant_glob("cache")


def test_score_counts_kills_and_timeouts_and_leaves_out_equivalents() -> None:
    codes: dict[str, int | None] = {"m1": 1, "m2": 36, "m3": 0, "m4": 33, "m5": 0, "m6": None}
    score = mutation.score_file("cache/x.py", codes, equivalent={"m5"})
    assert score.killed == 2 and score.survived == ["m3"] and score.no_tests == ["m4"]
    assert score.equivalent == 1 and score.not_counted == 1
    assert score.counted == 4 and score.score == 50.0
    assert mutation.score_file("empty.py", {}, set()).score == 100.0


def test_report_fails_a_file_under_the_threshold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    meta = tmp_path / "mutants" / "cache"
    meta.mkdir(parents=True)
    (meta / "a.py.meta").write_text(json.dumps({"exit_code_by_key": {"a1": 1, "a2": 1}}))
    (meta / "b.py.meta").write_text(json.dumps({"exit_code_by_key": {"b1": 1, "b2": 0}}))
    scores = mutation.read_scores(["cache/a.py", "cache/b.py"], root=tmp_path)
    assert [s.score for s in scores] == [100.0, 50.0]
    assert mutation.report(scores[:1], 90.0, verbose=False) is True
    assert mutation.report(scores, 90.0, verbose=True) is False
    out = capsys.readouterr().out
    assert "< threshold" in out and "survived: b2" in out
    assert (
        mutation.report(mutation.read_scores(["cache/none.py"], root=tmp_path), 90, False) is False
    )


def test_load_equivalent_skips_comments(tmp_path: Path) -> None:
    listed = tmp_path / "eq.txt"
    listed.write_text("# header\ncache.lru.x_f__mutmut_1  # why\n\n  spec.y__mutmut_2\n")
    assert mutation.load_equivalent(listed) == {"cache.lru.x_f__mutmut_1", "spec.y__mutmut_2"}
    assert mutation.load_equivalent(tmp_path / "missing.txt") == set()
