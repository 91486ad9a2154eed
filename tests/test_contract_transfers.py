"""Contract details of `cache.transfers.Transfers` (mutation survivors).

A copy names every slot and block it touches in `Copy.resources` (an engine
orders copies that share one by it, [R36]); a restore writes the frozen tail
into the sequence's block, never the other way; a copy that fails while being
queued is undone and forgotten by the engine ([R38]); failing a save fails
only the restores still queued on its checkpoint ([R46]), and failing a load
only the loads queued on its blocks ([R50]); the `copies_reaped` /
`copies_failed` counters count every reaped copy.
"""

from __future__ import annotations

import re

import pytest
import torch

from cache import BlockTrie, CacheError, Copy, DeviceCopies, Sequence
from tests.helpers import empty_state, ssm_trie, state
from tests.test_host_tier import OTHER, A, assert_reads, host_trie, serve_manual

PROMPT = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]  # two full blocks of 4 and a partial one


def _prefill(trie: BlockTrie, tokens: list[int]) -> Sequence:
    seq = trie.match(tokens)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    return seq


def test_a_copy_names_every_slot_and_block_it_touches() -> None:
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    full = trie.save(seq, 4, state(1.0))
    assert full is not None
    (ck4,) = trie.snapshot()["checkpoints"].values()
    assert full.resources == {("slot", ck4["slot"])}
    partial = trie.save(seq, 10, state(2.0))
    assert partial is not None
    ck10 = next(c for c in trie.snapshot()["checkpoints"].values() if c["step"] == 10)
    frozen_tail = ck10["frozen_block"]
    assert frozen_tail is not None
    assert partial.resources == {
        ("slot", ck10["slot"]),
        ("block", seq.blocks[2]),  # read
        ("block", frozen_tail),  # written
    }
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    hit = trie.match([*PROMPT, 9])
    restore = trie.restore(hit, empty_state())
    assert restore.resources == {
        ("slot", ck10["slot"]),
        ("block", frozen_tail),  # read
        ("block", hit.blocks[2]),  # written: the block restore allocated
    }
    copies.complete_all()
    trie.poll()
    trie.release(hit)
    trie.check()


def test_restore_writes_the_frozen_tail_into_the_sequences_block() -> None:
    trie, _ = ssm_trie(manual=False)
    kv = trie.kv_cache
    assert kv is not None
    seq = _prefill(trie, PROMPT)
    kv[seq.blocks[2]] = torch.arange(8, dtype=kv.dtype).reshape(kv.shape[1:]) + 1
    trie.save(seq, 10, state(1.0))
    trie.release(seq)
    (ck,) = trie.snapshot()["checkpoints"].values()
    frozen_tail = ck["frozen_block"]
    assert frozen_tail is not None
    tail = kv[frozen_tail].clone()
    assert torch.equal(tail, torch.arange(8, dtype=kv.dtype).reshape(kv.shape[1:]) + 1)
    kv.zero_()  # no block but the frozen tail still holds the data
    kv[frozen_tail] = tail
    hit = trie.match([*PROMPT, 9])
    trie.restore(hit, empty_state())
    assert hit.blocks[2] != frozen_tail
    assert torch.equal(kv[hit.blocks[2]], tail)
    assert torch.equal(kv[frozen_tail], tail), "the frozen tail is only read"
    trie.release(hit)
    trie.check()


class _FailingCopies(DeviceCopies):
    """CPU copies that fail when queued."""

    def _start(self, copy: Copy) -> None:
        raise RuntimeError("simulated copy failure")


def test_a_copy_that_fails_when_queued_is_undone_and_forgotten() -> None:
    trie, _ = ssm_trie(manual=False)
    failing = BlockTrie(trie.config, copies=_FailingCopies())
    seq = _prefill(failing, PROMPT)
    message = "save: the copy failed and was undone: simulated copy failure"
    with pytest.raises(CacheError, match=f"^{re.escape(message)}$"):
        failing.save(seq, 10, state(1.0))
    assert failing.poll() == 0, "the engine no longer tracks the failed copy"
    assert failing.snapshot()["copies"] == {}
    failing.release(seq)
    failing.check()


def test_failing_a_save_skips_the_restores_that_already_failed() -> None:
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    save = trie.save(seq, 8, state(1.0))
    assert save is not None
    trie.release(seq)
    hit = trie.match([*PROMPT[:8], 9])
    restore = trie.restore(hit, empty_state())
    copies.fail(restore)
    copies.fail(save)  # withdraws the checkpoint; `restore` has failed already
    assert (save.failed, restore.failed) == (True, True)
    assert trie.poll() == 2
    assert trie.stats.copies_failed == 2
    trie.release(hit)
    trie.check()


def test_reaped_and_failed_copies_are_counted_one_by_one() -> None:
    trie, copies = ssm_trie()
    assert copies is not None
    seq = _prefill(trie, PROMPT)
    made = [trie.save(seq, step, state(float(step))) for step in (3, 4, 10)]
    assert None not in made
    copies.fail(made[0])  # type: ignore[arg-type]
    copies.fail(made[1])  # type: ignore[arg-type]
    copies.complete_all()
    assert trie.poll() == 3
    assert (trie.stats.copies_reaped, trie.stats.copies_failed) == (3, 2)
    hit = trie.match([*PROMPT, 9])
    assert hit.num_cached_tokens == 10
    trie.restore(hit, empty_state())
    copies.complete_all()
    assert trie.poll() == 1
    assert (trie.stats.copies_reaped, trie.stats.copies_failed) == (4, 2)
    trie.release(hit)
    trie.release(seq)
    trie.check()


def test_a_copy_holding_host_blocks_needs_a_host_tier() -> None:
    """Only the host tier's stores and loads hold host blocks; a trie without one
    refuses such a copy by name, and takes no host reference."""
    trie, _ = ssm_trie()
    copy = Copy("load", 0, [], (), 7)
    message = f"{copy!r} holds host blocks, but there is no host tier"
    with pytest.raises(CacheError, match=f"^{re.escape(message)}$"):
        trie._transfers.hold(copy, [], [0])
    assert copy.host_blocks == []
    trie.check()


def test_a_failed_load_fails_only_the_queued_loads_that_share_its_blocks() -> None:
    """[R50]: a load ordered after a failed one fails too; a load of other blocks
    is not ordered after it, stays queued and delivers its data."""
    trie, copies = host_trie(num_blocks=10, manual=True)
    assert copies is not None
    serve_manual(trie, copies, A)
    serve_manual(trie, copies, OTHER)
    trie.evict(10)
    first, second = trie.match(A), trie.match(OTHER)
    failing, other = trie.load(first), trie.load(second)
    assert failing is not None and other is not None
    assert not failing.resources & other.resources
    copies.fail(failing)
    assert (failing.state, other.state) == ("failed", "queued") and not other.failed
    copies.complete(other)
    assert trie.poll() == 2
    assert_reads(trie, second, OTHER)
    trie.abort(first)
    trie.release(second)
    trie.check()
