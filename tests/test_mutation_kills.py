"""Tests written to kill mutants that survived `python -m tools.mutation`.

`spec/lifecycle.py` builds `NODE` and `CHECKPOINT` at import time, before
mutmut switches a mutant on, so a mutant in `_build`, `_derive_table` or
`_derive_routes` can only be seen by a test that builds a lifecycle again;
these do, and compare against an oracle written independently of the code
(the transition lists read literally, a plain BFS for the routes).
"""

from __future__ import annotations

from collections import deque
from enum import Enum

import pytest
import torch
from transitions import Machine

from cache import BlockTrie, Copy, ManualCopies
from cache.faults import Faults
from cache.kv_pool import KVBlockPool
from cache.lru import LRUIndex
from spec import lifecycle
from spec.errors import CacheError, IllegalTransition, InvalidType, OutOfBlocks
from spec.lifecycle import (
    CHECKPOINT,
    CHECKPOINT_TRANSITIONS,
    NODE,
    NODE_TRANSITIONS,
    CheckpointState,
    Lifecycle,
    NodeState,
)
from tests.helpers import ssm_trie
from tests.helpers import state as runtime_state

CASES = [
    ("node", NodeState, NodeState.CACHED, NODE_TRANSITIONS, NODE),
    ("checkpoint", CheckpointState, CheckpointState.ABSENT, CHECKPOINT_TRANSITIONS, CHECKPOINT),
]


def _oracle_table(
    transitions: tuple[tuple[str, tuple[Enum, ...], Enum], ...],
) -> dict[tuple[str, str], str]:
    table = {}
    for trigger, sources, dest in transitions:
        for source in sources:
            table[(trigger, source.value)] = dest.value
    return table


def _oracle_routes(
    states: list[str], table: dict[tuple[str, str], str]
) -> dict[tuple[str, str], int]:
    """Shortest route length between every reachable pair (plain BFS)."""
    lengths = {}
    for source in states:
        seen = {source: 0}
        queue = deque([source])
        while queue:
            here = queue.popleft()
            for (_, state), dest in sorted(table.items()):
                if state == here and dest not in seen:
                    seen[dest] = seen[here] + 1
                    queue.append(dest)
        for dest, n in seen.items():
            lengths[(source, dest)] = n
    return lengths


def _walk(life: Lifecycle, source: str, route: tuple[str, ...]) -> str:
    state = source
    for trigger in route:
        state = life.step(trigger, state)
    return state


@pytest.mark.parametrize(("name", "enum", "initial", "transitions", "built"), CASES)
def test_a_freshly_built_lifecycle_has_exactly_the_declared_table_and_shortest_routes(
    name: str,
    enum: type[Enum],
    initial: Enum,
    transitions: tuple[tuple[str, tuple[Enum, ...], Enum], ...],
    built: Lifecycle,
) -> None:
    life = lifecycle._build(name, list(enum), initial, transitions)  # Enum members, as declared
    states = [s.value for s in enum]
    assert life.name == name
    assert life.states == tuple(states)
    assert all(type(s) is str for s in life.states)
    assert life.initial == initial.value and type(life.initial) is str
    assert life.transitions == built.transitions
    assert all(
        type(d) is str and all(type(s) is str for s in src) for _, src, d in life.transitions
    )
    expected = _oracle_table(transitions)
    assert life.table == expected == built.table
    assert life.triggers == tuple(dict.fromkeys(t for t, _, _ in transitions))
    lengths = _oracle_routes(states, expected)
    assert set(life.routes) == set(lengths) == set(built.routes)
    for (source, dest), n in lengths.items():
        route = life.routes[(source, dest)]
        assert len(route) == n, (source, dest, route)
        assert _walk(life, source, route) == dest
        assert built.routes[(source, dest)] == route


