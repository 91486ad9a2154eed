"""`tools.mutation`: which files it mutates, how it scores them, and the gate."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

# The tool reads pyproject.toml with `tomllib` (Python 3.11+); the package supports 3.10.
pytest.importorskip("tomllib", reason="tools.mutation needs Python 3.11 (tomllib)")

from tools import mutation


def test_core_paths_are_the_core_modules_and_spec_lifecycle() -> None:
    paths = mutation.core_paths()
    assert "cache/trie.py" in paths and "cache/lru.py" in paths
    assert "spec/lifecycle.py" in paths and "spec/model.py" not in paths
    for excluded in ("cache/cli.py", "cache/replay.py", "cache/workload.py", "cache/demo.py"):
        assert excluded not in paths
    assert not any(p.startswith("cache/testing/") for p in paths)
    assert not any(p.startswith("cache/integrations/") for p in paths)


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


def test_a_partial_run_fails_the_gate_and_says_how_much_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    meta = tmp_path / "mutants" / "cache"
    meta.mkdir(parents=True)
    (meta / "a.py.meta").write_text(json.dumps({"exit_code_by_key": {"a1": 1, "a2": None}}))
    (score,) = mutation.read_scores(["cache/a.py"], root=tmp_path)
    assert score.score == 100.0 and score.not_counted == 1
    assert not score.passes(90.0)
    assert mutation.report([score], 90.0, verbose=False) is False
    line = capsys.readouterr().out.splitlines()[1]
    assert line.split()[:7] == ["cache/a.py", "1", "0", "0", "0", "1", "100.0%"]
    assert line.endswith("not fully run")


def _scored(tmp_path: Path, codes: dict[str, int | None], source: str = "x = 1\n") -> Path:
    (tmp_path / "cache").mkdir(exist_ok=True)
    (tmp_path / "cache" / "a.py").write_text(source)
    meta = tmp_path / "mutants" / "cache"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "a.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    return tmp_path / "scores.json"


def test_a_record_survives_mutants_and_holds_while_the_source_is_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = _scored(tmp_path, {"a1": 1, "a2": 1, "a3": 0})
    scores = mutation.read_scores(["cache/a.py", "cache/b.py"], root=tmp_path)
    kept = mutation.save_record(scores, root=tmp_path, path=record)
    assert [s.path for s in kept] == ["cache/a.py"]  # b has no results: nothing to keep
    (tmp_path / "mutants" / "cache" / "a.py.meta").unlink()  # a fresh machine
    got, notes = mutation.recorded_scores(["cache/a.py", "cache/b.py"], tmp_path, record)
    assert got[0] == scores[0] and got[0].survived == ["a3"]
    assert notes["cache/a.py"].startswith("recorded at ")
    assert notes["cache/b.py"] == "never recorded" and got[1].counted == 0
    assert mutation.report(got, 60.0, False, notes) is False  # b is unscored
    assert "unscored  (never recorded)" in capsys.readouterr().out
    # The source changes: the record no longer speaks for it.
    (tmp_path / "cache" / "a.py").write_text("x = 2\n")
    got, notes = mutation.recorded_scores(["cache/a.py"], tmp_path, record)
    assert got[0].counted == 0 and notes["cache/a.py"].startswith("source changed since ")
    assert mutation.report(got, 0.0, False, notes) is False


def test_recording_again_replaces_only_the_files_given(tmp_path: Path) -> None:
    record = _scored(tmp_path, {"a1": 1})
    (tmp_path / "cache" / "b.py").write_text("y = 1\n")
    (tmp_path / "mutants" / "cache" / "b.py.meta").write_text(
        json.dumps({"exit_code_by_key": {"b1": 0}})
    )
    both = mutation.read_scores(["cache/a.py", "cache/b.py"], root=tmp_path)
    mutation.save_record(both, root=tmp_path, path=record)
    (tmp_path / "mutants" / "cache" / "a.py.meta").write_text(
        json.dumps({"exit_code_by_key": {"a1": 1, "a2": 0}})
    )
    mutation.save_record(mutation.read_scores(["cache/a.py"], tmp_path), tmp_path, record)
    kept = mutation.load_record(record)
    assert kept["cache/a.py"].score.survived == ["a2"]
    assert kept["cache/b.py"].score.survived == ["b1"]  # untouched
    assert list(json.loads(record.read_text())) == ["cache/a.py", "cache/b.py"]


def test_record_and_recorded_are_exclusive() -> None:
    with pytest.raises(SystemExit) as exc:
        mutation.main(["--record", "--recorded", "--report-only"])
    assert exc.value.code == 2


class _Item:
    """What the conftest's hooks read of a pytest item."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


