"""Token ids as a one-dimensional integer array (`cache.validation._array_tokens`).

An engine that already holds a prompt as a numpy array, a CPU torch tensor or
an `array.array` passes it as is: the cache reads it in one conversion (a
vectorized range check, no check per token) and must then behave exactly as
for the same ids in a list — same hits, block tables, stored tokens and
trie. Malformed arrays are refused by the rules of [R1]/[R2] (type, then
range, then non-empty), changing nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import BlockTrie, CacheConfig, CacheError, InvalidArgument, InvalidType
from cache.validation import U32, U64, token_list
from tests.helpers import frozen

WIDE = 1 << 40  # needs 64 bits

CONVERTERS: dict[str, Callable[[list[int]], Any]] = {
    "numpy int64": lambda t: np.array(t, dtype=np.int64),
    "numpy uint64": lambda t: np.array(t, dtype=np.uint64),
    "numpy big-endian": lambda t: np.array(t, dtype=">u8"),
    "numpy strided": lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],
    "torch int64": lambda t: torch.tensor(t, dtype=torch.int64),
    "torch strided": lambda t: torch.tensor(t, dtype=torch.int64).repeat_interleave(2)[::2],
    "array Q": lambda t: array("Q", t),
}


def _trie() -> BlockTrie:
    return BlockTrie(CacheConfig(block_size=2, num_blocks=64, kv_block_shape=None))


def _serve(trie: BlockTrie, prompts: list[Any]) -> list[tuple[int, list[int], list[int]]]:
    """Match, allocate, commit and release each prompt; what each request saw."""
    seen = []
    for prompt in prompts:
        seq = trie.match(prompt)
        trie.allocate(seq, len(seq.tokens))
        trie.commit(seq, len(seq.tokens))
        seen.append((seq.num_cached_tokens, list(seq.block_ids), list(seq.tokens)))
        trie.release(seq)
    return seen


PROMPTS = st.lists(
    st.lists(st.sampled_from([0, 1, 2, 2**32 - 1, WIDE]), min_size=1, max_size=9),
    min_size=1,
    max_size=6,
)


@pytest.mark.parametrize("kind", sorted(CONVERTERS))
@settings(max_examples=25, deadline=None)
@given(prompts=PROMPTS)
def test_an_array_is_served_as_the_same_ids_in_a_list(kind: str, prompts: list[list[int]]) -> None:
    """Same hits, block tables, stored tokens and trie for arrays as for lists."""
    if kind.startswith("torch"):  # torch has no uint64 beyond int64's range here
        prompts = [[t if t < 2**63 else 5 for t in p] for p in prompts]
    as_lists, as_arrays = _trie(), _trie()
    convert = CONVERTERS[kind]
    assert _serve(as_arrays, [convert(p) for p in prompts]) == _serve(as_lists, prompts)
    assert frozen(as_arrays.snapshot()) == frozen(as_lists.snapshot())
    as_arrays.check()


def test_an_array_is_stored_at_the_narrowest_width() -> None:
    assert token_list(np.array([1, 2**32 - 1], dtype=np.int64)).typecode == U32
    assert token_list(np.array([1, 2**32], dtype=np.int64)).typecode == U64
    assert token_list(torch.tensor([7, 8], dtype=torch.int32)).tolist() == [7, 8]
    assert token_list(torch.tensor([7, 8], dtype=torch.uint8)).tolist() == [7, 8]
    assert token_list(array("b", [3, 4])).tolist() == [3, 4]
    assert token_list(np.array([], dtype=np.int64)).tolist() == []


def test_a_byte_swapped_array_keeps_ids_no_float_could_hold() -> None:
    """A non-native byte order is converted to native integers, not through floats:
    ids past 2**53 come back exact."""
    ids = [2**53 + 1, 2**64 - 1, 5]
    assert token_list(np.array(ids, dtype=">u8")).tolist() == ids
    assert token_list(np.array([2**31 - 1, 9], dtype=">i4")).tolist() == [2**31 - 1, 9]


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_a_signed_array_is_refused_only_for_its_sign_bit(dtype: Any) -> None:
    """The range check reads the sign bit alone: the largest positive id of a signed
    dtype (every other bit set) is accepted, and -1 is refused."""
    top = int(np.iinfo(dtype).max)
    assert token_list(np.array([top, top >> 1, 1], dtype=dtype)).tolist() == [top, top >> 1, 1]
    with pytest.raises(InvalidArgument, match=r"^tokens must be in \[0, 2\*\*64\); found -1$"):
        token_list(np.array([3, -1], dtype=dtype))


def test_a_tensor_subclass_is_read_as_a_tensor() -> None:
    """The package of the array's type decides how it is read: a `torch.nn.Parameter`
    (module `torch.nn.parameter`) is a tensor like any other."""
    ids = torch.nn.Parameter(torch.tensor([1, 2, 3]), requires_grad=False)
    assert token_list(ids).tolist() == [1, 2, 3]


def test_a_tensor_off_the_cpu_is_refused_saying_why() -> None:
    tokens = torch.zeros(3, dtype=torch.int64, device="meta")
    with pytest.raises(InvalidType) as raised:
        token_list(tokens, "prompt")
    assert str(raised.value) == (
        "prompt is a tensor on meta: pass token ids on the CPU "
        "(reading them would synchronize the device)"
    )


def test_without_numpy_a_tensor_is_read_through_its_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where `Tensor.numpy()` fails (no numpy), the ids are read through `tolist()` and
    checked as a list's are, under the argument's name."""

    def no_numpy(self: torch.Tensor) -> Any:
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    assert token_list(torch.tensor([5, WIDE], dtype=torch.int64)).tolist() == [5, WIDE]
    with pytest.raises(InvalidArgument) as raised:
        token_list(torch.tensor([3, -1], dtype=torch.int8), "prompt")
    assert str(raised.value) == "prompt must be in [0, 2**64); found -1"


