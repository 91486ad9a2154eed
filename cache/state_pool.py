"""The checkpoint state pool: one tensor per named SSM state, one row per slot."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from cache.faults import Faults
from spec.errors import CacheError, InvalidArgument, InvalidType, OutOfStateSlots


class StorageSpan(NamedTuple):
    """The bytes `[start, stop)` on `device` of a pool tensor's whole storage, and
    the pool's name (what `check_runtime` says a runtime tensor overlaps)."""

    device: torch.device
    start: int
    stop: int
    name: str


def storage_spans(pools: Iterable[tuple[str, torch.Tensor | None]]) -> list[StorageSpan]:
    """The storage span of each named pool tensor (None, or empty, is skipped)."""
    spans: list[StorageSpan] = []
    for name, tensor in pools:
        if tensor is None or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        spans.append(StorageSpan(tensor.device, start, start + storage.nbytes(), name))
    return spans


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes `[start, stop)` from the first to past the last element of `tensor`
    (its elements lie in there; a strided view may skip some)."""
    if tensor.numel() == 0:
        return (0, 0)
    size = tensor.element_size()
    start = stop = tensor.data_ptr()
    for n, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride >= 0:
            stop += (n - 1) * stride * size
        else:
            start += (n - 1) * stride * size
    return start, stop + size


class CheckpointSlotPool:
    """Owns `num_slots` checkpoint slots: per state name a `[num_slots, *shape]` tensor.

    `dtype`: one `torch.dtype` for every state, or a mapping of state name to
    dtype (`CacheConfig.state_dtype_of`), each tensor in its own.

    `name` labels its errors ("checkpoint pool", "host checkpoint pool");
    `pin_memory` page-locks a host pool that copies to a CUDA device read.

    Contract: a slot is either free (in the free list once) or held by exactly
    one checkpoint. `take` hands out a slot; `give` returns it; giving a free
    slot back raises `CacheError`.
    """

    __slots__ = (
        "_fault_point",
        "_faults",
        "_free",
        "_held",
        "capacity",
        "name",
        "pool_spans",
        "shapes",
        "tensors",
    )

    def __init__(
        self,
        num_slots: int,
        shapes: Mapping[str, tuple[int, ...]],
        dtype: torch.dtype | Mapping[str, torch.dtype],
        device: torch.device,
        faults: Faults,
        *,
        name: str = "checkpoint pool",
        pin_memory: bool = False,
    ) -> None:
        self.capacity = num_slots
        self.shapes = dict(shapes)
        self.pool_spans: list[StorageSpan] = []
        """The storage of every pool of the cache this pool serves (its owner sets
        it): what no runtime tensor may overlap ([R60])."""
        self.name = name
        self._fault_point = "slots.take" if name == "checkpoint pool" else "host_slots.take"
        dtypes = dtype if isinstance(dtype, Mapping) else dict.fromkeys(self.shapes, dtype)
        self.tensors: dict[str, torch.Tensor] = (
            {
                name: torch.zeros(
                    (num_slots, *shape), dtype=dtypes[name], device=device, pin_memory=pin_memory
                )
                for name, shape in self.shapes.items()
            }
            if num_slots
            else {}
        )
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._held = [False] * num_slots
        self._faults = faults

    @property
    def num_free(self) -> int:
        """Slots in the free list."""
        return len(self._free)

    def free_ids(self) -> list[int]:
        """The free list (a copy)."""
        return list(self._free)

    def take(self) -> int:
        """Take one free slot."""
        self._faults.check(self._fault_point)
        if not self._free:
            raise OutOfStateSlots(f"{self.name}: all {self.capacity} slots are held")
        slot = self._free.pop()
        self._held[slot] = True
        return slot

    def give(self, slot: int) -> None:
        """Return a held slot to the free list."""
        if not self._held[slot]:
            raise CacheError(f"{self.name}: slot {slot} is already free (double release)")
        self._held[slot] = False
        self._free.append(slot)

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        """Per state name, the storage of one slot."""
        return {name: t[slot] for name, t in self.tensors.items()}

    def check_runtime(
        self, runtime_state: object, written: bool = False
    ) -> dict[str, torch.Tensor]:
        """Validate an engine's runtime state for one sequence; returns it as a dict.

        It must map exactly the configured state names to tensors of the
        configured shapes, dense (strided), on a real device (dtype and device
        may differ from the pool's: copies convert, but complex and real never
        mix, [R60]: the imaginary part would be dropped). No tensor may
        overlap the storage of one of `pool_spans` (the cache's own pools: a
        runtime view of a checkpoint slot or a KV block would be read or
        overwritten behind its owner's back, [R60]). Tensors a restore writes
        (`written`) must not require grad, nor overlap themselves (an
        `expand()`ed view) or each other ([R60]). With no configured states,
        None or {} is accepted.
        """
        if runtime_state is None and not self.shapes:
            return {}
        if not isinstance(runtime_state, Mapping):
            raise InvalidType(
                f"runtime_state must map state name -> tensor, got {type(runtime_state).__name__}"
            )
        missing = [n for n in self.shapes if n not in runtime_state]
        unknown = [n for n in runtime_state if n not in self.shapes]
        if missing or unknown:
            raise InvalidArgument(
                f"runtime_state names must be {sorted(self.shapes)}; missing {missing}, "
                f"unknown {unknown}"
            )
        out: dict[str, torch.Tensor] = {}
        for name, shape in self.shapes.items():
            tensor = runtime_state[name]
            if not isinstance(tensor, torch.Tensor):
                raise InvalidType(f"runtime_state[{name!r}] must be a torch.Tensor")
            if tuple(tensor.shape) != shape:
                raise InvalidArgument(
                    f"runtime_state[{name!r}] has shape {tuple(tensor.shape)}, expected {shape}"
                )
            if tensor.device.type == "meta":
                raise InvalidArgument(f"runtime_state[{name!r}] is on the meta device (no data)")
            if tensor.layout != torch.strided:
                raise InvalidArgument(
                    f"runtime_state[{name!r}] must be a dense (strided) tensor, "
                    f"got layout {tensor.layout}"
                )
            if written and any(
                stride == 0 and size > 1
                for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
            ):
                raise InvalidArgument(
                    f"runtime_state[{name!r}] has overlapping memory (an expand()ed view); "
                    "a restore cannot write into it"
                )
            if written and tensor.requires_grad:
                raise InvalidArgument(
                    f"runtime_state[{name!r}] requires grad; a restore cannot write into it"
                )
            pool = self.tensors.get(name)
            if pool is not None and tensor.is_complex() != pool.is_complex():  # [R60]
                raise InvalidArgument(
                    f"runtime_state[{name!r}] is {tensor.dtype} and the {self.name} holds "
                    f"{pool.dtype}: complex and real states do not convert (an imaginary "
                    "part would be dropped)"
                )
            out[name] = tensor
        self._check_overlaps(out, written, self.pool_spans)
        return out

    @staticmethod
    def _check_overlaps(
        runtime: dict[str, torch.Tensor], written: bool, pools: Iterable[StorageSpan]
    ) -> None:
        """[R60]: no runtime tensor overlaps a pool's storage, and no two tensors a
        restore writes overlap each other (byte extents, compared per device)."""
        extents = {name: (tensor.device, *_extent(tensor)) for name, tensor in runtime.items()}
        for name, (device, start, stop) in extents.items():
            if start == stop:
                continue
            for span in pools:
                if span.device == device and start < span.stop and span.start < stop:
                    raise InvalidArgument(
                        f"runtime_state[{name!r}] overlaps the storage of the cache's "
                        f"{span.name} (a view of a pool); pass the engine's own tensor"
                    )
        if not written:
            return
        seen: list[tuple[str, torch.device, int, int]] = []
        for name, (device, start, stop) in extents.items():
            for other, o_device, o_start, o_stop in seen:
                if device == o_device and start < o_stop and o_start < stop:
                    raise InvalidArgument(
                        f"runtime_state[{name!r}] and runtime_state[{other!r}] overlap: "
                        "a restore would write one over the other"
                    )
            if start != stop:
                seen.append((name, device, start, stop))
