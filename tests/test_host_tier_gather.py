"""The host tier's store and load copies are gathered (`cache.moves.BlockMove`): one move
per copy, whatever blocks the pools hand out, and the KV round-trips bit for bit.

Each scenario first fragments the free lists (single-block prompts, half of them
evicted from both tiers), so the next prompt's device and host blocks are
scattered: none, a few runs (one operation per run), or more runs than
`MAX_RUN_OPS` (one gather and one scatter).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from cache import BlockTrie, CacheConfig, Copy, ManualCopies, Sequence
from cache.copies import BlockMove
from cache.events import BlockStored
from cache.moves import MAX_RUN_OPS, _runs
from spec.lifecycle import Residency
from tests.test_host_tier import B, assert_reads, compute, host_trie, residency

FRAGMENTS = {"contiguous": 0, "a few runs": MAX_RUN_OPS - 1, "scattered": MAX_RUN_OPS + 2}
"""Holes punched before the prompt: its blocks then form holes + 1 runs on each tier."""
PROMPT = [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9]  # 8 full blocks and a token
BLOCKS = len(PROMPT) // B


def runs(ids: list[int]) -> int:
    return len(_runs(sorted(ids)))


def finish(trie: BlockTrie, copies: ManualCopies | None) -> None:
    if copies is not None:
        copies.complete_all()
    trie.poll()


def fragment(trie: BlockTrie, copies: ManualCopies | None, holes: int) -> None:
    """Serve 2 * `holes` one-block prompts, then evict every other one from the device
    and the host, leaving `holes` isolated free blocks at the top of both free lists."""
    singles = [[50 + i, 50 + i, 99] for i in range(2 * holes)]
    for tokens in singles:
        seq = trie.match(tokens)
        trie.allocate(seq, len(tokens))
        compute(trie, seq, tokens)
        trie.commit(seq, len(tokens))
        trie.release(seq)
        finish(trie, copies)
    for tokens in singles[1::2]:  # touched again: the others are the LRU ones
        trie.release(trie.match(tokens))
    assert trie.evict(holes) == holes
    assert trie.evict_host(holes) == holes
    trie.check()


def store(trie: BlockTrie, copies: ManualCopies | None, tokens: list[int]) -> Sequence:
    seq = trie.match(tokens)
    trie.allocate(seq, len(tokens))
    compute(trie, seq, tokens)
    trie.commit(seq, len(tokens))
    return seq


def only_move(copy: Copy) -> BlockMove:
    (move,) = copy.moves
    assert isinstance(move, BlockMove)
    return move


def host_holds(trie: BlockTrie, tokens: list[int]) -> None:
    """Every node of `tokens` that has a host copy holds its tokens there, bit for bit."""
    host = trie.host_cache
    assert host is not None
    for node in trie.snapshot()["nodes"].values():
        if node["parent"] is not None and node["block_host"] is not None:
            key = list(node["key"][0])  # type: ignore[index]
            assert host[node["block_host"]].tolist() == key


@pytest.mark.parametrize("manual", [True, False], ids=["manual", "device"])
@pytest.mark.parametrize("fragments", FRAGMENTS)
def test_store_and_load_round_trip_bit_identical(fragments: str, manual: bool) -> None:
    holes = FRAGMENTS[fragments]
    trie, copies = host_trie(num_blocks=32, host_blocks=64, manual=manual)
    fragment(trie, copies, holes)
    seq = store(trie, copies, PROMPT)
    if copies is not None:
        (copy,) = copies.pending()
        move = only_move(copy)
        assert move.src_ids == list(seq.block_ids[:BLOCKS])  # the device blocks, as committed
        assert runs(move.src_ids) == runs(move.dst_ids) == holes + 1
        assert (runs(move.dst_ids) <= MAX_RUN_OPS) == (fragments != "scattered")
        assert residency(trie)[tuple(PROMPT[:B])] == Residency.STORING.value
    trie.release(seq)
    finish(trie, copies)
    host_holds(trie, PROMPT)
    assert trie.stats.stored_blocks == 2 * holes + BLOCKS
    assert trie.evict(trie.num_cached_blocks) > 0 and trie.num_cached_blocks == 0
    trie.kv_cache.fill_(-1.0)  # type: ignore[union-attr]  # only a load brings the bytes back
    seq = trie.match(PROMPT)
    assert seq.num_host_tokens == BLOCKS * B
    load = trie.load(seq)
    assert load is not None
    move = only_move(load)
    assert len(move) == BLOCKS and move.dst_ids == list(seq.block_ids[:BLOCKS])
    finish(trie, copies)
    assert_reads(trie, seq, PROMPT)
    trie.release(seq)
    trie.check()


def test_a_single_block_stores_and_loads() -> None:
    trie, copies = host_trie(manual=True)
    assert copies is not None
    seq = store(trie, copies, [7, 7, 9])
    (copy,) = copies.pending()
    assert len(only_move(copy)) == 1
    trie.release(seq)
    finish(trie, copies)
    trie.evict(1)
    trie.kv_cache.fill_(0.5)  # type: ignore[union-attr]
    seq = trie.match([7, 7, 9])
    load = trie.load(seq)
    assert load is not None and len(only_move(load)) == 1
    finish(trie, copies)
    assert_reads(trie, seq, [7, 7, 9])
    trie.release(seq)
    trie.check()


def test_ids_only_pools_move_nothing() -> None:
    trie = BlockTrie(CacheConfig(block_size=B, num_blocks=8, num_host_blocks=8))
    seq = trie.match([1, 1, 2, 2, 9])
    trie.allocate(seq, 5)
    trie.commit(seq, 5)
    trie.release(seq)
    trie.poll()
    assert trie.stats.stored_blocks == 2 and trie.evict(2) == 2
    seq = trie.match([1, 1, 2, 2, 9])
    load = trie.load(seq)
    assert load is not None and load.moves == []
    trie.poll()
    trie.release(seq)
    trie.check()


@contextmanager
def failing(
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
    after: int = 0,
    op: tuple[Any, str] = (torch, "index_select"),
) -> Iterator[None]:
    """`op` (the gather, `torch.index_select`, unless told) raises `error` after `after`
    calls."""
    owner, name = op
    real = getattr(owner, name)
    calls = [0]

    def gather(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] > after:
            raise error
        return real(*args, **kwargs)  # type: ignore[no-any-return]

    with monkeypatch.context() as patch:
        patch.setattr(owner, name, gather)
        yield
    assert calls[0] > after, "the gather ran"


@pytest.mark.parametrize(
    ("fragments", "op", "after"),
    [
        ("a few runs", (torch.Tensor, "copy_"), 1),  # the second run's copy
        ("scattered", (torch, "index_select"), 0),  # the gather
        ("scattered", (torch.Tensor, "index_copy_"), 0),  # the scatter, after the gather
    ],
    ids=["second-run", "gather", "scatter"],
)
def test_a_store_whose_gather_raises_fails_cleanly(
    monkeypatch: pytest.MonkeyPatch, fragments: str, op: tuple[Any, str], after: int
) -> None:
    """An operation of the copy raises: partial data may have reached the host blocks,
    none of it is ever published, and the copy keeps its blocks on both tiers until
    it is reaped."""
    trie, copies = host_trie(num_blocks=32, host_blocks=64, manual=True)
    assert copies is not None
    fragment(trie, copies, FRAGMENTS[fragments])
    seq = store(trie, copies, PROMPT)
    trie.release(seq)
    (copy,) = copies.pending()
    free_host, free_device = trie.num_free_host_blocks, trie.num_free_blocks
    trie.drain_events()
    with (
        failing(monkeypatch, RuntimeError("gather failed"), after=after, op=op),
        pytest.raises(RuntimeError, match="gather failed"),
    ):
        copies.complete(copy)
    assert copy.failed and copy.done and copy.state == "failed"
    assert trie.num_free_host_blocks == free_host, "its host blocks stay held until reaped"
    prompt_nodes = [tuple(PROMPT[i * B : i * B + B]) for i in range(BLOCKS)]
    evicted = trie.evict(trie.num_cached_blocks)  # only the single-block prompts go
    assert evicted < FRAGMENTS[fragments] + 1 and trie.num_free_blocks == free_device + evicted
    assert {residency(trie)[key] for key in prompt_nodes} == {Residency.STORING.value}
    trie.check()
    trie.poll()
    assert trie.num_free_host_blocks == free_host + BLOCKS
    assert not [e for e in trie.drain_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert trie.stats.copies_failed == 1
    assert {residency(trie)[key] for key in prompt_nodes} == {Residency.DEVICE.value}
    assert trie.evict(trie.num_cached_blocks) > 0
    seq = trie.match(PROMPT)
    assert seq.num_cached_tokens == 0 and seq.num_host_tokens == 0, "nothing on the host to hit"
    trie.abort(seq)
    trie.check()


def test_a_load_whose_gather_raises_fails_cleanly_and_loads_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trie, copies = host_trie(num_blocks=32, host_blocks=64, manual=True)
    assert copies is not None
    fragment(trie, copies, FRAGMENTS["scattered"])
    trie.release(store(trie, copies, PROMPT))
    finish(trie, copies)
    assert trie.evict(trie.num_cached_blocks) > 0
    trie.kv_cache.fill_(-1.0)  # type: ignore[union-attr]
    seq = trie.match(PROMPT)
    load = trie.load(seq)
    assert load is not None
    free_device = trie.num_free_blocks
    with failing(monkeypatch, RuntimeError("gather failed")), pytest.raises(RuntimeError):
        copies.complete(load)
    assert load.failed
    assert trie.num_free_blocks == free_device, "its device blocks stay held until reaped"
    trie.poll()
    assert set(residency(trie).values()) <= {Residency.HOST.value}
    trie.abort(seq)
    trie.check()
    host_holds(trie, PROMPT)  # the host copies are intact
    seq = trie.match(PROMPT)
    load = trie.load(seq)
    assert load is not None
    finish(trie, copies)
    assert_reads(trie, seq, PROMPT)
    trie.release(seq)
    trie.check()


def test_an_interrupt_inside_the_gather_fails_the_copy_and_propagates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trie, copies = host_trie(num_blocks=32, host_blocks=64, manual=True)
    assert copies is not None
    fragment(trie, copies, FRAGMENTS["scattered"])
    trie.release(store(trie, copies, PROMPT))
    (copy,) = copies.pending()
    with failing(monkeypatch, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        copies.complete(copy)
    assert copy.failed
    trie.poll()
    assert residency(trie)[tuple(PROMPT[:B])] == Residency.DEVICE.value
    trie.check()


def test_a_store_that_raises_when_queued_on_device_copies_is_undone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `DeviceCopies` a store runs when queued: a failing gather undoes it (the
    commit stands, its blocks device-only) and no copy is left in flight."""
    trie, copies = host_trie(num_blocks=32, host_blocks=64)
    fragment(trie, copies, FRAGMENTS["scattered"])
    free_host = trie.num_free_host_blocks
    with failing(monkeypatch, RuntimeError("gather failed")):
        seq = store(trie, copies, PROMPT)
    assert seq.num_cached_tokens == 0 and trie.num_free_host_blocks == free_host
    assert residency(trie)[tuple(PROMPT[:B])] == Residency.DEVICE.value
    trie.release(seq)
    trie.check()
    assert trie.poll() == 0, "undone when queued: nothing left in flight"
    assert trie.stats.stored_blocks == 2 * FRAGMENTS["scattered"]  # the single-block prompts
    host_holds(trie, PROMPT)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fragments", FRAGMENTS)
