"""Block keys and block identities: the one place the cache builds them.

A block's *identity* is its token ids plus its extra identity (multimodal
hash, ...) ([R5]). Its *key* is what a parent's `children` dict is keyed by:
the block's token ids packed as bytes (`pack_tokens`) when the block has no
extra identity, else `(packed tokens, extra)`; wrapped in `HashedKey` when a
test injects a hash (`CacheConfig.key_hash`). Python's dict hash narrows and
`==` decides, so a hash collision can never produce a wrong hit.

Packing stores the token ids exactly (identity is never decided by a hash):
native uint32 per token when every token of the block fits, else uint64 per
token followed by one marker byte. The encoding depends on the block's tokens
only, so equal blocks always have equal keys, and the two encodings never
collide (their lengths differ: 4 per token vs 8 per token plus 1). A packed
block of 16 tokens is one 97-byte object that keeps no `int` alive, where a
tuple is 168 bytes plus the 16 ints it holds (~32 bytes each unless shared).

The reference model (`spec.model`) builds its own keys on purpose: the
differential test is only worth something if the two sides share no code.
"""

from __future__ import annotations

from array import array
from collections import abc
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, overload

from cache.validation import U32, U64, Identity

if TYPE_CHECKING:
    from cache.config import KeyHash

_WIDE = b"\x08"  # suffix of a uint64-packed block
_U32_LIMIT = 1 << 32


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """One block's token ids (each in [0, 2**64)) as its key bytes (see the module doc)."""
    if not tokens or max(tokens) < _U32_LIMIT:
        return array(U32, tokens).tobytes()
    return array(U64, tokens).tobytes() + _WIDE


def unpack_tokens(packed: bytes) -> tuple[int, ...]:
    """The token ids that `pack_tokens` packed."""
    if len(packed) % 4:
        return tuple(array(U64, packed[:-1]))
    return tuple(array(U32, packed))


def salted(extra: tuple[Identity, ...] | None, salt: str) -> tuple[Identity, ...]:
    """`extra` with vLLM's `cache_salt` folded into block 0's identity ([R70]).

    Block 0's identity becomes a tuple: its own extra keys (none for None, the
    items of a tuple, else the value itself), then `salt`, which is where vLLM's
    `generate_block_hash_extra_keys` puts the salt (after the multimodal keys,
    block 0 only); later blocks keep theirs. So `cache.block_hash.extra_keys` of
    block 0 is vLLM's extra keys for it, and a salted request shares no node with
    an unsalted one or one salted otherwise.
    """
    first = extra[0] if extra else None
    own: tuple[Identity, ...] = (
        () if first is None else first if isinstance(first, tuple) else (first,)
    )
    return ((*own, salt), *(extra or ())[1:])


def block_identity(extra: tuple[Hashable, ...] | None, index: int) -> Hashable:
    """The extra identity of block `index`: `extra[index]`, None past its end ([R5])."""
    return extra[index] if extra is not None and index < len(extra) else None


def block_key(packed: bytes, identity: Hashable, key_hash: KeyHash | None) -> Hashable:
    """The children-dict key of a block with these packed tokens and extra identity.

    The `key_hash` hook sees the block as its token tuple, or `(tokens,
    identity)`, whatever the packing (a hook may look at the tokens).
    """
    key: Hashable = packed if identity is None else (packed, identity)
    if key_hash is not None:
        tokens = unpack_tokens(packed)
        key = HashedKey(key, key_hash(tokens if identity is None else (tokens, identity)))
    return key


def key_packed(key: Hashable) -> bytes:
    """The packed token ids inside a key built by `block_key` (`b""` for a root's `None`)."""
    if type(key) is bytes:
        return key
    if key is None:
        return b""
    if isinstance(key, HashedKey):
        key = key.inner
    if isinstance(key, tuple):  # (packed tokens, identity)
        key = key[0]
    if not isinstance(key, bytes):
        raise TypeError(f"not a block key: {key!r}")
    return key


