"""Contract details of `cache.sequence` (mutation survivors): receipt and sequence reprs."""

from __future__ import annotations

from cache.node import Checkpoint, Node
from cache.sequence import PinReceipt, Sequence
from spec.lifecycle import ReceiptState


def _checkpoint(step: int) -> Checkpoint:
    root = Node(
        parent=None,
        key=None,
        extra=None,
        block=-1,
        namespace="",
        serial=0,
        tick=0,
        block_hash=0,
        state="root",
    )
    return Checkpoint(
        anchor=root,
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
