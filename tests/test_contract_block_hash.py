"""Contract details of `cache.block_hash` (mutation survivors).

The xxh3 layout hashes token ids little-endian on every host; `_little_endian`
is what a big-endian host runs its packed keys through. Given keys packed in
big-endian order (what `pack_tokens` writes there), it returns the
little-endian packing of the same ids, the uint64 marker byte kept last; the
byte-order conversion is the same on every host, so it is tested here.

`encode_value` writes exactly the documented layout (``None -> b"N"``, an int
as ``b"i" || u32(n) || n bytes of minimal little-endian two's complement``, a
tuple as ``b"t" || u32(len) || items``), and `cbor_canonical` a bignum in its
minimal big-endian bytes. `root_hash` and `chain` are `BlockHasher.root` /
`.chain` with the same defaults (namespace ``""``, seed 0, scheme ``"xxh3"``).

Error messages are contract (issue 12, item 20): each names the argument and
the value refused, and a re-raised error does not chain the internal one.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

import pytest

from cache.block_hash import (
    BlockHasher,
    _little_endian,
    cbor_canonical,
    chain,
    encode_value,
    root_hash,
)
from cache.keys import _WIDE, pack_tokens

pytest.importorskip("xxhash")


def _big(ids: list[int], width: int) -> bytes:
    return b"".join(t.to_bytes(width, "big") for t in ids)


def _little(ids: list[int], width: int) -> bytes:
    return b"".join(t.to_bytes(width, "little") for t in ids)


def test_uint32_keys_are_rewritten_little_endian() -> None:
    ids = [1, 0x01020304, 2**32 - 1, 0]
    assert _little_endian(_big(ids, 4)) == _little(ids, 4)
    assert _little_endian(b"") == b""


def test_uint64_keys_are_rewritten_little_endian_with_the_marker_last() -> None:
    ids = [2**40 + 5, 7, 0x0102030405060708]
    assert _little_endian(_big(ids, 8) + _WIDE) == _little(ids, 8) + _WIDE


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: BlockHasher("md5"),
            ValueError,
            "unknown block hash scheme 'md5'; expected one of ('xxh3', 'vllm')",
        ),
        (
            lambda: BlockHasher("xxh3", -1),
            ValueError,
            "hash_seed must be an int in [0, 2**64), got -1",
        ),
        (  # a bool is not an int seed
            lambda: BlockHasher("xxh3", True),
            ValueError,
            "hash_seed must be an int in [0, 2**64), got True",
        ),
        (
            lambda: BlockHasher("xxh3").chain(2**64, [1]),
            ValueError,
            "parent hash must be a chain value of 'xxh3', got 18446744073709551616",
        ),
        (
            lambda: BlockHasher("vllm").chain(-1, [1]),
            ValueError,
            "parent hash must be a chain value of 'vllm', got -1",
        ),
        (lambda: BlockHasher("xxh3").root(3), TypeError, "namespace must be a str, got int"),
        (
            lambda: encode_value(1.5),
            TypeError,
            "a block's extra identity must be None, int, str, bytes or a tuple of those "
            "to be hashed stably; got float",
        ),
        (
            lambda: cbor_canonical(1.5),
            TypeError,
            "the vllm block hash covers None, bool, int, str, bytes and tuples of those; got float",
        ),
    ],
)
def test_errors_name_the_argument_and_value(
    make: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        make()


@pytest.mark.parametrize(
    ("make", "prefix"),
    [
        (lambda: BlockHasher("xxh3").chain(0, [-1]), "token ids must be ints in [0, 2**64): "),
        (lambda: encode_value("\ud800"), "extra identity string is not valid Unicode: "),
        (lambda: cbor_canonical("\ud800"), "extra key string is not valid Unicode: "),
    ],
)
def test_reraised_errors_name_the_cause_without_chaining_it(
    make: Callable[[], object], prefix: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(prefix)}.") as raised:
        make()
    assert raised.value.__suppress_context__ and raised.value.__cause__ is None


def _int(raw: bytes) -> bytes:
    return b"i" + len(raw).to_bytes(4, "little") + raw


def test_encode_value_writes_the_documented_layout() -> None:
    assert encode_value(None) == b"N"
    assert encode_value(0) == _int(b"\x00")
    assert encode_value(127) == _int(b"\x7f")  # 7 bits: one byte, sign bit clear
    assert encode_value(128) == _int(b"\x80\x00")
    assert encode_value(-129) == _int(b"\x7f\xff")
    assert encode_value(256) == _int(b"\x00\x01")  # little-endian
    assert encode_value((None, 1)) == b"t\x02\x00\x00\x00" + b"N" + _int(b"\x01")
    assert encode_value("ab") == b"s\x02\x00\x00\x00ab"
    assert encode_value((b"ab",)) == b"t\x01\x00\x00\x00" + b"b\x02\x00\x00\x00ab"


def test_cbor_bignums_are_minimal() -> None:
    """RFC 8949: an unsigned bignum is tag 2 over its big-endian bytes, no leading zero."""
    assert cbor_canonical(2**72 - 1) == b"\xc2\x49" + b"\xff" * 9
    assert cbor_canonical(2**64) == b"\xc2\x49\x01" + b"\x00" * 8
    assert cbor_canonical(-(2**72)) == b"\xc3\x49" + b"\xff" * 9


def test_the_pure_functions_are_the_hasher_with_its_defaults() -> None:
    hasher = BlockHasher()
    assert root_hash() == hasher.root() == hasher.root("")
    assert root_hash("ns") == hasher.root("ns")
    parent = hasher.root()
    assert chain(parent, [1, 2]) == hasher.chain(parent, [1, 2])
    vllm = BlockHasher("vllm")
    vparent = vllm.root()
    assert chain(vparent, [1, 2], scheme="vllm") == vllm.chain(vparent, [1, 2])
    with_ns = chain(vparent, [1, 2], scheme="vllm", namespace="lora")
    assert with_ns == vllm.chain(vparent, [1, 2], None, "lora") != vllm.chain(vparent, [1, 2])


def test_the_largest_seed_is_accepted() -> None:
    assert BlockHasher("xxh3", 2**64 - 1).root() != BlockHasher("xxh3", 0).root()


def test_a_missing_xxhash_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xxhash", None)  # `import xxhash` now fails
    message = "block_hash='xxh3' needs the xxhash package: pip install 'blocktrie[events]'"
    with pytest.raises(ImportError, match=f"^{re.escape(message)}$"):
        BlockHasher("xxh3")


def test_plain_digest_is_the_packed_hash_of_a_plain_block() -> None:
    """`plain_digest` is offered for xxh3 on little-endian hosts, and agrees with `packed_fn`."""
    assert BlockHasher("vllm").plain_digest is None
    hasher = BlockHasher("xxh3", 5)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        assert hasher.plain_digest is None
        return
    assert hasher.plain_digest is not None
    packed, parent = pack_tokens([1, 2, 2**33]), hasher.root()
    assert hasher.plain_digest(packed, parent) == hasher.packed_fn(parent, packed)


def test_the_plain_functions_default_to_no_namespace() -> None:
    """`chain_fn` and `packed_fn` are `chain` as plain functions, with its defaults."""
    for scheme in ("xxh3", "vllm"):
        hasher = BlockHasher(scheme)
        parent = hasher.root()
        expected = hasher.chain(parent, [1, 2], None, "")
        assert hasher.chain_fn(parent, [1, 2]) == expected
        assert hasher.packed_fn(parent, pack_tokens([1, 2])) == expected


def test_a_vllm_parent_is_any_256_bit_digest() -> None:
    hasher = BlockHasher("vllm")
    hasher.chain(2**256 - 1, [1])  # the largest digest is a parent
    message = f"parent hash must be a chain value of 'vllm', got {2**256}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hasher.chain(2**256, [1])
