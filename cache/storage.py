"""The storage a `CacheConfig` sizes, made once when a `BlockTrie` is built.

`allocate_storage` makes the device KV pool and checkpoint slot pool, their
host-tier twins (on the CPU, page-locked when the device is CUDA so that
copies can be asynchronous; empty without a host tier) and the node table.
The pools are made whole up front, so a configuration that does not fit
fails here, as one `ConfigError` naming every pool, and never later inside
an operation. The checkpoint pool is told the storage of every pool, which
no runtime state may overlap ([R60]). What each part holds and its rules
live in its own module (`cache.kv_pool`, `cache.state_pool`, `cache.node`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cache.config import CacheConfig
from cache.faults import Faults
from cache.kv_pool import KVBlockPool
from cache.node import NodeTable
from cache.state_pool import CheckpointSlotPool, storage_spans
from spec.errors import ConfigError

_ROWS_UP_FRONT = 1 << 23
"""A node table this big or smaller is made whole with the trie (about 0.9 GB)."""


class Storage(NamedTuple):
    """A trie's pools and node table, as `allocate_storage` made them."""

    kv: KVBlockPool
    """The device KV pool (`num_blocks`)."""
    slots: CheckpointSlotPool
    """The device checkpoint slot pool (`num_checkpoint_slots`)."""
    host_kv: KVBlockPool
    """The host tier's KV pool (`num_host_blocks`; 0 without a host tier)."""
    host_slots: CheckpointSlotPool
    """The host checkpoint slot pool (`num_host_checkpoint_slots`)."""
    nodes: NodeTable
    """The node table, with a row for every block of both KV pools."""


def allocate_storage(config: CacheConfig, device: torch.device, faults: Faults) -> Storage:
    """The pools and the node table `config` describes, the device ones on `device`;
    each pool's `take` is an allocation point of `faults`. Raises `ConfigError`
    when a pool cannot be allocated."""
    state_dtypes = {name: config.state_dtype_of(name) for name in config.state_shapes}
    try:
        kv = KVBlockPool(config.num_blocks, config.kv_block_shape, config.kv_dtype, device, faults)
        slots = CheckpointSlotPool(
            config.num_checkpoint_slots,
            config.state_shapes,
            state_dtypes,
            device,
            faults,
        )
        host_pool = KVBlockPool(
            config.num_host_blocks,
            config.kv_block_shape,
            config.kv_dtype,
            torch.device("cpu"),
            faults,
            name="host tier",
            pin_memory=config.host_tier and device.type == "cuda",
        )
        host_slots = CheckpointSlotPool(
            config.num_host_checkpoint_slots,
            config.state_shapes,
            state_dtypes,
            torch.device("cpu"),
            faults,
            name="host checkpoint pool",
            pin_memory=config.host_checkpoints and device.type == "cuda",
        )
    except (MemoryError, RuntimeError) as exc:
        raise ConfigError(
            f"cannot allocate the pools of {config.num_blocks} KV blocks "
            f"({config.kv_bytes_per_block()} B each), {config.num_host_blocks} host blocks "
            f"and {config.num_checkpoint_slots} + {config.num_host_checkpoint_slots} "
            "(host) checkpoint slots "
            f"({config.state_bytes_per_slot()} B each) on {device}: {exc}"
        ) from None
    slots.pool_spans = storage_spans(  # what no runtime state may overlap ([R60])
        [
            ("KV pool", kv.tensor),
            *((f"checkpoint pool {n!r}", t) for n, t in slots.tensors.items()),
            ("host tier", host_pool.tensor),
            *((f"host checkpoint pool {n!r}", t) for n, t in host_slots.tensors.items()),
        ]
    )
    # Every node needs a device or a host block, but roots: room for all of them
    # and a few namespaces (the table grows past that). Made up front (as the pools
    # are) up to `_ROWS_UP_FRONT` rows; past that, as needed, so a planner's
    # oversized pool costs what it holds.
    rows = config.num_blocks + config.num_host_blocks + 8
    nodes = NodeTable(
        config.block_size,
        rows,
        initial=rows if rows <= _ROWS_UP_FRONT else _ROWS_UP_FRONT // 8,
        hashes=(
            "none" if not config.enable_events else "u64" if config.block_hash == "xxh3" else "wide"
        ),
        host_tier=config.host_tier,
    )
    return Storage(kv, slots, host_pool, host_slots, nodes)
