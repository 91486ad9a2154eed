"""Contract details of `cache.checkpoints.CheckpointStore` (mutation survivors).

Through `BlockTrie`: checkpoint serials count saves ([R10], [R43]); `match`
skips a deeper checkpoint that is not usable (withdrawn, or its tail's extra
identity differs) and falls back to a shallower one ([R13]);
`evict_checkpoints(n)` evicts exactly `n`, oldest first, and the counters add
up ([R24]); make-room evicts exactly the missing number of frozen tails and
counts each ([R17]). Errors name the checkpoint or receipt they refuse.
"""

from __future__ import annotations

import re

import pytest

from cache import BlockTrie, IllegalTransition, PinError, Sequence
from cache.sequence import PinReceipt
from spec.lifecycle import CHECKPOINT, CheckpointState
from tests.helpers import empty_state, ssm_trie, state

PROMPT = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]  # two full blocks of 4 and a partial one


def _prefill(trie: BlockTrie, tokens: list[int], extra: object = None) -> Sequence:
    seq = trie.match(tokens, extra=extra)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    return seq


def test_checkpoint_serials_count_saves_in_creation_order() -> None:
    """[R10]/[R43]: checkpoint ids are a per-cache counter from 1; a replacement
    is a new checkpoint with the next serial."""
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 4, state(1.0))
    trie.save(seq, 8, state(2.0))
    snap = trie.snapshot()["checkpoints"]
    assert {ck["step"]: serial for serial, ck in snap.items()} == {4: 1, 8: 2}
    trie.save(seq, 6, state(3.0))  # replaces step 4's on the same anchor
    snap = trie.snapshot()["checkpoints"]
    assert {ck["step"]: serial for serial, ck in snap.items()} == {6: 3, 8: 2}
    trie.release(seq)
    trie.check()


