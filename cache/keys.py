"""Block keys and block identities: the one place the cache builds them.

A block's *identity* is its token ids plus its extra identity (multimodal
hash, ...) ([R5]). Its *key* is what a parent's `children` dict is keyed by:
the token tuple alone when the block has no extra identity, else
`(tokens, extra)`; wrapped in `HashedKey` when a test injects a hash
(`CacheConfig.key_hash`). Python's dict hash narrows and `==` decides, so a
hash collision can never produce a wrong hit.

The reference model (`spec.model`) builds its own keys on purpose: the
differential test is only worth something if the two sides share no code.
"""

from __future__ import annotations

from collections.abc import Hashable

from cache.config import KeyHash
from cache.node import HashedKey


def block_identity(extra: tuple[Hashable, ...] | None, index: int) -> Hashable:
    """The extra identity of block `index`: `extra[index]`, None past its end ([R5])."""
    return extra[index] if extra is not None and index < len(extra) else None


def block_key(tokens: tuple[int, ...], identity: Hashable, key_hash: KeyHash | None) -> Hashable:
    """The children-dict key of a block with these tokens and extra identity."""
    key: Hashable = tokens if identity is None else (tokens, identity)
    if key_hash is not None:
        key = HashedKey(key, key_hash(key))
    return key


def key_tokens(key: Hashable) -> tuple[int, ...]:
    """The token tuple inside a key built by `block_key`."""
    if isinstance(key, HashedKey):
        key = key.inner
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], tuple):
        # (tokens, identity); a plain token tuple never has a tuple element.
        return key[0]
    return key  # type: ignore[return-value]


def request_keys(
    tokens: list[int],
    extra: tuple[Hashable, ...] | None,
    block_size: int,
    key_hash: KeyHash | None,
    start: int,
    stop: int,
) -> list[Hashable]:
    """Keys of blocks `start .. stop-1` of a request, built once and carried
    from `match` to `commit` (the keys are also what attached nodes keep)."""
    size = block_size
    if extra is None and key_hash is None:
        return [tuple(tokens[i * size : (i + 1) * size]) for i in range(start, stop)]
    return [
        block_key(tuple(tokens[i * size : (i + 1) * size]), block_identity(extra, i), key_hash)
        for i in range(start, stop)
    ]
