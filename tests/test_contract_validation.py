"""Contract details of `cache.validation` (mutation survivors).

`extend_tokens` appends validated token ids of either width: the result holds
every id, in order, as uint64 when either side needs 64 bits and uint32
otherwise; a widened result is a new array and leaves the stored one as it was.
"""

from __future__ import annotations

import pytest

from cache.validation import U32, U64, extend_tokens, extra_tuple, int_arg, token_list
from spec.errors import InvalidArgument, InvalidType

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


def test_int_arg_accepts_ints_and_names_the_argument_otherwise() -> None:
    """`int_arg` returns an int unchanged; a bool or a non-int is `InvalidType` naming
    the argument and the type."""
    assert int_arg("n", 7) == 7 and int_arg("n", -3) == -3 and int_arg("n", 0) == 0
    for value, type_name in [(True, "bool"), (False, "bool"), (1.0, "float"), ("1", "str")]:
        with pytest.raises(InvalidType) as raised:
            int_arg("num_tokens", value)
        assert str(raised.value) == f"num_tokens must be an int, got {type_name}"


def test_token_list_stores_narrow_ids_as_uint32_and_wide_ones_as_uint64() -> None:
    """Ids below 2**32 give a uint32 array; any id in [2**32, 2**64) makes it uint64;
    both ends of the range are accepted; tuples as well as lists."""
    narrow = token_list([0, 1, 2**32 - 1])
    assert narrow.typecode == U32 and narrow.tolist() == [0, 1, 2**32 - 1]
    wide = token_list((0, 2**32, 2**64 - 1))
    assert wide.typecode == U64 and wide.tolist() == [0, 2**32, 2**64 - 1]
    assert token_list([]).typecode == U32 and token_list([]).tolist() == []
    assert token_list([True, 3]).tolist() == [1, 3]


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [
        ([1, -1], InvalidArgument, "tokens must be in [0, 2**64); found -1"),
        ([1, 2**64], InvalidArgument, f"tokens must be in [0, 2**64); found {2**64}"),
        ([2**40, -2], InvalidArgument, "tokens must be in [0, 2**64); found -2"),
        ([2**40, 2**70], InvalidArgument, f"tokens must be in [0, 2**64); found {2**70}"),
        ([1, "a"], InvalidType, "tokens must contain only integers; found 'a'"),
        ([2**40, 1.5], InvalidType, "tokens must contain only integers; found 1.5"),
        ([-1, "a"], InvalidType, "tokens must contain only integers; found 'a'"),
        ([None], InvalidType, "tokens must contain only integers; found None"),
    ],
)
def test_bad_token_ids_name_the_first_offender_types_before_ranges(
    tokens: list[object], error: type[Exception], message: str
) -> None:
    """A non-integer is `InvalidType` (checked before any range), an id outside
    [0, 2**64) is `InvalidArgument`; each message names the offending element."""
    with pytest.raises(error) as raised:
        token_list(tokens)
    assert type(raised.value) is error
    assert str(raised.value) == message


def test_token_list_names_the_argument_it_validates() -> None:
    """`what` names the argument in every message; a non-sequence names its type."""
    with pytest.raises(InvalidType) as raised:
        token_list({1, 2}, "prompt")
    assert (
        str(raised.value)
        == "prompt must be a list or tuple of ints, or a 1-D integer array, got set"
    )
    with pytest.raises(InvalidType) as raised:
        token_list("12")
    assert (
        str(raised.value)
        == "tokens must be a list or tuple of ints, or a 1-D integer array, got str"
    )
    with pytest.raises(InvalidArgument) as raised_range:
        token_list([5, -4], "prompt")
    assert str(raised_range.value) == "prompt must be in [0, 2**64); found -4"
    with pytest.raises(InvalidType) as raised:
        token_list([5, 2**40, "x"], "prompt")
    assert str(raised.value) == "prompt must contain only integers; found 'x'"


class _Flaky:
    """An integer-like whose `__index__` fails on the array's pass but not on the
    slow pass that explains the failure: every element then looks valid."""

    def __init__(self) -> None:
        self.calls = 0

    def __index__(self) -> int:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("first read fails")
        return 3


def test_a_failure_no_element_explains_is_still_invalid_type() -> None:
    """When the fast pass fails but every element reads as an in-range integer
    afterwards, `token_list` still refuses with a generic `InvalidType`."""
    with pytest.raises(InvalidType) as raised:
        token_list([_Flaky()], "prompt")
    assert str(raised.value) == "prompt must hold integer token ids (an element failed to convert)"


def test_extra_tuple_keeps_none_and_tuples_of_identities_the_cache_owns() -> None:
    """None stays None; a list or tuple becomes a tuple of the same items; the
    first item outside [R57]'s types is `InvalidType` naming its index, type and
    value; a lone surrogate is `InvalidArgument` naming where."""
    assert extra_tuple(None) is None
    assert extra_tuple(["a", 1, None]) == ("a", 1, None)
    assert extra_tuple(()) == ()
    kept = ("a", (b"b", (True, -3)))
    assert extra_tuple(kept) == kept
    with pytest.raises(InvalidType) as raised:
        extra_tuple(["a", ["b"], {}])
    assert str(raised.value) == (
        "extra[1] must be None, bool, int, str, bytes or a tuple of those "
        "(exactly, not a subclass), got list: ['b']"
    )
    with pytest.raises(InvalidType) as raised:
        extra_tuple([("a", ("b", 2.5))])
    assert str(raised.value).startswith("extra[0][1][1] must be None, bool, int, str")
    with pytest.raises(InvalidArgument) as bad:
        extra_tuple(["ok", ("x", "ab\udc80")])
    assert str(bad.value) == (
        "extra[1][1] is not valid Unicode (a lone surrogate at position 2): 'ab\\udc80'"
    )
    with pytest.raises(InvalidType) as raised:
        extra_tuple({"a": 1})
    assert str(raised.value) == (
        "extra must be None or a list/tuple of per-block identities, got dict"
    )
