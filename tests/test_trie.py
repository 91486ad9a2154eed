"""Unit tests of the KV prefix cache: the scenarios a serving engine meets."""

from __future__ import annotations

import pytest
import torch

from cache import (
    BlockRemoved,
    BlockStored,
    BlockTrie,
    CacheConfig,
    CacheError,
    ConfigError,
    InvalidArgument,
    InvalidType,
    OutOfBlocks,
    SequenceNotLive,
)
from cache.events import replay
from cache.kv_pool import KVBlockPool
from spec.errors import InvariantViolation
from tests.helpers import frozen, kv_trie, serve

SYSTEM = [7, 7, 7, 7, 1, 2, 3, 4]  # two blocks of 4


def test_shared_system_prompt_hits_across_requests() -> None:
    trie = kv_trie()
    assert serve(trie, [*SYSTEM, 10, 11]) == 0
    seq = trie.match([*SYSTEM, 20, 21, 22])
    assert seq.num_cached_tokens == 8
    assert trie.stats.hit_tokens == 8 and trie.stats.query_tokens == 10 + 11
    trie.check()


def test_hit_leaves_at_least_one_token_to_compute() -> None:
    trie = kv_trie()
    serve(trie, SYSTEM)
    seq = trie.match(SYSTEM)  # fully cached, but the last token must be computed
    assert seq.num_cached_tokens == 4
    assert seq.branch_step == 8
    trie.check()


def test_block_table_covers_the_hit_then_allocation() -> None:
    trie = kv_trie()
    serve(trie, [*SYSTEM, 9])
    seq = trie.match([*SYSTEM, 5, 5, 5])
    assert len(seq.block_ids) == 2
    trie.allocate(seq, 11)
    assert len(seq.block_ids) == seq.num_blocks == 3
    trie.allocate(seq, 5)  # already covered: nothing happens
    assert len(seq.block_ids) == 3
    trie.check()


def test_two_requests_committing_the_same_block_dedupe() -> None:
    trie = kv_trie()
    a = trie.match([1, 2, 3, 4, 5])
    b = trie.match([1, 2, 3, 4, 6])
    trie.allocate(a, 5)
    trie.allocate(b, 5)
    assert a.block_ids[0] != b.block_ids[0]
    free_before = trie.num_free_blocks
    trie.commit(a, 4)
    trie.commit(b, 4)
    assert a.block_ids[0] == b.block_ids[0], "b switched to the cached block"
    assert trie.num_free_blocks == free_before + 1, "b's duplicate was freed"
    assert trie.num_cached_blocks == 1
    trie.check()
    trie.release(a)
    trie.release(b)
    trie.check()


def test_namespaces_never_share_nodes() -> None:
    trie = kv_trie()
    serve(trie, [*SYSTEM, 1], namespace="lora-a")
    assert trie.match([*SYSTEM, 1], namespace="lora-b").num_cached_tokens == 0
    assert trie.match([*SYSTEM, 1], namespace="lora-a").num_cached_tokens == 8
    trie.check()


def test_extra_identity_distinguishes_equal_tokens() -> None:
    trie = kv_trie()
    serve(trie, [*SYSTEM, 1], extra=["img-a", None])
    assert trie.match([*SYSTEM, 1], extra=["img-b", None]).num_cached_tokens == 0
    assert trie.match([*SYSTEM, 1]).num_cached_tokens == 0
    assert trie.match([*SYSTEM, 1], extra=["img-a"]).num_cached_tokens == 8
    trie.check()


