"""`tools.native_mutation`: mutant names, the sample, the scoring, the record and
its gate without a compiler; and one end-to-end run over a tiny checkout
(tests/cpp_project.py), skipped where cmake, ninja or a C++ compiler is missing.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

# The tool shares tools.mutation's record machinery, which reads pyproject.toml
# with `tomllib` (Python 3.11+); the package supports 3.10.
pytest.importorskip("tomllib", reason="tools.mutation needs Python 3.11 (tomllib)")

from tests import cpp_project
from tools import mutation
from tools import native_mutation as nm

needs_mutate = pytest.mark.skipif(
    shutil.which("mutate") is None, reason="universalmutator's `mutate` is not installed"
)

SOURCE = """\
#pragma once
// [R1] a comment
inline int clamp(int x, int hi) {
    if (x > hi) {
        return hi;
    }
    return x;
}
"""


def _mutant(name: str, line: int = 1, path: str = "native/src/a.hpp") -> nm.Mutant:
    return nm.Mutant(path, f"{path}:{name}", line, "a < b", "a <= b", "text")


def test_a_mutant_is_named_by_its_change_and_context_not_its_position() -> None:
    """Lines added far above a mutant keep its name; a second identical change in
    an identical context gets a suffix; a text equal to the original is dropped."""
    flip = SOURCE.replace("x > hi", "x >= hi")
    (first,) = nm.read_mutants("native/src/a.hpp", SOURCE, [flip, SOURCE])
    assert first.name.startswith("native/src/a.hpp:") and len(first.name.split(":")[1]) == 12
    assert (first.line, first.before, first.after) == (4, "if (x > hi) {", "if (x >= hi) {")
    assert first.describe() == "line 4: if (x > hi) { -> if (x >= hi) {"
    moved = "// a\n// b\n// c\n// d\n" + SOURCE
    (again,) = nm.read_mutants("native/src/a.hpp", moved, ["// a\n// b\n// c\n// d\n" + flip])
    assert again.name == first.name and again.line == 8
    twice = SOURCE + "\n\n\n" + SOURCE
    both = [twice.replace("x > hi", "x >= hi", 1), SOURCE + "\n\n\n" + flip]
    names = [m.name for m in nm.read_mutants("native/src/a.hpp", twice, both)]
    assert names == [first.name, first.name + "~2"]
    inserted = SOURCE.replace("    return x;\n", "    break;\n    return x;\n")
    (added,) = nm.read_mutants("native/src/a.hpp", SOURCE, [inserted])
    assert added.describe() == "line 7: + break;"


@needs_mutate
def test_universalmutator_makes_the_mutants_and_leaves_comments_alone(tmp_path: Path) -> None:
    (tmp_path / "native/src").mkdir(parents=True)
    (tmp_path / "native/src/a.hpp").write_text(SOURCE)
    mutants = nm.generate(tmp_path, "native/src/a.hpp")
    changes = {(m.line, m.after) for m in mutants}
    assert (4, "if (x >= hi) {") in changes and (4, "if (x < hi) {") in changes
    assert not any("[R1]" in m.before for m in mutants)  # the comment is left alone
    assert len({m.name for m in mutants}) == len(mutants)
    assert [m.name for m in nm.generate(tmp_path, "native/src/a.hpp")] == [
        m.name for m in mutants
    ]  # the same every time


def test_the_sample_is_shared_in_proportion_with_at_least_one_a_file() -> None:
    counts = {"a": 700, "b": 290, "c": 10, "d": 0}
    assert nm.shares(counts, None) == dict.fromkeys(counts)
    got = nm.shares(counts, 100)
    assert got == {"a": 70, "b": 29, "c": 1, "d": 0}
    assert nm.shares(counts, 10) == {"a": 7, "b": 3, "c": 1, "d": 0}  # c: one at least
    assert nm.shares(counts, 5000) == counts
    assert nm.shares({"a": 2, "b": 1}, 2) == {"a": 1, "b": 1}  # largest remainders


def test_the_sample_order_depends_on_the_seed_and_the_file_only() -> None:
    mutants = [_mutant(str(i)) for i in range(50)]
    order = nm.sample_order(mutants, 7, "native/src/a.hpp")
    assert order == nm.sample_order(mutants, 7, "native/src/a.hpp")
    assert sorted(m.name for m in order) == sorted(m.name for m in mutants)
    assert order != nm.sample_order(mutants, 8, "native/src/a.hpp")
    assert order != nm.sample_order(mutants, 7, "native/src/b.hpp")


def test_a_file_is_walked_until_its_share_is_scored() -> None:
    """Build failures, same binaries and listed equivalents are passed over (the
    equivalents not even built); the walk stops at the share."""
    mutants = [_mutant(f"m{i}", i) for i in range(12)]
    outcomes = [nm.BUILD_FAILED, nm.SAME_BINARY, nm.KILLED, nm.SURVIVED, nm.TIMED_OUT]
    verdict = {m.name: outcomes[i % len(outcomes)] for i, m in enumerate(mutants)}
    equivalent = {mutants[3].name}
    built: list[str] = []

    def outcome_of(m: nm.Mutant) -> str:
        built.append(m.name)
        return verdict[m.name]

    order = nm.sample_order(mutants, 0, "native/src/a.hpp")
    score = nm.score_file("native/src/a.hpp", mutants, 4, 0, equivalent, outcome_of)
    assert score.counted == 4 and score.share == 4 and score.mutants == 12
    walked = order[: order.index(next(m for m in reversed(order) if m.name in built)) + 1]
    assert [m.name for m in walked if m.name not in equivalent] == built
    tally = Counter(verdict[n] for n in built)
    assert score.killed == tally[nm.KILLED] + tally[nm.TIMED_OUT]
    assert score.timed_out == tally[nm.TIMED_OUT]
    assert len(score.survived) == tally[nm.SURVIVED]
    assert score.build_failed == tally[nm.BUILD_FAILED]
    assert score.same_binary == tally[nm.SAME_BINARY]
    assert score.equivalent == (mutants[3] in walked)
    every = nm.score_file("native/src/a.hpp", mutants, None, 0, set(), lambda m: verdict[m.name])
    assert every.counted == 12 - 6  # 3 build failures and 3 same binaries of 12
    assert every.killed == 4 and every.timed_out == 2 and every.score == pytest.approx(100 * 4 / 6)


def test_a_score_counts_killed_over_killed_and_survived() -> None:
    score = nm.NativeFileScore("native/src/a.hpp")
    assert score.score == 100.0 and score.counted == 0
    score.add(_mutant("k"), nm.KILLED)
    score.add(_mutant("s", 9), nm.SURVIVED)
    score.add(_mutant("b"), nm.BUILD_FAILED)
    assert score.score == 50.0 and score.survived == {
        "native/src/a.hpp:s": "line 9: a < b -> a <= b"
    }
    with pytest.raises(ValueError, match="unknown outcome"):
        score.add(_mutant("x"), "maybe")


def _listing(tmp_path: Path, *names: str) -> Path:
    listing = tmp_path / "equivalents.txt"
    listing.write_text(
        "# header\n\n# why these are equivalent\n" + "".join(f"{n}  # x\n" for n in names)
    )
    return listing


def test_equivalents_are_listed_by_file_and_stale_when_no_mutant_has_the_name(
    tmp_path: Path,
) -> None:
    listing = _listing(
        tmp_path, "native/src/a.hpp:aaa", "native/src/a.hpp:bbb", "native/src/b.hpp:ccc"
    )
    assert nm.listed_for("native/src/a.hpp", listing) == [
        "native/src/a.hpp:aaa",
        "native/src/a.hpp:bbb",
    ]
    assert nm.listed_for("native/src/a", listing) == []  # a path, not a prefix
    mutants = [_mutant("aaa"), _mutant("zzz")]
    assert nm.stale_equivalents("native/src/a.hpp", mutants, listing) == ["native/src/a.hpp:bbb"]


def test_the_record_holds_while_the_source_and_its_equivalents_are_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "native/src").mkdir(parents=True)
    for name in ("a.hpp", "b.hpp"):
        (tmp_path / "native/src" / name).write_text(SOURCE)
    listing = _listing(tmp_path, "native/src/a.hpp:aaa")
    record = tmp_path / "scores.json"
    a = nm.NativeFileScore("native/src/a.hpp", killed=9, mutants=40, share=10)
    a.add(_mutant("s"), nm.SURVIVED)
    b = nm.NativeFileScore("native/src/b.hpp", killed=10, mutants=40, share=10)
    nm.save_record([a], 3, tmp_path, record, listing)
    nm.save_record([b], 3, tmp_path, record, listing)  # kept beside a's
    kept = nm.load_record(record)
    assert kept["native/src/a.hpp"].score == a and kept["native/src/a.hpp"].seed == 3
    assert kept["native/src/a.hpp"].equivalents == ["native/src/a.hpp:aaa"]
    assert list(json.loads(record.read_text())) == ["native/src/a.hpp", "native/src/b.hpp"]
    paths = ["native/src/a.hpp", "native/src/b.hpp", "native/src/c.hpp"]
    scores, notes = nm.recorded_scores(paths, tmp_path, record, listing)
    assert scores[:2] == [a, b] and scores[2] is None
    assert (
        notes["native/src/a.hpp"].startswith("recorded at ")
        and "seed 3" in notes["native/src/a.hpp"]
    )
    assert notes["native/src/c.hpp"] == "never recorded"
    assert nm.report(scores[:2], paths[:2], 90.0, verbose=True)  # 19 of 20
    out = capsys.readouterr().out
    assert "survived: native/src/a.hpp:s" in out and "19 killed of 20 scored = 95.0%" in out
    assert not nm.report(scores[:2], paths[:2], 96.0, verbose=False)
    assert not nm.report(scores, paths, 0.0, verbose=False, notes=notes)  # c is unscored
    assert "unscored  (never recorded)" in capsys.readouterr().out
    (tmp_path / "native/src/b.hpp").write_text(SOURCE + "// a comment\n")
    _listing(tmp_path, "native/src/a.hpp:aaa", "native/src/a.hpp:ddd")
    scores, notes = nm.recorded_scores(paths[:2], tmp_path, record, listing)
    assert scores == [None, None]
    assert notes["native/src/a.hpp"].startswith("accepted equivalents changed since ")
    assert notes["native/src/b.hpp"].startswith("source changed since ")


def test_record_and_recorded_are_exclusive_and_paths_must_be_native_sources() -> None:
    for argv in (["--record", "--recorded"], ["--paths", "cache/trie.py", "--list"]):
        with pytest.raises(SystemExit) as exc:
            nm.main(argv)
        assert exc.value.code == 2


def test_the_committed_equivalents_list_parses_and_names_native_sources() -> None:
    for name in mutation.load_equivalent(nm.EQUIVALENT):
        path, _, digest = name.partition(":")
        assert path.startswith("native/src/") and len(digest.split("~")[0]) == 12, name


@needs_mutate
@pytest.mark.skipif(cpp_project.tools_found() is not None, reason=f"{cpp_project.tools_found()}")
def test_mutation_end_to_end(tmp_path: Path) -> None:
    """A sample of the tiny checkout's mutants: those of `sub` (checked by its test)
    are killed, those of `twice` (never called) survive, and none is counted when it
    does not build or builds the same binary; the checkout is not written, and the
    tree is left unmutated."""
    root = cpp_project.make_project(tmp_path / "root")
    before = cpp_project.snapshot(root)
    paths = ["native/src/arith.hpp"]
    seen: dict[str, tuple[nm.Mutant, str]] = {}
    runner = nm.Runner(root, tmp_path / "work", ["tests/test_native*.py"])
    scores, stale = nm.run_mutants(
        runner,
        paths,
        sample=80,  # arith.hpp's share: 8 (23 of the 234 mutants)
        seed=1,
        listing=tmp_path / "none.txt",
        seen=lambda m, outcome: seen.setdefault(m.name, (m, outcome)),
    )
    (score,) = scores
    assert stale == {} and score.share is not None and score.counted == score.share > 0
    scored = {n: (m, o) for n, (m, o) in seen.items() if o in (nm.KILLED, nm.SURVIVED)}
    assert len(scored) == score.counted and set(score.survived) <= set(scored)
    for mutant, outcome in scored.values():
        assert outcome == (nm.KILLED if mutant.line == 2 else nm.SURVIVED), mutant.describe()
    assert {m.line for m, _ in scored.values()} == {2, 3}, "the sample should hold both"
    # One of each uncounted kind, asked of the runner directly (the build is warm).
    runner.prepare()
    every = {m.describe(): m for m in nm.generate(root, paths[0])}
    assert runner.outcome(every["line 1: #pragma once -> /*#pragma once*/"]) == nm.SAME_BINARY
    commented = next(m for d, m in every.items() if d.startswith("line 3: inline") and "/*" in d)
    assert runner.outcome(commented) == nm.BUILD_FAILED  # module.cpp calls twice
    runner.finish()
    assert cpp_project.snapshot(root) == before
    assert (tmp_path / "work/tree/native/src/arith.hpp").read_text() == cpp_project.ARITH


def test_main_records_a_run_unless_an_accepted_equivalent_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--record` writes nothing while a file's list names a mutant it no longer
    has; once fixed, it records every file run, and `--recorded` gates from that."""
    record, listing = tmp_path / "scores.json", _listing(tmp_path)
    monkeypatch.setattr(nm, "RECORD", record)
    monkeypatch.setattr(nm, "EQUIVALENT", listing)
    path = "native/src/lru.hpp"
    stale: dict[str, list[str]] = {path: [f"{path}:0123456789ab"]}

    def run_mutants(
        runner: nm.Runner, paths: list[str], sample: int | None, seed: int, listing: Path
    ) -> tuple[list[nm.NativeFileScore], dict[str, list[str]]]:
        assert paths == [path] and sample == 5 and seed == 2
        return [nm.NativeFileScore(path, killed=5, mutants=900, share=5)], stale

    monkeypatch.setattr(nm, "run_mutants", run_mutants)
    work = ["--work-dir", str(tmp_path / "work")]
    argv = ["--paths", path, "--sample", "5", "--seed", "2", "--record", *work]
    assert nm.main(argv) == 1
    assert "stale accepted equivalent (no such mutant now): native/src/lru.hpp:0123456789ab" in (
        capsys.readouterr().err
    )
    assert not record.exists()
    stale.clear()
    assert nm.main(argv) == 0
    assert nm.load_record(record)[path].score.killed == 5
    assert nm.main(["--recorded", "--paths", path]) == 0
    assert nm.main(["--recorded"]) == 1  # the other files were never recorded


