"""Contract details of `cache.state_pool.CheckpointSlotPool` (mutation survivors).

`check_runtime` validates any runtime state when states are configured (None
only passes with none configured), accepts a stride-0 dimension of size 1 (no
overlap), and its errors, like `take`'s, say what is wrong.
"""

from __future__ import annotations

import re

import pytest
import torch

from cache.faults import Faults
from cache.state_pool import CheckpointSlotPool
from spec.errors import (
    AllocationFailed,
    CacheError,
    InvalidArgument,
    InvalidType,
    OutOfStateSlots,
)


def _pool(shapes: dict[str, tuple[int, ...]], slots: int = 2) -> CheckpointSlotPool:
    return CheckpointSlotPool(slots, shapes, torch.float32, torch.device("cpu"), Faults())


def test_none_passes_only_when_no_state_is_configured() -> None:
    assert _pool({}).check_runtime(None) == {}
    with pytest.raises(
        InvalidType, match=r"^runtime_state must map state name -> tensor, got NoneType$"
    ):
        _pool({"ssm": (3,)}).check_runtime(None)
    with pytest.raises(InvalidType, match=r"got list$"):
        _pool({"ssm": (3,)}).check_runtime([])


def test_an_unconfigured_name_is_refused_even_with_no_states() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown \['ssm'\]"):
        _pool({}).check_runtime({"ssm": torch.zeros(3)})


def test_a_stride_zero_dimension_of_size_one_is_not_an_overlap() -> None:
    tensor = torch.zeros(3).as_strided((1, 3), (0, 1))
    out = _pool({"ssm": (1, 3)}).check_runtime({"ssm": tensor}, written=True)
    assert out["ssm"] is tensor


def test_an_expanded_view_is_refused_for_a_restore_with_its_reason() -> None:
    message = (
        "runtime_state['ssm'] has overlapping memory (an expand()ed view); "
        "a restore cannot write into it"
    )
    tensor = torch.zeros(1, 3).expand(2, 3)
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
        _pool({"ssm": (2, 3)}).check_runtime({"ssm": tensor}, written=True)
    assert _pool({"ssm": (2, 3)}).check_runtime({"ssm": tensor})["ssm"] is tensor


def test_take_from_an_exhausted_pool_names_its_capacity() -> None:
    pool = _pool({"ssm": (3,)}, slots=2)
    pool.take()
    pool.take()
    with pytest.raises(OutOfStateSlots, match=r"^checkpoint pool: all 2 slots are held$"):
        pool.take()


def test_the_pool_holds_one_tensor_per_state_in_the_configured_dtype_and_device() -> None:
    pool = CheckpointSlotPool(
        2, {"conv": (2, 3), "ssm": (4,)}, torch.float64, torch.device("meta"), Faults()
    )
    assert {n: (t.shape, t.dtype, t.device.type) for n, t in pool.tensors.items()} == {
        "conv": ((2, 2, 3), torch.float64, "meta"),
        "ssm": ((2, 4), torch.float64, "meta"),
    }
    assert (
        CheckpointSlotPool(0, {"ssm": (4,)}, torch.float64, torch.device("cpu"), Faults()).tensors
        == {}
    )


def test_giving_back_a_slot_never_taken_is_a_double_release() -> None:
    pool = _pool({"ssm": (3,)}, slots=2)
    with pytest.raises(
        CacheError, match=r"^checkpoint pool: slot 1 is already free \(double release\)$"
    ):
        pool.give(1)
    assert pool.free_ids() == [1, 0]


def test_each_pool_takes_at_its_own_fault_point() -> None:
    """The device pool's takes are `slots.take`, a host checkpoint pool's `host_slots.take`:
    a fault armed for a host take fails that take only, naming its point, taking nothing."""
    faults = Faults()
    shapes = {"ssm": (3,)}
    device = CheckpointSlotPool(2, shapes, torch.float32, torch.device("cpu"), faults)
    host = CheckpointSlotPool(
        2, shapes, torch.float32, torch.device("cpu"), faults, name="host checkpoint pool"
    )
    assert (device.take(), host.take()) == (0, 0)
    assert faults.points == ["slots.take", "host_slots.take"]
    faults.arm(after=1)
    assert device.take() == 1
    with pytest.raises(
        AllocationFailed, match=r"^injected allocation failure at host_slots\.take$"
    ):
        host.take()
    assert host.free_ids() == [1] and faults.points[-2:] == ["slots.take", "host_slots.take"]
    assert host.take() == 1


def test_a_meta_tensor_is_refused_with_its_reason() -> None:
    message = "runtime_state['ssm'] is on the meta device (no data)"
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
        _pool({"ssm": (3,)}).check_runtime({"ssm": torch.zeros(3, device="meta")})


def test_a_sparse_tensor_is_refused_with_its_layout() -> None:
    message = "runtime_state['ssm'] must be a dense (strided) tensor, got layout torch.sparse_coo"
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
        _pool({"ssm": (3,)}).check_runtime({"ssm": torch.zeros(3).to_sparse()})


def test_a_state_that_requires_grad_is_refused_only_for_a_restore() -> None:
    """A save reads a state that requires grad as plain data; a restore cannot write it."""
    tensor = torch.zeros(3, requires_grad=True)
    assert _pool({"ssm": (3,)}).check_runtime({"ssm": tensor})["ssm"] is tensor
    message = "runtime_state['ssm'] requires grad; a restore cannot write into it"
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
        _pool({"ssm": (3,)}).check_runtime({"ssm": tensor}, written=True)
