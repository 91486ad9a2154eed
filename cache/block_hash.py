"""Stable chained 64-bit block hashes, for KV events a router can index.

A block's hash depends on its parent's hash, its token ids and its extra
identity; the root of each namespace seeds the chain. The value is the same in
every process, on every machine and under every Python version (no use of
`hash()`), so two replicas that cache the same prefix publish the same hashes.
Hashes only *narrow* a lookup (a router's index): the trie keeps deciding by
exact token / namespace / extra equality.

Two schemes (`CacheConfig.block_hash`):

``"xxh3"`` (default): XXH3-64 (the `xxhash` package) with `seed = hash_seed`
over this byte layout (all integers little-endian):

- root: ``b"blocktrie-root\\x00" || enc(namespace)``
- block: the block's token ids as the trie keys them (``packed``, see
  `cache.keys.pack_tokens`: ``u32(token)`` each when every token is below
  ``2**32``, else ``u64(token)`` each followed by the byte ``0x08``), hashed
  with the parent's hash as the XXH3 seed: ``xxh3_64(packed, seed=parent)``;
  a block with an extra identity hashes ``u32(len(packed)) || packed ||
  enc(extra)`` with ``seed=parent ^ EXTRA_SEED`` (``EXTRA_SEED =
  0x9E3779B97F4A7C15``), so the two forms never share a seed. The trie
  hashes the key bytes it already holds: one C call per block, no unpacking.
  ``hash_seed`` enters through the root, and so through every chain.

where ``enc`` is the canonical value encoding (see `encode_value`): ``None ->
b"N"``; ``int`` (and ``bool``, as Python compares ``True == 1``) -> ``b"i" ||
u32(n) || n bytes of little-endian two's-complement``, ``n = (bit_length + 8) // 8``
(room for the sign bit beyond the magnitude: ``-128`` takes 2 bytes); ``str -> b"s" || u32(n) ||
UTF-8``; ``bytes`` -> ``b"b" || u32(n) || raw``; ``tuple -> b"t" || u32(len) ||
enc(item)...``. Anything else (floats, lists, custom objects) raises
`TypeError`: a float's bytes would not follow Python's ``1.0 == 1``.

``"vllm"``: vLLM's v1 prefix-caching hash, as published in
``vllm/v1/core/kv_cache_utils.py`` / ``vllm/utils/hashing.py`` on vLLM main in
2026 (``BlockHash`` = 32 raw SHA-256 bytes; hash function ``sha256_cbor``;
events with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``): the root is
``NONE_HASH = sha256(cbor(str(hash_seed)))`` (vLLM's ``init_none_hash`` with
``PYTHONHASHSEED=str(hash_seed)``), a block is ``sha256(cbor([parent_digest,
[tokens...], extra_keys]))`` with cbor2's canonical encoding, and the value a
router sees is the digest's low 64 bits (``int.from_bytes(d, "big") &
(2**64 - 1)``). The chain itself runs on the full digests, so in this scheme
`chain` and `root_hash` return the 256-bit digest as an int; use `to_wire`
(``& (2**64 - 1)``, the identity for ``"xxh3"``) for the published value.
The namespace plays vLLM's LoRA name: it is prepended to every block's
``extra_keys`` (vLLM's ``generate_block_hash_extra_keys`` puts the LoRA name
first); see `extra_keys`. vLLM's keys alone do not tell every two blocks
apart: namespace ``"a"`` with no identity and namespace ``""`` with identity
``("a",)`` (or ``"a"``) both give ``("a",)``. So vLLM's three-element layout is
used exactly for the blocks vLLM itself can name apart (`vllm_expressible`:
no identity, or a non-empty tuple that does not start with a str when the
namespace is ``""``); every other block hashes ``sha256(cbor([parent_digest,
[tokens...], namespace, extra]))``, a four-element array no vLLM block hashes
([R61]).

The extras' modules (`xxhash`) are imported only when a hasher is built.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import Literal, Protocol

from cache.keys import pack_tokens, unpack_tokens
from cache.validation import U32, U64

__all__ = [
    "EXTRA_SEED",
    "MASK64",
    "SCHEMES",
    "BlockHasher",
    "ChainFn",
    "PackedChainFn",
    "cbor_canonical",
    "chain",
    "encode_value",
    "extra_keys",
    "root_hash",
    "to_wire",
    "vllm_expressible",
]

Scheme = Literal["xxh3", "vllm"]
SCHEMES: tuple[str, ...] = ("xxh3", "vllm")
MASK64 = (1 << 64) - 1
_ROOT_TAG = b"blocktrie-root\x00"
_U32 = struct.Struct("<I")


def to_wire(block_hash: int) -> int:
    """The unsigned 64-bit value published for `block_hash` (its low 64 bits)."""
    return block_hash & MASK64


# ------------------------------------------------------------ xxh3 encoding


def encode_value(value: object) -> bytes:
    """Canonical bytes of an extra identity (see the module docstring).

    Raises `TypeError` for types outside None / int / bool / str / bytes /
    tuple, and `ValueError` for a str that is not valid Unicode (lone surrogates).
    """
    out = bytearray()
    _encode_into(value, out)
    return bytes(out)


def _encode_into(value: object, out: bytearray) -> None:
    if value is None:
        out += b"N"
    elif isinstance(value, int):
        v = int(value)
        raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        out += b"i"
        out += _U32.pack(len(raw))
        out += raw
    elif isinstance(value, str):
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"extra identity string is not valid Unicode: {exc}") from None
        out += b"s"
        out += _U32.pack(len(raw))
        out += raw
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        out += b"b"
        out += _U32.pack(len(raw))
        out += raw
    elif isinstance(value, tuple):
        out += b"t"
        out += _U32.pack(len(value))
        for item in value:
            _encode_into(item, out)
    else:
        raise TypeError(
            "a block's extra identity must be None, int, str, bytes or a tuple of those "
            f"to be hashed stably; got {type(value).__name__}"
        )


EXTRA_SEED = 0x9E3779B97F4A7C15
"""XOR-ed into the seed of a block with an extra identity (scheme ``xxh3``)."""


def _little_endian(packed: bytes) -> bytes:  # pragma: no cover - big-endian hosts only
    """`packed` (native byte order, as `pack_tokens` writes it) in little-endian order."""
    if len(packed) % 4:
        ids = array(U64, packed[:-1])
        ids.byteswap()
        return ids.tobytes() + packed[-1:]
    ids = array(U32, packed)
    ids.byteswap()
    return ids.tobytes()


# ------------------------------------------------------------ CBOR (vllm)


def cbor_canonical(value: object) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic form) of the values vLLM hashes.

    Covers None, bool, int, str, bytes and tuples of those: exactly the
    bytes `cbor2.dumps(value, canonical=True)` gives for them. Other types
    raise `TypeError`.
    """
    out = bytearray()
    _cbor_into(value, out)
    return bytes(out)


