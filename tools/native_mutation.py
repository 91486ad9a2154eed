"""Mutation testing of the native core: ``python -m tools.native_mutation [--sample N]
[--seed S] [--paths FILE ...] [--threshold 90] [--record | --recorded] [-v]``.

**Mutants.** universalmutator's ``mutate FILE cpp --noCheck`` over each source file
of ``native/src/`` (its universal, C-like and C++ rules: operators and comparisons
swapped, constants changed, conditions forced, statements commented out, ``break``
and ``continue`` inserted, ...). Its C++ "handler" checks nothing, so many mutants
do not compile; they are found by building each. A mutant is named
``<file>:<12 hex digits>``, the digest of its change with two lines of context
around it (`tools.mutation.diff_digest`), not its number: a name stays the same
through edits elsewhere in the file, and names the same change on every machine
(a second identical change with identical context gets ``~2``).

**Sample.** ``--sample N`` scores N mutants in all: each file's share is in
proportion to its count of mutants (at least one each), drawn in an order
shuffled by ``--seed`` and the file's path, walking it until the share is scored
(a mutant that does not build, or builds the same binary, is passed over).
Without ``--sample`` every mutant is scored. The shares are computed over every
file of ``native/src/`` even with ``--paths``, so a file gets the same sample
whether it runs alone or with the others.

**Running a mutant.** In a private copy of the checkout (`tools.native_build`:
the checkout is never written), the file is replaced by the mutant and the module
rebuilt incrementally (ninja; ``--build-type``, default Release as shipped). Then:

- the build fails: *build failed*, not a mutant of any program, not counted;
- the module's bytes equal those of the unmutated build: *same binary* (the
  compiler made the same program: equivalent for certain), not counted;
- else the kill tests run (default ``tests/test_native*.py`` then
  ``tests/test_differential.py``, with ``-x``, ``CI=true``,
  ``HYPOTHESIS_PROFILE=mutation``, ``BLOCKTRIE_BACKEND=native``): a failing test,
  a crash, or a run past ``--timeout`` (default 10x the unmutated run, plus 60 s)
  *kills* it; passing, it *survives*.

The file is put back after each mutant, and the tree rebuilt unmutated at the end.
Score = killed / (killed + survived), over the files run; it exits 1 under
``--threshold`` percent. universalmutator's own ``analyze_mutants`` is not used: it
copies each mutant over the source it is given, and counts a mutant that does not
build as killed.

**Equivalent mutants** are listed in ``tools/native_equivalent_mutants.txt`` (one
name a line, ``#`` comments; each under a comment block that says why no test can
tell it from the original, as for ``tools/equivalent_mutants.txt``): left out of
the score and not run. A listed name that a run's file no longer produces is
stale: it is reported, and ``--record`` refuses to record the file until the list
is fixed.

**The record.** The whole run takes hours, and a build folder does not outlive the
machine: ``--record`` keeps each file's result in
``tools/native_mutation_scores.json`` (committed) with the SHA-256 of its source,
its accepted equivalents, the seed, the commit and the date (the list and the digests as the run
started: the checkout may be edited while it goes on). ``--recorded`` reports
and gates from that record (running nothing): a file whose bytes changed since,
whose list of equivalents changed, or that was never recorded, is unscored, and an
unscored file fails the gate. ``--list`` prints every mutant's name and change
(to write an equivalent's entry), building nothing.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import hashlib
import json
import random
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools import mutation, native_build
from tools.native_build import ROOT, NativeToolError

WORK = ROOT / "build" / "native-mutation"
RECORD = Path(__file__).resolve().parent / "native_mutation_scores.json"
EQUIVALENT = Path(__file__).resolve().parent / "native_equivalent_mutants.txt"
CONTEXT_LINES = 2
"""Lines of context around a mutant's change in the diff its name is the digest of."""

KILLED, SURVIVED, TIMED_OUT = "killed", "survived", "killed (timeout)"
BUILD_FAILED, SAME_BINARY, EQUIVALENT_LISTED = "build failed", "same binary", "equivalent"


@dataclass(frozen=True)
class Mutant:
    """One mutant of a source file: its name, where and what it changes, and the
    whole mutated text."""

    path: str
    name: str
    line: int
    before: str
    after: str
    text: str

    def describe(self) -> str:
        """``line N: <before> -> <after>`` (``line N: + <after>`` for an insertion
        before line N)."""
        if not self.before:
            return f"line {self.line}: + {self.after}"
        return f"line {self.line}: {self.before} -> {self.after}"


