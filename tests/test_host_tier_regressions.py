"""Host-tier bugs peer engines shipped, restated in blocktrie's terms ([R47]-[R51]).

Each scenario is written once and run twice: as shipped, where it must pass,
and with the guard that prevents the bug removed (monkeypatched), where it
must fail. That the second run fails is what shows the first one tests
something. The upstream code is not copied; only the failure mode is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from cache import BlockTrie, CacheError, ManualCopies, OutOfBlocks, SequenceNotLive
from cache.copies import Copy
from cache.host_tier import HostTier
from cache.node import Node, state_name
from cache.offload import Offload
from cache.transfers import Transfers
from spec.invariants import rollback
from tests.test_host_tier import (
    A,
    B,
    assert_reads,
    committed_with_its_store_pending,
    compute,
    host_trie,
    serve_manual,
)

Scenario = Callable[[], None]


def cached_then_offloaded(tokens: list[int] = A) -> tuple[BlockTrie, ManualCopies]:
    """A trie whose `tokens` were served, stored to the host and evicted from the device."""
    trie, copies = host_trie(manual=True)
    assert copies is not None
    serve_manual(trie, copies, tokens)
    assert trie.evict(100) == len(tokens) // B
    return trie, copies


# ------------------------------------------------------------------- scenarios


def sglang_27631_host_eviction_never_frees_what_a_load_reads() -> None:
    """sgl-project/sglang#27631 (and the bytedance fork's #638): eviction re-entered
    during a load-back freed, then reused, host pages the host -> device copy was
    still reading. Here the load holds every host block it reads until reaped."""
    trie, copies = cached_then_offloaded()
    seq = trie.match(A)
    copy = trie.load(seq)
    assert copy is not None
    trie.check()
    assert trie.evict_host(100) == 0
    other = trie.match([7, 7, 8, 8, 9])  # a new store wants host blocks
    trie.allocate(other, 5)
    trie.commit(other, 4)
    trie.check()
    copies.complete_all()
    trie.poll()
    assert_reads(trie, seq, A)
    trie.release(seq)
    trie.release(other)
    trie.check()


def sglang_31427_abort_keeps_the_host_block_until_the_load_finishes() -> None:
    """sgl-project/sglang#31427: the host anchor was released before the async
    load-back had finished. Here a request aborted mid-load drops its own
    references; the copy's stay until it is reaped."""
    trie, copies = cached_then_offloaded()
    seq = trie.match(A)
    copy = trie.load(seq)
    assert copy is not None
    trie.abort(seq)
    trie.check()
    assert trie.evict_host(100) == 0 and trie.evict(100) == 0
    copies.complete(copy)
    trie.poll()
    trie.check()
    assert trie.evict(100) == 3  # mirrored again: only device blocks go
    assert trie.evict_host(100) == 3
    trie.check()


def sglang_28468_a_block_being_stored_is_never_freed_nor_reused() -> None:
    """sgl-project/sglang#28468: use-after-free when eviction freed a device block
    whose device -> host copy had not finished. Here the store copy holds it."""
    trie, copies, _ = committed_with_its_store_pending()
    trie.check()
    assert trie.evict(100) == 0
    copies.complete_all()
    trie.poll()
    trie.check()
    host = trie.host_cache
    assert host is not None
    assert sorted(map(tuple, host[:3].tolist())) == [(1, 1), (2, 2), (3, 3)]


def sglang_13483_a_shared_load_frees_each_block_once() -> None:
    """sgl-project/sglang#13483: a double free when two requests prefetched the same
    host pages. Here the second request shares the first one's load; every
    block is freed exactly once when both are done."""
    trie, copies = cached_then_offloaded()
    first, second = trie.match(A), trie.match(A)
    copy = trie.load(first)
    assert trie.load(second) is copy
    copies.complete_all()
    trie.poll()
    trie.release(first)
    trie.release(second)
    trie.check()
    assert trie.evict(100) == 3 and trie.evict_host(100) == 3
    assert trie.num_free_blocks == 8 and trie.num_free_host_blocks == 16
    trie.check()