def test_append_takes_an_array_and_widens_when_it_needs_to() -> None:
    trie = _trie()
    seq = trie.match(np.array([1, 2, 3], dtype=np.int32))
    trie.append(seq, torch.tensor([4], dtype=torch.int64))
    trie.append(seq, np.array([WIDE], dtype=np.uint64))
    assert seq.tokens == (1, 2, 3, 4, WIDE)
    trie.abort(seq)
    trie.check()


BAD: list[tuple[str, Any, type[CacheError], str]] = [
    ("2-D numpy", np.zeros((2, 2), dtype=np.int64), InvalidType, r"shape \(2, 2\)"),
    ("float numpy", np.array([1.0, 2.0]), InvalidType, r"numpy array of float64"),
    ("bool numpy", np.array([True, False]), InvalidType, r"numpy array of bool"),
    ("negative numpy", np.array([3, -7, -2], dtype=np.int64), InvalidArgument, r"found -7$"),
    ("numpy scalar", np.int64(5), InvalidType, r"got int64$"),
    ("empty numpy", np.array([], dtype=np.int64), InvalidArgument, r"at least one token"),
    ("float tensor", torch.tensor([1.0]), InvalidType, r"tensor of torch.float32"),
    ("bool tensor", torch.tensor([True]), InvalidType, r"tensor of torch.bool"),
    ("2-D tensor", torch.zeros((1, 2), dtype=torch.int64), InvalidType, r"shape \(1, 2\)"),
    ("negative tensor", torch.tensor([1, -1]), InvalidArgument, r"found -1$"),
    ("meta tensor", torch.zeros(3, dtype=torch.int64, device="meta"), InvalidType, r"on meta"),
    ("float array", array("d", [1.0]), InvalidType, r"typecode 'd'"),
    ("negative array", array("b", [1, -3]), InvalidArgument, r"found -3$"),
    ("generator", (t for t in [1, 2]), InvalidType, r"integer array, got generator$"),
]


@pytest.mark.parametrize(("label", "tokens", "error", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_array_is_refused_changing_nothing(
    label: str, tokens: Any, error: type[CacheError], message: str
) -> None:
    """Each refusal names what is wrong (shape, dtype, device or the first bad id)."""
    trie = _trie()
    live = trie.match([1, 2, 3])
    before = frozen(trie.snapshot())
    with pytest.raises(error, match=message) as info:
        trie.match(tokens)
    assert "tokens" in str(info.value)
    if label == "empty numpy":  # [R4]: appending no tokens is allowed and changes nothing
        trie.append(live, tokens)
    else:
        with pytest.raises(error, match=message):
            trie.append(live, tokens)
    assert frozen(trie.snapshot()) == before
    assert live.tokens == (1, 2, 3)
    trie.check()
