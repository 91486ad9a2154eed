"""The scheduler calls of issue 45 items 1-4 ([R62]-[R68]): admission queries, bounded
matches, KV pins by event hash, and releasing a chosen checkpoint.

The differential test (`tests/test_differential.py`) drives each call against the
reference model in every state; these pin down the cases an engine relies on.
"""

from __future__ import annotations

from typing import Any

import pytest

from cache import (
    BlockPinReceipt,
    BlockStored,
    BlockTrie,
    CacheError,
    CheckpointError,
    ConfigError,
    Copy,
    InvalidArgument,
    InvalidType,
    ManualCopies,
    OutOfBlocks,
    PinError,
    Sequence,
    SequenceNotLive,
)
from cache.block_hash import chain, root_hash, to_wire
from cache.events import BlockRemoved
from tests.helpers import frozen, kv_trie, serve, ssm_trie, state

# ------------------------------------------------------------ admission ([R62], [R63])


def test_reclaimable_counts_the_eviction_cascade_and_what_holders_keep() -> None:
    trie = kv_trie(num_blocks=8)
    assert trie.num_reclaimable_blocks == 8  # all free
    serve(trie, [1] * 4 + [2] * 4 + [3] * 4 + [9])  # an idle chain of 3 blocks
    assert trie.num_free_blocks == 5 and trie.num_evictable_blocks == 1
    assert trie.num_reclaimable_blocks == 8, "the leaf, then its parents as they become leaves"
    seq = trie.match([1] * 4 + [2] * 4 + [7])  # holds the first two blocks
    assert trie.num_reclaimable_blocks == 6, "held blocks and their ancestors are not"
    trie.release(seq)
    assert trie.num_reclaimable_blocks == 8
    trie.check()


def test_can_allocate_agrees_with_allocate_at_the_boundary() -> None:
    trie = kv_trie(num_blocks=6)
    serve(trie, [1] * 4 + [2] * 4 + [9])  # 2 cached idle blocks, 4 free
    seq = trie.match([5] * 24)
    assert trie.num_reclaimable_blocks == 6
    before = frozen(trie.snapshot())
    assert trie.can_allocate(seq, 24)  # 6 blocks: every free one and both cached ones
    assert trie.can_allocate(seq, 0)
    assert frozen(trie.snapshot()) == before, "asking changes nothing"
    other = trie.match([6] * 5)
    trie.allocate(other, 4)  # one block gone
    assert not trie.can_allocate(seq, 24)
    with pytest.raises(OutOfBlocks):
        trie.allocate(seq, 24)
    assert trie.can_allocate(seq, 20)
    trie.allocate(seq, 20)
    assert trie.num_reclaimable_blocks == 0
    trie.check()


