"""Hypothesis profiles and shared fixtures.

Profiles: `ci` (derandomized, loaded when CI=true), `dev` (the default),
`fuzz` (long runs: HYPOTHESIS_PROFILE=fuzz python -m pytest tests; 2,000 examples
a test, or FUZZ_MAX_EXAMPLES), and
`mutation` (derandomized and short, for `python -m tools.mutation`, which runs
the covering tests once per mutant).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Generator, Mapping
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from bench import default_traces_dir

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("FUZZ_MAX_EXAMPLES", "2000")),
    stateful_step_count=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "mutation",
    derandomize=True,
    max_examples=20,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
_default = "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))

TRACES = default_traces_dir()


def _mutmut_durations() -> Mapping[str, float]:
    """Each test's duration from mutmut's stats run (read, not copied), or {} outside
    a mutmut worker."""
    try:
        from mutmut.state import state
    except ImportError:  # pragma: no cover - mutmut is the `mutation` extra
        return {}
    return state().duration_by_test


def _accepted_equivalents() -> set[str]:
    """The mutants `tools/equivalent_mutants.txt` accepts as equivalent, when
    `tools.mutation` names that file in `BLOCKTRIE_EQUIVALENT_MUTANTS` (read anew
    for each mutant, so names added during a run count at once); else none."""
    listed = os.environ.get("BLOCKTRIE_EQUIVALENT_MUTANTS")
    if not listed or not Path(listed).is_file():
        return set()
    lines = Path(listed).read_text().splitlines()
    return {name for line in lines if (name := line.split("#", 1)[0].strip())}


MUTANT_SKIP_ABOVE_S = 60.0
"""Under a mutant, tests whose stats-run duration exceeds this are not run (unless
they are all a mutant has)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under mutmut (`MUTANT_UNDER_TEST` set), run a mutant's tests fastest first, and
    leave out the few that take minutes.

    mutmut's fork-server workers run a mutant's covering tests in no set order
    (they come from a set) and stop at the first failure (`-x`), so one slow
    stateful test first can cost minutes for a mutant a 5 ms contract test
    kills. Ordering by the durations of mutmut's own stats run puts the cheap
    kills first. Tests without a recorded duration go last, in collection order.

    A surviving mutant runs every covering test, and three tests (processes
    started to compare hashes across `PYTHONHASHSEED`s and to import the core
    alone, and a million fault-injector checks) took over a minute each in the
    stats run: half the suite's time, paid again for each survivor of
    `cache/trie.py`. Under a mutant, tests slower than `MUTANT_SKIP_ABOVE_S` are
    deselected, unless that would leave none. Running fewer tests can only kill
    fewer mutants: a score measured this way is never higher than the full
    suite's.

    An accepted equivalent mutant (`_accepted_equivalents`) runs no test at all:
    every score leaves it out, and it would survive every test, the costliest
    outcome.
    """
    if "MUTANT_UNDER_TEST" not in os.environ:
        return
    durations = _mutmut_durations()
    if not durations:
        return
    slow = float("inf")
    items.sort(key=lambda item: durations.get(item.nodeid, slow))
    mutant = os.environ["MUTANT_UNDER_TEST"]
    if "__mutmut_" not in mutant:
        return
    if mutant in _accepted_equivalents():
        keep: list[pytest.Item] = []
    else:
        keep = [i for i in items if durations.get(i.nodeid, 0.0) <= MUTANT_SKIP_ABOVE_S]
        keep = keep or items  # never none of a mutant's tests: the slow ones then run
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
        items[:] = keep


MUTANT_SLOWDOWN = 10.0
"""Under mutmut, a test that takes more than this many times its recorded duration
(plus `MUTANT_GRACE_S`) of CPU fails, so its mutant counts as killed."""
MUTANT_GRACE_S = 5.0


class MutantTooSlow(Exception):
    """A test ran far past its recorded duration under a mutant (a hang, usually)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """Under a mutant, give each test `MUTANT_SLOWDOWN` x its duration in mutmut's stats
    run plus `MUTANT_GRACE_S` seconds of CPU time (`ITIMER_PROF`), then fail it.

    mutmut's own limit is on a mutant's whole run: 4 x the summed durations of
    every covering test, many minutes for a `cache/trie.py` mutant that loops
    forever in the first test. This one stops that test within seconds. Its
    verdict is the one mutmut gives a timeout, which `tools.mutation` already
    counts as killed: the mutant changed behaviour a test can see (it hangs, or
    runs 10x slower). Outside a mutant run, or on a host without `setitimer`,
    nothing is armed.
    """
    name = os.environ.get("MUTANT_UNDER_TEST", "")
    recorded = _mutmut_durations().get(item.nodeid) if "__mutmut_" in name else None
    if recorded is None or not hasattr(signal, "setitimer"):
        return (yield)
    budget = MUTANT_SLOWDOWN * recorded + MUTANT_GRACE_S

    def expire(signum: int, frame: object) -> None:
        raise MutantTooSlow(f"{item.nodeid} used over {budget:.1f} s of CPU under {name}")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, budget)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@pytest.fixture
def traces_dir() -> Path:
    """The public traces (`bench.default_traces_dir`), or skip the test where they are absent."""
    if not TRACES.is_dir():
        pytest.skip(f"no traces folder at {TRACES} (set $BLOCKTRIE_TRACES_DIR)")
    return TRACES
