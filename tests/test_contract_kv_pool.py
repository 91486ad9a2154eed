"""Contract details of `cache.kv_pool.KVBlockPool` (mutation survivors).

A failed batch `decref_all` changes nothing: every count it had dropped is
restored, and exactly the blocks it had freed leave the free list again.
"""

from __future__ import annotations

import pytest
import torch

from cache.faults import Faults
from cache.kv_pool import KVBlockPool
from cache.node import NO_BLOCK
from spec.errors import CacheError, OutOfBlocks


def _pool(n: int) -> KVBlockPool:
    return KVBlockPool(n, None, torch.float32, torch.device("cpu"), Faults())


def test_a_failed_decref_all_takes_back_only_the_blocks_it_freed() -> None:
    pool = _pool(4)
    a, b, c = pool.take(3)
    pool.decref(c)  # c is free
    before_refs, before_free = pool.counts(), pool.free_ids()
    with pytest.raises(CacheError, match=rf"^KV pool: block {c} is already free"):
        pool.decref_all([a, c])  # a reaches 0 (freed) before the failure
    assert pool.counts() == before_refs and pool.free_ids() == before_free
    pool.incref(b)  # b: 2
    before_refs, before_free = pool.counts(), pool.free_ids()
    with pytest.raises(CacheError, match=rf"^KV pool: block {c} is already free"):
        pool.decref_all([b, c])  # b drops to 1 (still used) before the failure
    assert pool.counts() == before_refs and pool.free_ids() == before_free


def test_a_one_block_pool_has_storage_for_its_block() -> None:
    pool = KVBlockPool(1, (3,), torch.float32, torch.device("cpu"), Faults())
    assert pool.tensor is not None and tuple(pool.tensor.shape) == (1, 3)
    view = pool.view(0)
    assert view is not None and tuple(view.shape) == (3,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_a_pinned_pool_is_page_locked() -> None:
    """The host tier's pool of a CUDA trie is page-locked, so its copies can be asynchronous."""
    pool = KVBlockPool(
        2, (3,), torch.float32, torch.device("cpu"), Faults(), name="host tier", pin_memory=True
    )
    assert pool.tensor is not None and pool.tensor.is_pinned()


def test_a_zero_block_pool_has_no_storage_and_nothing_to_take() -> None:
    """A pool of 0 blocks holds no tensor, even with a block shape; taking 0 blocks
    gives none, taking one is `OutOfBlocks` naming the counts."""
    pool = KVBlockPool(0, (3,), torch.float32, torch.device("cpu"), Faults())
    assert pool.tensor is None and pool.view(0) is None
    assert pool.capacity == 0 and pool.num_free == 0 and pool.counts() == []
    assert pool.take(0) == []
    with pytest.raises(OutOfBlocks) as raised:
        pool.take(1)
    assert str(raised.value) == "KV pool: 1 blocks wanted, 0 free"


def test_taking_a_negative_count_is_refused_before_anything_happens() -> None:
    """`take(-1)` is a caller's bug: `ValueError` naming the count, and neither the free
    list nor the fault counter moves (the allocation point is not reached)."""
    faults = Faults()
    pool = KVBlockPool(3, None, torch.float32, torch.device("cpu"), faults)
    with pytest.raises(ValueError) as raised:
        pool.take(-1)
    assert str(raised.value) == "KV pool: cannot take -1 blocks"
    assert pool.num_free == 3 and pool.counts() == [0, 0, 0]
    assert faults.count == 0 and faults.points == []
    assert pool.take(1) == [0]


def test_taking_every_free_block_at_once_succeeds() -> None:
    """`take(n)` with exactly `n` blocks free hands them all out, lowest id first."""
    pool = _pool(3)
    assert pool.take(3) == [0, 1, 2]
    assert pool.num_free == 0 and pool.counts() == [1, 1, 1]


def test_a_host_tier_pool_names_itself_and_its_fault_point() -> None:
    """A pool named "host tier" checks the `host.take` allocation point and names
    itself in every error."""
    faults = Faults()
    pool = KVBlockPool(2, None, torch.float32, torch.device("cpu"), faults, name="host tier")
    assert pool.name == "host tier"
    a, b = pool.take(2)
    assert faults.points == ["host.take"]
    with pytest.raises(OutOfBlocks, match=r"^host tier pool: 1 blocks wanted, 0 free$"):
        pool.take(1)
    assert pool.decref(a) is True
    _refused_by_every_count_operation(pool, a, b)
    assert pool.counts() == [0, 1] and pool.free_ids() == [a]


def _refused_by_every_count_operation(pool: KVBlockPool, free: int, used: int) -> None:
    """`decref`, `incref` and their `_all` forms (after `used`) each refuse `free`,
    naming the pool and the block (`NO_BLOCK` as no block at all)."""
    name = pool.name
    released = rf"^{name} pool: block {free} is already free \(double free\)$"
    taken = rf"^{name} pool: block {free} is free; cannot take a reference to it$"
    if free == NO_BLOCK:
        released = taken = rf"^{name} pool: NO_BLOCK \(-1\) names no block; it has no count"
    with pytest.raises(CacheError, match=released):
        pool.decref(free)
    with pytest.raises(CacheError, match=taken):
        pool.incref(free)
    with pytest.raises(CacheError, match=taken):
        pool.incref_all([used, free])
    with pytest.raises(CacheError, match=released):
        pool.decref_all([used, free])


@pytest.mark.parametrize("name", ["KV", "host tier"])
def test_no_block_is_refused_as_free_and_never_counts_on_the_last_block(name: str) -> None:
    """`NO_BLOCK` (-1, a node's "no block") handed to a pool by mistake reads as a
    free block (the pool's guard entry), so every count operation refuses it with
    `CacheError` and changes nothing, while the last block is in use."""
    pool = KVBlockPool(3, None, torch.float32, torch.device("cpu"), Faults(), name=name)
    first, _, last = pool.take(3)
    pool.incref(last)  # 2: a decref(-1) reaching it would go unnoticed
    before = pool.counts(), pool.free_ids()
    _refused_by_every_count_operation(pool, NO_BLOCK, first)
    assert (pool.counts(), pool.free_ids()) == before == ([1, 1, 2], [])
    assert pool.refs[NO_BLOCK] == 0 and len(pool.refs) == pool.capacity + 1


def test_counts_is_a_copy_of_each_blocks_count() -> None:
    pool = _pool(2)
    counts = pool.counts()
    pool.take(1)
    assert counts == [0, 0] and pool.counts() == [1, 0]