def lmcache_3130_batched_host_eviction_respects_a_reader() -> None:
    """LMCache/LMCache#3130: batched eviction bypassed the reference count of an
    in-flight reader. Here a request that matched host blocks holds them: no
    batch of host eviction frees them."""
    trie, _ = cached_then_offloaded()
    seq = trie.match(A)
    assert seq.num_host_tokens == 6
    assert trie.evict_host(1_000) == 0
    trie.check()
    trie.release(seq)
    assert trie.evict_host(1_000) == 3
    trie.check()


def lmcache_5095_a_second_unpin_is_refused() -> None:
    """LMCache/LMCache#5095: a double unpin drove a pin count negative. Here the
    host references a request holds are dropped once; a second release is
    refused and changes nothing."""
    trie, _ = cached_then_offloaded()
    seq = trie.match(A)
    trie.release(seq)
    before = trie.snapshot()
    with pytest.raises(SequenceNotLive):
        trie.release(seq)
    assert trie.snapshot()["host_refcounts"] == before["host_refcounts"]
    trie.check()


def lmcache_1034_matched_but_never_loaded_is_unpinned() -> None:
    """LMCache/LMCache#1034: objects pinned at lookup but never retrieved were
    never unpinned. Here a request that matched host blocks and ended without
    loading them leaves them evictable again."""
    trie, _ = cached_then_offloaded()
    for end in (trie.release, trie.abort):
        seq = trie.match(A)
        end(seq)
        trie.check()
        assert trie.num_evictable_host_blocks == 1
    assert trie.evict_host(100) == 3
    trie.check()


def vllm_35846_making_room_for_a_load_never_evicts_its_own_blocks() -> None:
    """vllm-project/vllm#35846: `prepare_store` evicted blocks from its own input
    list. Here `load` holds the device-resident blocks it will read before it
    makes room for the rest, so room-making cannot evict them: with no other
    room it raises `OutOfBlocks` and changes nothing."""
    trie, copies = host_trie(num_blocks=4, manual=True)
    assert copies is not None
    prompt = [1, 1, 2, 2, 3, 3, 4, 4, 9]
    seq = trie.match(prompt)
    trie.allocate(seq, 8)
    compute(trie, seq, prompt)
    trie.commit(seq, 8)
    trie.release(seq)
    copies.complete_all()
    trie.poll()
    assert trie.evict(4) == 4  # the whole prompt lives on the host only
    loader = trie.match(prompt)  # host part: blocks 1-4
    other = trie.match([1, 1, 2, 2, 3, 3, 9])
    trie.load(other)  # brings blocks 1-3 back; block 3 is an evictable device leaf later
    copies.complete_all()
    trie.poll()
    trie.release(other)
    holder = trie.match([7, 7, 9])
    trie.allocate(holder, 2)  # the last free device block
    before = trie.snapshot()
    with pytest.raises(OutOfBlocks):
        trie.load(loader)  # block 4 needs room; only block 3, which it reads, is evictable
    assert rollback(before, trie.snapshot()) == []
    trie.check()
    trie.release(holder)
    trie.load(loader)
    copies.complete_all()
    trie.poll()
    assert_reads(trie, loader, prompt)
    trie.release(loader)
    trie.check()