class _Hook:
    def __init__(self, deselected: list[_Item]) -> None:
        self.deselected = deselected

    def pytest_deselected(self, items: list[_Item]) -> None:
        self.deselected.extend(items)


class _Config:
    """What the conftest's collection hook uses of pytest's config: its hook relay."""

    def __init__(self, deselected: list[_Item]) -> None:
        self.hook = _Hook(deselected)


def test_under_a_mutant_tests_run_fastest_first_and_the_slowest_are_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests import conftest

    durations = {"t::slow": 3.0, "t::fast": 0.01, "t::mid": 0.5, "t::minutes": 61.0}
    monkeypatch.setattr(conftest, "_mutmut_durations", lambda: durations)
    deselected: list[_Item] = []
    config = _Config(deselected)
    names = ("t::slow", "t::minutes", "t::new", "t::fast", "t::mid")
    items = [_Item(n) for n in names]
    monkeypatch.delenv("MUTANT_UNDER_TEST", raising=False)
    conftest.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == list(names)
    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")  # mutmut's own runs: ordered only
    conftest.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == ["t::fast", "t::mid", "t::slow", "t::minutes", "t::new"]
    assert deselected == []
    monkeypatch.setenv("MUTANT_UNDER_TEST", "cache.lru.x_add__mutmut_3")
    conftest.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == ["t::fast", "t::mid", "t::slow", "t::new"]
    assert [i.nodeid for i in deselected] == ["t::minutes"]
    only_slow = [_Item("t::minutes")]  # never all of a mutant's tests
    conftest.pytest_collection_modifyitems(config, only_slow)  # type: ignore[arg-type]
    assert [i.nodeid for i in only_slow] == ["t::minutes"]