def _cbor_head(major: int, n: int, out: bytearray) -> None:
    m = major << 5
    if n < 24:
        out.append(m | n)
    elif n < 0x100:
        out.append(m | 24)
        out.append(n)
    elif n < 0x10000:
        out.append(m | 25)
        out += n.to_bytes(2, "big")
    elif n < 0x100000000:
        out.append(m | 26)
        out += n.to_bytes(4, "big")
    else:  # n <= 2**64 - 1: callers encode larger ints as bignums
        out.append(m | 27)
        out += n.to_bytes(8, "big")


def _cbor_into(value: object, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True:
        out.append(0xF5)
    elif value is False:
        out.append(0xF4)
    elif isinstance(value, int):
        v = int(value)
        major, n = (0, v) if v >= 0 else (1, -1 - v)
        if n <= MASK64:
            _cbor_head(major, n, out)
        else:
            raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
            out.append(0xC2 if major == 0 else 0xC3)
            _cbor_head(2, len(raw), out)
            out += raw
    elif isinstance(value, str):
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"extra key string is not valid Unicode: {exc}") from None
        _cbor_head(3, len(raw), out)
        out += raw
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        _cbor_head(2, len(raw), out)
        out += raw
    elif isinstance(value, tuple):
        _cbor_head(4, len(value), out)
        for item in value:
            _cbor_into(item, out)
    else:
        raise TypeError(
            "the vllm block hash covers None, bool, int, str, bytes and tuples of those; "
            f"got {type(value).__name__}"
        )