SCENARIOS: dict[str, Scenario] = {
    f.__name__: f
    for f in (
        sglang_27631_host_eviction_never_frees_what_a_load_reads,
        sglang_31427_abort_keeps_the_host_block_until_the_load_finishes,
        sglang_28468_a_block_being_stored_is_never_freed_nor_reused,
        sglang_13483_a_shared_load_frees_each_block_once,
        lmcache_3130_batched_host_eviction_respects_a_reader,
        lmcache_5095_a_second_unpin_is_refused,
        lmcache_1034_matched_but_never_loaded_is_unpinned,
        vllm_35846_making_room_for_a_load_never_evicts_its_own_blocks,
    )
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_upstream_host_tier_bug_cannot_happen(name: str) -> None:
    SCENARIOS[name]()


# ----------------------------------------------------------- injected bugs


@contextmanager
def copies_hold_nothing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The bug class itself: a copy that does not hold the blocks it reads and writes."""

    def hold(self: Transfers, copy: Copy, blocks: list[int], host_blocks: list[int]) -> None:
        copy.blocks.extend(blocks)
        copy.host_blocks.extend(host_blocks)
        self._kv.incref_all(blocks)  # device references kept: only the host side drops

    with monkeypatch.context() as patch:
        patch.setattr(Transfers, "hold", hold)
        yield


@contextmanager
def device_holds_dropped(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A copy that holds its host blocks but not the device blocks it reads."""

    def hold(self: Transfers, copy: Copy, blocks: list[int], host_blocks: list[int]) -> None:
        copy.host_blocks.extend(host_blocks)
        if host_blocks and self.host is not None:
            self.host.pool.incref_all(host_blocks)

    with monkeypatch.context() as patch:
        patch.setattr(Transfers, "hold", hold)
        yield


@contextmanager
def host_index_ignores_readers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Host eviction that looks at residency only, not at who still reads a block."""
    original = HostTier.settle

    def settle(self: HostTier, node: Node) -> None:
        original(self, node)
        t = self.nodes
        if state_name(t.state[node]) == "offloaded" and t.is_leaf(node) and node not in self.index:
            self.index.add(node)

    with monkeypatch.context() as patch:
        patch.setattr(HostTier, "settle", settle)
        patch.setattr(HostTier, "_unindex", lambda self, node: None)
        yield


@contextmanager
def unpin_forgotten(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as patch:
        patch.setattr(HostTier, "unpin", lambda self, nodes: None)
        yield


@contextmanager
def unpin_twice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    original = HostTier.unpin

    def unpin(self: HostTier, nodes: list[Node]) -> None:
        original(self, nodes)
        original(self, nodes)

    with monkeypatch.context() as patch:
        patch.setattr(HostTier, "unpin", unpin)
        yield


@contextmanager
def load_not_shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A second request loads a block again instead of waiting on the first load."""
    original = Offload._launch_load

    def launch(
        self: Offload, seq: object, own: list[Node], shared: list[Node], pending: list[Copy]
    ) -> Copy | None:
        for node in shared:
            self._kv.decref(self._nodes.block[node])  # as if the block were taken over again
        return original(self, seq, own, shared, pending)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(Offload, "_launch_load", launch)
        yield


@contextmanager
def room_before_hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`load` that makes room before holding what it will read (vLLM #35846)."""

    def blocks_for_load(self: Offload, shared: list[Node], need: int) -> list[int]:
        self._evictor.make_room(need)
        blocks = self._kv.take(need)
        self._kv.incref_all([self._nodes.block[node] for node in shared])
        for node in shared:
            self._evictor.settle(node)
        return blocks

    with monkeypatch.context() as patch:
        patch.setattr(Offload, "_blocks_for_load", blocks_for_load)
        yield


CAUGHT = (AssertionError, CacheError, KeyError, IndexError, pytest.fail.Exception)
"""What a caught bug looks like: a failed assertion or `pytest.raises`, a broken
invariant or refused transition, or a crash."""

INJECTIONS = {
    "sglang_27631_host_eviction_never_frees_what_a_load_reads": host_index_ignores_readers,
    "sglang_31427_abort_keeps_the_host_block_until_the_load_finishes": copies_hold_nothing,
    "sglang_28468_a_block_being_stored_is_never_freed_nor_reused": device_holds_dropped,
    "sglang_13483_a_shared_load_frees_each_block_once": load_not_shared,
    "lmcache_3130_batched_host_eviction_respects_a_reader": host_index_ignores_readers,
    "lmcache_5095_a_second_unpin_is_refused": unpin_twice,
    "lmcache_1034_matched_but_never_loaded_is_unpinned": unpin_forgotten,
    "vllm_35846_making_room_for_a_load_never_evicts_its_own_blocks": room_before_hold,
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_scenario_catches_its_bug_when_injected(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with INJECTIONS[name](monkeypatch), pytest.raises(CAUGHT):
        SCENARIOS[name]()