def key_extra(key: Hashable) -> Hashable:
    """The extra identity inside a key built by `block_key` (None for a plain block)."""
    if isinstance(key, HashedKey):
        key = key.inner
    return key[1] if isinstance(key, tuple) else None


def key_tokens(key: Hashable) -> tuple[int, ...]:
    """The token ids inside a key built by `block_key` (`()` for a root's `None`)."""
    return unpack_tokens(key_packed(key))


def joined_tokens(packed: Sequence[bytes], block_size: int) -> PackedTokens | tuple[int, ...]:
    """The token ids of several packed full blocks (`block_size` ids each), in order.

    A `PackedTokens` over the joined bytes when every block is packed as
    uint32 (the usual case: no int is made); else a tuple.
    """
    try:
        joined = b"".join(packed)
    except TypeError:
        raise TypeError("joined_tokens takes packed block keys (bytes)") from None
    if len(joined) == 4 * block_size * len(packed):  # a uint64 block is 8 * size + 1 bytes
        return PackedTokens(joined)
    return tuple(t for p in packed for t in unpack_tokens(p))


class PackedTokens(abc.Sequence[int]):
    """Token ids held as native uint32 bytes, read as an immutable sequence of ints.

    What `BlockStored.token_ids` carries for blocks whose ids fit in 32 bits:
    the commit joins the blocks' key bytes instead of making one `int` per
    token, and `cache.kv_events` writes them to the wire straight from the
    bytes. It compares equal to a tuple (or another `PackedTokens`) with the
    same ids and hashes like that tuple, so it can stand where a tuple did.
    """

    __slots__ = ("packed",)

    def __init__(self, packed: bytes) -> None:
        if len(packed) % 4:
            raise ValueError(
                f"packed uint32 token ids need a multiple of 4 bytes, got {len(packed)}"
            )
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed) >> 2

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        ids = array(U32, self.packed)
        if isinstance(index, slice):
            return tuple(ids[index])
        return ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(array(U32, self.packed))

    def tolist(self) -> list[int]:
        """The ids as a list, in one C pass."""
        return array(U32, self.packed).tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedTokens):
            return self.packed == other.packed
        if isinstance(other, tuple):
            return tuple(self.tolist()) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.tolist()))

    def __repr__(self) -> str:
        return f"PackedTokens({tuple(self.tolist())!r})"


def request_keys(
    tokens: array[int],
    extra: tuple[Hashable, ...] | None,
    block_size: int,
    key_hash: KeyHash | None,
    start: int,
    stop: int,
) -> list[Hashable]:
    """Keys of blocks `start .. stop-1` of a request, built once and carried
    from `match` to `commit` (the keys are also what attached nodes keep).

    `tokens` is the validated array `cache.validation.token_list` returns.
    """
    size = block_size
    count = stop - start
    if count <= 0:
        return []
    span = tokens[start * size : stop * size]
    if span.typecode == U32:  # the usual case: the array's bytes are the keys
        buf = span.tobytes()
        width = 4 * size
        packed = [buf[at : at + width] for at in range(0, len(buf), width)]
    else:  # some id needs 64 bits: each block packs by its own ids
        packed = [pack_tokens(span[j * size : (j + 1) * size]) for j in range(count)]
    if extra is None and key_hash is None:
        return packed  # type: ignore[return-value]
    return [block_key(p, block_identity(extra, start + j), key_hash) for j, p in enumerate(packed)]


class HashedKey:
    """A block key with an injected hash (testing hook `CacheConfig.key_hash`).

    Equality is exact on the wrapped key, so collisions only narrow.
    """

    __slots__ = ("_hash", "inner")

    def __init__(self, inner: Hashable, hash_value: int) -> None:
        self.inner = inner
        self._hash = hash_value

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashedKey) and self.inner == other.inner
