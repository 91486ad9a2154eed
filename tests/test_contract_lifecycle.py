"""Contract details of `spec.lifecycle` (mutation survivors).

A refused step or route is an `IllegalTransition` that names the lifecycle,
the trigger (or ``-> dest``), the state and the subject exactly, by value
when given enum members; routes are the shortest trigger sequences; a
machine drives a model from the initial state with no auto transitions;
every enum hashes as its value (the tables accept either); and the implied
states follow the facts at their boundaries.
"""

from __future__ import annotations

from enum import Enum

import pytest
from transitions import Machine
from transitions.extensions import GraphMachine

from spec.errors import IllegalTransition
from spec.lifecycle import (
    CHECKPOINT,
    NODE,
    CheckpointState,
    CheckpointTrigger,
    CopyKind,
    CopyState,
    CopyTrigger,
    NodeState,
    NodeTrigger,
    ReceiptState,
    ReceiptTrigger,
    Residency,
    ResidencyTrigger,
    implied_checkpoint_state,
    implied_copy_state,
    implied_node_state,
)

ENUMS: list[type[Enum]] = [
    NodeState,
    Residency,
    CheckpointState,
    ReceiptState,
    CopyState,
    NodeTrigger,
    ResidencyTrigger,
    CheckpointTrigger,
    ReceiptTrigger,
    CopyKind,
    CopyTrigger,
]


def _fields(error: IllegalTransition) -> tuple[object, ...]:
    return (error.machine, error.trigger, error.state, error.subject, str(error))


def test_an_illegal_step_names_lifecycle_trigger_state_and_subject_by_value() -> None:
    with pytest.raises(IllegalTransition) as info:
        NODE.step(NodeTrigger.FREE, NodeState.PINNED, "node #7")
    assert _fields(info.value) == (
        "node",
        "free",
        "pinned",
        "node #7",
        "node lifecycle: trigger 'free' is not allowed from state 'pinned' on node #7",
    )
    with pytest.raises(IllegalTransition) as info:
        CHECKPOINT.step("pin", "absent")
    assert _fields(info.value) == (
        "checkpoint",
        "pin",
        "absent",
        "",
        "checkpoint lifecycle: trigger 'pin' is not allowed from state 'absent'",
    )


def test_a_missing_route_names_its_destination_source_and_subject() -> None:
    with pytest.raises(IllegalTransition) as info:
        NODE.route(NodeState.FREED, NodeState.CACHED, "node #3")
    assert _fields(info.value) == (
        "node",
        "-> cached",
        "freed",
        "node #3",
        "node lifecycle: trigger '-> cached' is not allowed from state 'freed' on node #3",
    )
    with pytest.raises(IllegalTransition) as info:
        NODE.route("freed", "evictable")
    assert str(info.value) == (
        "node lifecycle: trigger '-> evictable' is not allowed from state 'freed'"
    )


def test_routes_are_the_shortest_trigger_sequences() -> None:
    assert NODE.route("cached", "cached") == ()
    assert NODE.route("cached", "freed") == ("idle", "free")
    assert NODE.route("pinned", "evictable") == ("unpin", "idle")
    assert CHECKPOINT.route("absent", "pinned") == ("reserve", "publish", "pin")
    assert CHECKPOINT.route("pinned", "absent") == ("unpin", "release")


def test_a_machine_drives_a_model_from_the_initial_state_without_auto_transitions() -> None:
    class Model:
        state: str

    model = Model()
    NODE.machine(model)
    assert model.state == "cached"
    assert not hasattr(model, "to_freed")
    model.idle()  # type: ignore[attr-defined]
    assert model.state == "evictable"
    own = CHECKPOINT.machine()
    assert own.state == "absent" and not hasattr(own, "to_pinned")
    assert sorted(own.get_triggers("absent")) == ["reserve"]


@pytest.mark.parametrize("enum", ENUMS, ids=lambda e: e.__name__)
def test_every_lifecycle_enum_hashes_as_its_value(enum: type[Enum]) -> None:
    by_value = {member.value: member for member in enum}
    for member in enum:
        assert hash(member) == hash(member.value)
        assert by_value[member] is member
        assert {member: 1}[member.value] == 1


def test_implied_node_state_at_its_boundaries() -> None:
    facts = {"attached": True, "leaf": True, "block_refs": 1, "pins": 0}
    assert implied_node_state(**facts, root=True, on_device=False) == NodeState.ROOT  # type: ignore[arg-type]
    assert implied_node_state(**facts, on_device=False) == NodeState.OFFLOADED  # type: ignore[arg-type]
    assert (
        implied_node_state(attached=False, leaf=True, block_refs=0, pins=0, on_device=False)
        == NodeState.FREED
    )
    assert implied_node_state(attached=True, leaf=True, block_refs=1, pins=1) == NodeState.PINNED
    assert implied_node_state(attached=True, leaf=True, block_refs=1, pins=0) == "evictable"


def test_implied_checkpoint_state_with_one_pin() -> None:
    assert implied_checkpoint_state(present=True, published=True, pins=1) == "pinned"
    assert implied_checkpoint_state(present=True, published=False, pins=1) == "pinned"
    assert (
        implied_checkpoint_state(present=True, published=False, pins=0, withdrawn=True) == "absent"
    )


def test_implied_copy_state_follows_the_facts_in_order() -> None:
    assert implied_copy_state(reaped=True, failed=True, moved=False) == CopyState.REAPED
    assert implied_copy_state(reaped=False, failed=True, moved=True) == CopyState.FAILED
    assert implied_copy_state(reaped=False, failed=False, moved=True) == CopyState.FINISHED
    assert implied_copy_state(reaped=False, failed=False, moved=False) == CopyState.QUEUED


def test_a_machine_is_flat_unless_a_graph_is_asked_for_and_then_titled() -> None:
    """The tables are built from a plain `Machine`; only diagrams get a `GraphMachine`."""
    assert type(NODE.machine()) is Machine
    graph = CHECKPOINT.machine(graph=True)
    assert isinstance(graph, GraphMachine) and graph.title == "checkpoint lifecycle"