def test_match_skips_a_withdrawn_deeper_checkpoint_for_a_shallower_one() -> None:
    """A checkpoint whose save failed stays (withdrawn) while a request pins it,
    but no new match may use it: the next deepest usable one is the hit."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    first = trie.save(seq, 4, state(1.0))
    assert first is not None
    copies.complete(first)
    trie.poll()
    second = trie.save(seq, 8, state(2.0))
    assert second is not None
    trie.release(seq)
    query = [*PROMPT[:8], 9]
    early = trie.match(query)
    assert early.num_cached_tokens == 8  # published while its copy runs
    copies.fail(second)  # withdrawn; `early` still pins it
    trie.poll()
    assert trie.match(query).num_cached_tokens == 4
    trie.abort(early)
    trie.check()


def test_match_skips_a_deeper_tail_whose_extra_identity_differs() -> None:
    """A partial checkpoint matches only when its tail block's extra identity
    does too; otherwise a shallower checkpoint is the hit."""
    trie, _ = ssm_trie(manual=False)
    tokens = [1, 1, 1, 1, 2, 2, 2, 2, 3]
    seq = _prefill(trie, tokens, extra=("a", "b"))
    trie.save(seq, 2, state(1.0))  # root anchor, tail (1, 1) of block "a"
    trie.save(seq, 6, state(2.0))  # block-1 anchor, tail (2, 2) of block "b"
    trie.release(seq)
    assert trie.match(tokens, extra=("a", "b")).num_cached_tokens == 6
    assert trie.match(tokens, extra=("a", "c")).num_cached_tokens == 2
    assert trie.match(tokens, extra=("z", "b")).num_cached_tokens == 0
    trie.check()


def test_evict_checkpoints_evicts_exactly_n_oldest_first_and_counts_them() -> None:
    trie, _ = ssm_trie(manual=False)
    seqs = [_prefill(trie, [k] * 8 + [9]) for k in (1, 2, 3)]
    for value, seq in enumerate(seqs):
        trie.save(seq, 4, state(float(value)))
        trie.release(seq)
    assert trie.evict_checkpoints(1) == 1
    assert trie.stats.evicted_checkpoints == 1
    assert [ck["step"] for ck in trie.snapshot()["checkpoints"].values()] == [4, 4]
    assert trie.match([1] * 8 + [9]).num_cached_tokens == 0, "the oldest went first"
    assert trie.evict_checkpoints(1) == 1
    assert trie.stats.evicted_checkpoints == 2, "the counter accumulates"
    assert trie.match([3] * 8 + [9]).num_cached_tokens == 4
    trie.check()


def test_make_room_evicts_exactly_the_missing_frozen_tails_and_counts_each() -> None:
    """With every KV node held, room comes only from frozen tails: two blocks
    short evicts the two least recent unpinned ones, no more, and counts two
    checkpoints and two blocks."""
    trie, _ = ssm_trie(num_blocks=9, slots=4, manual=False)
    holders = []
    for k in (1, 2, 3):
        seq = _prefill(trie, [k] * 5)  # one cached block and the partial one
        trie.save(seq, 5, state(float(k)))  # a frozen tail block
        holders.append(seq)
    assert trie.num_free_blocks == 0
    hungry = trie.match([7] * 8)
    trie.allocate(hungry, 8)
    assert trie.stats.evicted_checkpoints == 2
    assert trie.stats.evicted_blocks == 2
    assert trie.num_free_checkpoint_slots == 3
    assert [ck["tail"] for ck in trie.snapshot()["checkpoints"].values()] == [(3,)]
    trie.abort(hungry)
    for seq in holders:
        trie.release(seq)
    trie.check()


def test_pin_of_a_released_checkpoint_names_it() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 4, state(1.0))
    trie.release(seq)
    hit = trie.match([*PROMPT, 1])
    assert hit.restore is not None
    ck = hit.restore.checkpoint
    trie.restore(hit, empty_state())  # done at once: the pin goes with the copy
    assert trie.evict_checkpoints(1) == 1
    with pytest.raises(IllegalTransition) as info:
        trie.pin(hit)
    assert info.value.subject == repr(ck)
    assert str(info.value).endswith(f"from state 'absent' on {ck!r}")
    trie.release(hit)
    trie.check()


def test_unpinning_a_used_receipt_again_says_it_was_used() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 4, state(1.0))
    hit = trie.match([*PROMPT, 1])
    receipt = trie.pin(hit)
    trie.unpin(receipt)
    assert receipt.used
    with pytest.raises(PinError, match=r"^unpin: <PinReceipt step=4 used> was already used$"):
        trie.unpin(receipt)
    trie.release(hit)
    trie.release(seq)
    trie.check()


def test_store_refuses_a_receipt_without_a_pin_behind_it() -> None:
    """The store's own guard (the trie checks receipts first): a receipt for a
    checkpoint with no pin, or one redeemed twice, is refused naming it, and no
    count changes."""
    trie, _ = ssm_trie(manual=False)
    store = trie._checkpoints
    seq = _prefill(trie, PROMPT)
    trie.save(seq, 4, state(1.0))
    hit = trie.match([*PROMPT, 1])
    assert hit.restore is not None
    ck = hit.restore.checkpoint
    first, second = trie.pin(hit), trie.pin(hit)
    store.unpin(first)
    pins = ck.pins
    with pytest.raises(IllegalTransition) as info:
        store.unpin(first)  # redeemed already, while others still pin `ck`
    assert info.value.subject == repr(first)
    assert (ck.pins, trie.stats.pins) == (pins, pins)
    trie.abort(hit)
    store.unpin(second)
    assert ck.pins == 0
    forged = PinReceipt(trie, ck)
    message = f"unpin: {ck!r} has no pin for {forged!r}"
    with pytest.raises(PinError, match=f"^{re.escape(message)}$"):
        store.unpin(forged)
    assert (ck.pins, trie.stats.pins, forged.used) == (0, 0, False)


def test_every_checkpoint_state_has_a_route_to_every_other() -> None:
    """Why `_settle` never raises a missing route (its subject argument is an
    accepted equivalent mutant in tools/equivalent_mutants.txt)."""
    states = [s.value for s in CheckpointState]
    assert all((a, b) in CHECKPOINT.routes for a in states for b in states)


def test_a_host_slot_asked_of_a_store_without_host_slots_is_an_invariant_violation() -> None:
    """`_host_pool` is the guard every host-slot use goes through: without host
    checkpoint slots it names the broken invariant instead of failing on None."""
    from spec.errors import InvariantViolation

    trie, _ = ssm_trie(manual=False)
    with pytest.raises(InvariantViolation) as raised:
        trie._checkpoints._host_pool()
    assert (raised.value.invariant, raised.value.detail) == (
        "host tier",
        "a host checkpoint slot without a host tier",
    )


def test_a_checkpoint_keeps_its_tail_identity_and_only_that_identity_hits_it() -> None:
    trie, copies = ssm_trie(num_blocks=16, slots=2)
    assert copies is not None
    seq = _prefill(trie, [1, 2, 3, 4, 5, 6], extra=("a", "b"))
    trie.save(seq, 6, state(1.0))
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    (view,) = trie.snapshot()["checkpoints"].values()
    assert (view["tail"], view["tail_extra"]) == ((5, 6), "b")
    other = trie.match([1, 2, 3, 4, 5, 6, 7], extra=("a", "c"))
    assert other.restore is None
    trie.abort(other)
    same = trie.match([1, 2, 3, 4, 5, 6, 7], extra=("a", "b"))
    assert same.restore is not None and same.restore.step == 6
    trie.abort(same)
    trie.check()


def test_evicting_several_checkpoints_counts_each_of_them() -> None:
    """`evict_checkpoints(n)` frees the n least recent unpinned checkpoints (their
    nodes stay) and `stats.evicted_checkpoints` counts every one of them."""
    trie, _ = ssm_trie(manual=False)
    for i in (1, 2, 3):
        seq = _prefill(trie, [i] * 8)
        trie.save(seq, 8, state(float(i)))
        trie.release(seq)
    assert trie.evict_checkpoints(2) == 2
    assert trie.stats.evicted_checkpoints == 2
    assert trie.evict_checkpoints(5) == 1  # only one is left
    assert trie.stats.evicted_checkpoints == 3
    assert trie.num_cached_blocks == 6  # the nodes stay
    trie.check()
