"""Mutation-testing gate: ``python -m tools.mutation [--threshold 90] [--paths FILE ...]``.

Runs mutmut (3.x, configured in ``pyproject.toml`` ``[tool.mutmut]``) over the
core modules (``cache/*.py`` minus the CLI, replay, workload, demo and test-kit
modules, plus ``spec/lifecycle.py``), or only over ``--paths``; then reads
mutmut's per-file results (``mutants/<file>.meta``), prints one score per file
and exits 1 when any file scores under ``--threshold`` percent.

Score of a file = killed / (killed + survived + no tests + suspicious), where
killed counts timeouts too, and mutants listed in ``tools/equivalent_mutants.txt``
(one mutmut mutant name per line, ``#`` comments; each an accepted equivalent
mutant with its reason in docs/testing.md) are left out of the denominator.
Not part of ``.ci/run``: a run over the whole core takes many minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT = Path(__file__).resolve().parent / "equivalent_mutants.txt"

KILLED = {1, 3, 36, 37, -24, 24, 152, 255}  # failed, internal error, timeouts, type check
SURVIVED = {0}
NO_TESTS = {5, 33}
NOT_COUNTED = {34, None, 2}  # skipped, not checked, interrupted


@dataclass
class FileScore:
    """Mutant outcomes of one source file."""

    path: str
    killed: int = 0
    survived: list[str] = field(default_factory=list)
    no_tests: list[str] = field(default_factory=list)
    suspicious: list[str] = field(default_factory=list)
    equivalent: int = 0
    not_counted: int = 0

    @property
    def counted(self) -> int:
        """Mutants in the denominator."""
        return self.killed + len(self.survived) + len(self.no_tests) + len(self.suspicious)

    @property
    def score(self) -> float:
        """Percent killed (100 when nothing was counted)."""
        return 100.0 * self.killed / self.counted if self.counted else 100.0


def core_paths(root: Path = ROOT) -> list[str]:
    """The files `[tool.mutmut]` mutates (only_mutate minus do_not_mutate), sorted."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    found: list[str] = []
    for source in config["source_paths"]:
        for file in sorted((root / source).rglob("*.py")):
            rel = file.relative_to(root).as_posix()
            if not any(fnmatch.fnmatch(rel, p) for p in config.get("only_mutate", ["*"])):
                continue
            if any(fnmatch.fnmatch(rel, p) for p in config.get("do_not_mutate", [])):
                continue
            found.append(rel)
    return found


def mutant_glob(path: str) -> str:
    """mutmut's name pattern for every mutant of `path` (``cache/lru.py`` -> ``cache.lru.*``)."""
    if not path.endswith(".py"):
        raise ValueError(f"{path!r} is not a Python file")
    return path[: -len(".py")].replace("/", ".") + ".*"


def load_equivalent(path: Path = EQUIVALENT) -> set[str]:
    """Accepted equivalent mutant names (blank lines and ``#`` comments ignored)."""
    if not path.exists():
        return set()
    names = set()
    for line in path.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.add(name)
    return names


def score_file(path: str, exit_codes: dict[str, int | None], equivalent: set[str]) -> FileScore:
    """Classify every mutant of one file by mutmut's exit code."""
    result = FileScore(path)
    for name, code in sorted(exit_codes.items()):
        if name in equivalent:
            result.equivalent += 1
        elif code in KILLED:
            result.killed += 1
        elif code in SURVIVED:
            result.survived.append(name)
        elif code in NO_TESTS:
            result.no_tests.append(name)
        elif code in NOT_COUNTED:
            result.not_counted += 1
        else:
            result.suspicious.append(name)
    return result


def read_scores(paths: Sequence[str], root: Path = ROOT) -> list[FileScore]:
    """Scores from ``mutants/<path>.meta``; a file with no results scores 0 mutants."""
    equivalent = load_equivalent()
    scores = []
    for path in paths:
        meta = root / "mutants" / f"{path}.meta"
        codes: dict[str, int | None] = {}
        if meta.exists():
            codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        scores.append(score_file(path, codes, equivalent))
    return scores


def report(scores: Sequence[FileScore], threshold: float, verbose: bool) -> bool:
    """Print the table (and survivors when `verbose`); True when every file passes."""
    ok = True
    print(f"{'file':32} {'killed':>7} {'survived':>8} {'no tests':>8} {'equiv':>5} {'score':>7}")
    for s in scores:
        passed = s.score >= threshold and s.counted > 0
        ok &= passed
        print(
            f"{s.path:32} {s.killed:>7} {len(s.survived):>8} {len(s.no_tests):>8} "
            f"{s.equivalent:>5} {s.score:>6.1f}%{'' if passed else '  < threshold'}"
        )
        if verbose:
            for name in s.survived + s.no_tests + s.suspicious:
                print(f"    survived: {name}")
    killed = sum(s.killed for s in scores)
    counted = sum(s.counted for s in scores)
    total = 100.0 * killed / counted if counted else 100.0
    print(f"{'total':32} {killed:>7} {counted - killed:>8} {'':>8} {'':>5} {total:>6.1f}%")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """Run mutmut over the chosen files, print per-file scores, gate on the threshold."""
    parser = argparse.ArgumentParser(prog="python -m tools.mutation", description=__doc__)
    parser.add_argument("--threshold", type=float, default=90.0, help="percent per file")
    parser.add_argument("--paths", nargs="+", help="files to mutate (default: the core)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--report-only", action="store_true", help="read the last run's results")
    parser.add_argument("-v", "--verbose", action="store_true", help="list surviving mutants")
    args = parser.parse_args(argv)
    core = core_paths()
    paths = args.paths or core
    unknown = [p for p in paths if p not in core]
    if unknown:
        parser.error(f"not in the mutated core ([tool.mutmut]): {unknown}")
    if not args.report_only:
        # Derandomized, short Hypothesis runs: the covering tests run once per mutant.
        env = dict(os.environ, CI="true", HYPOTHESIS_PROFILE="mutation")
        command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)]
        command += [mutant_glob(p) for p in paths]
        done = subprocess.run(command, cwd=ROOT, env=env, check=False)
        if done.returncode != 0:
            print(f"mutmut exited with {done.returncode}", file=sys.stderr)
            return 2
    return 0 if report(read_scores(paths), args.threshold, args.verbose) else 1


if __name__ == "__main__":
    sys.exit(main())