def test_a_record_keeps_what_the_run_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An entry added to the list, or a source edited, while a run goes on changed
    nothing that run measured: the record keeps the list and the source's digest as
    they were at the start (and says so), and `--recorded` then counts the file as
    unscored until it is run again."""
    root = tmp_path / "checkout"
    path = "native/src/lru.hpp"
    (root / "native" / "src").mkdir(parents=True)
    (root / path).write_text("int lru;\n")
    record, listing = tmp_path / "scores.json", _listing(tmp_path)
    monkeypatch.setattr(nm, "ROOT", root)
    monkeypatch.setattr(nm, "RECORD", record)
    monkeypatch.setattr(nm, "EQUIVALENT", listing)
    before = nm.listed_for(path, listing)
    digest = mutation.source_digest(path, root)

    def run_mutants(
        runner: nm.Runner, paths: list[str], sample: int | None, seed: int, used: Path
    ) -> tuple[list[nm.NativeFileScore], dict[str, list[str]]]:
        assert nm.listed_for(path, used) == before
        listing.write_text(listing.read_text() + f"{path}:0123456789ab\n")  # meanwhile
        (root / path).write_text("int lru = 1;\n")
        assert nm.listed_for(path, used) == before
        return [nm.NativeFileScore(path, killed=5, mutants=9, share=5)], {}

    monkeypatch.setattr(nm, "run_mutants", run_mutants)
    argv = ["--paths", path, "--record", "--work-dir", str(tmp_path / "work")]
    assert nm.main(argv) == 0
    err = capsys.readouterr().err
    assert "changed during the run" in err and f"{path} changed during the run" in err
    recorded = nm.load_record(record)[path]
    assert (recorded.equivalents, recorded.source_sha256) == (before, digest)
    assert nm.main(["--recorded", "--paths", path]) == 1