def _change(original: list[str], mutated: list[str]) -> tuple[int, str, str]:
    """The first changed line (1-based) of `mutated`, as it was and as it is."""
    matcher = difflib.SequenceMatcher(a=original, b=mutated, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            before = " ".join(line.strip() for line in original[i1:i2])
            after = " ".join(line.strip() for line in mutated[j1:j2])
            return i1 + 1, before, after
    raise ValueError("the mutant changes nothing")


def read_mutants(path: str, original: str, texts: Sequence[str]) -> list[Mutant]:
    """`Mutant`s of the file `path` (text `original`) from the mutated `texts`, in
    their order; texts equal to the original are dropped."""
    lines = original.splitlines()
    mutants: list[Mutant] = []
    seen: dict[str, int] = {}
    for text in texts:
        if text == original:
            continue
        mutated = text.splitlines()
        diff = difflib.unified_diff(lines, mutated, n=CONTEXT_LINES, lineterm="")
        digest = mutation.diff_digest("\n".join(diff))
        seen[digest] = seen.get(digest, 0) + 1
        suffix = f"~{seen[digest]}" if seen[digest] > 1 else ""
        line, before, after = _change(lines, mutated)
        mutants.append(Mutant(path, f"{path}:{digest}{suffix}", line, before, after, text))
    return mutants


def generate(root: Path, path: str) -> list[Mutant]:
    """Every mutant universalmutator makes of `path` (relative to `root`), in its
    order (``mutate FILE cpp --noCheck``)."""
    source = root / path
    with tempfile.TemporaryDirectory(prefix="native-mutants-") as folder:
        out = Path(folder) / "mutants"
        out.mkdir()
        command = ["mutate", str(source), "cpp", "--noCheck", "--mutantDir", f"{out}/"]
        done = native_build.run(command, cwd=Path(folder), timeout=600)
        if not done.ok:
            raise NativeToolError(f"mutate failed on {path}:\n{native_build.tail(done.output)}")
        files = sorted(out.iterdir(), key=lambda f: int(f.name.split(".mutant.")[1].split(".")[0]))
        texts = [f.read_text() for f in files]
    return read_mutants(path, source.read_text(), texts)


def shares(counts: Mapping[str, int], sample: int | None) -> dict[str, int | None]:
    """How many mutants of each file to score: None (all) without `sample`; else
    `sample` split in proportion to each file's count of mutants (largest
    remainders first, in file order on ties), at least one for a file that has
    any, never more than it has."""
    if sample is None:
        return dict.fromkeys(counts)
    total = sum(counts.values())
    if sample >= total:
        return dict(counts)
    exact = {path: sample * n / total for path, n in counts.items()}
    given = {path: int(share) for path, share in exact.items()}
    left = sample - sum(given.values())
    by_remainder = sorted(counts, key=lambda p: (-(exact[p] - given[p]), p))
    for path in by_remainder[:left]:
        given[path] += 1
    return {path: min(counts[path], max(given[path], 1 if counts[path] else 0)) for path in counts}


def sample_order(mutants: Sequence[Mutant], seed: int, path: str) -> list[Mutant]:
    """`mutants` shuffled by `seed` and `path` (the same on every machine)."""
    order = list(mutants)
    random.Random(f"{seed}:{path}").shuffle(order)
    return order


@dataclass
class NativeFileScore:
    """One source file's mutants as a run scored them."""

    path: str
    killed: int = 0
    timed_out: int = 0
    """Of `killed`: those whose tests ran past the time limit."""
    survived: dict[str, str] = field(default_factory=dict)
    """Name -> change (`Mutant.describe`) of each surviving mutant."""
    build_failed: int = 0
    same_binary: int = 0
    equivalent: int = 0
    mutants: int = 0
    """Mutants universalmutator made of the file."""
    share: int | None = None
    """Mutants to score (None: all of them)."""

    @property
    def counted(self) -> int:
        """Mutants in the denominator: killed or survived."""
        return self.killed + len(self.survived)

    @property
    def score(self) -> float:
        """Percent killed (100 when nothing was counted)."""
        return 100.0 * self.killed / self.counted if self.counted else 100.0

    def add(self, mutant: Mutant, outcome: str) -> None:
        """Count `mutant`'s `outcome`."""
        if outcome in (KILLED, TIMED_OUT):
            self.killed += 1
            self.timed_out += outcome == TIMED_OUT
        elif outcome == SURVIVED:
            self.survived[mutant.name] = mutant.describe()
        elif outcome == BUILD_FAILED:
            self.build_failed += 1
        elif outcome == SAME_BINARY:
            self.same_binary += 1
        elif outcome == EQUIVALENT_LISTED:
            self.equivalent += 1
        else:
            raise ValueError(f"unknown outcome {outcome!r}")


def score_file(
    path: str,
    mutants: Sequence[Mutant],
    share: int | None,
    seed: int,
    equivalent: set[str],
    outcome_of: Callable[[Mutant], str],
    progress: Callable[[Mutant, str], object] = lambda m, o: None,
) -> NativeFileScore:
    """Walk `path`'s mutants in `sample_order` until `share` of them are scored (all
    without a share), asking `outcome_of` for each not listed as `equivalent`."""
    result = NativeFileScore(path, mutants=len(mutants), share=share)
    for mutant in sample_order(mutants, seed, path):
        if share is not None and result.counted >= share:
            break
        outcome = EQUIVALENT_LISTED if mutant.name in equivalent else outcome_of(mutant)
        result.add(mutant, outcome)
        progress(mutant, outcome)
    return result


def listed_for(path: str, listing: Path = EQUIVALENT) -> list[str]:
    """`path`'s accepted equivalents (sorted names)."""
    return sorted(n for n in mutation.load_equivalent(listing) if n.startswith(f"{path}:"))


def snapshot_listing(listing: Path, work: Path) -> Path:
    """A copy of `listing` in `work` (empty when there is none): what a run scores
    with and records, whatever happens to `listing` meanwhile."""
    work.mkdir(parents=True, exist_ok=True)
    copy = work / "equivalents-at-start.txt"
    copy.write_bytes(listing.read_bytes() if listing.exists() else b"")
    return copy


def stale_equivalents(
    path: str, mutants: Sequence[Mutant], listing: Path = EQUIVALENT
) -> list[str]:
    """The accepted equivalents of `path` that none of its `mutants` is named."""
    names = {m.name for m in mutants}
    return [n for n in listed_for(path, listing) if n not in names]


class Runner:
    """Builds and tests mutants in a private copy of the checkout (`work/tree`,
    built in `work/build`)."""

    def __init__(
        self,
        root: Path,
        work: Path,
        tests: Sequence[str],
        build_type: str = "Release",
        timeout: float | None = None,
        pytest_args: Sequence[str] = (),
    ) -> None:
        self.root, self.work, self.tests, self.pytest_args = root, work, tests, pytest_args
        self.build_type, self.timeout = build_type, timeout
        self.build_dir = work / "build"
        self.tree = work / "tree"
        self.env: dict[str, str] = {}
        self.selected: list[str] = []
        self.binary = ""

    def _module_digest(self) -> str:
        return hashlib.sha256(native_build.built_module(self.build_dir).read_bytes()).hexdigest()

    def prepare(self) -> float:
        """Build the unmutated module, check that the tests import it and pass;
        returns their time (and sets the time limit from it, unless given)."""
        options = {"BLOCKTRIE_COVERAGE": "OFF", "BLOCKTRIE_SANITIZE": "OFF"}
        tree, module = native_build.build_module(self.root, self.work, self.build_type, options)
        self.binary = self._module_digest()
        self.env = native_build.run_env(tree, {"HYPOTHESIS_PROFILE": "mutation"})
        native_build.imported_module(tree, self.env, module)
        self.selected = native_build.selected_tests(tree, self.tests)
        baseline = native_build.run(self._tests_command(), tree, self.env)
        if not baseline.ok:
            raise NativeToolError(
                f"the kill tests fail without a mutant:\n{native_build.tail(baseline.output)}"
            )
        if self.timeout is None:
            self.timeout = 10 * baseline.seconds + 60
        return baseline.seconds

    def _tests_command(self) -> list[str]:
        return native_build.pytest_command(self.selected, ["-x", *self.pytest_args])

    def outcome(self, mutant: Mutant) -> str:
        """Build `mutant` into the tree's module and run the kill tests on it."""
        source = self.tree / mutant.path
        original = source.read_bytes()
        try:
            source.write_text(mutant.text)
            built = native_build.build(self.build_dir, timeout=600)
            if not built.ok:
                return BUILD_FAILED
            if self._module_digest() == self.binary:
                return SAME_BINARY
            native_build.install_module(native_build.built_module(self.build_dir), self.tree)
            ran = native_build.run(self._tests_command(), self.tree, self.env, self.timeout)
            if ran.returncode is None:
                return TIMED_OUT
            return SURVIVED if ran.ok else KILLED
        finally:
            source.write_bytes(original)

    def finish(self) -> None:
        """Rebuild and install the unmutated module (the tree as the checkout was)."""
        built = native_build.build(self.build_dir)
        if not built.ok:
            raise NativeToolError(f"the unmutated rebuild failed:\n{built.output}")
        native_build.install_module(native_build.built_module(self.build_dir), self.tree)


@dataclass
class Recorded:
    """One file's result as kept in `RECORD`, and what it was measured on."""

    score: NativeFileScore
    source_sha256: str
    equivalents: list[str]
    seed: int
    commit: str
    date: str


def load_record(path: Path = RECORD) -> dict[str, Recorded]:
    """The recorded results, by file (empty when there is no record yet)."""
    if not path.exists():
        return {}
    recorded = {}
    for file, entry in json.loads(path.read_text()).items():
        fields = {**entry, "score": NativeFileScore(**entry["score"])}
        recorded[file] = Recorded(**fields)
    return recorded


def save_record(
    scores: Sequence[NativeFileScore],
    seed: int,
    root: Path = ROOT,
    path: Path = RECORD,
    listing: Path = EQUIVALENT,
    measured: Mapping[str, str] | None = None,
) -> None:
    """Record `scores` over `path`'s entries for other files. `measured` gives each
    file's SHA-256 as the run read it (else the file's now)."""
    entries = json.loads(path.read_text()) if path.exists() else {}
    commit, today = mutation.head_commit(root), datetime.date.today().isoformat()
    for s in scores:
        entries[s.path] = asdict(
            Recorded(
                s,
                (measured or {}).get(s.path) or mutation.source_digest(s.path, root),
                listed_for(s.path, listing),
                seed,
                commit,
                today,
            )
        )
    mutation.write_record(entries, path)


def recorded_scores(
    paths: Sequence[str], root: Path = ROOT, path: Path = RECORD, listing: Path = EQUIVALENT
) -> tuple[list[NativeFileScore | None], dict[str, str]]:
    """Each file's recorded score (None: unscored) and a note: where it was recorded,
    or why it is unscored."""
    record = load_record(path)
    scores: list[NativeFileScore | None] = []
    notes = {}
    for file in paths:
        rec = record.get(file)
        if rec is None:
            scores.append(None)
            notes[file] = "never recorded"
        elif rec.source_sha256 != mutation.source_digest(file, root):
            scores.append(None)
            notes[file] = f"source changed since {rec.commit}"
        elif rec.equivalents != listed_for(file, listing):
            scores.append(None)
            notes[file] = f"accepted equivalents changed since {rec.commit}"
        else:
            scores.append(rec.score)
            notes[file] = f"recorded at {rec.commit}, {rec.date}, seed {rec.seed}"
    return scores, notes


def report(
    scores: Sequence[NativeFileScore | None],
    paths: Sequence[str],
    threshold: float,
    verbose: bool,
    notes: Mapping[str, str] | None = None,
) -> bool:
    """Print the table (and the survivors when `verbose`); True when every file is
    scored and the total is at least `threshold` percent."""
    print(
        f"{'file':32} {'killed':>6} {'survived':>8} {'equiv':>5} {'same bin':>8} "
        f"{'no build':>8} {'of':>6} {'score':>7}"
    )
    ok = True
    for path, s in zip(paths, scores, strict=True):
        note = f"  ({notes[path]})" if notes and path in notes else ""
        if s is None:
            ok = False
            print(f"{path:32} {'-':>58}  unscored{note}")
            continue
        shown = f"{s.score:>6.1f}%" if s.counted else f"{'-':>7}"
        print(
            f"{path:32} {s.killed:>6} {len(s.survived):>8} {s.equivalent:>5} "
            f"{s.same_binary:>8} {s.build_failed:>8} {s.mutants:>6} {shown}{note}"
        )
        if verbose:
            for name, change in s.survived.items():
                print(f"    survived: {name}  {change}")
    scored = [s for s in scores if s is not None]
    killed, counted = sum(s.killed for s in scored), sum(s.counted for s in scored)
    total = 100.0 * killed / counted if counted else 0.0
    ok = ok and counted > 0 and total >= threshold
    verdict = "ok" if ok else "FAIL"
    print(
        f"total: {killed} killed of {counted} scored = {total:.1f}% "
        f"(threshold {threshold:g}%): {verdict}"
    )
    return ok


def run_mutants(
    runner: Runner,
    paths: Sequence[str],
    sample: int | None,
    seed: int,
    listing: Path = EQUIVALENT,
    seen: Callable[[Mutant, str], object] = lambda m, o: None,
) -> tuple[list[NativeFileScore], dict[str, list[str]]]:
    """Generate the mutants of the runner's checkout, sample them, build and test
    those of `paths` (each outcome printed, and passed to `seen`); returns each
    file's score and its stale accepted equivalents."""
    every = native_build.native_sources(runner.root)
    mutants = {path: generate(runner.root, path) for path in every}
    share = shares({path: len(found) for path, found in mutants.items()}, sample)
    planned = sum(len(mutants[p]) if share[p] is None else share[p] or 0 for p in paths)
    print(f"native_mutation: {planned} mutant(s) to score in {len(paths)} file(s)", flush=True)
    seconds = runner.prepare()
    print(
        f"kill tests: {' '.join(runner.selected)} ({seconds:.1f} s unmutated, "
        f"limit {runner.timeout:.0f} s)",
        flush=True,
    )
    equivalent = mutation.load_equivalent(listing)
    done = 0

    def progress(mutant: Mutant, outcome: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done}] {mutant.name} {mutant.describe()[:80]}: {outcome}", flush=True)
        seen(mutant, outcome)

    scores = []
    try:
        for path in paths:
            scores.append(
                score_file(
                    path, mutants[path], share[path], seed, equivalent, runner.outcome, progress
                )
            )
    finally:
        runner.finish()
    stale = {path: stale_equivalents(path, mutants[path], listing) for path in paths}
    return scores, {path: names for path, names in stale.items() if names}