def test_derive_table_takes_the_first_transition_and_skips_states_without_one() -> None:
    life = Lifecycle("t", ("a", "b", "c"), "a", (("go", ("a", "b"), "c"), ("back", ("c",), "a")))
    table = lifecycle._derive_table(life.machine(), life.states, life.triggers)
    assert table == {("go", "a"): "c", ("go", "b"): "c", ("back", "c"): "a"}
    assert all(type(v) is str for v in table.values())
    routes = lifecycle._derive_routes(life.states, table)
    assert routes[("a", "a")] == () and routes[("b", "a")] == ("go", "back")
    assert ("a", "b") not in routes and ("c", "b") not in routes
    assert routes[("c", "c")] == ()


@pytest.mark.parametrize("life", [NODE, CHECKPOINT], ids=lambda life: life.name)
def test_machine_is_flat_without_auto_transitions_and_drives_a_model(life: Lifecycle) -> None:
    class Model:
        state: str

    model = Model()
    machine = life.machine(model)
    assert model.state == life.initial
    assert sorted(machine.states) == sorted(life.states)
    assert not any(name.startswith("to_") for name in dir(model)), "no auto transitions"
    assert set(machine.events) == set(life.triggers)
    trigger, sources, dest = life.transitions[0]
    assert life.initial in sources
    getattr(model, trigger)()
    assert model.state == dest
    bare = life.machine()
    assert type(bare) is Machine, "a plain machine unless graph=True"
    assert bare.initial == life.initial
    assert bare.get_triggers(life.initial) and "to_" + life.initial not in dir(bare)


@pytest.mark.parametrize("life", [NODE, CHECKPOINT], ids=lambda life: life.name)
def test_graph_machine_draws_a_titled_mermaid_diagram(life: Lifecycle) -> None:
    text = life.machine(graph=True).get_graph().draw(None)
    assert text.startswith(f"---\n{life.name} lifecycle\n---\nstateDiagram")
    for state in life.states:
        assert state in text


def test_route_and_step_name_the_lifecycle_and_states_when_illegal() -> None:
    with pytest.raises(IllegalTransition, match=r"from state 'freed'$"):
        NODE.route("freed", "evictable")  # no subject: no " on ..." suffix
    assert NODE.route("cached", "freed") == ("idle", "free")
    assert NODE.route("pinned", "pinned") == ()
    with pytest.raises(IllegalTransition, match=r"^node lifecycle: trigger '-> cached' is not "
                       r"allowed from state 'freed' on leaf#3$"):  # fmt: skip
        NODE.route("freed", "cached", "leaf#3")
    with pytest.raises(IllegalTransition) as info:
        CHECKPOINT.step("evict", CheckpointState.PINNED.value, "ck#1")
    assert (info.value.machine, info.value.trigger, info.value.state, info.value.subject) == (
        "checkpoint", "evict", "pinned", "ck#1",
    )  # fmt: skip
    assert CHECKPOINT.route("reserved", "pinned") == ("publish", "pin")
    assert lifecycle._name(NodeState.PINNED) == "pinned"
    assert lifecycle._name("evictable") == "evictable"
    assert CHECKPOINT.can("unpin", "pinned") and not CHECKPOINT.can("unpin", "published")


@pytest.mark.parametrize(
    ("attached", "leaf", "refs", "pins", "state"),
    [
        (False, True, 1, 0, NodeState.FREED),
        (False, True, 1, 3, NodeState.FREED),
        (True, True, 1, 1, NodeState.PINNED),
        (True, False, 2, 1, NodeState.PINNED),
        (True, True, 1, 0, NodeState.EVICTABLE),
        (True, True, 2, 0, NodeState.CACHED),
        (True, True, 0, 0, NodeState.CACHED),
        (True, False, 1, 0, NodeState.CACHED),
    ],
)
def test_implied_node_state_at_every_boundary(
    attached: bool, leaf: bool, refs: int, pins: int, state: NodeState
) -> None:
    got = lifecycle.implied_node_state(attached=attached, leaf=leaf, block_refs=refs, pins=pins)
    assert got is state


