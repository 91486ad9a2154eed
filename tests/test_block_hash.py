"""Stable block hashes: determinism across processes, canonical extras, vLLM parity."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("xxhash")

from cache.block_hash import (
    MASK64,
    BlockHasher,
    cbor_canonical,
    chain,
    encode_value,
    extra_keys,
    root_hash,
    to_wire,
    vllm_expressible,
)

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json
from cache.block_hash import BlockHasher, to_wire
out = {}
for scheme in ("xxh3", "vllm"):
    h = BlockHasher(scheme, 12345)
    vals = []
    for ns in ("", "tenant-a"):
        p = h.root(ns)
        for i, extra in enumerate([None, ("img", 3), "salt", (1, (b"x", None))]):
            p = h.chain(p, list(range(i * 16, i * 16 + 16)), extra, ns)
            vals.append(to_wire(p))
    out[scheme] = vals
print(json.dumps(out))
"""


def _child(hash_seed: str) -> dict[str, list[int]]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    res = subprocess.run(
        [sys.executable, "-c", _CHILD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    out: dict[str, list[int]] = json.loads(res.stdout)
    return out


def test_hashes_equal_across_processes_with_different_pythonhashseed() -> None:
    a, b = _child("0"), _child("4242")
    assert a == b
    # and equal to this process (whatever its PYTHONHASHSEED)
    h = BlockHasher("xxh3", 12345)
    p = h.root("")
    p = h.chain(p, list(range(16)), None, "")
    assert a["xxh3"][0] == p
    assert all(0 <= v <= MASK64 for vals in a.values() for v in vals)
    assert len(set(a["xxh3"])) == len(a["xxh3"])  # no accidental collisions


def test_xxh3_layout_is_the_documented_one() -> None:
    import struct

    import xxhash

    seed = 99
    root = root_hash("ns", seed)
    assert root == xxhash.xxh3_64_intdigest(
        b"blocktrie-root\x00" + b"s" + struct.pack("<I", 2) + b"ns", seed
    )
    # a block with a token past 2**32 and an extra identity: u64 ids + 0x08,
    # length-prefixed, extra appended, seed = parent ^ EXTRA_SEED
    toks = [5, 2**63 + 1, 2**40]
    got = chain(root, toks, ("a", 7), seed=seed)
    packed = struct.pack("<3Q", *toks) + b"\x08"
    data = struct.pack("<I", len(packed)) + packed
    data += b"t" + struct.pack("<I", 2)
    data += b"s" + struct.pack("<I", 1) + b"a"
    data += b"i" + struct.pack("<I", 1) + bytes([7])
    assert got == xxhash.xxh3_64_intdigest(data, root ^ 0x9E3779B97F4A7C15)
    # a plain block whose ids fit in 32 bits: u32 ids, seeded by the parent
    plain = chain(got, [1, 2, 2**32 - 1], seed=seed)
    assert plain == xxhash.xxh3_64_intdigest(struct.pack("<3I", 1, 2, 2**32 - 1), got)
    # the seed reaches every block through the root
    assert chain(root_hash("ns", seed + 1), [1, 2], seed=seed + 1) != chain(root, [1, 2], seed=seed)


def test_chain_depends_on_every_input() -> None:
    h = BlockHasher("xxh3", 0)
    r = h.root("")
    base = h.chain(r, [1, 2, 3, 4])
    assert h.chain(r, [1, 2, 3, 4]) == base
    assert h.chain(r, [1, 2, 3, 5]) != base
    assert h.chain(r, [1, 2, 3]) != h.chain(r, [1, 2, 3, 0])
    assert h.chain(r ^ 1, [1, 2, 3, 4]) != base
    assert h.chain(r, [1, 2, 3, 4], "x") != base
    assert h.chain(r, [1, 2, 3, 4], ("x",)) != h.chain(r, [1, 2, 3, 4], "x")
    assert h.root("a") != h.root("b") != h.root("")
    assert BlockHasher("xxh3", 1).root("") != r  # the seed matters


def test_encode_value_is_canonical_and_injective_on_samples() -> None:
    samples: list[Any] = [
        None,
        0,
        1,
        -1,
        255,
        256,
        -129,
        2**80,
        "",
        "a",
        "ab",
        b"",
        b"a",
        (),
        ("a",),
        ("a", "b"),
        (("a",), "b"),
        ("a", ("b",)),
        (None,),
        (1, "1", b"1"),
    ]
    encoded = [encode_value(v) for v in samples]
    assert len(set(encoded)) == len(samples)
    assert encode_value(True) == encode_value(1)  # Python compares True == 1
    assert encode_value(bytearray(b"ab")) == encode_value(b"ab")


@pytest.mark.parametrize("bad", [1.5, [1, 2], {"a": 1}, frozenset({1}), object(), (1, [2])])
def test_unsupported_extra_types_are_rejected(bad: object) -> None:
    with pytest.raises(TypeError, match="extra identity"):
        encode_value(bad)
    h = BlockHasher("xxh3", 0)
    with pytest.raises(TypeError):
        h.chain(h.root(), [1], bad)  # type: ignore[arg-type]
    v = BlockHasher("vllm", 0)
    with pytest.raises(TypeError):
        v.chain(v.root(), [1], bad)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="scheme"):
        BlockHasher("md5")
    with pytest.raises(ValueError, match="hash_seed"):
        BlockHasher("xxh3", -1)
    with pytest.raises(ValueError, match="hash_seed"):
        BlockHasher("xxh3", 2**64)
    with pytest.raises(ValueError, match="parent hash"):
        BlockHasher("xxh3").chain(2**64, [1])
    with pytest.raises(ValueError, match="parent hash"):
        BlockHasher("vllm").chain(-1, [1])
    with pytest.raises(ValueError, match="token ids"):
        BlockHasher("xxh3").chain(0, [-1])
    with pytest.raises(ValueError, match="token ids"):
        BlockHasher("xxh3").chain(0, [2**64])
    with pytest.raises(ValueError, match="Unicode"):
        encode_value("\ud800")
    with pytest.raises(TypeError, match="namespace"):
        BlockHasher("xxh3").root(3)  # type: ignore[arg-type]


# ------------------------------------------------------------------ vLLM parity

cbor2 = pytest.importorskip("cbor2")


def _vllm_reference(seed: str, blocks: list[tuple[list[int], tuple[Any, ...] | None]]) -> list[int]:
    """vLLM's published algorithm, written out independently with cbor2 + hashlib.

    vllm/utils/hashing.py: sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True)).digest()
    vllm/v1/core/kv_cache_utils.py: NONE_HASH = sha256_cbor(PYTHONHASHSEED);
    hash_block_tokens(parent or NONE_HASH, tokens, extra_keys) =
    sha256_cbor((parent, tuple(tokens), extra_keys)); maybe_convert_block_hash =
    int.from_bytes(digest, "big") & (2**64 - 1).
    """

    def sha256_cbor(x: Any) -> bytes:
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    none_hash = sha256_cbor(seed)
    parent: bytes | None = None
    out = []
    for tokens, keys in blocks:
        digest = sha256_cbor((parent or none_hash, tuple(tokens), keys))
        out.append(int.from_bytes(digest, byteorder="big") & ((1 << 64) - 1))
        parent = digest
    return out


@pytest.mark.parametrize("seed", [0, 1, 2**40])
def test_vllm_scheme_matches_the_published_algorithm(seed: int) -> None:
    blocks = [
        (list(range(16)), None),
        (list(range(100, 116)), (("mm-hash-abc", 3),)),
        ([7] * 16, None),
        ([2**20 + i for i in range(16)], (b"\x00\xff", "salt", -5)),
    ]
    h = BlockHasher("vllm", seed)
    p = h.root("")
    got = []
    for tokens, extra in blocks:
        p = h.chain(p, tokens, extra)
        got.append(to_wire(p))
    keys = [extra_keys(e) for _, e in blocks]
    assert got == _vllm_reference(str(seed), list(zip([b[0] for b in blocks], keys, strict=True)))
    # a scalar extra identity is the single extra key
    assert keys[0] is None and keys[2] is None
    assert extra_keys("x") == ("x",)


def test_vllm_scheme_namespace_is_the_lora_name() -> None:
    h = BlockHasher("vllm", 7)
    p = h.root("adapter-1")
    assert p == h.root("")  # one NONE_HASH, as in vLLM
    a = h.chain(p, [1, 2], None, "adapter-1")
    b = h.chain(a, [3, 4], ("img", 0), "adapter-1")
    ref = _vllm_reference("7", [([1, 2], ("adapter-1",)), ([3, 4], ("adapter-1", "img", 0))])
    assert [to_wire(a), to_wire(b)] == ref
    assert extra_keys(None, "adapter-1") == ("adapter-1",)


@pytest.mark.parametrize(
    ("namespace", "extra"),
    [("", "a"), ("", ("a",)), ("", ("a", "img", 0)), ("", ()), ("a", "x"), ("a", ())],
)
def test_vllm_scheme_hashes_what_vllm_cannot_name_apart_in_its_own_layout(
    namespace: str, extra: Any
) -> None:
    """[R61]: vLLM's extra keys of namespace "" with a str-first identity equal those of
    namespace <that str> with the rest, and a scalar or empty identity gives the keys of
    another one. Such blocks hash [parent, tokens, namespace, identity] (four elements:
    no vLLM block's layout) and never equal the block vLLM would confuse them with."""
    h = BlockHasher("vllm", 0)
    assert not vllm_expressible(extra, namespace)
    assert not vllm_expressible(("a",))  # the default namespace is ""
    parent = h.root(namespace)
    got = h.chain(parent, [1, 2], extra, namespace)
    payload = (parent.to_bytes(32, "big"), (1, 2), namespace, extra)
    digest = hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
    assert got == int.from_bytes(digest, "big")
    keys = extra_keys(extra, namespace)  # what vLLM's layout would have hashed
    vllm_form = _vllm_reference("0", [([1, 2], keys)])
    assert to_wire(got) != vllm_form[0]


def test_vllm_scheme_keeps_vllms_layout_for_what_vllm_names_apart() -> None:
    h = BlockHasher("vllm", 0)
    root = h.root()
    cases: list[tuple[str, Any]] = [
        ("", None),
        ("a", None),
        ("a", ("x",)),
        ("a", ("a", "img", 0)),
        ("", (("mm", 3),)),
        ("", (b"embeds", "salt")),
    ]
    for namespace, extra in cases:
        assert vllm_expressible(extra, namespace)
        got = to_wire(h.chain(root, [1, 2], extra, namespace))
        assert [got] == _vllm_reference("0", [([1, 2], extra_keys(extra, namespace))])
    # and all the blocks of both tests are told apart
    odd: list[tuple[str, Any]] = [("", "a"), ("", ("a",)), ("", ("a", "x")), ("", ())]
    assert len({h.chain(root, [1, 2], e, ns) for ns, e in cases + odd}) == len(cases + odd)


def test_cbor_encoder_matches_cbor2() -> None:
    values: list[Any] = [
        None,
        True,
        False,
        0,
        23,
        24,
        255,
        256,
        65535,
        65536,
        2**32 - 1,
        2**32,
        MASK64,
        2**64,
        2**200,
        -1,
        -24,
        -25,
        -(2**64),
        -(2**64) - 1,
        "",
        "é" * 40,
        b"",
        b"x" * 300,
        (1, ("a", None), b"z"),
        (1, (2, (3,))),
        ("y" * 70_000,),
    ]
    for v in values:
        assert cbor_canonical(v) == cbor2.dumps(v, canonical=True), v
