"""Packed block keys (`cache.keys`): exact, injective, and consistent across requests.

The differential test draws tokens from {0, 1}; these tests cover the whole
token range, where a block is packed as uint32 or (when a token needs it)
uint64, and check that the encoding never decides identity wrongly.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.keys import (
    HashedKey,
    PackedTokens,
    block_key,
    joined_tokens,
    key_extra,
    key_packed,
    key_tokens,
    pack_tokens,
    request_keys,
    unpack_tokens,
)
from cache.validation import token_list
from tests.helpers import kv_trie, root_of, serve

EDGES = [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
TOKEN = st.one_of(st.sampled_from(EDGES), st.integers(0, 2**64 - 1), st.integers(0, 2**17))
BLOCK = st.lists(TOKEN, min_size=1, max_size=6)


@given(BLOCK)
def test_pack_round_trips(tokens: list[int]) -> None:
    packed = pack_tokens(tokens)
    assert isinstance(packed, bytes)
    assert unpack_tokens(packed) == tuple(tokens)
    assert key_tokens(packed) == tuple(tokens)
    assert key_tokens((packed, "img")) == tuple(tokens)
    assert key_tokens(HashedKey(packed, 0)) == tuple(tokens)
    assert key_tokens(HashedKey((packed, None), 0)) == tuple(tokens)


@given(BLOCK, BLOCK)
def test_pack_is_injective(a: list[int], b: list[int]) -> None:
    assert (pack_tokens(a) == pack_tokens(b)) == (a == b)


@given(st.lists(TOKEN, min_size=0, max_size=20), st.integers(1, 4))
def test_request_keys_pack_each_block_alone(tokens: list[int], size: int) -> None:
    """A request's keys equal its blocks packed one by one, whatever its other blocks hold
    (a wide token elsewhere must not change how a narrow block is packed)."""
    n = len(tokens) // size
    validated = token_list(tokens)  # what match hands request_keys: uint32 or uint64
    keys = request_keys(validated, None, size, None, 0, n)
    assert keys == [pack_tokens(tokens[i * size : (i + 1) * size]) for i in range(n)]
    assert request_keys(validated, None, size, None, 1, n) == keys[1:]
    extra = tuple(["img"] * n)
    keyed = request_keys(validated, extra, size, None, 0, n)
    assert keyed == [block_key(k, "img", None) for k in keys]


def test_narrow_block_is_shared_with_a_request_holding_wide_tokens() -> None:
    trie = kv_trie(num_blocks=16, block_size=2)
    assert serve(trie, [5, 6, 7, 8, 1]) == 0
    # Same first two blocks, then a block with a token >= 2**32: the prefix still hits.
    assert serve(trie, [5, 6, 7, 8, 2**40, 3, 1]) == 4
    assert serve(trie, [5, 6, 7, 8, 2**40, 3, 9]) == 6
    assert serve(trie, [5, 6, 7, 8, 2**40, 4, 9]) == 4
    trie.check()
    tokens = {n["key"][0] for n in trie.snapshot()["nodes"].values() if n["key"] is not None}
    assert tokens == {(5, 6), (7, 8), (2**40, 3), (2**40, 4)}


def test_cached_blocks_keep_no_caller_ints() -> None:
    """Nodes keep their token ids packed in the table's token column, not the caller's
    int objects (nor a key object of their own)."""
    trie = kv_trie(num_blocks=8, block_size=2)
    serve(trie, [1000, 2000, 3000, 4000, 1])
    root = root_of(trie)
    child = root.child_nodes()[0]
    assert child.id not in trie._nodes.wide
    assert isinstance(child.key, bytes)
    assert child.tokens == (1000, 2000)


def test_key_hash_hook_sees_token_tuples() -> None:
    """`CacheConfig.key_hash` is called with the block as tokens, not with its packing."""
    seen: list[object] = []

    def hook(key: object) -> int:
        seen.append(key)
        return 0

    packed = pack_tokens([7, 2**40])
    assert block_key(packed, None, hook) == HashedKey(packed, 0)
    assert block_key(packed, "img", hook) == HashedKey((packed, "img"), 0)
    assert seen == [(7, 2**40), ((7, 2**40), "img")]


@given(st.lists(BLOCK, min_size=1, max_size=5), st.integers(0, 2))
def test_joined_tokens_concatenate_the_blocks(blocks: list[list[int]], size_shift: int) -> None:
    """`joined_tokens` gives every block's ids in order: packed (no ints made) when all
    fit in 32 bits, a tuple otherwise; equal to the tuple either way."""
    size = 3 + size_shift
    blocks = [(b * size)[:size] for b in blocks]  # full blocks of `size` ids
    flat = tuple(t for b in blocks for t in b)
    got = joined_tokens([pack_tokens(b) for b in blocks], size)
    assert got == flat and flat == got and tuple(got) == flat and list(got) == list(flat)
    assert len(got) == len(flat) and hash(got) == hash(flat)
    assert isinstance(got, PackedTokens) == (max(flat) < 2**32)
    if isinstance(got, PackedTokens):
        assert got.tolist() == list(flat)
        assert got[0] == flat[0] and got[-1] == flat[-1] and got[1:3] == flat[1:3]
        assert got == PackedTokens(got.packed) and got != PackedTokens(got.packed + bytes(4))
        assert repr(got) == f"PackedTokens({flat!r})"
        assert got != list(flat)  # like a tuple: never equal to a list


def test_packed_tokens_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        PackedTokens(b"\x01\x02\x03")
    with pytest.raises(TypeError, match="packed block keys"):
        joined_tokens([b"\x00" * 4, (b"\x00" * 4, "img")], 1)  # type: ignore[list-item]


@given(BLOCK, st.one_of(st.none(), st.text(max_size=3), st.tuples(st.integers(), st.text())))
def test_a_key_carries_its_extra_identity(tokens: list[int], identity: object) -> None:
    """`Node.extra` is read from the key (no slot of its own): every key shape gives back
    the identity it was built with."""
    packed = pack_tokens(tokens)
    for key_hash in (None, lambda block: 7):
        key = block_key(packed, identity, key_hash)  # type: ignore[arg-type]
        assert key_extra(key) == identity and (key_extra(key) is None) == (identity is None)
        assert key_packed(key) == packed
    assert key_extra(None) is None  # a root's key