def test_degenerate_hash_is_decided_by_exact_tokens() -> None:
    trie = kv_trie(key_hash=lambda key: 0)  # every key collides
    serve(trie, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    serve(trie, [1, 1, 1, 1, 3, 3, 3, 3, 0])
    serve(trie, [4, 4, 4, 4, 0])
    assert trie.num_cached_blocks == 4
    assert trie.match([1, 1, 1, 1, 3, 3, 3, 3, 9]).num_cached_tokens == 8
    assert trie.match([1, 1, 1, 1, 3, 3, 3, 2, 9]).num_cached_tokens == 4
    assert trie.match([4, 4, 4, 5, 9]).num_cached_tokens == 0
    trie.check()


def test_eviction_order_is_lru_by_release_with_serial_tie_break() -> None:
    trie = kv_trie(num_blocks=8)
    serve(trie, [1, 1, 1, 1, 0])  # released at tick 2
    serve(trie, [2, 2, 2, 2, 0])  # tick 4
    serve(trie, [3, 3, 3, 3, 0])  # tick 6
    serve(trie, [1, 1, 1, 1, 0])  # touches [1]*4 again
    assert trie.evict(1) == 1
    assert trie.match([2, 2, 2, 2, 0]).num_cached_tokens == 0, "[2] was least recent"
    assert trie.match([3, 3, 3, 3, 0]).num_cached_tokens == 4
    assert trie.match([1, 1, 1, 1, 0]).num_cached_tokens == 4
    trie.check()


def test_evicting_a_leaf_makes_its_parent_evictable_in_the_same_call() -> None:
    trie = kv_trie(num_blocks=8)
    serve(trie, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0])
    assert trie.num_evictable_blocks == 1
    assert trie.evict(3) == 3
    assert trie.num_cached_blocks == 0 and trie.num_free_blocks == 8
    trie.check()