def test_implied_checkpoint_state_at_every_boundary() -> None:
    imply = lifecycle.implied_checkpoint_state
    assert imply(present=False, published=True, pins=2) is CheckpointState.ABSENT
    assert imply(present=True, published=False, pins=1) is CheckpointState.PINNED
    assert imply(present=True, published=True, pins=0) is CheckpointState.PUBLISHED
    assert imply(present=True, published=False, pins=0) is CheckpointState.RESERVED


def test_state_enums_hash_and_compare_like_their_values() -> None:
    assert hash(NodeState.CACHED) == hash("cached")
    assert hash(CheckpointState.PINNED) == hash("pinned")
    assert {NodeState.EVICTABLE: 1}["evictable"] == 1


# ------------------------------------------------------------------- cache/kv_pool.py


def _pool(n: int = 4, shape: tuple[int, ...] | None = (2,)) -> KVBlockPool:
    return KVBlockPool(n, shape, torch.float32, torch.device("cpu"), Faults())


def test_kv_pool_hands_out_lowest_ids_first_with_count_one_all_or_nothing() -> None:
    pool = _pool(4)
    assert pool.capacity == 4 and pool.num_free == 4
    assert pool.tensor is not None and tuple(pool.tensor.shape) == (4, 2)
    assert pool.tensor.dtype == torch.float32 and not pool.tensor.any()
    assert pool.take(2) == [0, 1]
    assert pool.counts() == [1, 1, 0, 0]
    assert pool.free_ids() == [3, 2]
    with pytest.raises(OutOfBlocks, match=r"^KV pool: 3 blocks wanted, 2 free$"):
        pool.take(3)
    assert pool.num_free == 2 and pool.counts() == [1, 1, 0, 0]
    assert pool.take(0) == []
    assert pool.take(2) == [2, 3] and pool.num_free == 0


def test_kv_pool_counts_and_returns_blocks_once() -> None:
    pool = _pool(3)
    a, b = pool.take(2)
    pool.incref(a)
    assert pool.refs[a] == 2
    assert pool.decref(a) is False and pool.refs[a] == 1
    assert pool.decref(a) is True and pool.refs[a] == 0
    assert pool.free_ids() == [2, a]
    with pytest.raises(CacheError, match=rf"^KV pool: block {a} is already free \(double free\)$"):
        pool.decref(a)
    with pytest.raises(CacheError, match=rf"^KV pool: block {a} is free; cannot take a"):
        pool.incref(a)
    assert pool.counts() == [0, 1, 0] and pool.free_ids() == [2, a]
    assert pool.take(1) == [a], "the block freed last is handed out first"
    view = pool.view(b)
    assert view is not None and view.data_ptr() == pool.tensor[b].data_ptr()  # type: ignore[index]


def test_kv_pool_ids_only_and_fault_point() -> None:
    faults = Faults()
    pool = KVBlockPool(2, None, torch.float16, torch.device("cpu"), faults)
    assert pool.tensor is None and pool.view(0) is None
    faults.arm(after=0)
    with pytest.raises(CacheError, match=r"kv\.take"):
        pool.take(1)
    assert pool.num_free == 2 and faults.points == ["kv.take"]


# ----------------------------------------------------------------------- cache/lru.py


class _Item:
    def __init__(self, tick: int, serial: int) -> None:
        self.tick = tick
        self.serial = serial


def test_lru_remove_of_a_stranger_with_a_live_tick_raises() -> None:
    index: LRUIndex[_Item] = LRUIndex()
    member, stranger = _Item(3, 1), _Item(3, 2)
    index.add(member)
    with pytest.raises(KeyError) as info:
        index.remove(stranger)
    assert info.value.args == (stranger,), "the error names the object"
    assert len(index) == 1 and index.oldest() is member
    assert stranger not in index and _Item(4, 1) not in index