def extra_keys(extra: Hashable, namespace: str = "") -> tuple[object, ...] | None:
    """vLLM's ``extra_keys`` for a block with extra identity `extra` in `namespace`.

    The namespace (vLLM's LoRA name) comes first when not empty; then the extra
    identity: a tuple contributes its items (pass ``((mm_hash, offset),)`` to
    match a vLLM multimodal block), any other non-None value contributes
    itself. None when both are empty, as vLLM does. This is also what a
    `BlockStored` event carries per block in ``extra_keys``.
    """
    head: tuple[object, ...] = (namespace,) if namespace else ()
    if extra is None:
        body: tuple[object, ...] = ()
    elif isinstance(extra, tuple):
        body = extra
    else:
        body = (extra,)
    keys = head + body
    return keys if keys else None


def vllm_expressible(extra: Hashable, namespace: str = "") -> bool:
    """Whether scheme ``"vllm"`` hashes a block with identity `extra` in
    `namespace` exactly as vLLM does ([R61]).

    True when `extra` is None or a non-empty tuple, unless the namespace is
    ``""`` and the tuple's first item is a str: vLLM's ``extra_keys`` of that
    block equal those of the block whose LoRA name is that str (``(ns,) +
    rest``), and a scalar or empty identity gives the keys of another
    identity (``"a"`` and ``("a",)``, ``()`` and None). Blocks for which this
    is False are hashed in blocktrie's own layout instead, so that two
    different blocks never publish one hash.
    """
    if extra is None:
        return True
    if not isinstance(extra, tuple) or not extra:
        return False
    return bool(namespace) or not isinstance(extra[0], str)


# ------------------------------------------------------------ the hasher


class ChainFn(Protocol):
    """Signature of `BlockHasher.chain_fn`."""

    def __call__(
        self, parent: int, tokens: Sequence[int], extra: Hashable = None, namespace: str = ""
    ) -> int: ...


class PackedChainFn(Protocol):
    """Signature of `BlockHasher.packed_fn`: `chain` over a block's packed key bytes."""

    def __call__(
        self, parent: int, packed: bytes, extra: Hashable = None, namespace: str = ""
    ) -> int: ...


