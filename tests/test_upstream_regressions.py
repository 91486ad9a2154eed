"""Regression tests for lifecycle bugs that peer engines shipped.

Each test restates the upstream failure in blocktrie's terms and checks that
the specified behaviour holds (and that `check()` still passes). The upstream
code is not copied; only the failure mode is.
"""

from __future__ import annotations

import pytest

from cache import BlockTrie, CacheError, PinError, Sequence, SequenceNotLive
from tests.helpers import empty_state, frozen, kv_trie, ssm_trie, state

PROMPT = [1, 1, 1, 1, 2, 2, 2, 2, 3]


def _committed(trie: BlockTrie, tokens: list[int]) -> Sequence:
    seq = trie.match(tokens)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    return seq


def test_lmdeploy_4700_kv_eviction_skips_a_leaf_whose_checkpoint_is_pinned() -> None:
    """InternLM/lmdeploy#4700: eviction chose leaves by KV refcount alone and
    released a checkpoint an in-flight save still pinned. When every candidate
    is skipped, nothing may be freed."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _committed(trie, PROMPT)
    copy = trie.save(seq, 8, state(1.0))
    trie.release(seq)
    before = frozen(trie.snapshot())
    assert trie.evict(100) == 0
    assert frozen(trie.snapshot())["nodes"] == before["nodes"]
    trie.check()
    assert copy is not None
    copies.complete(copy)
    trie.poll()
    assert trie.evict(100) == 2
    trie.check()


def test_sglang_21379_checkpoint_eviction_never_touches_kv_held_by_a_request() -> None:
    """sgl-project/sglang#21379: evicting an SSM state picked a leaf whose KV an
    in-flight request still held and tried to evict the KV with it. Here
    checkpoint eviction frees the state slot only; the KV node stays."""
    trie, _ = ssm_trie(manual=False)
    seq = _committed(trie, PROMPT)
    trie.save(seq, 8, state(1.0))  # CPU copy: finished and unpinned at once
    cached = trie.num_cached_blocks
    assert trie.evict_checkpoints(1) == 1
    assert trie.num_cached_blocks == cached
    assert trie.evict(100) == 0  # the request still holds its blocks
    trie.release(seq)
    trie.check()


def test_sglang_36770_no_evictable_slot_skips_the_checkpoint_instead_of_crashing() -> None:
    """sgl-project/sglang#36770: `assert` when no mamba slot could be evicted
    because every cached state was locked. A save with no slot is skipped and
    counted, never an error."""
    trie, copies = ssm_trie(slots=1)
    assert copies is not None
    seq = _committed(trie, PROMPT)
    assert trie.save(seq, 4, state(1.0)) is not None  # holds the only slot, pinned
    before = trie.stats.checkpoints_skipped
    assert trie.save(seq, 8, state(2.0)) is None
    assert trie.stats.checkpoints_skipped == before + 1
    trie.release(seq)
    trie.check()


def test_mllm_656_releasing_what_was_never_taken_is_refused() -> None:
    """UbiquitousLearning/mllm#656: a lock released without a matching take
    drove the count negative and corrupted the evictable-size accounting."""
    trie, _ = ssm_trie(manual=False)
    seq = _committed(trie, PROMPT)
    trie.save(seq, 8, state(1.0))
    trie.release(seq)
    hit = trie.match([*PROMPT, 4])
    receipt = trie.pin(hit)
    trie.unpin(receipt)
    before = frozen(trie.snapshot())
    with pytest.raises(PinError):
        trie.unpin(receipt)
    trie.release(hit)
    after_release = frozen(trie.snapshot())
    with pytest.raises(SequenceNotLive):
        trie.release(hit)
    assert frozen(trie.snapshot()) == after_release
    assert before["refcounts"] != after_release["refcounts"]  # the first release did count
    assert min(trie.snapshot()["refcounts"].values()) >= 0
    trie.check()


def test_mini_sglang_52_the_deepest_matched_node_is_held_too() -> None:
    """sgl-project/mini-sglang#52: locking a match skipped the matched node
    itself (only its ancestors were locked), so eviction could free a block
    the request was using."""
    trie = kv_trie(num_blocks=8)
    serve = _committed(trie, PROMPT)
    trie.release(serve)
    hit = trie.match(PROMPT)
    assert hit.num_cached_tokens == 8
    assert trie.evict(100) == 0, "every matched block, the deepest included, is held"
    assert set(hit.block_ids) <= {
        n["block"] for n in trie.snapshot()["nodes"].values() if n["block"] is not None
    }
    trie.release(hit)
    assert trie.evict(100) == 2
    trie.check()


def test_sglang_27147_a_pin_is_bound_to_the_checkpoint_it_was_taken_on() -> None:
    """sgl-project/sglang#27147: a lock taken while a node had no SSM state was
    released against a state revived in between, decrementing a count that was
    never incremented. A blocktrie pin is a receipt for one checkpoint object:
    a request that matched no checkpoint holds no pin, and one saved later at
    the same node is unaffected by that request's release."""
    trie, copies = ssm_trie()
    assert copies is not None
    first = _committed(trie, PROMPT)
    trie.release(first)
    hit = trie.match([*PROMPT, 4])  # KV cached, no checkpoint: no hit, no pin
    assert hit.restore is None
    writer = _committed(trie, [*PROMPT, 5])
    copy = trie.save(writer, 8, state(3.0))  # a checkpoint appears at that node
    assert copy is not None
    trie.release(hit)
    snap = trie.snapshot()
    (ck,) = snap["checkpoints"].values()
    assert ck["pins"] == 1, "only the producer pin; the old match never pinned it"
    trie.check()
    copies.complete(copy)
    trie.poll()
    trie.release(writer)
    trie.check()


def test_a_block_freed_twice_is_refused_at_the_pool() -> None:
    """The class of bug where two owners both free one block: the pool refuses
    the second free and keeps its free list exact."""
    trie = kv_trie()
    seq = trie.match([1, 2, 3])
    trie.allocate(seq, 3)
    (block,) = seq.block_ids
    trie.release(seq)
    with pytest.raises(CacheError, match="double free"):
        trie._kv.decref(block)
    assert trie.snapshot()["free_blocks"].count(block) == 1
    trie.check()


def test_restore_copy_destination_outlives_an_aborted_request() -> None:
    """A checkpoint released while an async copy still used it (the seed of
    this project), on the restore side: aborting the request does not free the
    block or the checkpoint the pending restore copy writes and reads."""
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _committed(trie, [*PROMPT, 3])
    copies.complete_all()
    trie.save(seq, 10, state(1.0))
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    hit = trie.match([*PROMPT, 3, 9])
    copy = trie.restore(hit, empty_state())
    target = hit.block_ids[2]
    trie.abort(hit)
    assert target not in trie.snapshot()["free_blocks"]
    assert trie.evict_checkpoints(10) == 0
    trie.check()
    copies.complete(copy)
    trie.poll()
    assert target in trie.snapshot()["free_blocks"]
    trie.check()