def test_cuda_store_and_load_are_gathered_and_round_trip(fragments: str) -> None:
    """A CUDA device pool and a page-locked host pool: the store gathers on the device
    and copies into the host runs, the load gathers on the host into page-locked
    staging and scatters on the device, both on the side stream."""
    config = CacheConfig(
        block_size=B,
        num_blocks=32,
        num_host_blocks=64,
        kv_block_shape=(B,),
        kv_dtype=torch.float64,
        device="cuda",
        enable_events=True,
    )
    trie = BlockTrie(config)
    holes = FRAGMENTS[fragments]
    singles = [[50 + i, 50 + i, 99] for i in range(2 * holes)]
    for tokens in singles:
        seq = trie.match(tokens)
        trie.allocate(seq, len(tokens))
        compute(trie, seq, tokens)
        trie.commit(seq, len(tokens))
        trie.release(seq)
        torch.cuda.synchronize()
        trie.poll()
    for tokens in singles[1::2]:
        trie.release(trie.match(tokens))
    assert trie.evict(holes) == holes and trie.evict_host(holes) == holes
    seq = trie.match(PROMPT)
    trie.allocate(seq, len(PROMPT))
    compute(trie, seq, PROMPT)
    trie.commit(seq, len(PROMPT))
    trie.release(seq)
    torch.cuda.synchronize()
    trie.poll()
    host_holds(trie, PROMPT)
    assert trie.evict(trie.num_cached_blocks) > 0
    trie.kv_cache.fill_(-1.0)  # type: ignore[union-attr]
    seq = trie.match(PROMPT)
    load = trie.load(seq)
    assert load is not None and len(only_move(load)) == BLOCKS
    load.wait()
    assert_reads(trie, seq, PROMPT)
    torch.cuda.synchronize()
    trie.poll()
    assert all(m._keep == [] for m in load.moves if isinstance(m, BlockMove))
    trie.release(seq)
    trie.check()
