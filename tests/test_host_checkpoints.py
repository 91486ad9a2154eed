"""SSM checkpoints in the host tier ([R53]-[R56]): store, offload, host eviction, restore.

Every checkpoint here holds a state that names it (`state(v)`), so a restore is
checked bit for bit against the save it claims to come from.
"""

from __future__ import annotations

import pytest
import torch

from cache import (
    BlockTrie,
    CacheConfig,
    ConfigError,
    Copy,
    HostTierUnusedWarning,
    ManualCopies,
    Sequence,
)
from cache.events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored
from spec.errors import InvalidArgument, InvariantViolation
from spec.invariants import violations
from spec.lifecycle import CheckpointState, Residency

B = 2
PROMPT = [1, 2, 3, 4, 5]  # two full blocks and one token to compute


def ssm_trie(
    slots: int = 2, host_slots: int = 2, manual: bool = False, **kw: object
) -> tuple[BlockTrie, ManualCopies | None]:
    """A hybrid-model trie with host checkpoint slots; states are float64 pairs."""
    kw.setdefault("enable_events", True)
    kw.setdefault("num_blocks", 16)
    config = CacheConfig(
        block_size=B,
        kv_block_shape=(B,),
        kv_dtype=torch.float64,
        num_checkpoint_slots=slots,
        state_shapes={"s": (2,)},
        state_dtype=torch.float64,
        num_host_checkpoint_slots=host_slots,
        **kw,  # type: ignore[arg-type]
    )
    copies = ManualCopies() if manual else None
    return BlockTrie(config, copies=copies), copies


def state(value: float) -> dict[str, torch.Tensor]:
    return {"s": torch.tensor([value, -value], dtype=torch.float64)}


def checkpointed(trie: BlockTrie, tokens: list[int], step: int, value: float) -> Copy | None:
    """Prefill `tokens`, save the state after `step` tokens, finish the request."""
    seq = trie.match(tokens)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    copy = trie.save(seq, step, state(value))
    trie.release(seq)
    return copy


def the_checkpoint(trie: BlockTrie, step: int) -> dict[str, object]:
    (ck,) = [c for c in trie.snapshot()["checkpoints"].values() if c["step"] == step]
    return dict(ck)