class BlockHasher:
    """Computes root and block hashes for one (scheme, seed).

    `root(namespace)` seeds a namespace's chain; `chain(parent, tokens, extra,
    namespace)` hashes one full block under its parent's hash. Results are
    ints: in ``[0, 2**64)`` for ``"xxh3"``, full 256-bit digests for
    ``"vllm"`` (publish `to_wire(h)`). `chain_fn` is `chain` as a plain
    function, for hot paths. Raises `ValueError` for an unknown
    scheme or a seed outside ``[0, 2**64)``, `ImportError` (naming the
    ``events`` extra) when ``xxhash`` is missing.
    """

    __slots__ = ("_roots", "chain_fn", "packed_fn", "plain_digest", "scheme", "seed")

    def __init__(self, scheme: str = "xxh3", seed: int = 0) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"unknown block hash scheme {scheme!r}; expected one of {SCHEMES}")
        if type(seed) is not int or not 0 <= seed <= MASK64:
            raise ValueError(f"hash_seed must be an int in [0, 2**64), got {seed!r}")
        self.scheme = scheme
        self.seed = seed
        self._roots: dict[str, int] = {}
        self.plain_digest: Callable[[bytes, int], int] | None = None
        """For scheme ``xxh3`` on little-endian hosts, the C function with
        ``plain_digest(packed, parent) == packed_fn(parent, packed)`` for a block
        without an extra identity (no Python frame per block); else None."""
        self.packed_fn: PackedChainFn
        """`chain` over the block's packed key bytes (`cache.keys.pack_tokens`),
        as a plain function: what the trie calls per attached block. Trusts its
        input (a parent that is a chain value, bytes `pack_tokens` made);
        `chain_fn` checks both."""
        if scheme == "xxh3":
            try:
                import xxhash
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise ImportError(
                    "block_hash='xxh3' needs the xxhash package: pip install 'blocktrie[events]'"
                ) from exc
            digest = xxhash.xxh3_64_intdigest
            length = _U32.pack
            swap = sys.byteorder != "little"

            def xxh3_packed(
                parent: int, packed: bytes, extra: Hashable = None, namespace: str = ""
            ) -> int:
                if swap:  # pragma: no cover - big-endian hosts
                    packed = _little_endian(packed)
                if extra is None:
                    h: int = digest(packed, parent)
                else:
                    data = length(len(packed)) + packed + encode_value(extra)
                    h = digest(data, parent ^ EXTRA_SEED)
                return h

            self.packed_fn = xxh3_packed
            if not swap:
                self.plain_digest = digest
        else:

            def vllm_packed(
                parent: int, packed: bytes, extra: Hashable = None, namespace: str = ""
            ) -> int:
                digest, tokens = parent.to_bytes(32, "big"), unpack_tokens(packed)
                if vllm_expressible(extra, namespace):
                    payload = cbor_canonical((digest, tokens, extra_keys(extra, namespace)))
                else:  # [R61]: a four-element array, which no vLLM block hashes
                    payload = cbor_canonical((digest, tokens, namespace, extra))
                return int.from_bytes(hashlib.sha256(payload).digest(), "big")

            self.packed_fn = vllm_packed

        packed_fn = self.packed_fn
        parent_limit = MASK64 if scheme == "xxh3" else (1 << 256) - 1

        def chain_fn(
            parent: int, tokens: Sequence[int], extra: Hashable = None, namespace: str = ""
        ) -> int:
            if type(parent) is not int or not 0 <= parent <= parent_limit:
                raise ValueError(f"parent hash must be a chain value of {scheme!r}, got {parent!r}")
            try:
                packed = pack_tokens(tokens)
            except (OverflowError, TypeError) as exc:
                raise ValueError(f"token ids must be ints in [0, 2**64): {exc}") from None
            return packed_fn(parent, packed, extra, namespace)

        self.chain_fn: ChainFn = chain_fn
        """`chain` as a plain function (no method dispatch)."""

    def root(self, namespace: str = "") -> int:
        """The chain seed of `namespace` (cached per namespace)."""
        h = self._roots.get(namespace)
        if h is None:
            h = self._roots[namespace] = self._root(namespace)
        return h

    def _root(self, namespace: str) -> int:
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        if self.scheme == "vllm":
            # vLLM's NONE_HASH: sha256_cbor(PYTHONHASHSEED); the namespace is in
            # every block's extra keys instead (as a LoRA name is).
            seed = cbor_canonical(str(self.seed))
            return int.from_bytes(hashlib.sha256(seed).digest(), "big")
        import xxhash

        return int(xxhash.xxh3_64_intdigest(_ROOT_TAG + encode_value(namespace), self.seed))

    def chain(
        self, parent: int, tokens: Sequence[int], extra: Hashable = None, namespace: str = ""
    ) -> int:
        """The hash of a block with `tokens` and `extra` whose parent hashes to `parent`.

        `namespace` matters only to ``"vllm"`` (it is the LoRA name in the
        extra keys); ``"xxh3"`` takes it from the root.
        """
        return self.chain_fn(parent, tokens, extra, namespace)


_hashers: dict[tuple[str, int], BlockHasher] = {}


def _hasher(scheme: str, seed: int) -> BlockHasher:
    h = _hashers.get((scheme, seed))
    if h is None:
        h = _hashers[(scheme, seed)] = BlockHasher(scheme, seed)
    return h


def root_hash(namespace: str = "", seed: int = 0, scheme: str = "xxh3") -> int:
    """Pure function form of `BlockHasher.root`."""
    return _hasher(scheme, seed).root(namespace)


def chain(
    parent_hash: int,
    token_ids: Sequence[int],
    extra: Hashable = None,
    scheme: str = "xxh3",
    *,
    seed: int = 0,
    namespace: str = "",
) -> int:
    """Pure function form of `BlockHasher.chain`."""
    return _hasher(scheme, seed).chain(parent_hash, token_ids, extra, namespace)