def test_an_accepted_equivalent_mutant_runs_no_test(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A mutant listed in the equivalents file `tools.mutation` names runs nothing
    (every score leaves it out); one not listed, or with no file named, runs its
    tests; and the file is read anew for each mutant."""
    from tests import conftest

    monkeypatch.setattr(conftest, "_mutmut_durations", lambda: {"t::a": 0.1, "t::b": 0.2})
    listed = tmp_path / "equivalent_mutants.txt"
    listed.write_text("# why\ncache.lru.x_add__mutmut_3  # inline\n")
    monkeypatch.setenv("MUTANT_UNDER_TEST", "cache.lru.x_add__mutmut_3")

    def run() -> tuple[list[str], list[str]]:
        deselected: list[_Item] = []
        items = [_Item("t::b"), _Item("t::a")]
        conftest.pytest_collection_modifyitems(_Config(deselected), items)  # type: ignore[arg-type]
        return [i.nodeid for i in items], [i.nodeid for i in deselected]

    monkeypatch.delenv("BLOCKTRIE_EQUIVALENT_MUTANTS", raising=False)
    assert run() == (["t::a", "t::b"], [])
    monkeypatch.setenv("BLOCKTRIE_EQUIVALENT_MUTANTS", str(listed))
    assert run() == ([], ["t::a", "t::b"])
    monkeypatch.setenv("MUTANT_UNDER_TEST", "cache.lru.x_add__mutmut_4")
    assert run() == (["t::a", "t::b"], [])
    listed.write_text("cache.lru.x_add__mutmut_4\n")
    assert run() == ([], ["t::a", "t::b"])
    monkeypatch.setenv("BLOCKTRIE_EQUIVALENT_MUTANTS", str(tmp_path / "missing.txt"))
    assert run() == (["t::a", "t::b"], [])
    assert mutation.EQUIVALENT.is_file()  # the file `tools.mutation` names


@pytest.mark.skipif(not hasattr(__import__("signal"), "setitimer"), reason="no setitimer")
def test_under_a_mutant_a_test_far_past_its_recorded_time_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-test CPU budget: armed only for a mutant and a recorded test, it turns a
    spin into `MutantTooSlow`, and it is disarmed afterwards."""
    import signal
    import time

    from tests import conftest

    monkeypatch.setattr(conftest, "_mutmut_durations", lambda: {"t::spin": 0.001})
    monkeypatch.setattr(conftest, "MUTANT_GRACE_S", 0.05)

    def spin(hook: Generator[None, object, object]) -> None:
        next(hook)
        deadline = time.process_time() + 2.0
        try:
            while time.process_time() < deadline:
                pass
        finally:
            with pytest.raises(StopIteration):
                hook.send(None)

    monkeypatch.setenv("MUTANT_UNDER_TEST", "cache.lru.x_add__mutmut_3")
    with pytest.raises(conftest.MutantTooSlow, match=r"^t::spin used over 0\.1 s of CPU"):
        spin(conftest.pytest_runtest_call(_Item("t::spin")))  # type: ignore[arg-type]
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)

    # Not a mutant (mutmut's stats and clean runs), or a test without a recorded
    # duration: nothing is armed, and the loop runs to its end.
    for name, nodeid in (("stats", "t::spin"), ("cache.lru.x_add__mutmut_3", "t::new")):
        monkeypatch.setenv("MUTANT_UNDER_TEST", name)
        hook = conftest.pytest_runtest_call(_Item(nodeid))  # type: ignore[arg-type]
        next(hook)
        assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
        with pytest.raises(StopIteration):
            hook.send(None)


_SOURCE = '''"""Module doc."""

X = 1
"""What X is."""


def f(a: int) -> int:
    """Doc of f."""
    # a comment
    return a + X  # pragma: no mutate


class C:
    \'\'\'Doc of C.\'\'\'

    def g(self) -> str:
        return """not a statement: a value"""
'''


@pytest.mark.parametrize(
    ("old", "new", "holds"),
    [
        ('"""Module doc."""', '"""Another module doc,\n\nlonger."""', True),
        ('"""What X is."""', '"""What X is, again."""', True),
        ('"""Doc of f."""', "", True),  # a docstring removed
        ("'''Doc of C.'''", "'''Doc of C, edited.'''", True),
        ("# a comment", "# another comment", True),
        ("X = 1\n", "X = 1\n\n\n", True),  # layout
        ("X = 1", "X = 2", False),
        ("return a + X  # pragma: no mutate", "return a + X", False),  # decides mutants
        ('"""not a statement: a value"""', '"""another value"""', False),
        ('"""What X is."""', '"What X is."', False),  # mutmut mutates this one
        ('"""What X is."""', '"""What X is.""" "x"', False),  # and half of this
    ],
)
def test_a_record_holds_through_docstring_and_comment_edits_only(
    tmp_path: Path, old: str, new: str, holds: bool
) -> None:
    record = _scored(tmp_path, {"a1": 1}, source=_SOURCE)
    mutation.save_record(mutation.read_scores(["cache/a.py"], tmp_path), tmp_path, record)
    assert old in _SOURCE
    (tmp_path / "cache" / "a.py").write_text(_SOURCE.replace(old, new))
    got, notes = mutation.recorded_scores(["cache/a.py"], tmp_path, record)
    assert (got[0].killed == 1) is holds, notes
    assert notes["cache/a.py"].startswith("recorded at " if holds else "source changed since ")


def test_a_file_that_does_not_parse_is_digested_as_bytes(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "a.py").write_text("def (:\n")
    digest = mutation.code_digest("cache/a.py", tmp_path)
    assert digest == "bytes:" + mutation.source_digest("cache/a.py", tmp_path)
    assert mutation.code_digest("cache/none.py", tmp_path) == ""