def restored(trie: BlockTrie, tokens: list[int]) -> tuple[Sequence, Copy, list[float]]:
    seq = trie.match(tokens)
    runtime = state(0.0)
    copy = trie.restore(seq, runtime)
    copy.wait()
    return seq, copy, runtime["s"].tolist()


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"num_host_checkpoint_slots": -1}, "num_host_checkpoint_slots must be >= 0"),
        ({"num_host_checkpoint_slots": 1.0}, "num_host_checkpoint_slots must be an int"),
        ({"num_host_checkpoint_slots": 2**31}, "num_host_checkpoint_slots must be <="),
        (
            {"num_host_checkpoint_slots": 1, "num_checkpoint_slots": 0},
            "num_host_checkpoint_slots needs num_checkpoint_slots > 0",
        ),
    ],
)
def test_bad_host_checkpoint_configs_name_the_field(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CacheConfig(block_size=B, num_blocks=4, **kw)  # type: ignore[arg-type]


def test_without_host_slots_nothing_changes() -> None:
    trie, _ = ssm_trie(host_slots=0)
    checkpointed(trie, PROMPT, 4, 7.0)
    ck = the_checkpoint(trie, 4)
    assert ck["residency"] == Residency.DEVICE.value and ck["host_slot"] is None
    assert trie.evict_checkpoints(1) == 1
    assert trie.snapshot()["checkpoints"] == {}
    assert trie.stats.evicted_checkpoints == 1 and trie.stats.checkpoints_offloaded == 0


# ---------------------------------------------------------------- store ([R53])


def test_copies_are_numbered_in_the_order_built_and_a_store_carries_its_step() -> None:
    """Each copy a trie builds takes the trie's next serial (what errors and logs
    name it by), whichever part built it: a KV store (the host tier's), a save, a
    checkpoint's store. A checkpoint's store copy carries the checkpoint's step."""
    with pytest.warns(HostTierUnusedWarning):
        trie, copies = ssm_trie(manual=True, num_host_blocks=8)
    assert copies is not None
    checkpointed(trie, PROMPT, 4, 7.0)
    checkpointed(trie, [7, 7, 7, 7, 7], 2, 6.0)
    assert [(c.serial, c.kind, c.step) for c in copies.pending()] == [
        (1, "store", 0),
        (2, "save", 4),
        (3, "store", 4),
        (4, "store", 0),
        (5, "save", 2),
        (6, "store", 2),
    ]


def test_a_block_aligned_checkpoint_is_stored_to_a_host_slot_as_it_is_saved() -> None:
    trie, _ = ssm_trie()
    checkpointed(trie, PROMPT, 4, 7.0)
    ck = the_checkpoint(trie, 4)
    assert ck["residency"] == Residency.MIRRORED.value
    assert ck["slot"] is not None and ck["host_slot"] is not None
    assert trie.stats.checkpoints_stored == 1
    assert trie.num_free_host_checkpoint_slots == 1 and trie.num_host_checkpoints == 1
    host = trie.host_checkpoint_states["s"][ck["host_slot"]]  # type: ignore[index]
    assert host.tolist() == [7.0, -7.0]
    stored = [e for e in trie.drain_events() if isinstance(e, BlockStored) and e.group_idx == 1]
    assert [(e.medium, e.block_ids) for e in stored] == [
        (MEDIUM_GPU, (ck["slot"],)),
        (MEDIUM_CPU, (ck["host_slot"],)),
    ]
    assert stored[0].block_hashes == stored[1].block_hashes  # one checkpoint, two tiers
    same = ("parent_block_hash", "token_ids", "block_size", "namespace", "extra_keys")
    assert [getattr(stored[1], f) for f in same] == [getattr(stored[0], f) for f in same]
    assert stored[1].block_size == B and stored[1].token_ids == (3, 4)
    checkpointed(trie, [7, 7, 7, 7, 7], 4, 6.0)
    assert trie.stats.checkpoints_stored == 2  # every store counts
    trie.check()


def test_with_events_off_a_stored_host_checkpoint_is_not_held_against_the_events() -> None:
    """Events off: no event view exists, so `check()` compares none (a view that
    replayed nothing would count the stored host checkpoint as missing)."""
    trie, _ = ssm_trie(enable_events=False)
    checkpointed(trie, PROMPT, 4, 7.0)
    assert the_checkpoint(trie, 4)["host_slot"] is not None
    snap = trie.snapshot()
    assert snap["event_host_checkpoint_slots"] is None and snap["event_blocks"] is None
    trie.check()


def test_a_partial_checkpoint_stays_on_the_device() -> None:
    trie, _ = ssm_trie()
    checkpointed(trie, PROMPT, 3, 7.0)
    ck = the_checkpoint(trie, 3)
    assert ck["residency"] == Residency.DEVICE.value and ck["host_slot"] is None
    assert trie.stats.checkpoints_stored == 0
    assert trie.evict_checkpoints(1) == 1  # evicted: nothing on the host to keep
    assert trie.snapshot()["checkpoints"] == {}


def test_a_storing_checkpoint_is_pinned_until_its_store_is_reaped() -> None:
    trie, manual = ssm_trie(manual=True)
    assert manual is not None
    save = checkpointed(trie, PROMPT, 4, 7.0)
    assert save is not None
    (store,) = [c for c in manual.pending() if c.kind == "store"]
    ck = the_checkpoint(trie, 4)
    assert store.resources == {("slot", ck["slot"]), ("host_slot", ck["host_slot"])}
    assert (store.step, store.serial) == (4, save.serial + 1)  # numbered right after it
    assert ck["residency"] == Residency.STORING.value
    assert ck["state"] == CheckpointState.PINNED.value and ck["pins"] == 2  # save + store
    assert trie.evict_checkpoints(1) == 0  # neither evicted nor offloaded while read
    manual.complete(store)  # completes the save first: the store reads its slot
    assert save.done
    trie.poll()
    ck = the_checkpoint(trie, 4)
    assert ck["residency"] == Residency.MIRRORED.value and ck["pins"] == 0
    assert trie.host_checkpoint_states["s"][ck["host_slot"]].tolist() == [7.0, -7.0]  # type: ignore[index]
    trie.check()


def test_the_store_alone_keeps_the_checkpoint_pinned_once_its_save_is_reaped() -> None:
    """The seed's bug one tier down: the save is done and reaped, the store still
    reads the device slot; evicting checkpoints must not free or reuse that slot."""
    trie, manual = ssm_trie(slots=1, manual=True)
    assert manual is not None
    save = checkpointed(trie, PROMPT, 4, 7.0)
    assert save is not None
    (store,) = [c for c in manual.pending() if c.kind == "store"]
    manual.complete(save)
    trie.poll()  # the save's producer pin is gone; the store's is not
    ck = the_checkpoint(trie, 4)
    assert ck["state"] == CheckpointState.PINNED.value and ck["pins"] == 1
    trie.check()
    assert trie.evict_checkpoints(1) == 0
    assert checkpointed(trie, [9, 9, 9, 9, 9], 4, 8.0) is None  # [R28]: no slot to take
    assert trie.stats.checkpoints_skipped == 1
    manual.complete(store)
    trie.poll()
    assert trie.host_checkpoint_states["s"][ck["host_slot"]].tolist() == [7.0, -7.0]  # type: ignore[index]
    trie.check()


def test_a_failed_save_fails_its_store_and_both_slots_come_back() -> None:
    trie, manual = ssm_trie(manual=True)
    assert manual is not None
    save = checkpointed(trie, PROMPT, 4, 7.0)
    assert save is not None
    (store,) = [c for c in manual.pending() if c.kind == "store"]
    manual.fail(save)
    assert store.failed  # it would copy a slot the save never wrote
    trie.poll()
    assert trie.snapshot()["checkpoints"] == {}
    assert trie.num_free_checkpoint_slots == 2 and trie.num_free_host_checkpoint_slots == 2
    assert trie.stats.checkpoints_stored == 0
    trie.check()


def test_a_failed_store_leaves_the_checkpoint_device_only_and_matchable() -> None:
    trie, manual = ssm_trie(manual=True)
    assert manual is not None
    save = checkpointed(trie, PROMPT, 4, 7.0)
    assert save is not None
    (store,) = [c for c in manual.pending() if c.kind == "store"]
    manual.complete(save)
    manual.fail(store)
    trie.poll()
    ck = the_checkpoint(trie, 4)
    assert ck["residency"] == Residency.DEVICE.value and ck["host_slot"] is None
    assert ck["state"] == CheckpointState.PUBLISHED.value
    assert trie.num_free_host_checkpoint_slots == 2
    assert trie.match(PROMPT).num_cached_tokens == 4
    trie.check()


def test_no_host_slot_to_be_had_the_checkpoint_stays_device_only() -> None:
    trie, _ = ssm_trie(slots=2, host_slots=1)
    checkpointed(trie, PROMPT, 4, 7.0)  # mirrored: holds the only host slot
    checkpointed(trie, [9, 9, 9, 9, 9], 4, 8.0)  # no host-only checkpoint to evict
    residencies = sorted(c["residency"] for c in trie.snapshot()["checkpoints"].values())
    assert residencies == [Residency.DEVICE.value, Residency.MIRRORED.value]
    assert trie.stats.host_evicted_checkpoints == 0
    trie.check()


# ---------------------------------------------------------------- offload ([R54])


def test_evicting_a_mirrored_checkpoint_keeps_it_host_only() -> None:
    trie, _ = ssm_trie()
    checkpointed(trie, PROMPT, 4, 7.0)
    slot = the_checkpoint(trie, 4)["slot"]
    trie.drain_events()
    assert trie.evict_checkpoints(5) == 1  # one device slot freed
    ck = the_checkpoint(trie, 4)
    assert ck["residency"] == Residency.HOST.value and ck["slot"] is None
    assert ck["state"] == CheckpointState.PUBLISHED.value
    assert trie.num_free_checkpoint_slots == 2
    assert trie.stats.checkpoints_offloaded == 1 and trie.stats.evicted_checkpoints == 0
    assert trie.snapshot()["host_checkpoint_index"] == [ck["serial"]]
    assert trie.evict_checkpoints(5) == 0  # host-only: nothing left on the device
    (removed,) = trie.drain_events()
    assert isinstance(removed, BlockRemoved)
    assert (removed.medium, removed.block_ids) == (MEDIUM_GPU, (slot,))
    trie.check()


def test_slot_pressure_on_save_offloads_the_lru_mirrored_checkpoint() -> None:
    trie, _ = ssm_trie(slots=1, host_slots=2)
    checkpointed(trie, PROMPT, 4, 7.0)
    checkpointed(trie, [9, 9, 9, 9, 9], 4, 8.0)  # [R28]: needs the only device slot
    by_value = {
        trie.host_checkpoint_states["s"][c["host_slot"]][0].item(): c["residency"]  # type: ignore[index]
        for c in trie.snapshot()["checkpoints"].values()
    }
    assert by_value == {7.0: Residency.HOST.value, 8.0: Residency.MIRRORED.value}
    assert trie.stats.checkpoints_offloaded == 1 and trie.stats.evicted_checkpoints == 0
    trie.check()


def test_the_anchor_leaving_the_device_drops_the_checkpoint_from_both_tiers() -> None:
    trie, _ = ssm_trie()
    checkpointed(trie, PROMPT, 4, 7.0)
    host_slot = the_checkpoint(trie, 4)["host_slot"]
    trie.evict_checkpoints(1)  # host-only now
    trie.drain_events()
    trie.evict(16)
    assert trie.snapshot()["checkpoints"] == {}
    assert trie.num_free_host_checkpoint_slots == 2
    assert trie.stats.evicted_checkpoints == 1
    removed = [e for e in trie.drain_events() if isinstance(e, BlockRemoved) and e.group_idx == 1]
    assert [(e.medium, e.block_ids) for e in removed] == [(MEDIUM_CPU, (host_slot,))]
    trie.check()


# ---------------------------------------------------------------- restore ([R56])


def test_a_host_only_checkpoint_restores_straight_from_its_host_slot() -> None:
    trie, _ = ssm_trie()
    checkpointed(trie, PROMPT, 4, 7.0)
    trie.evict_checkpoints(1)
    host_slot = the_checkpoint(trie, 4)["host_slot"]
    seq, copy, got = restored(trie, [1, 2, 3, 4, 6])
    assert seq.num_cached_tokens == 4
    assert got == [7.0, -7.0]
    assert copy.resources == {("host_slot", host_slot)}  # one host -> device copy
    assert trie.stats.restores == 1
    trie.release(seq)
    trie.check()


def test_a_restore_in_flight_keeps_a_host_only_checkpoint_from_host_eviction() -> None:
    trie, manual = ssm_trie(slots=2, host_slots=1, manual=True)
    assert manual is not None
    checkpointed(trie, PROMPT, 4, 7.0)
    manual.complete_all()
    trie.poll()
    trie.evict_checkpoints(1)  # host-only, in the only host slot
    seq = trie.match([1, 2, 3, 4, 6])
    runtime = state(0.0)
    restore = trie.restore(seq, runtime)
    trie.abort(seq)  # the copy keeps its pin ([R35])
    checkpointed(trie, [9, 9, 9, 9, 9], 4, 8.0)  # wants a host slot: the pinned one stays
    manual.complete_all()
    trie.poll()
    assert restore.done and runtime["s"].tolist() == [7.0, -7.0]
    assert trie.stats.host_evicted_checkpoints == 0
    residencies = sorted(c["residency"] for c in trie.snapshot()["checkpoints"].values())
    assert residencies == [Residency.DEVICE.value, Residency.HOST.value]
    trie.check()


# ---------------------------------------------------------------- host eviction ([R55])


def test_a_store_evicts_the_lru_host_only_checkpoint_for_its_host_slot() -> None:
    trie, _ = ssm_trie(slots=2, host_slots=1)
    checkpointed(trie, PROMPT, 4, 7.0)
    trie.evict_checkpoints(1)  # host-only
    trie.drain_events()
    checkpointed(trie, [9, 9, 9, 9, 9], 4, 8.0)
    assert trie.stats.host_evicted_checkpoints == 1
    (ck,) = trie.snapshot()["checkpoints"].values()
    assert ck["residency"] == Residency.MIRRORED.value
    assert trie.host_checkpoint_states["s"][ck["host_slot"]].tolist() == [8.0, -8.0]  # type: ignore[index]
    assert trie.match(PROMPT).num_cached_tokens == 0  # the host-only one is gone
    trie.check()


def test_every_offload_is_counted() -> None:
    trie, _ = ssm_trie(slots=2, host_slots=2)
    checkpointed(trie, PROMPT, 4, 7.0)
    checkpointed(trie, [7, 7, 7, 7, 7], 4, 6.0)
    assert trie.evict_checkpoints(1) == 1
    assert trie.evict_checkpoints(1) == 1
    assert trie.stats.checkpoints_offloaded == 2 and trie.stats.evicted_checkpoints == 0
    trie.check()


def test_each_store_evicts_exactly_one_host_only_checkpoint_and_the_count_adds_up() -> None:
    """A store short of a host slot evicts the least recent host-only checkpoint and no
    other ([R55]); `host_evicted_checkpoints` counts every eviction, store after store."""
    trie, _ = ssm_trie(slots=2, host_slots=2)
    checkpointed(trie, PROMPT, 4, 7.0)
    trie.evict_checkpoints(1)  # host-only, the least recent
    checkpointed(trie, [7, 7, 7, 7, 7], 4, 6.0)
    trie.evict_checkpoints(1)  # host-only too: both host slots held
    checkpointed(trie, [9, 9, 9, 9, 9], 4, 8.0)  # needs a host slot: PROMPT's goes
    assert trie.stats.host_evicted_checkpoints == 1
    gone, kept = trie.match(PROMPT), trie.match([7, 7, 7, 7, 8])
    assert (gone.num_cached_tokens, kept.num_cached_tokens) == (0, 4)
    trie.abort(gone)
    trie.abort(kept)
    checkpointed(trie, [5, 5, 5, 5, 5], 4, 5.0)  # the next store: [7, 7, 7, 7]'s goes
    assert trie.stats.host_evicted_checkpoints == 2
    steps = sorted((c["residency"], c["step"]) for c in trie.snapshot()["checkpoints"].values())
    assert steps == [(Residency.MIRRORED.value, 4)] * 2  # each in a device and a host slot
    trie.check()


def test_replacing_a_host_only_checkpoint_takes_a_device_slot_and_frees_its_host_slot() -> None:
    trie, _ = ssm_trie(slots=1, host_slots=2)
    checkpointed(trie, PROMPT, 4, 7.0)
    trie.evict_checkpoints(1)  # host-only; the device slot is free again
    seq = trie.match([1, 2, 3, 4, 5, 6])
    trie.restore(seq, state(0.0))  # its match pin goes with the (finished) copy
    trie.allocate(seq, 6)
    trie.commit(seq, 6)
    trie.save(seq, 5, state(8.0))  # partial, on the same anchor: replaces it
    trie.release(seq)
    (ck,) = trie.snapshot()["checkpoints"].values()
    assert ck["step"] == 5 and ck["residency"] == Residency.DEVICE.value
    assert trie.num_free_host_checkpoint_slots == 2
    trie.check()


def test_clear_frees_every_host_slot() -> None:
    trie, _ = ssm_trie()
    checkpointed(trie, PROMPT, 4, 7.0)
    checkpointed(trie, [9, 9, 9, 9, 9], 4, 8.0)
    trie.evict_checkpoints(1)
    trie.clear()
    assert trie.num_free_host_checkpoint_slots == 2 and trie.num_free_checkpoint_slots == 2
    trie.check()


# ---------------------------------------------------------------- the spec catches


def test_the_invariant_catches_a_storing_checkpoint_no_store_copy_pins() -> None:
    trie, manual = ssm_trie(manual=True)
    assert manual is not None
    checkpointed(trie, PROMPT, 4, 7.0)
    manual.complete_all()
    trie.poll()
    ck = trie._checkpoints.lru.oldest()
    ck.residency = Residency.STORING.value  # the bug: a store that holds no pin
    found = violations(trie.snapshot())
    assert ("host_tier", f"checkpoint {ck.serial}: storing, pinned by 0 store copies") in found
    with pytest.raises(InvariantViolation):
        trie.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_host_checkpoints_on_cuda_round_trip() -> None:
    config = CacheConfig(
        block_size=B,
        num_blocks=16,
        num_checkpoint_slots=1,
        state_shapes={"s": (2,)},
        state_dtype=torch.float64,
        num_host_checkpoint_slots=2,
        device="cuda",
    )
    trie = BlockTrie(config)
    assert trie.host_checkpoint_states["s"].is_pinned()
    seq = trie.match(PROMPT)
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
    saved = trie.save(seq, 4, {"s": torch.tensor([7.0, -7.0], dtype=torch.float64, device="cuda")})
    assert saved is not None
    trie.release(seq)
    torch.cuda.synchronize()
    trie.poll()
    trie.evict_checkpoints(1)
    seq = trie.match([1, 2, 3, 4, 6])
    runtime = {"s": torch.zeros(2, dtype=torch.float64, device="cuda")}
    trie.restore(seq, runtime).wait()
    assert runtime["s"].tolist() == [7.0, -7.0]
    trie.release(seq)
    torch.cuda.synchronize()
    trie.poll()
    trie.check()


def test_the_snapshot_replays_host_checkpoint_slots_only_with_host_slots() -> None:
    """`snapshot()["event_host_checkpoint_slots"]`: None without host checkpoint slots;
    with them, the slots the drained events say hold a stored checkpoint."""
    without, _ = ssm_trie(host_slots=0)
    checkpointed(without, PROMPT, 4, 7.0)
    assert without.snapshot()["event_host_checkpoint_slots"] is None
    trie, _ = ssm_trie()
    checkpointed(trie, PROMPT, 4, 7.0)
    assert trie.snapshot()["event_host_checkpoint_slots"] == {the_checkpoint(trie, 4)["host_slot"]}


def test_a_host_copy_is_announced_with_the_device_checkpoints_identity() -> None:
    """[R53]: the host copy of a block-aligned checkpoint is announced as the device
    one is (same hash, parent, tokens, extra keys), only its medium and slot differ:
    a router keeps one entry per prefix whichever tier holds it. At block 1 the
    anchor's parent is the root, so there is no parent hash."""
    trie, _ = ssm_trie()
    seq = trie.match(PROMPT, namespace="ns", extra=["img"])
    trie.allocate(seq, len(PROMPT))
    trie.commit(seq, len(PROMPT))
    trie.save(seq, B, state(1.0))
    trie.release(seq)
    trie.poll()
    group = [e for e in trie.drain_events() if isinstance(e, BlockStored) and e.group_idx]
    device, host = group
    assert (device.medium, host.medium) == (MEDIUM_GPU, MEDIUM_CPU)
    assert host.parent_block_hash is None
    assert host.extra_keys == device.extra_keys == (("ns", "img"),)
    same = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "namespace")
    assert [getattr(host, f) for f in same] == [getattr(device, f) for f in same]
    trie.check()