def test_lru_stale_heap_is_compacted() -> None:
    index: LRUIndex[_Item] = LRUIndex()
    for t in range(200):
        item = _Item(t, t)
        index.add(item)
        index.remove(item)
    assert len(index._ticks) <= 2 * len(index._buckets) + 65
    keep = _Item(1000, 0)
    index.add(keep)
    assert index.oldest() is keep and bool(index)


def test_lru_heap_is_rebuilt_only_when_stale_ticks_outnumber_live_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Amortized O(log n): with 100 live ticks, 1000 add/remove churns rebuild the
    heap only every ~2 x 100 + 64 stale ticks, not on every add."""
    import heapq

    rebuilds = [0]
    real = heapq.heapify

    def counting(heap: list[int]) -> None:
        rebuilds[0] += 1
        real(heap)

    monkeypatch.setattr(heapq, "heapify", counting)
    index: LRUIndex[_Item] = LRUIndex()
    live = [_Item(t, t) for t in range(100)]
    for item in live:
        index.add(item)
    for t in range(100, 1100):
        item = _Item(t, t)
        index.add(item)
        index.remove(item)
    assert 1 <= rebuilds[0] <= 1000 // 200 + 1, rebuilds[0]
    assert index.oldest() is live[0] and len(index) == 100


def test_kv_pool_tensor_has_the_configured_dtype_and_device() -> None:
    pool = KVBlockPool(2, (3,), torch.float16, torch.device("meta"), Faults())
    assert pool.tensor is not None
    assert pool.tensor.dtype == torch.float16 and pool.tensor.device.type == "meta"
    assert tuple(pool.tensor.shape) == (2, 3)


def test_step_without_a_subject_names_no_subject() -> None:
    with pytest.raises(IllegalTransition, match=r"^node lifecycle: trigger 'free' is not "
                       r"allowed from state 'cached'$"):  # fmt: skip
        NODE.step("free", "cached")


# -------------------------------------------------------------------- cache/copies.py


def _two_independent_saves() -> tuple[ManualCopies, Copy, Copy, BlockTrie]:
    trie, copies = ssm_trie(slots=4)
    assert copies is not None
    a = trie.match([1, 1, 1, 1, 2])
    trie.allocate(a, 5)
    trie.commit(a, 5)
    b = trie.match([3, 3, 3, 3, 4])
    trie.allocate(b, 5)
    trie.commit(b, 5)
    first = trie.save(a, 4, runtime_state(1.0))
    second = trie.save(b, 4, runtime_state(2.0))
    assert first is not None and second is not None
    return copies, first, second, trie


def test_completing_a_copy_leaves_independent_earlier_copies_pending() -> None:
    copies, first, second, trie = _two_independent_saves()
    assert first.resources.isdisjoint(second.resources)
    copies.complete(second)
    assert second.done and not first.done
    assert copies.pending() == [first]
    assert repr(first) == "<Copy #1 save step=4 queued>"
    assert repr(second) == "<Copy #2 save step=4 finished>"
    assert first.kind == "save" and first.step == 4
    first.wait()  # under ManualCopies, wait completes it
    assert first.done and copies.pending() == []
    assert trie.poll() == 2
    trie.check()


def test_manual_complete_names_the_wrong_argument_type() -> None:
    with pytest.raises(InvalidType, match=r"^complete\(\) takes a Copy, got str$"):
        ManualCopies().complete("copy")  # type: ignore[arg-type]


def test_an_unqueued_copy_waits_for_nothing() -> None:
    copy = Copy("save", 3, [], [("slot", 0)], 7)
    copy.wait()
    assert not copy.done and copy.step == 3 and copy.serial == 7
    assert copy.resources == frozenset({("slot", 0)})


def test_forget_stops_tracking_exactly_that_copy() -> None:
    engine = ManualCopies()
    engine.forget(Copy("save", 1, [], [], 1))  # nothing tracked: nothing to do
    copies = [Copy("save", i, [], [("slot", i)], i) for i in range(3)]
    for copy in copies:
        engine.queue(copy)
    engine.forget(copies[1])
    assert engine.pending() == [copies[0], copies[2]]
    engine.forget(copies[2])
    assert engine.pending() == [copies[0]]
    engine.forget(Copy("save", 9, [], [], 9))  # not tracked: nothing changes
    assert engine.pending() == [copies[0]]


# ---------------------------------------------------------------- cache/validation.py


class _Fickle:
    """An `__index__` that answers -1 twice (both fast passes, uint32 then uint64,
    refuse it), then 5."""

    def __init__(self) -> None:
        self.calls = 0

    def __index__(self) -> int:
        self.calls += 1
        return -1 if self.calls <= 2 else 5


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([0, 2**64], r"^tokens must be in \[0, 2\*\*64\); found 18446744073709551616$"),
        ([200, -1], r"^tokens must be in \[0, 2\*\*64\); found -1$"),
        ([0, 1, "x"], r"^tokens must contain only integers; found 'x'$"),
    ],
)
def test_bad_tokens_name_the_first_offender(tokens: list[object], message: str) -> None:
    from cache.validation import token_list

    with pytest.raises(CacheError, match=message):
        token_list(tokens)


def test_tokens_that_are_not_a_list_name_their_type() -> None:
    from cache.validation import token_list

    with pytest.raises(
        InvalidType,
        match=r"^prompt must be a list or tuple of ints, or a 1-D integer array, got str$",
    ):
        token_list("12", what="prompt")


def test_tokens_refused_by_the_fast_path_alone_still_raise_invalid_type() -> None:
    from cache.validation import token_list

    with pytest.raises(
        InvalidType,
        match=r"^tokens must hold integer token ids \(an element failed to convert\)$",
    ):
        token_list([_Fickle()])


def test_extra_of_the_wrong_type_is_named() -> None:
    from cache.validation import extra_tuple

    with pytest.raises(
        InvalidType, match=r"^extra must be None or a list/tuple of per-block identities, got str$"
    ):
        extra_tuple("ab")


# -------------------------------------------------------------------- cache/faults.py


def test_arm_defaults_to_the_next_allocation_point() -> None:
    faults = Faults()
    faults.arm()
    with pytest.raises(CacheError, match=r"^injected allocation failure at kv\.take$"):
        faults.check("kv.take")
    faults.check("kv.take")
    with pytest.raises(ValueError, match=r"^after must be >= 0, got -1$"):
        faults.arm(after=-1)


def test_kv_pool_batch_references_are_all_or_nothing() -> None:
    """`incref_all` / `decref_all` (the match and release paths) change every count or
    none: a free block anywhere in the batch leaves counts and free list as they were."""
    pool = _pool(5)
    a, b, c = pool.take(3)
    pool.incref_all([a, b, c])
    assert list(pool.refs[:3]) == [2, 2, 2]
    pool.decref_all([a, b])
    assert list(pool.refs[:3]) == [1, 1, 2] and pool.free_ids() == [4, 3]
    pool.decref_all([a])
    assert pool.refs[a] == 0 and pool.free_ids() == [4, 3, a]
    before_refs, before_free = pool.counts(), pool.free_ids()
    with pytest.raises(CacheError, match=rf"^KV pool: block {a} is free; cannot take a"):
        pool.incref_all([b, c, a])
    assert pool.counts() == before_refs and pool.free_ids() == before_free
    with pytest.raises(CacheError, match=rf"^KV pool: block {a} is already free \(double free\)"):
        pool.decref_all([b, c, a])  # b reaches 0 (freed) before the failure: undone
    assert pool.counts() == before_refs and pool.free_ids() == before_free
    pool.incref(c)  # c: 3
    with pytest.raises(CacheError, match=r"double free"):
        pool.decref_all([c, c, c, c])  # the fourth drives it below zero
    assert pool.counts() == [*before_refs[:2], 3, *before_refs[3:]]
    assert pool.free_ids() == before_free