def test_rekey_gives_unchanged_files_of_an_old_record_their_code_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = _scored(tmp_path, {"a1": 1}, source=_SOURCE)
    (tmp_path / "cache" / "b.py").write_text("y = 1\n")
    (tmp_path / "mutants" / "cache" / "b.py.meta").write_text(
        json.dumps({"exit_code_by_key": {"b1": 1}})
    )
    scores = mutation.read_scores(["cache/a.py", "cache/b.py"], tmp_path)
    mutation.save_record(scores, tmp_path, record)
    entries = json.loads(record.read_text())
    for entry in entries.values():  # a record made before code digests
        del entry["code_sha256"]
    record.write_text(json.dumps(entries))
    (tmp_path / "cache" / "b.py").write_text("y = 2\n")  # changed since
    old_doc = _SOURCE.replace('"""Doc of f."""', '"""Edited."""')
    (tmp_path / "cache" / "a.py").write_text(old_doc)  # a docstring: bytes differ too
    assert mutation.rekey_record(tmp_path, record) == []  # neither holds by its bytes
    (tmp_path / "cache" / "a.py").write_text(_SOURCE)
    assert mutation.rekey_record(tmp_path, record) == ["cache/a.py"]
    assert mutation.rekey_record(tmp_path, record) == []  # done once
    kept = mutation.load_record(record)
    assert kept["cache/a.py"].code_sha256 == mutation.code_digest("cache/a.py", tmp_path)
    assert kept["cache/b.py"].code_sha256 == ""
    (tmp_path / "cache" / "a.py").write_text(old_doc)  # now a docstring edit keeps it
    got, notes = mutation.recorded_scores(["cache/a.py", "cache/b.py"], tmp_path, record)
    assert got[0].killed == 1 and notes["cache/a.py"].startswith("recorded at ")
    assert got[1].counted == 0 and notes["cache/b.py"].startswith("source changed since ")


def test_the_rekey_command_rekeys_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    record = _scored(tmp_path, {"a1": 1}, source=_SOURCE)
    mutation.save_record(mutation.read_scores(["cache/a.py"], tmp_path), tmp_path, record)
    entries = json.loads(record.read_text())
    del entries["cache/a.py"]["code_sha256"]
    record.write_text(json.dumps(entries))
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    monkeypatch.setattr(mutation, "RECORD", record)
    assert mutation.main(["--rekey"]) == 0
    assert capsys.readouterr().out == "rekeyed 1 file(s) in scores.json\n"
    assert mutation.load_record(record)["cache/a.py"].code_sha256


def test_an_unchanged_file_holds_whatever_its_code_digest_says(tmp_path: Path) -> None:
    """A record made under another Python (whose `ast.dump` differs) still holds for
    a file whose bytes are the ones measured."""
    record = _scored(tmp_path, {"a1": 1}, source=_SOURCE)
    mutation.save_record(mutation.read_scores(["cache/a.py"], tmp_path), tmp_path, record)
    entries = json.loads(record.read_text())
    entries["cache/a.py"]["code_sha256"] = "digest of another Python's syntax tree"
    record.write_text(json.dumps(entries))
    got, notes = mutation.recorded_scores(["cache/a.py"], tmp_path, record)
    assert got[0].killed == 1 and notes["cache/a.py"].startswith("recorded at ")
    (tmp_path / "cache" / "a.py").write_text(_SOURCE.replace("Doc of f", "Edited"))
    got, notes = mutation.recorded_scores(["cache/a.py"], tmp_path, record)
    assert got[0].counted == 0  # neither the bytes nor that digest match now


def _diff_of(name: str) -> str:
    """A stand-in for mutmut's diff of a mutant (names ending in 9 do not exist)."""
    if name.endswith("_9"):
        raise KeyError(name)
    return f"--- a.py\n+++ a.py\n@@ -1 +1 @@\n-    old({name})\n+    new({name})\n"


