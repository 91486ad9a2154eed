"""KV block pools: storage, reference counts and the free list (device and host tiers)."""

from __future__ import annotations

from array import array
from types import ModuleType

import torch

from cache.faults import Faults
from cache.node import NO_BLOCK
from spec.errors import CacheError, OutOfBlocks


class KVBlockPool:
    """Owns `num_blocks` KV blocks: a tensor `[num_blocks, *shape]` (or ids only).

    Contract: a block is free iff its reference count is 0, and then it is in
    the free list exactly once. `take` hands out blocks with count 1;
    `incref`/`decref` move counts; a decref to 0 returns the block to the free
    list. Driving a count below zero, or referencing a free block, raises
    `CacheError` and changes nothing; so does `NO_BLOCK` (-1), which reads as a
    free block (the error names it as no block). Other ids outside
    `0 .. num_blocks - 1` are the caller's bug (the trie only passes ids it was
    handed).

    The same class is the host tier's pool (`name="host tier"`, on the CPU, in
    page-locked memory when the device is CUDA so copies can be asynchronous).
    """

    __slots__ = (
        "_fault_point",
        "_faults",
        "_free",
        "capacity",
        "name",
        "native",
        "refs",
        "tensor",
    )

    def __init__(
        self,
        num_blocks: int,
        shape: tuple[int, ...] | None,
        dtype: torch.dtype,
        device: torch.device,
        faults: Faults,
        *,
        name: str = "KV",
        pin_memory: bool = False,
    ) -> None:
        self.capacity = num_blocks
        self.name = name
        """"KV" for the device pool, "host tier" for the host tier (errors name it)."""
        self.tensor: torch.Tensor | None = (
            None
            if shape is None or num_blocks == 0
            else torch.zeros(
                (num_blocks, *shape), dtype=dtype, device=device, pin_memory=pin_memory
            )
        )
        self._fault_point = "kv.take" if name == "KV" else "host.take"
        # Counts are small ints (shared objects): a list, read and written on every
        # hot path, costs 8 bytes a block and is faster than an `array`. One entry
        # more than there are blocks: a guard that stays 0, which is what `refs[-1]`
        # reads, so `NO_BLOCK` (-1) given by mistake is refused as a free block
        # instead of counting on the last block (at no cost to the hot paths).
        self.refs: list[int] = [0] * (num_blocks + 1)
        # A stack: the lowest ids are handed out first on a fresh pool. Machine ints
        # (4 bytes a block, no `int` object per free block).
        self._free = array("i", range(num_blocks - 1, -1, -1))
        self._faults = faults
        self.native: ModuleType | None = None
        """The native core (`cache.native`) when the trie runs it: the per-block loops
        of `take`, `incref_all` and `decref_all` are its kernels then."""

    @property
    def num_free(self) -> int:
        """Blocks in the free list."""
        return len(self._free)

    def counts(self) -> list[int]:
        """Each block's reference count, by block id (a copy, without the guard)."""
        return self.refs[: self.capacity]

    def free_ids(self) -> list[int]:
        """The free list (a copy), next to be taken last."""
        return list(self._free)

    def take(self, n: int) -> list[int]:
        """Take `n` free blocks with reference count 1; all or nothing. A negative `n`
        is the caller's bug: `ValueError`, before the allocation point is reached."""
        if n < 0:
            raise ValueError(f"{self.name} pool: cannot take {n} blocks")
        self._faults.check(self._fault_point)
        if n > len(self._free):
            raise OutOfBlocks(f"{self.name} pool: {n} blocks wanted, {len(self._free)} free")
        free = self._free
        if self.native is not None:
            return self.native.take(self.refs, free, n)  # type: ignore[no-any-return]
        taken = free[len(free) - n :].tolist()
        del free[len(free) - n :]
        taken.reverse()
        refs = self.refs
        for b in taken:
            refs[b] = 1
        return taken

    def incref(self, block: int) -> None:
        """Add one reference to a block that is in use."""
        if self.refs[block] <= 0:
            raise CacheError(self._refusal(block, "is free; cannot take a reference to it"))
        self.refs[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; returns True when the block became free."""
        count = self.refs[block]
        if count <= 0:
            raise CacheError(self._refusal(block, "is already free (double free)"))
        count -= 1
        self.refs[block] = count
        if count == 0:
            self._free.append(block)
            return True
        return False

    def incref_all(self, blocks: list[int]) -> None:
        """`incref` each of `blocks`, in one call; all or nothing."""
        refs = self.refs
        if self.native is not None and type(blocks) is list:
            bad = self.native.incref_all(refs, blocks)
            if bad >= 0:
                why = "is free; cannot take a reference to it"
                raise CacheError(self._refusal(blocks[bad], why))
            return
        for i, block in enumerate(blocks):
            if refs[block] <= 0:
                for done in blocks[:i]:
                    refs[done] -= 1
                raise CacheError(self._refusal(block, "is free; cannot take a reference to it"))
            refs[block] += 1

    def decref_all(self, blocks: list[int]) -> None:
        """`decref` each of `blocks`, in one call; all or nothing."""
        refs = self.refs
        if self.native is not None and type(blocks) is list:
            bad = self.native.decref_all(refs, self._free, blocks)
            if bad >= 0:
                raise CacheError(self._refusal(blocks[bad], "is already free (double free)"))
            return
        free = self._free
        for i, block in enumerate(blocks):
            count = refs[block]
            if count <= 0:
                for done in reversed(blocks[:i]):
                    if refs[done] == 0:
                        free.pop()  # it was the last block appended
                    refs[done] += 1
                raise CacheError(self._refusal(block, "is already free (double free)"))
            refs[block] = count - 1
            if count == 1:
                free.append(block)

    def _refusal(self, block: int, why: str) -> str:
        """The message refusing a count operation on `block` (a free one, or
        `NO_BLOCK`, which names no block at all)."""
        if block == NO_BLOCK:
            return f"{self.name} pool: NO_BLOCK (-1) names no block; it has no count to change"
        return f"{self.name} pool: block {block} {why}"

    def view(self, block: int) -> torch.Tensor | None:
        """The storage of one block (None for an ids-only pool)."""
        return None if self.tensor is None else self.tensor[block]