def test_can_allocate_refuses_what_allocate_refuses() -> None:
    trie = kv_trie()
    seq = trie.match([1, 2, 3])
    with pytest.raises(InvalidType):
        trie.can_allocate(seq, 1.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        trie.can_allocate(seq, 4)
    with pytest.raises(InvalidType):
        trie.can_allocate("seq", 1)  # type: ignore[arg-type]
    trie.release(seq)
    with pytest.raises(SequenceNotLive):
        trie.can_allocate(seq, 1)


def test_reclaimable_counts_unpinned_frozen_tails_not_pinned_checkpoints() -> None:
    trie, copies = ssm_trie(num_blocks=8)
    assert copies is not None
    seq = trie.match([1] * 4 + [2] * 3)
    trie.allocate(seq, 7)
    trie.commit(seq, 4)
    copy = trie.save(seq, 6, state(1.0))  # a partial step: a frozen tail block
    assert copy is not None
    trie.release(seq)
    # the node and the frozen tail, kept by the producer pin; the copy reads block 1
    assert trie.num_free_blocks == 5
    assert trie.num_reclaimable_blocks == 5
    copies.complete(copy)
    trie.poll()
    assert trie.num_reclaimable_blocks == 8, "the node, then its checkpoint's frozen tail"
    trie.check()


# ------------------------------------------------------------ bounded matches ([R64], [R65])

PROMPT = [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5]  # four full blocks of 4 and one token


def test_max_hit_tokens_rounds_down_to_a_block() -> None:
    trie = kv_trie()
    serve(trie, PROMPT)
    for cap, hit in ((None, 16), (16, 16), (15, 12), (4, 4), (3, 0), (0, 0)):
        seq = trie.match(PROMPT, max_hit_tokens=cap)
        assert seq.num_cached_tokens == hit, cap
        assert len(seq.block_ids) == hit // 4
        assert seq.branch_step == 16
        trie.abort(seq)
    trie.check()


def test_prompt_logprobs_request_hits_nothing_yet_commits_deduplicated() -> None:
    """vLLM computes a prompt-logprobs request's whole prompt: no hit; its computed
    blocks are deduplicated into the cached ones ([R18])."""
    trie = kv_trie()
    serve(trie, PROMPT)
    cached = trie.num_cached_blocks
    seq = trie.match(PROMPT, max_hit_tokens=0)
    assert seq.num_cached_tokens == 0 and seq.block_ids == ()
    assert trie.stats.hit_tokens == 0
    trie.allocate(seq, len(PROMPT))
    own = seq.block_ids
    trie.commit(seq, len(PROMPT))
    assert trie.num_cached_blocks == cached, "nothing cached twice"
    shared = trie.match(PROMPT)
    assert seq.block_ids[:4] == shared.block_ids and seq.block_ids[:4] != own[:4]
    trie.release(shared)
    trie.release(seq)
    trie.check()


def test_atomic_spans_are_hit_whole_or_not_at_all() -> None:
    trie = kv_trie()
    serve(trie, PROMPT)
    cases: list[tuple[list[tuple[int, int]], int]] = [
        ([(2, 16)], 16),  # taken whole
        ([(14, 18)], 12),  # cut at 16: back to 14, then to the block at 12
        ([(6, 10), (9, 17)], 4),  # 16 cuts the second, 8 the first: 4
        ([(16, 17)], 16),  # a hit ending at a span's start takes none of it
        ([(1, 3), (3, 5)], 16),
        ([(0, 18)], 0),  # a span from the first token that every hit would cut: none
    ]
    for spans, hit in cases:
        seq = trie.match(PROMPT, atomic_spans=spans)
        assert seq.num_cached_tokens == hit, spans
        trie.abort(seq)
    seq = trie.match(PROMPT, max_hit_tokens=12, atomic_spans=[(10, 13)])
    assert seq.num_cached_tokens == 8
    trie.abort(seq)


def test_ssm_hit_is_a_checkpoint_at_or_below_the_cap_outside_every_span() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = trie.match(PROMPT)
    trie.allocate(seq, 17)
    trie.commit(seq, 16)
    for step in (4, 10, 13):  # one checkpoint per anchor (block 1, 2, 3)
        assert trie.save(seq, step, state(float(step))) is not None
    trie.release(seq)
    for kwargs, hit in (
        ({}, 13),
        ({"max_hit_tokens": 12}, 10),
        ({"max_hit_tokens": 5}, 4),
        ({"max_hit_tokens": 3}, 0),
        ({"atomic_spans": [(12, 14)]}, 10),  # 13 cuts it; 10 does not
        ({"atomic_spans": [(5, 14)]}, 4),
        ({"atomic_spans": [(9, 11)]}, 13),  # taken whole
        ({"atomic_spans": [(3, 5), (9, 11)], "max_hit_tokens": 12}, 0),
    ):
        seq = trie.match(PROMPT, **kwargs)
        assert seq.num_cached_tokens == hit, kwargs
        assert (seq.restore is None) == (hit == 0)
        trie.abort(seq)
    trie.check()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_hit_tokens": -1}, InvalidArgument, r"max_hit_tokens must be >= 0, got -1$"),
        ({"max_hit_tokens": True}, InvalidType, r"None or an int, got bool$"),
        ({"max_hit_tokens": 2.0}, InvalidType, r"None or an int, got float$"),
        ({"atomic_spans": [(3, 3)]}, InvalidArgument, r"\[0\] must have 0 <= start < end"),
        ({"atomic_spans": [(-1, 3)]}, InvalidArgument, r"got \(-1, 3\)$"),
        ({"atomic_spans": [(1, 2, 3)]}, InvalidType, r"\[0\] must be a \(start, end\) pair"),
        ({"atomic_spans": [(1.0, 2)]}, InvalidType, r"must hold ints, got float in \(1.0, 2\)$"),
        ({"atomic_spans": "0-4"}, InvalidType, r"\(start, end\) pairs, got str$"),
        ({"atomic_spans": [(0, 4), None]}, InvalidType, r"atomic_spans\[1\] .* got None$"),
    ],
)
def test_malformed_bounds_are_refused_changing_nothing(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    trie = kv_trie()
    serve(trie, PROMPT)
    before = frozen(trie.snapshot())
    with pytest.raises(error, match=message):
        trie.match(PROMPT, namespace="fresh", **kwargs)
    assert frozen(trie.snapshot()) == before


# ------------------------------------------------------------ block pins ([R66], [R67])


def _hashes(namespace: str, tokens: list[int], size: int = 4) -> list[int]:
    h = root_hash(namespace)
    out = []
    for i in range(len(tokens) // size):
        h = chain(h, tokens[i * size : (i + 1) * size], namespace=namespace)
        out.append(to_wire(h))
    return out


def test_pinned_blocks_survive_eviction_until_unpinned() -> None:
    trie = kv_trie(num_blocks=8)
    serve(trie, PROMPT)
    stored = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    published = [h for e in stored for h in e.block_hashes]
    assert published == _hashes("", PROMPT)
    receipt = trie.pin_blocks([published[2], 999, published[2]])
    assert isinstance(receipt, BlockPinReceipt) and receipt.pinned == 1
    trie.check()
    assert trie.num_reclaimable_blocks == 4 + 1, "the pinned block and its ancestors stay"
    assert trie.evict(8) == 1  # only the leaf below it
    assert trie.num_cached_blocks == 3
    seq = trie.match(PROMPT)
    assert seq.num_cached_tokens == 12
    trie.abort(seq)
    assert repr(receipt) == "<BlockPinReceipt pinned=1>"
    trie.unpin_blocks(receipt)
    assert receipt.used and repr(receipt) == "<BlockPinReceipt pinned=1 used>"
    with pytest.raises(PinError):
        trie.unpin_blocks(receipt)
    assert trie.evict(8) == 3
    trie.check()


def test_block_pins_are_per_namespace_and_skip_what_is_not_cached() -> None:
    trie = kv_trie()
    serve(trie, PROMPT, namespace="lora-a")
    assert trie.pin_blocks(_hashes("lora-a", PROMPT), namespace="").pinned == 0
    receipt = trie.pin_blocks(_hashes("lora-a", PROMPT), namespace="lora-a")
    assert receipt.pinned == 4
    serve(trie, [7] * 8 + [1], namespace="lora-a")  # committed after the index was built
    assert trie.pin_blocks(_hashes("lora-a", [7] * 8), namespace="lora-a").pinned == 2
    # the blocks indexed before those commits are still found (the index grew, not restarted)
    assert trie.pin_blocks(_hashes("lora-a", PROMPT), namespace="lora-a").pinned == 4
    with pytest.raises(CacheError, match="block pins"):
        trie.clear()
    trie.check()


def test_the_hash_index_skips_evicted_nodes_and_finds_them_again() -> None:
    trie = kv_trie(num_blocks=5)
    hashes = _hashes("", PROMPT)
    trie.unpin_blocks(trie.pin_blocks(hashes))  # builds the (empty) index
    serve(trie, PROMPT)
    trie.evict(5)
    assert trie.pin_blocks(hashes).pinned == 0, "evicted: its row may hold another node"
    serve(trie, [8] * 17)  # reuses the rows
    assert trie.pin_blocks(hashes).pinned == 0
    trie.evict(5)
    serve(trie, PROMPT)
    assert trie.pin_blocks(hashes).pinned == 4
    trie.check()


def test_block_pins_name_vllm_hashes_by_their_wire_value() -> None:
    trie = kv_trie(block_hash="vllm")
    serve(trie, PROMPT)
    published = [
        h for e in trie.drain_events() if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert trie.pin_blocks(published).pinned == 4  # the full digests events carry
    assert trie.pin_blocks([to_wire(h) for h in published]).pinned == 4  # the wire's
    trie.check()


def test_block_pins_need_events_and_well_formed_input() -> None:
    with pytest.raises(ConfigError, match="enable_events"):
        kv_trie(enable_events=False).pin_blocks([1])
    trie = kv_trie()
    for bad, error, message in (
        ((1, "2"), InvalidType, "got str"),
        ([True], InvalidType, "got bool"),
        ({1, 2}, InvalidType, "list or tuple of ints, got set"),
        ([-1], InvalidArgument, "-1"),
    ):
        with pytest.raises(error, match=message):
            trie.pin_blocks(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidType):
        trie.pin_blocks([1], namespace=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidType):
        trie.unpin_blocks(object())  # type: ignore[arg-type]
    other = kv_trie()
    with pytest.raises(PinError):
        trie.unpin_blocks(other.pin_blocks([1]))


# ------------------------------------------------------------ drop_checkpoint ([R68])


def test_rolling_decode_checkpoint_drops_the_previous_one() -> None:
    """lmdeploy keeps one decode checkpoint per sequence: save the new, drop the old."""
    trie, _ = ssm_trie(manual=False, slots=2)
    seq = trie.match(PROMPT)
    trie.allocate(seq, 17)
    trie.commit(seq, 16)
    trie.save(seq, 10, state(1.0))  # partial: a frozen tail
    trie.drain_events()
    free_blocks = trie.num_free_blocks
    trie.save(seq, 16, state(2.0))
    evicted = trie.stats.evicted_checkpoints
    assert trie.drop_checkpoint(seq, 10) is True
    assert trie.stats.evicted_checkpoints == evicted + 1
    assert trie.num_free_checkpoint_slots == 1
    assert trie.num_free_blocks == free_blocks + 1, "its frozen tail went back"
    assert any(isinstance(e, BlockRemoved) for e in trie.drain_events())
    assert trie.drop_checkpoint(seq, 10) is False, "none there any more"
    trie.release(seq)
    assert trie.match(PROMPT).num_cached_tokens == 16
    trie.check()


def _saving(step: int) -> tuple[BlockTrie, ManualCopies, Sequence, Copy]:
    """An SSM trie whose PROMPT request committed 2 blocks and is saving at `step`."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = trie.match(PROMPT)
    trie.allocate(seq, 17)
    trie.commit(seq, 8)
    copy = trie.save(seq, step, state(1.0))
    assert copy is not None
    return trie, copies, seq, copy


def test_drop_checkpoint_refuses_pinned_and_ignores_other_prefixes() -> None:
    trie, copies, seq, copy = _saving(6)
    before = frozen(trie.snapshot())
    with pytest.raises(PinError):
        trie.drop_checkpoint(seq, 6)  # its save copy is in flight
    assert frozen(trie.snapshot()) == before
    copies.complete(copy)
    trie.poll()
    other = trie.match([1] * 4 + [3, 3, 9])  # another tail at the same anchor
    trie.allocate(other, 7)
    trie.commit(other, 4)
    assert trie.drop_checkpoint(other, 6) is False
    assert trie.drop_checkpoint(seq, 5) is False  # another step
    assert trie.drop_checkpoint(seq, 12) is False  # not on its path
    receipt = trie.pin(trie.match(PROMPT))
    with pytest.raises(PinError):
        trie.drop_checkpoint(seq, 6)
    trie.unpin(receipt)
    with pytest.raises(InvalidArgument):
        trie.drop_checkpoint(seq, 0)


def test_drop_checkpoint_leaves_a_withdrawn_checkpoint_to_its_last_pin() -> None:
    trie, copies, seq, copy = _saving(8)
    copies.fail(copy)  # [R46]: withdrawn, held by its producer pin until reaped
    assert trie.drop_checkpoint(seq, 8) is False
    trie.poll()
    assert trie.num_free_checkpoint_slots == 4
    trie.check()


def test_drop_checkpoint_needs_ssm_and_a_live_sequence() -> None:
    trie = kv_trie()
    seq = trie.match(PROMPT)
    with pytest.raises(CheckpointError):
        trie.drop_checkpoint(seq, 4)
    trie.release(seq)
    with pytest.raises(SequenceNotLive):
        trie.drop_checkpoint(seq, 4)


def test_drop_checkpoint_names_what_it_refuses() -> None:
    trie, _ = ssm_trie(manual=False)
    seq = trie.match(PROMPT)
    with pytest.raises(InvalidType, match="step must be an int, got str"):
        trie.drop_checkpoint(seq, "4")  # type: ignore[arg-type]
    with pytest.raises(
        InvalidArgument, match=rf"drop_checkpoint: step=0 outside 1\.\.{len(PROMPT)}"
    ):
        trie.drop_checkpoint(seq, 0)
    attention = kv_trie()
    with pytest.raises(
        CheckpointError,
        match=r"^drop_checkpoint: SSM checkpoints are disabled \(num_checkpoint_slots=0\)$",
    ):
        attention.drop_checkpoint(attention.match(PROMPT), 4)


@pytest.mark.parametrize("namespace", ["", "tenant"])
def test_drop_checkpoint_at_the_committed_end_and_under_the_root(namespace: str) -> None:
    """A checkpoint at the last committed block boundary (its anchor is the path's
    last node) and one inside block 0 (anchored at the namespace's root) are dropped."""
    trie, _ = ssm_trie(manual=False)
    seq = trie.match(PROMPT, namespace=namespace)
    trie.allocate(seq, 17)
    trie.commit(seq, 8)
    trie.save(seq, 8, state(1.0))
    trie.save(seq, 2, state(2.0))
    slots = trie.num_free_checkpoint_slots
    assert trie.drop_checkpoint(seq, 8) is True
    assert trie.drop_checkpoint(seq, 2) is True
    assert trie.num_free_checkpoint_slots == slots + 2
    trie.check()


def test_drop_checkpoint_finds_a_tail_by_its_extra_identity() -> None:
    """A partial checkpoint's tail keeps its block's extra identity ([R5]): the request
    that saved it drops it; a request whose tail block differs only in extra does not."""
    trie, _ = ssm_trie(manual=False)
    extra = [None, None, "img"]
    seq = trie.match(PROMPT, extra=extra)
    trie.allocate(seq, 17)
    trie.commit(seq, 8)
    trie.save(seq, 8, state(2.0))  # no tail: no extra either
    assert trie.drop_checkpoint(seq, 8) is True
    trie.save(seq, 10, state(1.0))  # (one checkpoint per anchor: [R27])
    plain = trie.match(PROMPT)
    assert trie.drop_checkpoint(plain, 10) is False
    other = trie.match(PROMPT, extra=[None, None, "audio"])
    assert trie.drop_checkpoint(other, 10) is False
    assert trie.drop_checkpoint(seq, 10) is True
    for s in (seq, plain, other):
        trie.release(s)
    trie.check()


@pytest.mark.parametrize("extra", [None, [None, "img"]])
def test_blocks_committed_after_the_hash_index_exists_are_pinned_by_hash(extra: object) -> None:
    """[R66]: the hash index, built by the first `pin_blocks`, takes every block a later
    commit attaches, under the request's namespace (the native commit for a plain
    request, the Python core's for one with an extra identity)."""
    trie = kv_trie()
    trie.unpin_blocks(trie.pin_blocks([], namespace="ns"))  # the index now exists
    seq = trie.match(PROMPT, namespace="ns", extra=extra)
    trie.allocate(seq, 17)
    trie.commit(seq, 16)
    hashes = [h for e in trie.drain_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(hashes) == 4
    receipt = trie.pin_blocks(hashes, namespace="ns")
    assert receipt.pinned == 4
    assert trie.pin_blocks(hashes).pinned == 0  # another namespace's blocks
    trie.check()