def _pin(name: str) -> str:
    return mutation.diff_digest(_diff_of(name))


def test_show_equivalents_prints_each_entry_under_its_reason_with_its_diff_now(
    tmp_path: Path,
) -> None:
    listing = tmp_path / "equivalent_mutants.txt"
    listing.write_text(
        "# A.f: first reason,\n# on two lines.\ncache.a.x_f__mutmut_1\n"
        f"cache.a.x_f__mutmut_2  # diff {_pin('cache.a.x_f__mutmut_2')}\n"
        "# A.g: second reason.\ncache.a.x_g__mutmut_1  # diff 0123456789ab\n\n"
        "# B.h: another file.\ncache.b.x_h__mutmut_1\n"
        "# A.k: a name mutmut no longer has.\ncache.a.x_k__mutmut_9\n"
    )
    assert mutation.equivalent_reasons(listing) == [
        ("cache.a.x_f__mutmut_1", ["# A.f: first reason,", "# on two lines."]),
        ("cache.a.x_f__mutmut_2", ["# A.f: first reason,", "# on two lines."]),
        ("cache.a.x_g__mutmut_1", ["# A.g: second reason."]),
        ("cache.b.x_h__mutmut_1", ["# B.h: another file."]),
        ("cache.a.x_k__mutmut_9", ["# A.k: a name mutmut no longer has."]),
    ]
    assert mutation.equivalent_reasons(tmp_path / "none.txt") == []

    lines: list[str] = []
    shown = mutation.show_equivalents(["cache/a.py"], _diff_of, lines.append, listing)
    assert shown == 4  # cache.b's entry is not shown
    g_now = _pin("cache.a.x_g__mutmut_1")
    assert lines == [
        "",
        "# A.f: first reason,",
        "# on two lines.",
        f"  cache.a.x_f__mutmut_1  [not pinned; diff {_pin('cache.a.x_f__mutmut_1')}]",
        "      -    old(cache.a.x_f__mutmut_1)",
        "      +    new(cache.a.x_f__mutmut_1)",
        f"  cache.a.x_f__mutmut_2  [pinned, diff {_pin('cache.a.x_f__mutmut_2')}]",
        "      -    old(cache.a.x_f__mutmut_2)",
        "      +    new(cache.a.x_f__mutmut_2)",
        "",
        "# A.g: second reason.",
        f"  cache.a.x_g__mutmut_1  [CHANGED: pinned to diff 0123456789ab, diff now {g_now}]",
        "      -    old(cache.a.x_g__mutmut_1)",
        "      +    new(cache.a.x_g__mutmut_1)",
        "",
        "# A.k: a name mutmut no longer has.",
        "  cache.a.x_k__mutmut_9  [no such mutant]",
        "      -?",
        "      +? no such mutant now (KeyError: 'cache.a.x_k__mutmut_9')",
    ]


def test_a_diff_digest_is_what_the_mutant_changes_and_the_lines_around_it() -> None:
    diff = "--- cache/a.py\n+++ cache/a.py\n@@ -7,3 +7,3 @@\n     a = 1\n"
    diff += "-    b = a > 2\n+    b = a >= 2\n"
    digest = mutation.diff_digest(diff)
    assert len(digest) == 12 and int(digest, 16) >= 0
    moved = diff.replace("@@ -7,3 +7,3 @@", "@@ -9,3 +9,3 @@").replace("cache/a.py", "b.py")
    assert mutation.diff_digest(moved) == digest  # where it is does not count
    assert mutation.diff_digest(diff + "   \n") == mutation.diff_digest(diff + "\n")
    for other in (
        diff.replace(">= 2", "!= 2"),  # another change
        diff.replace("a = 1", "a = 0"),  # the same change in another place
    ):
        assert mutation.diff_digest(other) != digest


