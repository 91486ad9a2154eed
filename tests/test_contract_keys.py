"""Contract details of `cache.keys` that the behaviour tests leave open (mutation survivors).

A root's key is `None` and unpacks to no tokens; a non-key and a non-bytes block
are refused with a message that names what was passed.
"""

from __future__ import annotations

import re

import pytest

from cache.keys import (
    HashedKey,
    block_identity,
    joined_tokens,
    key_packed,
    key_tokens,
    pack_tokens,
    request_keys,
)
from cache.validation import token_list


def test_a_root_key_packs_to_no_bytes_and_no_tokens() -> None:
    assert key_packed(None) == b""
    assert key_tokens(None) == ()


def test_a_non_key_is_refused_with_its_repr() -> None:
    with pytest.raises(TypeError, match=r"^not a block key: \[1, 2\]$"):
        key_packed([1, 2])
    with pytest.raises(TypeError, match=r"^not a block key: \('x', 'y'\)$"):
        key_packed((("x", "y"), None))


def test_joined_tokens_refuses_non_bytes_with_its_contract() -> None:
    message = "joined_tokens takes packed block keys (bytes)"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$") as raised:
        joined_tokens([(1, 2)], 2)  # type: ignore[list-item]
    assert raised.value.__cause__ is None
    assert raised.value.__suppress_context__


def test_block_identity_is_none_past_the_extra_tuple() -> None:
    assert block_identity(("a", "b"), 1) == "b"
    assert block_identity(("a", "b"), 2) is None
    assert block_identity(None, 0) is None


def test_request_keys_give_each_block_its_own_extra_identity() -> None:
    tokens = token_list([1, 2, 3, 4, 5, 6, 7])  # what match hands request_keys
    keys = request_keys(tokens, ("a", "b", "c"), 2, None, 1, 3)
    assert keys == [(pack_tokens([3, 4]), "b"), (pack_tokens([5, 6]), "c")]
    assert request_keys(tokens, ("a", "b", "c"), 2, None, 2, 2) == []


def test_request_keys_wrap_every_block_with_the_injected_hash() -> None:
    keys = request_keys(token_list([1, 2, 3, 4]), None, 2, lambda block: 7, 0, 2)
    assert keys == [HashedKey(pack_tokens([1, 2]), 7), HashedKey(pack_tokens([3, 4]), 7)]
    assert all(hash(k) == 7 for k in keys)


def test_hashed_keys_with_colliding_hashes_stay_unequal() -> None:
    """Equality is exact on the wrapped key: an injected collision only narrows."""
    a, b = HashedKey(pack_tokens([1, 2]), 7), HashedKey(pack_tokens([3, 4]), 7)
    assert hash(a) == hash(b)
    assert a != b and len({a, b}) == 2
    assert a == HashedKey(pack_tokens([1, 2]), 7)
    assert a != pack_tokens([1, 2])  # a hashed key never equals a bare one
