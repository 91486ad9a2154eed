"""The moves a `Copy` is made of: one tensor `copy_`, or many KV blocks gathered.

A move is anything with `run()` (move the data now, on the current stream),
`tensors()` (the long-lived tensors it reads or writes, for stream bookkeeping)
and `release()` (drop the temporaries its last `run` made).

- `TensorMove(src, dst)`: ``dst.copy_(src, non_blocking=True)``. Checkpoint
  save / restore and the frozen tail use it (one tensor each, nothing to gather).
- `BlockMove(src, src_ids, dst, dst_ids)`: block ``src_ids[i]`` of pool tensor
  `src` into block ``dst_ids[i]`` of `dst` (dim 0 indexes blocks), for every
  `i`, as a few gathered operations instead of one ``copy_`` per block. The
  pairs are taken in destination order and cut into runs of consecutive
  destination blocks:

  - same device: each destination run is one slice ``copy_`` (when its source
    blocks are consecutive too) or one ``index_select(..., out=dst[run])``; more
    than `MAX_RUN_OPS` runs become one ``index_select`` into a temporary plus
    one ``index_copy_`` -- except on the CPU when the runs consecutive on both
    sides average at least `SPLIT_RUN_BYTES`: then one ``copy_`` each, issued in
    one ``torch._foreach_copy_`` (a memcpy per run beats two passes over the
    bytes there);
  - device -> host (a store on CUDA): one ``index_select`` on the device into a
    contiguous temporary (a slice when the source blocks are consecutive), then
    one ``copy_(non_blocking=True)`` per destination run straight into the
    page-locked host pool (usually one; as many as the host blocks' runs);
  - host -> device (a load on CUDA): one ``index_select`` on the CPU into a
    page-locked staging tensor (a slice of the pool when the source blocks are
    consecutive), one ``copy_(non_blocking=True)`` to the device, straight into
    the destination when it is one run, else into a device temporary then one
    ``index_copy_``.

  Every temporary is created on the current stream (the engine's side stream)
  and kept referenced by the move until `release()`, which the engine calls
  only once the copy's event has fired (or it is reaped). The host-side gather
  of a load runs on the CPU when the copy starts: the host blocks it reads
  must hold their data then, which the host tier guarantees (a block is
  loadable only after its store is reaped). Blocks are reinterpreted as 8-byte
  words when their size allows (fewer, wider elements for the index kernels;
  the bytes are copied exactly). Pairs must not repeat a destination block,
  and `src` and `dst` must be different tensors (two pools).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

MAX_RUN_OPS = 4
"""A same-device `BlockMove` does one operation per destination run up to this many
runs; beyond, one gather into a temporary and one scatter."""

SPLIT_RUN_BYTES = 12 * 1024
"""On the CPU, runs (consecutive on both sides) averaging at least this many bytes are
copied one ``copy_`` each (issued together, `_copy_runs`) rather than gathered and
scattered: measured with torch 2.13 on one core over 2,048 scattered blocks, the
gather + scatter costs about 0.4x the batched per-run copies at 2 KiB blocks, 0.75x
at 8 KiB, but 2x at 16 KiB and 3-4x from 32 KiB (two passes over the bytes, and
a temporary that leaves the cache, against one memcpy)."""


class Move(Protocol):
    """One step of a `Copy` (see the module docstring)."""

    def run(self) -> None:
        """Move the data now, on the current stream (asynchronously on CUDA)."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The long-lived tensors it reads or writes (not its temporaries)."""
        ...

    def release(self) -> None:
        """Drop the temporaries of the last `run` (its data has arrived, or never will)."""