def test_pinning_pins_the_files_given_and_stale_entries_are_named(tmp_path: Path) -> None:
    listing = tmp_path / "equivalent_mutants.txt"
    listing.write_text(
        "# A.f: why.\ncache.a.x_f__mutmut_1\ncache.a.x_f__mutmut_2  # diff 0123456789ab\n"
        "\n# B.h: why not.\ncache.b.x_h__mutmut_1\n"
    )
    stale = mutation.stale_equivalents(["cache/a.py", "cache/b.py"], _diff_of, listing)
    assert stale == [
        ("cache.a.x_f__mutmut_1", f"not pinned (its diff now: {_pin('cache.a.x_f__mutmut_1')})"),
        (
            "cache.a.x_f__mutmut_2",
            f"pinned to diff 0123456789ab, but its diff now is {_pin('cache.a.x_f__mutmut_2')}",
        ),
        ("cache.b.x_h__mutmut_1", f"not pinned (its diff now: {_pin('cache.b.x_h__mutmut_1')})"),
    ]
    assert mutation.pin_equivalents(["cache/a.py"], _diff_of, listing) == [
        "cache.a.x_f__mutmut_1",
        "cache.a.x_f__mutmut_2",
    ]
    assert listing.read_text() == (
        f"# A.f: why.\ncache.a.x_f__mutmut_1  # diff {_pin('cache.a.x_f__mutmut_1')}\n"
        f"cache.a.x_f__mutmut_2  # diff {_pin('cache.a.x_f__mutmut_2')}\n"
        "\n# B.h: why not.\ncache.b.x_h__mutmut_1\n"  # another file: as it was
    )
    assert mutation.load_equivalent(listing) == {
        "cache.a.x_f__mutmut_1",
        "cache.a.x_f__mutmut_2",
        "cache.b.x_h__mutmut_1",
    }
    assert mutation.stale_equivalents(["cache/a.py"], _diff_of, listing) == []
    # A name mutmut no longer has: named as stale, and pinning it writes nothing.
    before = listing.read_text() + "cache.a.x_k__mutmut_9\n"
    listing.write_text(before)
    assert mutation.stale_equivalents(["cache/a.py"], _diff_of, listing) == [
        ("cache.a.x_k__mutmut_9", "no such mutant now")
    ]
    with pytest.raises(ValueError, match=r"x_k__mutmut_9: no such mutant now"):
        mutation.pin_equivalents(["cache/a.py"], _diff_of, listing)
    assert listing.read_text() == before


def test_a_record_keeps_its_equivalents_and_ends_when_they_change(tmp_path: Path) -> None:
    listing = tmp_path / "equivalent_mutants.txt"
    listing.write_text(f"# why.\ncache.a.a3  # diff {_pin('cache.a.a3')}\n")
    record = _scored(tmp_path, {"cache.a.a1": 1, "cache.a.a2": 1, "cache.a.a3": 0})
    scores = mutation.read_scores(["cache/a.py"], tmp_path, listing)
    assert scores[0].equivalent == 1 and scores[0].score == 100.0
    mutation.save_record(scores, tmp_path, record, listing)
    assert mutation.load_record(record)["cache/a.py"].equivalents == {
        "cache.a.a3": _pin("cache.a.a3")
    }
    got, notes = mutation.recorded_scores(["cache/a.py"], tmp_path, record, listing)
    assert got[0].score == 100.0 and notes["cache/a.py"].startswith("recorded at ")
    for changed in (
        "# why.\ncache.a.a3  # diff 0123456789ab\n",  # pinned to another diff
        "",  # removed: a3 would count as a survivor
        f"# why.\ncache.a.a3  # diff {_pin('cache.a.a3')}\ncache.a.a2\n",  # one added
    ):
        listing.write_text(changed)
        got, notes = mutation.recorded_scores(["cache/a.py"], tmp_path, record, listing)
        assert got[0].counted == 0
        assert notes["cache/a.py"].startswith("accepted equivalents changed since ")
    listing.write_text(f"# why.\ncache.a.a3  # diff {_pin('cache.a.a3')}\ncache.b.b1\n")
    got, _ = mutation.recorded_scores(["cache/a.py"], tmp_path, record, listing)
    assert got[0].score == 100.0  # another file's entry changes nothing here