def test_the_host_checkpoint_pool_takes_at_its_own_fault_point() -> None:
    """A save takes its device slot at `slots.take` and its write-through store takes
    a host slot at `host_slots.take` (so a fault can be aimed at either pool)."""
    trie, _ = ssm_trie()
    trie.faults.reset()
    checkpointed(trie, [*PROMPT, 6], 4, 1.0)
    assert trie.faults.points.count("slots.take") == 1
    assert trie.faults.points.count("host_slots.take") == 1
    assert trie.faults.points.index("slots.take") < trie.faults.points.index("host_slots.take")
    assert trie.num_host_checkpoints == 1
    trie.check()


def test_a_runtime_state_inside_the_host_tier_is_refused_by_name() -> None:
    """[R60]: a restore into a tensor that is a view of the host tier's KV storage is
    refused before any copy, naming that pool (as for the device pools)."""
    trie, _ = ssm_trie(num_host_blocks=4)
    checkpointed(trie, [1, 1, 1, 1, 2], 4, 1.0)
    seq = trie.match([1, 1, 1, 1, 2])
    host = trie._host_pool.tensor  # type: ignore[attr-defined]
    assert host is not None and host.dtype == torch.float64
    inside = {"s": host.reshape(-1)[:2]}
    with pytest.raises(InvalidArgument, match="overlaps the storage of the cache's host tier"):
        trie.restore(seq, inside)
    trie.abort(seq)
    trie.check()
