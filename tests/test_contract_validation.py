"""Contract details of `cache.validation` (mutation survivors).

`extend_tokens` appends validated token ids of either width: the result holds
every id, in order, as uint64 when either side needs 64 bits and uint32
otherwise; a widened result is a new array and leaves the stored one as it was.
"""

from __future__ import annotations

from cache.validation import U32, U64, extend_tokens, token_list

BIG = 2**40 + 3


def test_appending_wide_ids_to_narrow_ones_widens_into_a_new_array() -> None:
    stored = token_list([1, 2])
    out = extend_tokens(stored, token_list([BIG, 4]))
    assert out.typecode == U64 and out.tolist() == [1, 2, BIG, 4]
    assert stored.typecode == U32 and stored.tolist() == [1, 2]


def test_appending_narrow_ids_to_wide_ones_keeps_them_wide() -> None:
    stored = token_list([BIG])
    out = extend_tokens(stored, token_list([5, 6]))
    assert out.typecode == U64 and out.tolist() == [BIG, 5, 6]


def test_appending_narrow_ids_to_narrow_ones_stays_narrow() -> None:
    out = extend_tokens(token_list([1]), token_list([2, 3]))
    assert out.typecode == U32 and out.tolist() == [1, 2, 3]