def test_rekey_gives_an_old_record_its_equivalents_once_they_are_all_pinned(
    tmp_path: Path,
) -> None:
    listing = tmp_path / "equivalent_mutants.txt"
    listing.write_text("# why.\ncache.a.a3\n")
    record = _scored(tmp_path, {"cache.a.a1": 1, "cache.a.a3": 0}, source=_SOURCE)
    mutation.save_record(mutation.read_scores(["cache/a.py"], tmp_path, listing), tmp_path, record)
    entries = json.loads(record.read_text())
    del entries["cache/a.py"]["equivalents"]  # a record made before pins
    record.write_text(json.dumps(entries))
    got, notes = mutation.recorded_scores(["cache/a.py"], tmp_path, record, listing)
    assert got[0].counted == 0
    assert notes["cache/a.py"].startswith("equivalents not recorded (")
    assert mutation.rekey_record(tmp_path, record, listing) == []  # a3 is not pinned
    listing.write_text(f"# why.\ncache.a.a3\ncache.a.a1  # diff {_pin('cache.a.a1')}\n")
    mutation.pin_equivalents(["cache/a.py"], _diff_of, listing)
    assert mutation.rekey_record(tmp_path, record, listing) == []  # a1 was not left out
    listing.write_text("# why.\ncache.a.a3\n")
    mutation.pin_equivalents(["cache/a.py"], _diff_of, listing)
    (tmp_path / "cache" / "a.py").write_text("x = 2\n")  # and the record no longer holds
    assert mutation.rekey_record(tmp_path, record, listing) == []
    (tmp_path / "cache" / "a.py").write_text(_SOURCE)
    assert mutation.rekey_record(tmp_path, record, listing) == ["cache/a.py"]
    assert mutation.rekey_record(tmp_path, record, listing) == []  # done once
    got, notes = mutation.recorded_scores(["cache/a.py"], tmp_path, record, listing)
    assert got[0].score == 100.0 and notes["cache/a.py"].startswith("recorded at ")


def test_record_refuses_a_file_with_stale_equivalents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "lru.py").write_text("x = 1\n")
    meta = tmp_path / "mutants" / "cache"
    meta.mkdir(parents=True)
    (meta / "lru.py.meta").write_text(
        json.dumps({"exit_code_by_key": {"cache.lru.l1": 1, "cache.lru.l2": 0}})
    )
    listing = tmp_path / "equivalent_mutants.txt"
    listing.write_text("# why.\ncache.lru.l2\n")
    record = tmp_path / "scores.json"
    monkeypatch.chdir(tmp_path)
    for name, value in (("ROOT", tmp_path), ("RECORD", record), ("EQUIVALENT", listing)):
        monkeypatch.setattr(mutation, name, value)
    monkeypatch.setattr(mutation, "_mutmut_diff", _diff_of)
    argv = ["--report-only", "--record", "--paths", "cache/lru.py"]
    assert mutation.main(argv) == 1
    err = capsys.readouterr().err
    assert "stale accepted equivalent: cache.lru.l2: not pinned" in err
    assert "not recorded:" in err and not record.exists()
    assert mutation.main(["--pin-equivalents", "--paths", "cache/lru.py"]) == 0
    assert capsys.readouterr().out == "pinned 1 accepted equivalent(s) in equivalent_mutants.txt\n"
    assert mutation.main(argv) == 0
    kept = mutation.load_record(record)["cache/lru.py"]
    assert kept.score.killed == 1 and kept.score.equivalent == 1
    assert kept.equivalents == {"cache.lru.l2": _pin("cache.lru.l2")}
    with pytest.raises(SystemExit):
        mutation.main(["--pin-equivalents"])  # which files: --paths