def main(argv: Sequence[str] | None = None) -> int:
    """Score the native core's mutants (or the record), and gate on the threshold."""
    parser = argparse.ArgumentParser(prog="python -m tools.native_mutation", description=__doc__)
    parser.add_argument("--sample", type=int, help="mutants to score in all (default: every one)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--paths", nargs="+", help="files of native/src to run (default: all)")
    parser.add_argument("--threshold", type=float, default=90.0, help="percent, over all files")
    parser.add_argument("--record", action="store_true", help=f"keep results in {RECORD.name}")
    parser.add_argument("--recorded", action="store_true", help="gate from the record, run nothing")
    parser.add_argument("--list", action="store_true", help="print every mutant's name and change")
    parser.add_argument("--timeout", type=float, help="seconds for a mutant's tests")
    parser.add_argument(
        "--build-type", default="Release", help="CMAKE_BUILD_TYPE (default Release)"
    )
    native_build.add_run_arguments(parser, WORK)
    parser.add_argument("-v", "--verbose", action="store_true", help="list surviving mutants")
    args = parser.parse_args(argv)
    if args.record and args.recorded:
        parser.error("--record keeps a run's results; --recorded reads them back: pick one")
    every = native_build.native_sources(ROOT)
    paths = args.paths or every
    unknown = [p for p in paths if p not in every]
    if unknown:
        parser.error(f"not a source of the native core ({native_build.SOURCE_DIR}): {unknown}")
    if args.recorded:
        recorded, notes = recorded_scores(paths, ROOT, RECORD, EQUIVALENT)
        return 0 if report(recorded, paths, args.threshold, args.verbose, notes) else 1
    try:
        if args.list:
            for path in paths:
                for mutant in generate(ROOT, path):
                    print(f"{mutant.name}  {mutant.describe()}")
            return 0
        runner = Runner(
            ROOT, args.work_dir, args.tests, args.build_type, args.timeout, args.pytest_arg
        )
        # The list and the sources as the run starts: the run scores and the record
        # keeps these, even if the checkout is edited while the run goes on (an hour).
        listing = snapshot_listing(EQUIVALENT, args.work_dir)
        measured = {path: mutation.source_digest(path, ROOT) for path in paths}
        scores, stale = run_mutants(runner, paths, args.sample, args.seed, listing)
    except NativeToolError as exc:
        print(f"native_mutation: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("native_mutation: interrupted; nothing recorded", file=sys.stderr)
        return 130
    for names in stale.values():
        for name in names:
            print(f"stale accepted equivalent (no such mutant now): {name}", file=sys.stderr)
    ok = report(scores, paths, args.threshold, args.verbose)
    if args.record:
        if stale:
            print(f"not recorded: fix {EQUIVALENT.name} first", file=sys.stderr)
            return 1
        save_record(scores, args.seed, ROOT, RECORD, listing, measured)
        print(f"recorded {len(scores)} file(s) in {RECORD}")
        for path in paths:
            if mutation.source_digest(path, ROOT) != measured[path]:
                print(
                    f"{path} changed during the run: recorded for the source it ran on "
                    "(`--recorded` counts it as unscored)",
                    file=sys.stderr,
                )
        if listing.read_bytes() != (EQUIVALENT.read_bytes() if EQUIVALENT.exists() else b""):
            print(
                f"{EQUIVALENT.name} changed during the run: recorded with the list it "
                "started with (`--recorded` counts a file whose entries changed as unscored)",
                file=sys.stderr,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
