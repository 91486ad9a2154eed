"""Line coverage of the native core: ``python -m tools.native_coverage [--min 95]``.

Builds ``cache._native`` with ``BLOCKTRIE_COVERAGE=ON`` (``--coverage -O0 -g``) in
``build/native-coverage/`` from a copy of the checkout (`tools.native_build`: the
tests then import that instrumented module and no other, which is checked before
they run), clears the counters, runs the tests that exercise the native core
(default ``tests/test_native*.py tests/test_differential.py``, with
``BLOCKTRIE_BACKEND=native`` and ``CI=true``), and runs gcovr over ``native/src/``
only. Prints each file's line coverage and its uncovered lines, the total, and
exits 1 when the total is under ``--min`` percent or a test failed (2 when it
could not measure: no compiler, a failed build).

A source file of ``native/src/`` that no test's process compiled code of has no
coverage data: it is named, and counts 0 covered of 0 lines (a header of
declarations only); a file with code that never ran still has its lines, as
uncovered. Lines can be left out with gcovr's markers (``// GCOVR_EXCL_LINE``,
``GCOVR_EXCL_START``/``STOP``); each needs a comment saying why no test can reach it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools import native_build
from tools.native_build import ROOT, NativeToolError

WORK = ROOT / "build" / "native-coverage"


@dataclass(frozen=True)
class FileCoverage:
    """gcovr's line counts for one source file (path relative to the checkout)."""

    path: str
    covered: int
    total: int

    @property
    def percent(self) -> float:
        """Lines covered, in percent (100 for a file without lines)."""
        return 100.0 * self.covered / self.total if self.total else 100.0


@dataclass
class Coverage:
    """A run's result: each file's lines, and the sources without data."""

    files: list[FileCoverage] = field(default_factory=list)
    without_data: list[str] = field(default_factory=list)

    @property
    def covered(self) -> int:
        """Lines covered, over all files."""
        return sum(f.covered for f in self.files)

    @property
    def total(self) -> int:
        """Lines, over all files."""
        return sum(f.total for f in self.files)

    @property
    def percent(self) -> float:
        """Line coverage over all files, in percent (0 when there is no line at all:
        nothing was measured)."""
        return 100.0 * self.covered / self.total if self.total else 0.0


def read_summary(summary: dict[str, object], sources: Sequence[str]) -> Coverage:
    """A `Coverage` from gcovr's ``--json-summary`` (files reported relative to the
    checkout): the `sources` it has lines of, and those it does not name."""
    files = summary.get("files", [])
    assert isinstance(files, list)
    by_name = {entry["filename"]: entry for entry in files}
    result = Coverage()
    for path in sources:
        entry = by_name.get(path)
        if entry is None:
            result.without_data.append(path)
        else:
            result.files.append(FileCoverage(path, entry["line_covered"], entry["line_total"]))
    return result


def zero_counters(build_dir: Path) -> int:
    """Remove the ``.gcda`` counter files of earlier runs; returns how many."""
    stale = list(build_dir.rglob("*.gcda"))
    for file in stale:
        file.unlink()
    return len(stale)


def gcovr_command(build_dir: Path, work: Path, html: bool) -> list[str]:
    """gcovr over `build_dir`'s counters, run from the tree, kept to ``native/src/``:
    a JSON summary and a text report (lines not covered) in `work`, and an annotated
    HTML report in ``work/html/`` with `html`. ``--merge-lines``: a line of a
    template counts once, covered when any of its instances ran it (gcovr 8 would
    otherwise count it once per instance). ``$GCOV`` names another gcov (it must
    match the compiler)."""
    command = [sys.executable, "-m", "gcovr", "--root", ".", "--merge-lines", "--filter"]
    command.append(re.escape(native_build.SOURCE_DIR + "/"))
    command += ["--json-summary", str(work / "coverage.json"), "--txt", str(work / "coverage.txt")]
    if html:
        (work / "html").mkdir(parents=True, exist_ok=True)
        command += ["--html-details", str(work / "html" / "index.html")]
    if os.environ.get("GCOV"):
        command += ["--gcov-executable", os.environ["GCOV"]]
    return [*command, str(build_dir)]


def measure(
    root: Path,
    work: Path,
    tests: Sequence[str],
    pytest_args: Sequence[str] = (),
    html: bool = False,
    echo: bool = True,
) -> tuple[Coverage, bool]:
    """Build, run the tests (their output shown as it comes with `echo`), read
    the coverage; returns it and whether the tests passed. Raises `NativeToolError`
    when a step fails."""
    options = {"BLOCKTRIE_COVERAGE": "ON", "BLOCKTRIE_SANITIZE": "OFF"}
    tree, module = native_build.build_module(root, work, "Release", options)
    build_dir = work / "build"
    env = native_build.run_env(tree)
    native_build.imported_module(tree, env, module)
    zero_counters(build_dir)  # the check above ran the module's initialization once
    selected = native_build.selected_tests(tree, tests)
    print(f"native_coverage: running {' '.join(selected)}", flush=True)
    ran = native_build.run(native_build.pytest_command(selected, pytest_args), tree, env, echo=echo)
    if not any(build_dir.rglob("*.gcda")):
        raise NativeToolError(
            f"no coverage counters were written: the tests never loaded {module}\n"
            f"{native_build.tail(ran.output)}"
        )
    report = native_build.run(gcovr_command(build_dir, work, html), tree)
    if not report.ok:
        raise NativeToolError(f"gcovr failed:\n{native_build.tail(report.output)}")
    summary = json.loads((work / "coverage.json").read_text())
    return read_summary(summary, native_build.native_sources(tree)), ran.ok


def report(coverage: Coverage, minimum: float, tests_passed: bool) -> bool:
    """Print the coverage; True when the tests passed and the total is at least
    `minimum` percent."""
    for f in coverage.files:
        print(f"{f.path:40} {f.covered:>6} / {f.total:<6} {f.percent:6.1f}%")
    for path in coverage.without_data:
        print(f"{path:40} no coverage data (no code of it was compiled and loaded)")
    ok = tests_passed and coverage.total > 0 and coverage.percent >= minimum
    verdict = "ok" if ok else "FAIL"
    print(
        f"native line coverage: {coverage.covered} / {coverage.total} = "
        f"{coverage.percent:.1f}% (minimum {minimum:g}%): {verdict}"
    )
    if not tests_passed:
        print("native_coverage: a test failed (see above)")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the native core's line coverage and gate it on ``--min``."""
    parser = argparse.ArgumentParser(prog="python -m tools.native_coverage", description=__doc__)
    parser.add_argument("--min", type=float, default=95.0, help="minimum line coverage, percent")
    native_build.add_run_arguments(parser, WORK)
    parser.add_argument("--html", action="store_true", help="also an annotated HTML report")
    args = parser.parse_args(argv)
    try:
        coverage, passed = measure(ROOT, args.work_dir, args.tests, args.pytest_arg, args.html)
    except NativeToolError as exc:
        print(f"native_coverage: {exc}", file=sys.stderr)
        return 2
    text = (args.work_dir / "coverage.txt").read_text()
    print(text.rstrip())
    ok = report(coverage, args.min, passed)
    if args.html:
        print(f"annotated sources: {args.work_dir / 'html' / 'index.html'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
