"""The lifecycles: derived tables agree with the `transitions` machines; docs are current."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from transitions.core import MachineError

from spec import docgen
from spec.errors import CacheError, IllegalTransition
from spec.lifecycle import (
    CHECKPOINT,
    LIFECYCLES,
    NODE,
    CheckpointState,
    Lifecycle,
    NodeState,
    implied_checkpoint_state,
    implied_node_state,
)


class _Model:
    state: str


def _fire(life: Lifecycle, trigger: str, state: str) -> str | None:
    """Fire `trigger` from `state` on a real `transitions` machine; None if illegal."""
    model = _Model()
    machine = life.machine(model)
    machine.set_state(state)
    try:
        getattr(model, trigger)()
    except MachineError:
        return None
    return model.state


@pytest.mark.parametrize("life", LIFECYCLES, ids=lambda life: life.name)
def test_table_agrees_with_machine_on_every_pair(life: Lifecycle) -> None:
    for state, trigger in itertools.product(life.states, life.triggers):
        expected = _fire(life, trigger, state)
        if expected is None:
            assert not life.can(trigger, state)
            with pytest.raises(IllegalTransition) as info:
                life.step(trigger, state)
            assert trigger in str(info.value) and state in str(info.value)
        else:
            assert life.step(trigger, state) == expected


@pytest.mark.parametrize("life", LIFECYCLES, ids=lambda life: life.name)
def test_routes_follow_the_table(life: Lifecycle) -> None:
    for (source, dest), route in life.routes.items():
        state = source
        for trigger in route:
            state = life.step(trigger, state)
        assert state == dest


def test_states_are_the_enums() -> None:
    assert set(NODE.states) == {s.value for s in NodeState}
    assert set(CHECKPOINT.states) == {s.value for s in CheckpointState}


@pytest.mark.parametrize(
    ("life", "trigger", "state"),
    [
        (NODE, "free", "pinned"),  # the seed bug: evicting a pinned node
        (NODE, "free", "cached"),
        (NODE, "idle", "freed"),  # freed is terminal
        (CHECKPOINT, "release", "pinned"),
        (CHECKPOINT, "replace", "pinned"),
        (CHECKPOINT, "evict", "pinned"),
        (CHECKPOINT, "pin", "absent"),  # a pin on a released checkpoint
        (CHECKPOINT, "pin", "reserved"),  # not matchable before publish
    ],
)
def test_illegal_transitions_raise_a_cache_error(life: Lifecycle, trigger: str, state: str) -> None:
    with pytest.raises(IllegalTransition) as info:
        life.step(trigger, state, subject="node #7")
    assert isinstance(info.value, CacheError)
    assert "node #7" in str(info.value)


def test_freed_is_terminal() -> None:
    assert not any(NODE.can(t, NodeState.FREED.value) for t in NODE.triggers)
    assert NODE.routes.get((NodeState.FREED.value, NodeState.CACHED.value)) is None


def test_implied_node_state() -> None:
    assert implied_node_state(attached=False, leaf=True, block_refs=1, pins=0) == NodeState.FREED
    assert implied_node_state(attached=True, leaf=True, block_refs=1, pins=1) == NodeState.PINNED
    assert implied_node_state(attached=True, leaf=True, block_refs=1, pins=0) == NodeState.EVICTABLE
    assert implied_node_state(attached=True, leaf=True, block_refs=2, pins=0) == NodeState.CACHED
    assert implied_node_state(attached=True, leaf=False, block_refs=1, pins=0) == NodeState.CACHED


def test_implied_checkpoint_state() -> None:
    assert implied_checkpoint_state(present=False, published=True, pins=0) == "absent"
    assert implied_checkpoint_state(present=True, published=False, pins=0) == "reserved"
    assert implied_checkpoint_state(present=True, published=True, pins=0) == "published"
    assert implied_checkpoint_state(present=True, published=True, pins=2) == "pinned"


def test_lifecycle_doc_is_generated_from_the_spec() -> None:
    assert docgen.DEFAULT_PATH.read_text() == docgen.render(), (
        "docs/lifecycle.md is stale: run python -m spec.docgen"
    )
    assert docgen.main(["--check"]) == 0


def test_docgen_check_detects_a_stale_file(tmp_path: Path) -> None:
    path = tmp_path / "lifecycle.md"
    path.write_text("stale")
    assert docgen.main(["--check", "--path", str(path)]) == 1
    assert docgen.main(["--path", str(path)]) == 0
    assert docgen.main(["--check", "--path", str(path)]) == 0


def test_a_withdrawn_checkpoint_is_implied_absent_once_its_last_pin_goes() -> None:
    """[R46]: the rule lives in the spec; the cache and the model release on it."""
    assert (
        implied_checkpoint_state(present=True, published=True, pins=1, withdrawn=True)
        == CheckpointState.WITHDRAWN
    )
    assert (
        implied_checkpoint_state(present=True, published=True, pins=0, withdrawn=True)
        == CheckpointState.ABSENT
    )
    assert CHECKPOINT.can("release", CheckpointState.WITHDRAWN.value)
    assert not CHECKPOINT.can("pin", CheckpointState.WITHDRAWN.value)
