"""Events as the trie emits them: off by default, stable chained hashes, and
SSM checkpoints in their own group so a router sees where a hybrid hit can end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xxhash")

from cache import BlockTrie, CacheConfig
from cache.block_hash import BlockHasher
from cache.events import (
    CHECKPOINT_GROUP,
    KIND_MAMBA,
    KV_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    replay,
)
from spec.errors import InvariantViolation
from tests.helpers import kv_trie, serve, ssm_trie, state

ROOT = Path(__file__).resolve().parent.parent


def test_events_are_off_by_default_and_nothing_accumulates() -> None:
    trie = BlockTrie(CacheConfig(block_size=4, num_blocks=8))
    for i in range(5):
        serve(trie, [i, i, i, i, 1])
    assert trie.drain_events() == []
    assert trie._events._events == []


def test_block_hashes_chain_from_the_namespace_root() -> None:
    trie = kv_trie(num_blocks=8, hash_seed=7)
    serve(trie, [1, 2, 3, 4, 5, 6, 7, 8, 9], namespace="tenant")
    (stored,) = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    hasher = BlockHasher("xxh3", 7)
    first = hasher.chain(hasher.root("tenant"), (1, 2, 3, 4))
    second = hasher.chain(first, (5, 6, 7, 8))
    assert stored.block_hashes == (first, second)
    assert stored.parent_block_hash is None
    assert len(set(stored.block_hashes)) == 2  # every block its own hash
    assert stored.extra_keys == (("tenant",), ("tenant",))


def test_a_blocks_extra_identity_is_hashed_into_its_own_block_only() -> None:
    """[R5]: a block's extra identity (an image's hash, say) is part of its chained
    hash; a block past the end of `extra` has none."""
    trie = kv_trie(num_blocks=8)
    serve(trie, [1, 2, 3, 4, 5, 6, 7, 8, 9], extra=["img0"])
    (stored,) = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    hasher = BlockHasher("xxh3")
    first = hasher.chain(hasher.root(""), (1, 2, 3, 4), "img0")
    assert stored.block_hashes == (first, hasher.chain(first, (5, 6, 7, 8)))
    assert first != hasher.chain(hasher.root(""), (1, 2, 3, 4))


@pytest.mark.parametrize("scheme", ["xxh3", "vllm"])
def test_a_commit_chains_its_new_blocks_from_the_last_block_it_shares(scheme: str) -> None:
    """A commit that deduplicates its first blocks hashes the rest under the last
    shared one; an injected key hash (a test hook) changes no published hash."""
    hashes = []
    for key_hash in (None, lambda block: 0):
        trie = kv_trie(num_blocks=16, block_hash=scheme, key_hash=key_hash)
        serve(trie, [1, 2, 3, 4, 5, 6, 7, 8])
        serve(trie, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])
        first, second = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
        hasher = BlockHasher(scheme)
        one = hasher.chain(hasher.root(""), (1, 2, 3, 4))
        two = hasher.chain(one, (5, 6, 7, 8))
        three = hasher.chain(two, (9, 10, 11, 12))
        assert first.block_hashes == (one, two)
        assert second.block_hashes == (three, hasher.chain(three, (13, 14, 15, 16)))
        assert second.parent_block_hash == two
        hashes.append(first.block_hashes + second.block_hashes)
    assert hashes[0] == hashes[1]


@pytest.mark.parametrize("scheme", ["xxh3", "vllm"])
def test_a_stored_run_holds_its_hashes_packed_when_each_fits_64_bits(scheme: str) -> None:
    """A commit's record (`drain_event_records`) holds its blocks' hashes as one `bytes`
    of native uint64s (`packed_hashes`: no `int` per block) when each fits in 64
    bits, as every `xxh3` chain value does; a run of `vllm` digests keeps its ints.
    Either way `run_hashes` gives the chain's hashes, which the built event carries."""
    from array import array

    from cache.event_log import packed_hashes, run_hashes

    trie = kv_trie(num_blocks=16, block_hash=scheme)
    serve(trie, [1, 2, 3, 4, 5, 6, 7, 8])
    serve(trie, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    records = trie.drain_event_records()
    runs = [item for item in records.items if type(item) is tuple]
    hasher = BlockHasher(scheme)
    one = hasher.chain(hasher.root(""), (1, 2, 3, 4))
    two = hasher.chain(one, (5, 6, 7, 8))
    three = hasher.chain(two, (9, 10, 11, 12))
    assert [run_hashes(run[1]) for run in runs] == [[one, two], [three]]
    if scheme == "xxh3":
        packed = [array("Q", [one, two]).tobytes(), array("Q", [three]).tobytes()]
        assert [run[1] for run in runs] == packed
    else:
        assert [run[1] for run in runs] == [[one, two], [three]]
    assert [e.block_hashes for e in records.events()] == [(one, two), (three,)]
    assert packed_hashes([]) == b"" and run_hashes(b"") == []
    assert packed_hashes([1 << 64]) == [1 << 64]  # past 64 bits: the list itself


def test_vllm_block_hashes_carry_the_namespace_as_the_lora_name_in_every_block() -> None:
    """Under vLLM's scheme the namespace is each block's LoRA name: it is hashed
    into every block's extra keys, not only into the root's seed."""
    trie = kv_trie(num_blocks=8, block_hash="vllm")
    serve(trie, [1, 2, 3, 4, 5, 6, 7, 8, 9], namespace="tenant")
    (stored,) = [e for e in trie.drain_events() if isinstance(e, BlockStored)]
    hasher = BlockHasher("vllm")
    first = hasher.chain(hasher.root("tenant"), (1, 2, 3, 4), None, "tenant")
    second = hasher.chain(first, (5, 6, 7, 8), None, "tenant")
    assert stored.block_hashes == (first, second)
    assert first != hasher.chain(hasher.root("tenant"), (1, 2, 3, 4))  # no LoRA name


@pytest.mark.parametrize("scheme", ["xxh3", "vllm"])
@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("a", None), ("", ["a"])),  # LoRA "a", no identity / no LoRA, identity "a"
        (("a", None), ("", [("a",)])),
        (("a", [("x",)]), ("", [("a", "x")])),
        (("", ["a"]), ("", [("a",)])),  # a scalar identity and its 1-tuple
        (("", None), ("", [()])),  # no identity and the empty one
    ],
)
def test_two_cached_blocks_never_publish_one_hash(
    scheme: str, first: tuple[str, list[object] | None], second: tuple[str, list[object] | None]
) -> None:
    """[R61]: blocks that differ in namespace or identity publish different hashes,
    so a `BlockRemoved` of one never tells a router the other is gone."""
    trie = kv_trie(num_blocks=8, block_hash=scheme)
    for namespace, extra in (first, second):
        serve(trie, [1, 2, 3, 4, 5], namespace=namespace, extra=extra)
    stored = [e.block_hashes for e in trie.drain_events() if isinstance(e, BlockStored)]
    assert len(stored) == 2 and stored[0] != stored[1]
    trie.check()
    assert trie.evict(1) == 1
    (removed,) = [e.block_hashes for e in trie.drain_events() if isinstance(e, BlockRemoved)]
    assert removed in stored and trie.num_cached_blocks == 1