def test_a_pinned_entry_whose_name_moved_is_shown_where_its_diff_went(tmp_path: Path) -> None:
    """An edit renumbers a function's mutants: for a pinned entry whose name now gives
    another diff, or none, the mutants of the same function that give the pinned
    diff now are named; other functions' mutants are not looked at."""
    old = "cache.a.x_f__mutmut_1"
    listing = tmp_path / "equivalent_mutants.txt"
    listing.write_text(
        f"# A.f: why.\n{old}  # diff {_pin('cache.a.x_f__mutmut_3')}\n"
        f"cache.a.x_f__mutmut_9  # diff {_pin('cache.a.x_f__mutmut_4')}\n"
        f"cache.a.x_f__mutmut_5  # diff {_pin('cache.a.x_g__mutmut_1')}\n"
    )
    names = [
        "cache.a.x_f__mutmut_1",
        "cache.a.x_f__mutmut_3",
        "cache.a.x_f__mutmut_4",
        "cache.a.x_f__mutmut_5",
        "cache.a.x_f__mutmut_30",
        "cache.a.x_g__mutmut_1",  # the same diff digest, but another function
    ]
    assert mutation.pinned_diff_now_at(old, _pin("cache.a.x_f__mutmut_3"), names, _diff_of) == [
        "cache.a.x_f__mutmut_3"
    ]
    lines: list[str] = []
    mutation.show_equivalents(["cache/a.py"], _diff_of, lines.append, listing, names)
    status = [line for line in lines if line.startswith("  cache.")]
    assert status[0].endswith("; the pinned diff is now cache.a.x_f__mutmut_3]")
    assert status[1].startswith("  cache.a.x_f__mutmut_9  [no such mutant")
    assert status[1].endswith("; the pinned diff is now cache.a.x_f__mutmut_4]")
    assert status[2].endswith("; no mutant of its function has the pinned diff now]")
    unnamed: list[str] = []  # without the run's names, nothing is looked up
    mutation.show_equivalents(["cache/a.py"], _diff_of, unnamed.append, listing)
    assert "pinned diff" not in "\n".join(unnamed)


def test_mutant_names_are_read_from_a_runs_meta_files(tmp_path: Path) -> None:
    meta = tmp_path / "mutants" / "cache" / "a.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(
        json.dumps({"exit_code_by_key": {"cache.a.x_f__mutmut_2": 1, "cache.a.x_f__mutmut_1": 0}})
    )
    assert mutation.mutant_names(["cache/a.py", "cache/b.py"], tmp_path) == [
        "cache.a.x_f__mutmut_1",
        "cache.a.x_f__mutmut_2",
    ]


def test_a_source_edited_during_a_run_is_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """mutmut copies the sources when it starts: a file edited while it runs (hours)
    would be recorded under code the run never saw. It is left out of the record,
    with a message; the other files of the run are recorded."""
    (tmp_path / "cache").mkdir()
    for name in ("lru.py", "gate.py"):
        (tmp_path / "cache" / name).write_text("x = 1\n")
    meta = tmp_path / "mutants" / "cache"
    meta.mkdir(parents=True)
    for name, prefix in (("lru.py", "cache.lru"), ("gate.py", "cache.gate")):
        (meta / f"{name}.meta").write_text(json.dumps({"exit_code_by_key": {f"{prefix}.m1": 1}}))
    record = tmp_path / "scores.json"
    monkeypatch.chdir(tmp_path)
    for name, value in (("ROOT", tmp_path), ("RECORD", record)):
        monkeypatch.setattr(mutation, name, value)
    monkeypatch.setattr(mutation, "EQUIVALENT", tmp_path / "equivalent_mutants.txt")

    run = subprocess.run

    def mutmut(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if "mutmut" not in command:
            return run(command, **kwargs)  # git, for the record's commit
        (tmp_path / "cache" / "lru.py").write_text("x = 2\n")  # edited meanwhile
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", mutmut)  # the one module tools.mutation calls
    argv = ["--record", "--paths", "cache/lru.py", "cache/gate.py"]
    assert mutation.main(argv) == 0
    assert "cache/lru.py changed during the run: not recorded" in capsys.readouterr().err
    assert set(mutation.load_record(record)) == {"cache/gate.py"}
