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
A file passes when it scores at least the threshold *and* every one of its
mutants was run: a partial run is reported with its count of mutants not run,
and fails.

Not part of ``.ci/run``: a run over the whole core takes hours on 2 cores, and
``mutants/`` does not outlive the machine. ``--record`` therefore keeps each
file's result in ``tools/mutation_scores.json`` (committed), with the SHA-256
of the source it was measured on; ``--recorded`` reports and gates from that
record, where a file whose source has changed since (or that was never
recorded) counts as unscored. A file edited while mutmut runs (it copied the
sources when it started) is left out of that run's record. A record stays valid
while the file's code is unchanged: tests are only ever added, which can kill
more, never fewer. What
counts as its code is what mutmut mutates and runs (`code_digest`): editing a
docstring or a comment keeps the record; any other edit, or a ``pragma: no
mutate`` line added or changed, voids it.

Accepted equivalents are named by mutmut's names (function and number), and an
edit to a function renumbers its mutants: an entry may then name another
mutant, silently left out of the score. So each entry is *pinned* to the diff
it was accepted for (a trailing ``# diff <12 hex digits>``, `diff_digest`):
``--show-equivalents`` prints each entry's reason, its diff now and whether
that still matches its pin (and, where it does not, which mutants of the same
function have the pinned diff now); ``--pin-equivalents --paths FILE`` pins a file's
entries to their diffs now, once they have been read; ``--record`` refuses to
record a file whose entries are unpinned, gone or changed; and a record keeps
the file's entries with their pins, so that ``--recorded`` counts the file as
unscored when its list has changed since (an entry added or removed changes
what the score means). ``--rekey`` brings records made before a rule up to it:
the code digest where the file's bytes are still the ones measured, and the
accepted equivalents where the record holds and all of them are pinned.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import fnmatch
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT = Path(__file__).resolve().parent / "equivalent_mutants.txt"
RECORD = Path(__file__).resolve().parent / "mutation_scores.json"

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

    def passes(self, threshold: float) -> bool:
        """At or above `threshold`, with mutants counted and none left unrun."""
        return self.score >= threshold and self.counted > 0 and self.not_counted == 0


@dataclass
class Recorded:
    """One file's result as kept in `RECORD`: the score, and what it was measured on."""

    score: FileScore
    source_sha256: str
    commit: str
    date: str
    code_sha256: str = ""
    """`code_digest` of the source (empty in a record made before it existed)."""
    equivalents: dict[str, str | None] | None = None
    """The file's accepted equivalents and their pins when it was recorded
    (`listed_for`; None in a record made before pins existed)."""


def source_digest(path: str, root: Path = ROOT) -> str:
    """SHA-256 (hex) of the file's bytes; "" when it does not exist."""
    file = root / path
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.exists() else ""


class _WithoutStringStatements(ast.NodeTransformer):
    """Drops the statements that are only a triple-quoted string (docstrings,
    attribute docstrings): mutmut never mutates a triple-quoted string, and as a
    statement it does nothing."""

    def __init__(self, text: str) -> None:
        self._text = text

    def visit_Expr(self, node: ast.Expr) -> ast.Expr | None:
        value = node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            literal = (ast.get_source_segment(self._text, value) or "").lstrip("rRuU")
            if literal.startswith(('"""', "'''")) and literal.endswith(literal[:3]):
                return None
        return node


def code_digest(path: str, root: Path = ROOT) -> str:
    """SHA-256 (hex) of what mutmut mutates and runs in the file; "" when it does
    not exist.

    The digest covers the syntax tree (`ast.dump`: no comments, no layout) less
    its triple-quoted string statements (`_WithoutStringStatements`), and every
    line that says ``pragma: no mutate`` (a comment that decides which mutants
    exist). So it changes with any edit to code, and not with one to a
    docstring or a comment. A file that does not parse is digested as bytes.
    """
    file = root / path
    if not file.exists():
        return ""
    text = file.read_text()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return "bytes:" + source_digest(path, root)
    code = ast.dump(_WithoutStringStatements(text).visit(tree))
    pragmas = [line.strip() for line in text.splitlines() if "pragma: no mutate" in line]
    return hashlib.sha256("\n".join([code, *pragmas]).encode()).hexdigest()


def head_commit(root: Path) -> str:
    """The short hash of `root`'s HEAD ("unknown" outside a git checkout)."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def load_record(path: Path = RECORD) -> dict[str, Recorded]:
    """The recorded results, by file (empty when there is no record yet)."""
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())
    recorded = {}
    for file, entry in entries.items():
        score = FileScore(**entry["score"])
        recorded[file] = Recorded(
            score,
            entry["source_sha256"],
            entry["commit"],
            entry["date"],
            entry.get("code_sha256", ""),
            entry.get("equivalents"),
        )
    return recorded


def holds(rec: Recorded, file: str, root: Path = ROOT) -> bool:
    """Whether `rec` still speaks for `file`: its bytes are unchanged, or its code
    digest matches. (`ast.dump` differs between Python versions, so under another
    Python than the one that recorded it only the bytes can match; the project
    records with 3.11.)"""
    if rec.source_sha256 == source_digest(file, root):
        return True
    return bool(rec.code_sha256) and rec.code_sha256 == code_digest(file, root)


def write_record(entries: dict[str, object], path: Path) -> None:
    """Write the record's entries, sorted by file (one stable layout for diffs)."""
    path.write_text(json.dumps(dict(sorted(entries.items())), indent=1) + "\n")


def save_record(
    scores: Sequence[FileScore],
    root: Path = ROOT,
    path: Path = RECORD,
    listing: Path = EQUIVALENT,
) -> list[FileScore]:
    """Record `scores` (files with results only) over `path`'s entries; returns those
    recorded. Each entry keeps the source's SHA-256, its `code_digest`, the file's
    accepted equivalents with their pins, the commit and the date."""
    entries = json.loads(path.read_text()) if path.exists() else {}
    commit = head_commit(root)
    today = datetime.date.today().isoformat()
    kept = [s for s in scores if s.counted or s.not_counted]
    for s in kept:
        entries[s.path] = {
            "score": asdict(s),
            "source_sha256": source_digest(s.path, root),
            "code_sha256": code_digest(s.path, root),
            "equivalents": listed_for(s.path, listing),
            "commit": commit,
            "date": today,
        }
    write_record(entries, path)
    return kept


def rekey_record(root: Path = ROOT, path: Path = RECORD, listing: Path = EQUIVALENT) -> list[str]:
    """Bring entries made before a rule up to it; returns the files changed.

    - The code digest, for every entry that has none and whose file's bytes are
      still the ones measured.
    - The file's accepted equivalents, for every entry that has none, still holds,
      and whose equivalents are all pinned (`pin_equivalents`, after reading them
      with `show_equivalents`: the pins say each name was read against its diff)
      and as many as the run left out of the score.

    Other entries are left as they are (unscored until measured again)."""
    if not path.exists():
        return []
    entries = json.loads(path.read_text())
    rekeyed = []
    for file, entry in entries.items():
        changed = False
        if not entry.get("code_sha256") and entry["source_sha256"] == source_digest(file, root):
            entry["code_sha256"] = code_digest(file, root)
            changed = True
        listed = listed_for(file, listing)
        counted = entry["score"].get("equivalent", 0)  # what the run left out
        if "equivalents" not in entry and all(listed.values()) and len(listed) == counted:
            rec = Recorded(
                FileScore(file), entry["source_sha256"], "", "", entry.get("code_sha256", "")
            )
            if holds(rec, file, root):
                entry["equivalents"] = listed
                changed = True
        if changed:
            rekeyed.append(file)
    write_record(entries, path)
    return rekeyed


def recorded_scores(
    paths: Sequence[str], root: Path = ROOT, path: Path = RECORD, listing: Path = EQUIVALENT
) -> tuple[list[FileScore], dict[str, str]]:
    """Scores from the record, and a note per file: where it was recorded, or why it
    counts as unscored (never recorded, its source changed since, or its accepted
    equivalents or their pins differ from those it was recorded with: each is left
    out of the score, so a changed list changes what the score means)."""
    record = load_record(path)
    scores, notes = [], {}
    for file in paths:
        rec = record.get(file)
        if rec is None:
            scores.append(FileScore(file))
            notes[file] = "never recorded"
        elif not holds(rec, file, root):
            scores.append(FileScore(file))
            notes[file] = f"source changed since {rec.commit}"
        elif rec.equivalents != listed_for(file, listing):
            scores.append(FileScore(file))
            notes[file] = (
                f"equivalents not recorded ({rec.commit}): --rekey after pinning them"
                if rec.equivalents is None
                else f"accepted equivalents changed since {rec.commit}"
            )
        else:
            scores.append(rec.score)
            notes[file] = f"recorded at {rec.commit}, {rec.date}"
    return scores, notes


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


def equivalent_reasons(path: Path = EQUIVALENT) -> list[tuple[str, list[str]]]:
    """Each accepted equivalent with the comment lines of the block it is listed
    under (its reason), in file order."""
    if not path.exists():
        return []
    entries: list[tuple[str, list[str]]] = []
    reason: list[str] = []
    after_name = False
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text:
            reason, after_name = [], False
        elif text.startswith("#"):
            if after_name:  # a new reason right after the previous block's names
                reason, after_name = [], False
            reason.append(text)
        else:
            entries.append((text.split("#", 1)[0].strip(), list(reason)))
            after_name = True
    return entries


_PIN = re.compile(r"#\s*diff\s+([0-9a-f]{12})\b")
"""An entry's pin: a trailing ``# diff <12 hex digits>`` comment (`diff_digest`)."""


def diff_digest(diff: str) -> str:
    """12 hex digits of the SHA-256 of a mutant's diff, without its headers (the
    file names and the hunk's line numbers): what the mutant changes, and the
    lines around it."""
    body = [
        line.rstrip() for line in diff.splitlines() if not line.startswith(("---", "+++", "@@"))
    ]
    return hashlib.sha256("\n".join(body).encode()).hexdigest()[:12]


def equivalent_pins(path: Path = EQUIVALENT) -> dict[str, str | None]:
    """Each accepted equivalent's pinned diff digest (None when it has no pin)."""
    if not path.exists():
        return {}
    pins: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            pin = _PIN.search(line)
            pins[name] = pin.group(1) if pin else None
    return pins


def _modules(paths: Sequence[str]) -> tuple[str, ...]:
    return tuple(mutant_glob(p)[:-1] for p in paths)


def _current_digest(name: str, diff_of: Callable[[str], str]) -> str | None:
    """The digest of `name`'s diff now; None when mutmut has no such mutant."""
    try:
        return diff_digest(diff_of(name))
    except Exception:  # a name mutmut no longer has
        return None


def stale_equivalents(
    paths: Sequence[str], diff_of: Callable[[str], str], listing: Path = EQUIVALENT
) -> list[tuple[str, str]]:
    """The accepted equivalents of `paths` whose pin does not match their diff now,
    with why: not pinned, no such mutant now, or a diff changed since it was pinned
    (an edit renumbered the function's mutants, so the name now means another)."""
    modules = _modules(paths)
    stale = []
    for name, pin in equivalent_pins(listing).items():
        if not name.startswith(modules):
            continue
        now = _current_digest(name, diff_of)
        if now is None:
            stale.append((name, "no such mutant now"))
        elif pin is None:
            stale.append((name, f"not pinned (its diff now: {now})"))
        elif pin != now:
            stale.append((name, f"pinned to diff {pin}, but its diff now is {now}"))
    return stale


def pin_equivalents(
    paths: Sequence[str], diff_of: Callable[[str], str], listing: Path = EQUIVALENT
) -> list[str]:
    """Pin every accepted equivalent of `paths` to its diff now (after reading it
    with `show_equivalents`), rewriting only those entries' lines (the pin takes the
    place of any trailing comment: reasons belong in the comment block above);
    returns the names pinned. Raises `ValueError`, writing nothing, for a name
    mutmut does not have."""
    modules = _modules(paths)
    lines = listing.read_text().splitlines()
    pinned = []
    for i, line in enumerate(lines):
        name = line.split("#", 1)[0].strip()
        if not name or not name.startswith(modules):
            continue
        now = _current_digest(name, diff_of)
        if now is None:
            raise ValueError(f"{name}: no such mutant now; remove it from {listing.name}")
        lines[i] = f"{name}  # diff {now}"
        pinned.append(name)
    listing.write_text("\n".join(lines) + "\n")
    return pinned


def listed_for(file: str, listing: Path = EQUIVALENT) -> dict[str, str | None]:
    """`file`'s accepted equivalents with their pins (what a record keeps)."""
    module = _modules([file])
    return {n: p for n, p in equivalent_pins(listing).items() if n.startswith(module)}


def _exit_codes(path: str, root: Path = ROOT) -> dict[str, int | None]:
    """mutmut's exit code of each mutant of `path` (``mutants/<path>.meta``; None for
    one not run); empty when no run left the file."""
    meta = root / "mutants" / f"{path}.meta"
    if not meta.exists():
        return {}
    codes: dict[str, int | None] = json.loads(meta.read_text()).get("exit_code_by_key", {})
    return codes


def mutant_names(paths: Sequence[str], root: Path = ROOT) -> list[str]:
    """Every mutant name a run left in ``mutants/<path>.meta`` for `paths`, sorted."""
    return sorted(name for path in paths for name in _exit_codes(path, root))


def _function_of(name: str) -> str:
    """A mutant name without its number (``m.x_f__mutmut_3`` -> ``m.x_f__mutmut_``)."""
    return name.rstrip("0123456789")


def pinned_diff_now_at(
    name: str, pin: str, names: Sequence[str], diff_of: Callable[[str], str]
) -> list[str]:
    """The mutants of `name`'s function (among `names`) whose diff now has the digest
    `pin`: where a renumbered entry's mutant went, so it can be renamed."""
    function = _function_of(name)
    return [
        other
        for other in names
        if other != name
        and _function_of(other) == function
        and _current_digest(other, diff_of) == pin
    ]


def show_equivalents(
    paths: Sequence[str],
    diff_of: Callable[[str], str],
    out: Callable[[str], object] = print,
    listing: Path = EQUIVALENT,
    names: Sequence[str] = (),
) -> int:
    """Print each accepted equivalent of `paths` under its reason, with the diff its
    name gives now (`diff_of`, mutmut's; needs `mutants/` from a run): an entry
    names a mutant by function and number, and an edit to the function renumbers
    its mutants, so read the diffs against the reasons after any such edit.
    For a pinned entry whose name now gives another diff (or none), the mutants of
    its function among `names` (`mutant_names`) whose diff is the pinned one are
    named: where the accepted mutant went. Returns how many entries were shown."""
    modules = _modules(paths)
    pins = equivalent_pins(listing)
    shown = 0
    last: list[str] | None = None
    for name, reason in equivalent_reasons(listing):
        if not name.startswith(modules):
            continue
        if reason != last:
            out("")
            for text in reason:
                out(text)
            last = reason
        pin = pins.get(name)
        now: str | None = None
        try:
            diff = diff_of(name)
        except Exception as exc:  # a name mutmut no longer has: stale for sure
            diff = f"-?\n+? no such mutant now ({type(exc).__name__}: {exc})"
            status = "no such mutant"
        else:
            now = diff_digest(diff)
            status = (
                f"not pinned; diff {now}"
                if pin is None
                else f"pinned, diff {now}"
                if pin == now
                else f"CHANGED: pinned to diff {pin}, diff now {now}"
            )
        if pin is not None and pin != now:
            moved = pinned_diff_now_at(name, pin, names, diff_of)
            if moved:
                status += f"; the pinned diff is now {', '.join(moved)}"
            elif names:
                status += "; no mutant of its function has the pinned diff now"
        out(f"  {name}  [{status}]")
        for change in diff.splitlines():
            if change[:1] in "+-" and not change.startswith(("---", "+++")):
                out(f"      {change}")
        shown += 1
    return shown


def _mutmut_diff(name: str) -> str:  # pragma: no cover - needs a mutmut run's mutants/
    from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant

    return str(get_diff_for_mutant(name, path=find_mutant(name).path))


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


def read_scores(
    paths: Sequence[str], root: Path = ROOT, listing: Path = EQUIVALENT
) -> list[FileScore]:
    """Scores from ``mutants/<path>.meta``; a file with no results scores 0 mutants."""
    equivalent = load_equivalent(listing)
    scores = []
    for path in paths:
        scores.append(score_file(path, _exit_codes(path, root), equivalent))
    return scores


def report(
    scores: Sequence[FileScore],
    threshold: float,
    verbose: bool,
    notes: dict[str, str] | None = None,
) -> bool:
    """Print the table (and survivors when `verbose`); True when every file passes."""
    ok = True
    print(
        f"{'file':32} {'killed':>7} {'survived':>8} {'no tests':>8} {'equiv':>5} "
        f"{'not run':>7} {'score':>7}"
    )
    for s in scores:
        passed = s.passes(threshold)
        ok &= passed
        if passed:
            why = ""
        elif not s.counted and not s.not_counted:
            why = "  unscored"
        elif s.not_counted:
            why = "  not fully run"
        else:
            why = "  < threshold"
        note = f"  ({notes[s.path]})" if notes and s.path in notes else ""
        shown = f"{s.score:>6.1f}%" if s.counted else f"{'-':>7}"
        print(
            f"{s.path:32} {s.killed:>7} {len(s.survived):>8} {len(s.no_tests):>8} "
            f"{s.equivalent:>5} {s.not_counted:>7} {shown}{why}{note}"
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
    parser.add_argument(
        "--record",
        action="store_true",
        help=f"keep the results in {RECORD.relative_to(ROOT)} (with each source's SHA-256)",
    )
    parser.add_argument(
        "--recorded",
        action="store_true",
        help="report and gate from the record instead of mutants/ (runs nothing)",
    )
    parser.add_argument(
        "--rekey",
        action="store_true",
        help="give records made before code digests theirs, where the file is unchanged",
    )
    parser.add_argument(
        "--show-equivalents",
        action="store_true",
        help="print each accepted equivalent's reason and its mutant's diff now (after a run)",
    )
    parser.add_argument(
        "--pin-equivalents",
        action="store_true",
        help="pin each accepted equivalent of --paths to its mutant's diff now (after a run, "
        "once --show-equivalents has been read)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="list surviving mutants")
    args = parser.parse_args(argv)
    if args.record and args.recorded:
        parser.error("--record keeps a run's results; --recorded reads them back: pick one")
    if args.show_equivalents or args.pin_equivalents:
        os.chdir(ROOT)  # mutmut reads its configuration and mutants/ from here
        if args.pin_equivalents:
            if not args.paths:
                parser.error("--pin-equivalents pins the files given with --paths")
            pinned = pin_equivalents(args.paths, _mutmut_diff, EQUIVALENT)
            print(f"pinned {len(pinned)} accepted equivalent(s) in {EQUIVALENT.name}")
        else:
            shown = args.paths or core_paths()
            show_equivalents(shown, _mutmut_diff, listing=EQUIVALENT, names=mutant_names(shown))
        return 0
    if args.rekey:
        rekeyed = rekey_record(ROOT, RECORD, EQUIVALENT)
        print(f"rekeyed {len(rekeyed)} file(s) in {RECORD.relative_to(ROOT)}")
        return 0
    core = core_paths()
    paths = args.paths or core
    unknown = [p for p in paths if p not in core]
    if unknown:
        parser.error(f"not in the mutated core ([tool.mutmut]): {unknown}")
    if args.recorded:
        scores, notes = recorded_scores(paths, ROOT, RECORD, EQUIVALENT)
        return 0 if report(scores, args.threshold, args.verbose, notes) else 1
    measured = {p: source_digest(p, ROOT) for p in paths}  # what mutmut copies and runs
    if not args.report_only:
        # Derandomized, short Hypothesis runs: the covering tests run once per mutant.
        # The accepted equivalents run no tests (tests/conftest.py): they are left
        # out of every score, so running them would only spend time.
        env = dict(
            os.environ,
            CI="true",
            HYPOTHESIS_PROFILE="mutation",
            BLOCKTRIE_EQUIVALENT_MUTANTS=str(EQUIVALENT),
        )
        command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)]
        command += [mutant_glob(p) for p in paths]
        done = subprocess.run(command, cwd=ROOT, env=env, check=False)
        if done.returncode != 0:
            print(f"mutmut exited with {done.returncode}", file=sys.stderr)
            return 2
    scores = read_scores(paths, ROOT, EQUIVALENT)
    if args.record and not args.report_only:
        edited = [p for p in paths if source_digest(p, ROOT) != measured[p]]
        for p in edited:
            print(f"{p} changed during the run: not recorded (run it again)", file=sys.stderr)
        scores = [s for s in scores if s.path not in edited]
    if args.record:
        os.chdir(ROOT)
        with_results = [s.path for s in scores if s.counted or s.not_counted]
        stale = stale_equivalents(with_results, _mutmut_diff, EQUIVALENT)
        if stale:
            for name, why in stale:
                print(f"stale accepted equivalent: {name}: {why}", file=sys.stderr)
            print(
                "not recorded: read them with --show-equivalents, fix the list, then "
                "--pin-equivalents --paths FILE",
                file=sys.stderr,
            )
            return 1
        kept = save_record(scores, ROOT, RECORD, EQUIVALENT)
        print(f"recorded {len(kept)} file(s) in {RECORD.relative_to(ROOT)}")
    return 0 if report(scores, args.threshold, args.verbose) else 1


if __name__ == "__main__":
    sys.exit(main())