class TensorMove(NamedTuple):
    """``dst.copy_(src, non_blocking=True)``: one tensor, nothing to gather. Unpacks as
    ``(src, dst)``."""

    src: torch.Tensor
    dst: torch.Tensor

    def run(self) -> None:
        """Copy `src` into `dst` on the current stream."""
        self.dst.copy_(self.src, non_blocking=True)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(src, dst)``."""
        return (self.src, self.dst)

    def release(self) -> None:
        """Nothing to release: no temporaries."""


class BlockMove:
    """Blocks `src_ids` of `src` into blocks `dst_ids` of `dst`, gathered (module docstring).

    `src` and `dst` are pool tensors ``[num_blocks, *block_shape]`` of the same block
    shape and dtype, on the same or different devices. Raises `ValueError` when the
    id lists differ in length or the pools in block shape or dtype.
    """

    __slots__ = ("_keep", "dst", "dst_ids", "src", "src_ids")

    def __init__(
        self, src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]
    ) -> None:
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"BlockMove: {len(src_ids)} source ids, {len(dst_ids)} destination")
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError(
                f"BlockMove: blocks {tuple(src.shape[1:])} {src.dtype} into "
                f"{tuple(dst.shape[1:])} {dst.dtype}"
            )
        self.src = src
        """The source pool tensor."""
        self.src_ids = src_ids
        """The source blocks, in pair order."""
        self.dst = dst
        """The destination pool tensor."""
        self.dst_ids = dst_ids
        """The destination blocks: ``dst_ids[i]`` receives ``src_ids[i]``."""
        self._keep: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.src_ids)

    def __repr__(self) -> str:
        return f"<BlockMove {len(self)} blocks {self.src.device} -> {self.dst.device}>"

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(src, dst)``: the two pools."""
        return (self.src, self.dst)

    def release(self) -> None:
        """Drop the temporaries (index tensors, gathered blocks, staging) of the last run."""
        self._keep = []

    def run(self) -> None:
        """Move the blocks now, on the current stream (module docstring)."""
        if not self.src_ids:
            return
        src, dst = _words(self.src, self.dst)
        pairs = sorted(zip(self.dst_ids, self.src_ids, strict=True))
        d_ids = [d for d, _ in pairs]
        s_ids = [s for _, s in pairs]
        runs = _runs(d_ids)
        if src.device == dst.device:
            self._same_device(src, s_ids, dst, d_ids, runs)
        elif src.device.type == "cpu":
            self._from_host(src, s_ids, dst, d_ids, runs)
        else:
            self._to_other_device(src, s_ids, dst, d_ids, runs)

    # ------------------------------------------------------------------ paths

    def _index(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """`ids` as an int64 index tensor on `device` (moved without blocking on CUDA)."""
        index = torch.tensor(ids, dtype=torch.int64)
        if device.type == "cpu":
            return index
        if device.type == "cuda":
            index = index.pin_memory()
            self._keep.append(index)
        on_device = index.to(device, non_blocking=True)
        self._keep.append(on_device)
        return on_device

    def _same_device(
        self,
        src: torch.Tensor,
        s_ids: list[int],
        dst: torch.Tensor,
        d_ids: list[int],
        runs: list[tuple[int, int]],
    ) -> None:
        if len(runs) <= MAX_RUN_OPS:
            for pos, length in runs:
                seg = s_ids[pos : pos + length]
                out = dst[d_ids[pos] : d_ids[pos] + length]
                if _is_run(seg):
                    out.copy_(src[seg[0] : seg[0] + length], non_blocking=True)
                else:
                    torch.index_select(src, 0, self._index(seg, src.device), out=out)
            return
        if src.device.type == "cpu":
            common = _common_runs(d_ids, s_ids)
            if len(d_ids) * src[0].nbytes >= SPLIT_RUN_BYTES * len(common):
                _copy_runs(src, s_ids, dst, d_ids, common)
                return
        values = self._gather(src, s_ids)
        dst.index_copy_(0, self._index(d_ids, dst.device), values)

    def _gather(self, src: torch.Tensor, s_ids: list[int]) -> torch.Tensor:
        """The blocks `s_ids` of `src`, in that order, as one contiguous tensor on its
        device (a slice of `src` when they are consecutive)."""
        if _is_run(s_ids):
            return src[s_ids[0] : s_ids[0] + len(s_ids)]
        values = torch.index_select(src, 0, self._index(s_ids, src.device))
        self._keep.append(values)
        return values

    def _to_other_device(
        self,
        src: torch.Tensor,
        s_ids: list[int],
        dst: torch.Tensor,
        d_ids: list[int],
        runs: list[tuple[int, int]],
    ) -> None:
        """Gather on the source device, then one copy per destination run."""
        values = self._gather(src, s_ids)
        for pos, length in runs:
            start = d_ids[pos]
            dst[start : start + length].copy_(values[pos : pos + length], non_blocking=True)

    def _from_host(
        self,
        src: torch.Tensor,
        s_ids: list[int],
        dst: torch.Tensor,
        d_ids: list[int],
        runs: list[tuple[int, int]],
    ) -> None:
        """Gather on the CPU into page-locked staging, one copy to the device, scatter."""
        n = len(s_ids)
        if _is_run(s_ids):
            staging = src[s_ids[0] : s_ids[0] + n]
        else:
            staging = torch.empty(
                (n, *src.shape[1:]), dtype=src.dtype, pin_memory=dst.device.type == "cuda"
            )
            self._keep.append(staging)
            torch.index_select(src, 0, torch.tensor(s_ids, dtype=torch.int64), out=staging)
        if len(runs) == 1:
            dst[d_ids[0] : d_ids[0] + n].copy_(staging, non_blocking=True)
            return
        values = torch.empty(staging.shape, dtype=staging.dtype, device=dst.device)
        self._keep.append(values)
        values.copy_(staging, non_blocking=True)
        dst.index_copy_(0, self._index(d_ids, dst.device), values)


def block_moves(
    src: torch.Tensor | None, src_ids: list[int], dst: torch.Tensor | None, dst_ids: list[int]
) -> list[Move]:
    """The moves of a copy of blocks `src_ids` of pool tensor `src` into `dst_ids` of
    `dst`: one `BlockMove`, or none for ids-only pools (either tensor None) or no
    blocks."""
    if src is None or dst is None or not src_ids:
        return []
    return [BlockMove(src, src_ids, dst, dst_ids)]


def _copy_runs(
    src: torch.Tensor,
    s_ids: list[int],
    dst: torch.Tensor,
    d_ids: list[int],
    runs: list[tuple[int, int]],
) -> None:
    """One ``copy_`` per run (consecutive on both sides), all issued by one
    ``torch._foreach_copy_`` call where torch has it (one dispatch instead of one
    per run: about 1.5 microseconds a run less), else one by one. A run of one
    block is taken by index, not sliced (a cheaper view)."""
    dst_views: list[torch.Tensor] = []
    src_views: list[torch.Tensor] = []
    for pos, length in runs:
        d, s = d_ids[pos], s_ids[pos]
        if length == 1:
            dst_views.append(dst[d])
            src_views.append(src[s])
        else:
            dst_views.append(dst[d : d + length])
            src_views.append(src[s : s + length])
    if _FOREACH_COPY is not None:
        _FOREACH_COPY(dst_views, src_views)
        return
    for out, values in zip(dst_views, src_views, strict=True):  # pragma: no cover (torch < 2.1)
        out.copy_(values)


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)
"""torch's batched ``copy_`` over lists of tensor pairs (torch >= 2.1), or None."""


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids (each one more than the last), as (position,
    length); `ids` non-empty."""
    runs: list[tuple[int, int]] = []
    start = 0
    prev = ids[0]
    for i in range(1, len(ids)):
        cur = ids[i]
        if cur != prev + 1:
            runs.append((start, i - start))
            start = i
        prev = cur
    runs.append((start, len(ids) - start))
    return runs


def _common_runs(d_ids: list[int], s_ids: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of pairs consecutive on both sides, as (position, length)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(d_ids)):
        if d_ids[i] != d_ids[i - 1] + 1 or s_ids[i] != s_ids[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    runs.append((start, len(d_ids) - start))
    return runs


def _is_run(ids: list[int]) -> bool:
    """Whether `ids` (non-empty) are consecutive ascending."""
    first = ids[0]
    return ids[-1] - first == len(ids) - 1 and ids == list(range(first, first + len(ids)))


def _words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`src` and `dst` as ``[num_blocks, words]`` int64 views when both allow it (contiguous,
    8-byte aligned, a block a whole number of words), else as ``[num_blocks, elements]``
    views when contiguous, else unchanged. Same bytes, fewer and wider elements."""
    if not (src.is_contiguous() and dst.is_contiguous()) or src.dim() == 0:
        return src, dst
    src2, dst2 = src.view(src.shape[0], -1), dst.view(dst.shape[0], -1)
    size = src.element_size()
    row = src2.shape[1] * size
    if (
        size < 8
        and row % 8 == 0
        and (src.storage_offset() * size) % 8 == 0
        and (dst.storage_offset() * size) % 8 == 0
        and not src.is_complex()
        and src.dtype != torch.bool
    ):
        try:
            return src2.view(torch.int64), dst2.view(torch.int64)
        except RuntimeError:  # a layout the reinterpreting view refuses
            pass
    return src2, dst2
