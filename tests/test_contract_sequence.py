"""Contract details of `cache.sequence` (mutation survivors): receipt and sequence reprs."""

from __future__ import annotations

from cache.node import Checkpoint
from cache.sequence import PinReceipt, Sequence
from spec.lifecycle import ReceiptState
from tests.helpers import empty_state, ssm_trie, state


def _checkpoint(step: int) -> Checkpoint:
    return Checkpoint(
        anchor=0,
        step=step,
        tail=(1,) * step,
        tail_extra=None,
        slot=0,
        frozen_block=None,
        serial=1,
        tick=0,
        state="ready",
    )


def test_receipt_repr_says_used_only_once_redeemed() -> None:
    receipt = PinReceipt(object(), _checkpoint(3))
    assert repr(receipt) == "<PinReceipt step=3>"
    receipt.state = ReceiptState.REDEEMED.value
    assert repr(receipt) == "<PinReceipt step=3 used>"


def test_sequence_repr_says_live_or_done() -> None:
    seq = Sequence(object(), 4, [1, 2, 3], "", None)
    assert repr(seq) == "<Sequence #4 live tokens=3 cached=0 blocks=0>"
    seq.live = False
    assert repr(seq) == "<Sequence #4 done tokens=3 cached=0 blocks=0>"


def test_tokens_is_a_tuple_even_when_empty_and_follows_appends() -> None:
    seq = Sequence(object(), 5, [], "", None)
    empty = seq.tokens
    assert empty == () and type(empty) is tuple
    seq.token_list.append(7)
    assert seq.tokens == (7,)


def test_restored_is_false_until_the_restore_is_queued() -> None:
    trie, copies = ssm_trie(num_blocks=16, slots=2)
    assert copies is not None
    first = trie.match([1, 2, 3, 4, 5])
    assert first.restored is False
    trie.allocate(first, 5)
    trie.commit(first, 5)
    trie.save(first, 4, state(1.0))
    copies.complete_all()
    trie.poll()
    trie.release(first)
    seq = trie.match([1, 2, 3, 4, 5, 6])
    assert seq.restore is not None and seq.restored is False
    trie.allocate(seq, 6)
    trie.restore(seq, empty_state())
    assert seq.restored is True
