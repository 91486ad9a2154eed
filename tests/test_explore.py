"""Bounded exhaustive exploration (`tools.explore`): every sequence of operations up to
a depth over a tiny cache, cache and reference model side by side, every invariant
and the pin promise checked in every reached state. CI runs the small bound below
(about 15 s of one core); docs/testing.md gives the figures and the larger bounds
for long runs."""

from __future__ import annotations

import pytest

from tools.explore import Bounds, ExplorationFailure, Explorer, explore, main, state_key


@pytest.mark.parametrize(
    ("start", "depth", "states", "transitions"),
    # at 8ab0f00: 3,109 states / 9,308 transitions, and 1,243 / 2,648
    [("empty", 4, 3000, 9000), ("warm", 3, 1200, 2600)],
)
def test_every_sequence_of_operations_up_to_the_ci_bound_keeps_every_invariant(
    start: str, depth: int, states: int, transitions: int
) -> None:
    report = explore(Bounds(depth=depth, start=start))
    assert report.complete and report.depth_reached == depth
    assert report.states >= states and report.transitions >= transitions
    assert sum(d["transitions"] for d in report.per_depth) == report.transitions
    assert report.refusals > 0  # refusals are explored too (same error, nothing changed)


def test_the_warm_start_has_its_slots_taken_and_a_request_that_hits_restores() -> None:
    explorer = Explorer(Bounds(start="warm"))
    from tools.explore import STARTS

    m = explorer.replay(STARTS["warm"])
    assert m.cache.num_cached_blocks == 2 and m.cache.num_free_checkpoint_slots == 0
    explorer.apply(m, ("match", (1, 1, 0)))
    assert m.live_handles[0].real.num_cached_tokens == 2
    assert ("restore", 0) in list(explorer.operations(m))
    explorer.check(m)


def test_states_reached_by_different_paths_are_explored_once() -> None:
    explorer = Explorer(Bounds())
    a = explorer.replay([("evict", 1), ("match", (0, 1, 1))])
    b = explorer.replay([("match", (0, 1, 1)), ("poll",)])
    c = explorer.replay([("match", (0, 1, 0))])
    assert state_key(a) == state_key(b) != state_key(c)


def test_the_explorer_finds_a_cache_that_keeps_a_failed_save_matchable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache that does not withdraw the checkpoint of a failed save ([R46]) is
    found within four operations (match, prefill, save, fail), with the path."""
    from cache.checkpoints import CheckpointStore

    monkeypatch.setattr(CheckpointStore, "withdraw", lambda self, ck: None)
    with pytest.raises(ExplorationFailure) as info:
        explore(Bounds(depth=4, max_live=1))
    names = [op[0] for op in info.value.path]
    assert names[:3] == ["match", "prefill", "save"] and names[-1] in ("fail", "interrupt")


def test_the_command_prints_a_report_per_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--depth", "1", "--start", "empty,warm"]) == 0
    out = capsys.readouterr().out
    assert '"start": "empty"' in out and '"start": "warm"' in out
    with pytest.raises(SystemExit):
        main(["--start", "cold"])
