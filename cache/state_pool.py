"""The checkpoint state pool: one tensor per named SSM state, one row per slot."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from cache.faults import Faults
from spec.errors import CacheError, InvalidArgument, InvalidType, OutOfStateSlots


class CheckpointSlotPool:
    """Owns `num_slots` checkpoint slots: per state name a `[num_slots, *shape]` tensor.

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
        "shapes",
        "tensors",
    )

    def __init__(
        self,
        num_slots: int,
        shapes: Mapping[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        faults: Faults,
        *,
        name: str = "checkpoint pool",
        pin_memory: bool = False,
    ) -> None:
        self.capacity = num_slots
        self.shapes = dict(shapes)
        self.name = name
        self._fault_point = "slots.take" if name == "checkpoint pool" else "host_slots.take"
        self.tensors: dict[str, torch.Tensor] = (
            {
                name: torch.zeros(
                    (num_slots, *shape), dtype=dtype, device=device, pin_memory=pin_memory
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
        may differ from the pool's: copies convert). Tensors a restore writes
        (`written`) must not require grad nor overlap themselves (an
        `expand()`ed view). With no configured states, None or {} is accepted.
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
            out[name] = tensor
        return out