def test_shared_and_inner_nodes_are_not_evicted() -> None:
    trie = kv_trie(num_blocks=8)
    serve(trie, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    holder = trie.match([1, 1, 1, 1, 2, 2, 2, 2, 0])
    assert trie.evict(8) == 0
    trie.release(holder)
    assert trie.evict(8) == 2
    trie.check()


def test_allocate_evicts_lru_when_short() -> None:
    trie = kv_trie(num_blocks=4)
    serve(trie, [1, 1, 1, 1, 0])
    serve(trie, [2, 2, 2, 2, 0])
    seq = trie.match([5] * 12)
    trie.allocate(seq, 12)  # 2 free + 2 reclaimable
    assert trie.stats.evicted_blocks == 1
    assert trie.match([1, 1, 1, 1, 0]).num_cached_tokens == 0
    trie.check()


def test_out_of_blocks_changes_nothing() -> None:
    trie = kv_trie(num_blocks=4)
    serve(trie, [1, 1, 1, 1, 0])
    holder = trie.match([1, 1, 1, 1, 9])
    before = frozen(trie.snapshot())
    seq = trie.match([5] * 20)
    before_seq = frozen(trie.snapshot())
    with pytest.raises(OutOfBlocks):
        trie.allocate(seq, 20)
    assert frozen(trie.snapshot()) == before_seq
    trie.abort(seq)
    assert frozen(trie.snapshot()) == before
    trie.release(holder)
    trie.check()


def test_abort_restores_everything() -> None:
    trie = kv_trie()
    serve(trie, [*SYSTEM, 1])
    serve(trie, [9, 9, 9, 9, 1])
    before = trie.snapshot()
    seq = trie.match([*SYSTEM, 3])
    assert seq.num_cached_tokens == 8
    trie.abort(seq)
    after = trie.snapshot()
    assert frozen(after) == frozen(before)
    assert trie.stats.hit_rate == before["stats"]["hit_tokens"] / before["stats"]["query_tokens"]
    with pytest.raises(SequenceNotLive):
        trie.abort(seq)


def test_release_keeps_committed_blocks_and_frees_private_ones() -> None:
    trie = kv_trie(num_blocks=8)
    seq = trie.match([1, 2, 3, 4, 5, 6])
    trie.allocate(seq, 6)
    trie.commit(seq, 6)
    assert trie.num_free_blocks == 6
    trie.release(seq)
    assert trie.num_free_blocks == 7  # the partial block came back
    assert trie.num_cached_blocks == 1
    trie.check()


def test_decode_append_allocate_commit() -> None:
    trie = kv_trie()
    seq = trie.match([1, 2, 3])
    trie.allocate(seq, 3)
    trie.commit(seq, 3)
    for token in (4, 5, 6, 7, 8):
        trie.append(seq, [token])
        trie.allocate(seq, len(seq.tokens))
        trie.commit(seq, len(seq.tokens))
    assert seq.tokens == (1, 2, 3, 4, 5, 6, 7, 8)
    assert trie.num_cached_blocks == 2
    trie.release(seq)
    assert trie.match([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_cached_tokens == 8
    trie.check()


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        ("1234", InvalidType),
        ([1, 2.0, 3], InvalidType),
        ([1, None], InvalidType),
        ([1, 2**64], InvalidArgument),
        (["1", -1], InvalidType),  # types are checked before ranges
        ([1, -2], InvalidArgument),
        ([], InvalidArgument),
        ({1, 2}, InvalidType),
    ],
)
def test_match_rejects_bad_tokens(tokens: object, error: type[Exception]) -> None:
    trie = kv_trie()
    before = frozen(trie.snapshot())
    with pytest.raises(error):
        trie.match(tokens)  # type: ignore[arg-type]
    assert frozen(trie.snapshot()) == before


def test_integer_like_tokens_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    trie = kv_trie()
    serve(trie, [*SYSTEM, 1])
    assert trie.match([np.int64(t) for t in SYSTEM] + [1]).num_cached_tokens == 8
    trie.check()


def test_bad_arguments_raise_clear_errors_and_change_nothing() -> None:
    trie = kv_trie()
    serve(trie, [*SYSTEM, 1])
    seq = trie.match([*SYSTEM, 1, 2])
    trie.allocate(seq, 10)
    trie.commit(seq, 9)
    before = frozen(trie.snapshot())
    cases = [
        (lambda: trie.match([1], namespace=3), InvalidType),  # type: ignore[arg-type]
        (lambda: trie.match([1], extra=[[1]]), InvalidType),
        (lambda: trie.match([1], extra="ab"), InvalidType),
        (lambda: trie.allocate(seq, 11), InvalidArgument),  # beyond the sequence
        (lambda: trie.allocate(seq, -1), InvalidArgument),
        (lambda: trie.allocate(seq, 2.5), InvalidType),  # type: ignore[arg-type]
        (lambda: trie.commit(seq, 8), InvalidArgument),  # not monotone
        (lambda: trie.commit(seq, 11), InvalidArgument),  # beyond the sequence
        (lambda: trie.append(seq, [1, -1]), InvalidArgument),
        (lambda: trie.append(seq, 5), InvalidType),  # type: ignore[arg-type]
        (lambda: trie.evict(-1), InvalidArgument),
        (lambda: trie.evict_checkpoints(-1), InvalidArgument),
        (lambda: trie.release("seq"), InvalidType),  # type: ignore[arg-type]
        (lambda: trie.save(seq, 4, {}), CacheError),  # SSM disabled
        (lambda: trie.save(seq, "3", {}), InvalidType),  # argument types come first
    ]
    for call, error in cases:
        with pytest.raises(error):
            call()
        assert frozen(trie.snapshot()) == before
    trie.release(seq)
    with pytest.raises(SequenceNotLive):
        trie.release(seq)
    with pytest.raises(SequenceNotLive):
        trie.commit(seq, 10)
    other = kv_trie()
    with pytest.raises(SequenceNotLive):
        other.release(trie.match([1, 2]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0, "num_blocks": 4},
        {"block_size": -1, "num_blocks": 4},
        {"block_size": 4, "num_blocks": 0},
        {"block_size": 4, "num_blocks": 4, "num_checkpoint_slots": -1},
        {"block_size": 4.0, "num_blocks": 4},
        {"block_size": 4, "num_blocks": 4, "kv_block_shape": (0, 2)},
        {"block_size": 4, "num_blocks": 4, "state_shapes": {"ssm": (-1,)}},
        {"block_size": 4, "num_blocks": 4, "device": "nonsense"},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        CacheConfig(**kwargs)  # type: ignore[arg-type]


def test_kv_pool_refuses_double_free_and_negative_counts() -> None:
    from cache.faults import Faults

    pool = KVBlockPool(2, None, torch.float16, torch.device("cpu"), Faults())
    (block,) = pool.take(1)
    assert pool.decref(block) is True
    with pytest.raises(CacheError, match="double free"):
        pool.decref(block)
    with pytest.raises(CacheError):
        pool.incref(block)
    assert pool.refs[block] == 0 and pool.num_free == 2


def test_events_replay_to_the_cached_block_set() -> None:
    trie = kv_trie(num_blocks=6)
    serve(trie, [*SYSTEM, 1])
    serve(trie, [*SYSTEM, 5, 5, 5, 5, 1])
    serve(trie, [8, 8, 8, 8, 1])
    trie.evict(2)
    events = trie.drain_events()
    assert any(isinstance(e, BlockStored) for e in events)
    assert any(isinstance(e, BlockRemoved) for e in events)
    cached = {n["block"] for n in trie.snapshot()["nodes"].values() if n["block"] is not None}
    assert replay(events) == cached
    assert trie.drain_events() == []
    trie.clear()
    assert replay(trie.drain_events(), set(cached)) == set()
    assert trie.num_free_blocks == 6
    trie.check()


def test_stored_event_chains_parent_hashes() -> None:
    trie = kv_trie()
    serve(trie, [*SYSTEM, 1])
    serve(trie, [*SYSTEM, 5, 5, 5, 5, 1])
    first, second = trie.drain_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids == (5, 5, 5, 5)


def test_check_detects_a_corrupted_count() -> None:
    trie = kv_trie()
    serve(trie, [*SYSTEM, 1])
    trie._kv.refs[0] += 1  # simulate a leaked reference
    with pytest.raises(InvariantViolation) as info:
        trie.check()
    assert info.value.invariant == "reference_conservation"


def test_clear_refuses_while_sequences_are_live() -> None:
    trie = kv_trie()
    seq = trie.match([1, 2])
    with pytest.raises(CacheError):
        trie.clear()
    trie.release(seq)
    trie.clear()


def test_ids_only_pool_works_without_tensors() -> None:
    trie = BlockTrie(CacheConfig(block_size=2, num_blocks=4))
    assert trie.kv_cache is None
    serve(trie, [1, 2, 3, 4, 5])
    assert trie.match([1, 2, 3, 4, 6]).num_cached_tokens == 4
    trie.check()


def test_int_subclasses_are_ints_but_bools_are_not() -> None:
    import enum

    class Size(enum.IntEnum):
        FOUR = 4

    trie = kv_trie()
    seq = trie.match([1, 2, 3, 4, 5])
    trie.allocate(seq, Size.FOUR)
    with pytest.raises(InvalidType):
        trie.allocate(seq, True)  # type: ignore[arg-type]
    trie.release(seq)
    trie.check()


def test_checker_reports_a_broken_snapshot_instead_of_crashing() -> None:
    from cache import ManualCopies
    from spec import invariants

    config = CacheConfig(block_size=2, num_blocks=8, num_checkpoint_slots=2)
    trie = BlockTrie(config, copies=ManualCopies())
    seq = trie.match([1, 2, 3, 4, 5])
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
    trie.save(seq, 4, None)
    trie.release(seq)
    hit = trie.match([1, 2, 3, 4, 5])
    snap = trie.snapshot()
    snap["sequences"][hit.serial]["path"] = []  # corrupt: deeper checkpoint than path
    with pytest.raises(InvariantViolation):
        invariants.check_all(snap)