def test_check_refuses_two_cached_blocks_with_one_published_hash() -> None:
    """`check()` (invariant 10) sees two cached blocks sharing a published hash."""
    trie = kv_trie(num_blocks=8)
    serve(trie, [1, 2, 3, 4, 5])
    serve(trie, [5, 6, 7, 8, 9])
    trie.check()
    t = trie._nodes
    first, second = t.child_nodes(next(iter(trie._roots.values())))
    t.block_hash[second] = t.block_hash[first]
    with pytest.raises(InvariantViolation, match="publish the same block hash"):
        trie.check()


def test_block_hashes_are_the_same_in_two_processes() -> None:
    code = (
        "from tests.helpers import kv_trie, serve\n"
        "t = kv_trie(num_blocks=8, block_hash='{scheme}')\n"
        "serve(t, [3, 1, 4, 1, 5, 9, 2, 6, 5], namespace='ns')\n"
        "print([e.block_hashes for e in t.drain_events()])\n"
    )
    for scheme in ("xxh3", "vllm"):
        outputs = set()
        for seed in ("0", "12345"):
            env = {**os.environ, "PYTHONHASHSEED": seed}
            out = subprocess.run(
                [sys.executable, "-c", code.format(scheme=scheme)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            outputs.add(out.stdout)
        assert len(outputs) == 1, scheme


def test_checkpoints_are_announced_in_their_own_group() -> None:
    trie, copies = ssm_trie(num_blocks=16, slots=2)
    seq = trie.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    trie.allocate(seq, 11)
    trie.commit(seq, 11)
    trie.save(seq, 4, state(1.0))  # at a block boundary: named by its KV block
    trie.save(seq, 10, state(2.0))  # a partial tail past block 2
    events = trie.drain_events()
    kv = [e for e in events if isinstance(e, BlockStored) and e.group_idx == KV_GROUP]
    cks = [e for e in events if isinstance(e, BlockStored) and e.group_idx == CHECKPOINT_GROUP]
    assert [e.kv_cache_spec_kind for e in cks] == [KIND_MAMBA, KIND_MAMBA]
    block1, block2 = kv[0].block_hashes
    assert cks[0].block_hashes == (block1,)  # a hybrid hit can end after block 1
    assert cks[0].parent_block_hash is None  # block 1's parent is the root
    assert cks[1].parent_block_hash == block2
    assert cks[1].token_ids == (9, 10)
    assert cks[1].block_hashes[0] not in kv[0].block_hashes
    assert replay(events, group_idx=CHECKPOINT_GROUP) == {0, 1}
    assert copies is not None
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    assert trie.evict_checkpoints(2) == 2
    removed = [e for e in trie.drain_events() if isinstance(e, BlockRemoved)]
    assert {e.group_idx for e in removed} == {CHECKPOINT_GROUP}
    assert {h for e in removed for h in e.block_hashes} == {
        cks[0].block_hashes[0],
        cks[1].block_hashes[0],
    }
    trie.check()  # invariant 10 for both groups


def test_clear_emits_only_all_blocks_cleared() -> None:
    trie, copies = ssm_trie(num_blocks=16, slots=2)
    seq = trie.match([1, 2, 3, 4, 5])
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
    trie.save(seq, 4, state(1.0))
    assert copies is not None
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    trie.drain_events()
    trie.clear()
    assert trie.drain_events() == [AllBlocksCleared()]
    trie.check()


def test_one_eviction_over_two_namespaces_removes_by_namespace_runs() -> None:
    """`BlockRemoved` names one namespace: an evict() that frees blocks of two
    namespaces emits one event per run of the same namespace, in eviction order."""
    trie = kv_trie(num_blocks=8, block_size=2)
    serve(trie, [1, 2, 3], namespace="a")  # one block in "a" (the oldest)
    serve(trie, [1, 2, 3], namespace="b")  # the same tokens in "b"
    serve(trie, [5, 6, 7], namespace="a")
    trie.drain_events()
    assert trie.evict(3) == 3
    removed = [e for e in trie.drain_events() if isinstance(e, BlockRemoved)]
    assert [(e.namespace, len(e.block_ids)) for e in removed] == [("a", 1), ("b", 1), ("a", 1)]
    trie.check()


@pytest.mark.parametrize("drained", [False, True])
def test_check_catches_events_that_do_not_replay_to_the_cache(drained: bool) -> None:
    """Invariant 10 is not vacuous: an event the cache did not make (a removal of a
    block still cached, a store of a block that is free) fails `check()`, whether
    it is still pending or already drained (each event counts from when it is
    recorded)."""
    from spec.errors import InvariantViolation

    trie = kv_trie(num_blocks=8)
    serve(trie, [1, 2, 3, 4, 5, 6, 7, 8])
    trie.check()
    cached = sorted(trie.snapshot()["event_blocks"])
    assert len(cached) == 2
    log = trie._events
    log.removed([123], [cached[0]], [""])  # a removal the cache never made
    if drained:
        trie.drain_event_records()
    with pytest.raises(InvariantViolation, match="events"):
        trie.check()
    log.stored(None, [123], [bytes(16)], [cached[0]], 0, 1, 4, "")  # put it back
    trie.check()
    free = next(b for b in range(8) if b not in cached)
    log.stored(None, [456], [bytes(16)], [free], 0, 1, 4, "")  # a free block "stored"
    if drained:
        trie.drain_events()
    with pytest.raises(InvariantViolation, match="events"):
        trie.check()
