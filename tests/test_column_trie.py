"""`bench.column_trie.ColumnTrie` does exactly what `bench.baseline.DictTrie` does.

The peers benchmark quotes the column trie's cost next to the dict trie's, as
the same algorithm in another layout; that only means something if every
observable agrees: hits, block tables, evictions, free and cached counts.
A stateful test drives both with the same requests (tiny token alphabet and
pool, so prefixes collide, nodes branch and un-branch, and eviction runs).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from bench.baseline import DictTrie
from bench.column_trie import ColumnTrie
from spec.errors import OutOfBlocks

BLOCK = 2
CAPACITY = 10
tokens = st.lists(st.integers(0, 2), max_size=4 * BLOCK + 1)
namespaces = st.sampled_from(["", "lora"])


class ColumnVersusDict(RuleBasedStateMachine):
    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.dict = DictTrie(BLOCK, CAPACITY)
        self.cols = ColumnTrie(BLOCK, CAPACITY)

    def _both(self, op: str, *args: Any) -> tuple[Any, Any]:
        outcomes = []
        for trie, arg in ((self.dict, args), (self.cols, args)):
            try:
                outcomes.append(("ok", getattr(trie, op)(*arg)))
            except OutOfBlocks:
                outcomes.append(("out of blocks", None))
        assert [kind for kind, _ in outcomes] == [outcomes[0][0]] * 2, op
        return outcomes[0][1], outcomes[1][1]

    @rule(target=live, toks=tokens, namespace=namespaces)
    def serve(self, toks: list[int], namespace: str) -> tuple[Any, Any]:
        a, b = self.dict.match(toks, namespace), self.cols.match(toks, namespace)
        assert (a.num_cached_tokens, a.branch_step, a.block_ids) == (
            b.num_cached_tokens,
            b.branch_step,
            b.block_ids,
        )
        try:
            self.dict.allocate(a, len(toks))
        except OutOfBlocks:
            with pytest.raises(OutOfBlocks):
                self.cols.allocate(b, len(toks))
            self.dict.abort(a)
            self.cols.abort(b)
            return a, b  # aborted: later releases find nothing held
        self.cols.allocate(b, len(toks))
        self.dict.commit(a, len(toks))
        self.cols.commit(b, len(toks))
        assert a.block_ids == b.block_ids
        return a, b

    @rule(pair=consumes(live), extra=tokens)
    def decode_and_release(self, pair: tuple[Any, Any], extra: list[int]) -> None:
        a, b = pair
        if not a.path and not a.block_ids:
            return
        self.dict.append(a, extra)
        self.cols.append(b, extra)
        n = len(a.tokens)
        try:
            self.dict.allocate(a, n)
        except OutOfBlocks:
            with pytest.raises(OutOfBlocks):
                self.cols.allocate(b, n)
        else:
            self.cols.allocate(b, n)
            self.dict.commit(a, n)
            self.cols.commit(b, n)
            assert a.block_ids == b.block_ids
        self.dict.release(a)
        self.cols.release(b)

    @rule(pair=consumes(live))
    def abort(self, pair: tuple[Any, Any]) -> None:
        self.dict.abort(pair[0])
        self.cols.abort(pair[1])

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        assert self.dict.evict(n) == self.cols.evict(n)

    @invariant()
    def same_counts(self) -> None:
        for name in ("num_free_blocks", "num_cached_blocks"):
            assert getattr(self.dict, name) == getattr(self.cols, name), name
        d, c = self.dict.stats, self.cols.stats
        assert (d.query_tokens, d.hit_tokens, d.evicted_blocks) == (
            c.query_tokens,
            c.hit_tokens,
            c.evicted_blocks,
        )


TestColumnVersusDict = ColumnVersusDict.TestCase


def test_a_node_goes_from_one_child_to_many_and_back() -> None:
    trie = ColumnTrie(1, 8)
    for toks in ([1, 2, 0], [1, 3, 0], [1, 4, 0]):  # three children under block [1]
        seq = trie.match(toks)
        trie.allocate(seq, 2)
        trie.commit(seq, 2)
        trie.release(seq)
    (first,) = trie.match([1, 0]).path
    assert trie.child[first] < 0 and trie.fanout[first] == 3
    assert trie.evict(3) == 3  # the three leaves; [1] is held by the match above
    assert trie.child[first] == -1 and first not in trie.fanout
    assert list(trie.index.values()) == [first]  # only the root's child is left indexed


def test_token_ids_past_32_bits_are_refused() -> None:
    with pytest.raises(ValueError, match="below 2\\*\\*32"):
        ColumnTrie(2, 4).match([1, 2**32])
