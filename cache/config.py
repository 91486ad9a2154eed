"""`CacheConfig`: everything a `BlockTrie` is built from, validated once."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from cache.block_hash import SCHEMES
from cache.stats import DEFAULT_STATS_WINDOW
from spec.errors import ConfigError

BACKENDS = ("auto", "native", "python")
"""`CacheConfig.backend` values (`cache.native` resolves them)."""

KeyHash = Callable[[Hashable], int]
"""Hash used to narrow a child lookup; exact key comparison always decides."""

BLOCK_HASH_SCHEMES = SCHEMES
"""`CacheConfig.block_hash` values (`cache.block_hash.SCHEMES`)."""

HOST_WRITE_POLICIES = ("through", "back")
"""`CacheConfig.host_write` values: when blocks are copied to the host tier."""


MAX_POOL_ENTRIES = 2**31 - 1
"""The most KV blocks (or checkpoint slots) one pool may have (ids are int32-sized)."""


def _positive_int(
    name: str, value: object, *, allow_zero: bool = False, limit: int | None = None
) -> int:
    if type(value) is not int:
        raise ConfigError(f"CacheConfig.{name} must be an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"CacheConfig.{name} must be {bound}, got {value}")
    if limit is not None and value > limit:
        raise ConfigError(f"CacheConfig.{name} must be <= {limit}, got {value}")
    return value


def _shape(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(d) is int and d > 0 for d in value):
        raise ConfigError(f"CacheConfig.{name} must be a tuple of positive ints, got {value!r}")
    return tuple(value)


def _caller_stacklevel(warning_frame: FrameType) -> int:
    """`warnings.warn`'s `stacklevel`, for a warning issued from `warning_frame` (a frame
    of this module), that names the code that built the `CacheConfig`: the frame just
    above the outermost of this module's frames on the stack (its `__post_init__` and
    the dataclass `__init__`, which runs in this module's globals), however many
    wrapper frames sit between them or around this function."""
    frame: FrameType | None = warning_frame  # stacklevel 1
    level = outermost_own = 1
    while frame is not None:
        if frame.f_globals.get("__name__") == __name__:
            outermost_own = level
        frame = frame.f_back
        level += 1
    return outermost_own + 1


class HostTierUnusedWarning(UserWarning):
    """A `CacheConfig` with a KV host tier (`num_host_blocks` > 0) and SSM checkpoints:
    the host tier is written through but never read. An SSM hit ends at a
    checkpoint on a device-resident block, and offloading a block drops its
    checkpoint from both tiers, so no hit reaches host-resident KV (docs/host-tier.md,
    "What is not there yet"). The configuration is still valid and consistent."""


@dataclass(frozen=True)
class CacheConfig:
    """Sizes, layouts and devices of a `BlockTrie` (the contract page, "Public API").

    Frozen; validated once when constructed: a field that breaks its rule raises
    `ConfigError` (a `ValueError`) naming the field, and no config is made.

    - `block_size`: tokens per KV block (an int > 0); only full blocks enter the trie.
    - `num_blocks`: KV blocks in the pool (an int > 0).
    - `kv_block_shape`: per-block storage shape (a tuple of ints > 0), or None for
      an ids-only pool.
    - `kv_dtype`: the KV pool's `torch.dtype` (default float16).
    - `num_checkpoint_slots`: SSM checkpoint slots (an int >= 0); 0 for
      attention-only models (then `ssm` is False and `save` / `restore` / `pin`
      raise `CheckpointError`).
    - `state_shapes`: per named SSM state (a non-empty str), the shape of one
      sequence's state (a tuple of ints > 0). Empty with slots > 0 gives an
      ids-only state pool (capacity planning).
    - `state_dtype`: the checkpoint pool's `torch.dtype` (default float32); runtime
      state of another dtype is converted by the copies.
    - `state_dtypes`: per named state, its own `torch.dtype` (default: none listed),
      for hybrids that keep conv state in the model dtype and the recurrent state
      in float32 (`{"conv": torch.bfloat16, "ssm": torch.float32}`); a state not
      listed is stored as `state_dtype`. Each name must be one of `state_shapes`.
      `state_dtype_of(name)` reads the result.
    - `device`: where the pools live ("cpu", "cuda", "cuda:1", a torch.device).
    - `enable_events` (a bool, default False, as in vLLM): emit BlockStored /
      BlockRemoved / AllBlocksCleared (and checkpoint events in their own group).
      They accumulate until `BlockTrie.drain_events()`; hand them to a
      `cache.kv_publisher.KVEventPublisher` once per scheduler step.
    - `hash_seed` (an int in [0, 2**64)) and `block_hash` ("xxh3", the default,
      or "vllm"): the stable chained block hash events carry
      (`cache.block_hash`; needs the `events` extra when events are on).
    - `num_host_blocks`: KV blocks in the host tier (an int >= 0, default 0: no
      host tier). With a host tier, committed blocks are copied to host memory
      and device eviction keeps them there, so a later `match` can `load` them
      back instead of recomputing (docs/host-tier.md). With SSM checkpoints too
      it warns (`HostTierUnusedWarning`): no SSM hit reaches host-resident KV.
    - `host_write`: when blocks are copied to the host tier: "through" (the
      default: each block as it is committed) or "back" (only when device
      eviction picks it; its device block is freed once the copy finished).
    - `num_host_checkpoint_slots`: SSM checkpoint slots in host memory (an int >=
      0, default 0; needs `num_checkpoint_slots` > 0). A block-aligned checkpoint
      is copied to a host slot as it is saved; evicting it from its device slot
      then keeps it, host-only, for a later restore straight from the host
      ([R53]-[R56], docs/host-tier.md).
    - `stats_window`: how many requests (matches) `stats.recent_hit_rate` looks
      back over (an int > 0, default 1000 as vLLM's `CachingMetrics`; [R69]).
    - `backend`: which core runs the trie: "auto" (the default: the native core
      when its extension imports, else the Python core, with one
      `NativeUnavailableWarning`), "native" (`ConfigError` when unavailable) or
      "python". The environment variable `BLOCKTRIE_BACKEND` overrides it;
      `BlockTrie.backend` says which runs (`cache.native`). Both behave alike.
    - `key_hash`: testing hook; replaces the hash of every block key (a
      degenerate one makes every lookup collide; results must not change).

    Limits: `num_blocks`, `num_host_blocks` and both checkpoint slot counts at most
    `MAX_POOL_ENTRIES`;
    a CUDA device must exist when asked for.
    """

    block_size: int
    num_blocks: int
    kv_block_shape: tuple[int, ...] | None = None
    kv_dtype: torch.dtype = torch.float16
    num_checkpoint_slots: int = 0
    state_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    state_dtype: torch.dtype = torch.float32
    state_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    device: str | torch.device = "cpu"
    enable_events: bool = False
    key_hash: KeyHash | None = None
    hash_seed: int = 0
    block_hash: str = "xxh3"
    num_host_blocks: int = 0
    host_write: str = "through"
    num_host_checkpoint_slots: int = 0
    stats_window: int = DEFAULT_STATS_WINDOW
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"CacheConfig.backend must be one of {BACKENDS}, got {self.backend!r}"
            )
        _positive_int("block_size", self.block_size)
        _positive_int("num_blocks", self.num_blocks, limit=MAX_POOL_ENTRIES)
        _positive_int(
            "num_checkpoint_slots",
            self.num_checkpoint_slots,
            allow_zero=True,
            limit=MAX_POOL_ENTRIES,
        )
        _positive_int(
            "num_host_blocks", self.num_host_blocks, allow_zero=True, limit=MAX_POOL_ENTRIES
        )
        _positive_int(
            "num_host_checkpoint_slots",
            self.num_host_checkpoint_slots,
            allow_zero=True,
            limit=MAX_POOL_ENTRIES,
        )
        _positive_int("stats_window", self.stats_window)
        if self.num_host_checkpoint_slots > 0 and self.num_checkpoint_slots == 0:
            raise ConfigError(
                "CacheConfig.num_host_checkpoint_slots needs num_checkpoint_slots > 0: host "
                "checkpoints are stored from device checkpoints"
            )
        if self.host_write not in HOST_WRITE_POLICIES:
            raise ConfigError(
                f"CacheConfig.host_write must be one of {HOST_WRITE_POLICIES}, "
                f"got {self.host_write!r}"
            )
        if self.host_write == "back" and self.num_checkpoint_slots > 0:
            raise ConfigError(
                "CacheConfig.host_write='back' needs num_checkpoint_slots=0: a checkpoint's "
                "frozen tail needs a block at once, and write-back frees blocks only when "
                "their stores finish (use 'through' with SSM checkpoints)"
            )
        if self.kv_block_shape is not None:
            object.__setattr__(
                self, "kv_block_shape", _shape("kv_block_shape", self.kv_block_shape)
            )
        if not isinstance(self.state_shapes, Mapping):
            raise ConfigError("CacheConfig.state_shapes must be a mapping of name -> shape")
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in self.state_shapes.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"CacheConfig.state_shapes: state name {name!r} is not a str")
            shapes[name] = _shape(f"state_shapes[{name!r}]", shape)
        object.__setattr__(self, "state_shapes", shapes)
        pools: list[tuple[str, int, tuple[int, ...] | None]] = [
            ("kv_block_shape", self.num_blocks, self.kv_block_shape),
            ("kv_block_shape", self.num_host_blocks, self.kv_block_shape),
        ]
        pools += [(f"state_shapes[{n!r}]", self.num_checkpoint_slots, s) for n, s in shapes.items()]
        pools += [
            (f"state_shapes[{n!r}]", self.num_host_checkpoint_slots, s) for n, s in shapes.items()
        ]
        for field_name, entries, pool_shape in pools:
            if pool_shape is not None and entries * _numel(pool_shape) >= 2**63:
                raise ConfigError(
                    f"CacheConfig.{field_name}: {entries} x {pool_shape} elements do not fit "
                    "in one tensor"
                )
        for name in ("kv_dtype", "state_dtype"):
            if not isinstance(getattr(self, name), torch.dtype):
                raise ConfigError(f"CacheConfig.{name} must be a torch.dtype")
        if not isinstance(self.state_dtypes, Mapping):
            raise ConfigError("CacheConfig.state_dtypes must be a mapping of state name -> dtype")
        dtypes: dict[str, torch.dtype] = {}
        for name, dtype in self.state_dtypes.items():
            if name not in shapes:
                raise ConfigError(
                    f"CacheConfig.state_dtypes names {name!r}, which is not a state of "
                    f"state_shapes {sorted(shapes)}"
                )
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"CacheConfig.state_dtypes[{name!r}] must be a torch.dtype")
            dtypes[name] = dtype
        object.__setattr__(self, "state_dtypes", dtypes)
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"CacheConfig.device {self.device!r} is not a device: {exc}"
            ) from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"CacheConfig.device {self.device!r}: CUDA is not available")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ConfigError(
                    f"CacheConfig.device {self.device!r}: only "
                    f"{torch.cuda.device_count()} CUDA device(s)"
                )
        if self.key_hash is not None and not callable(self.key_hash):
            raise ConfigError("CacheConfig.key_hash must be callable or None")
        if type(self.enable_events) is not bool:
            raise ConfigError(
                f"CacheConfig.enable_events must be a bool, got {self.enable_events!r}"
            )
        if type(self.hash_seed) is not int or not 0 <= self.hash_seed < 2**64:
            raise ConfigError(
                f"CacheConfig.hash_seed must be an int in [0, 2**64), got {self.hash_seed!r}"
            )
        if self.block_hash not in BLOCK_HASH_SCHEMES:
            raise ConfigError(
                f"CacheConfig.block_hash must be one of {BLOCK_HASH_SCHEMES}, "
                f"got {self.block_hash!r}"
            )
        if self.num_host_blocks > 0 and self.num_checkpoint_slots > 0:
            warnings.warn(
                "CacheConfig: num_host_blocks > 0 with SSM checkpoints "
                "(num_checkpoint_slots > 0) stores KV to the host but never serves it: an SSM "
                "hit ends at a checkpoint, and a block offloaded to the host loses its "
                "checkpoint. Set num_host_blocks=0; num_host_checkpoint_slots keeps "
                "checkpoints in host memory",
                HostTierUnusedWarning,
                stacklevel=_caller_stacklevel(sys._getframe()),
            )

    @property
    def host_tier(self) -> bool:
        """Whether evicted KV blocks are kept in a host-memory tier."""
        return self.num_host_blocks > 0

    @property
    def host_checkpoints(self) -> bool:
        """Whether SSM checkpoints are also kept in a host-memory tier ([R53])."""
        return self.num_host_checkpoint_slots > 0

    @property
    def ssm(self) -> bool:
        """Whether SSM checkpoints are enabled."""
        return self.num_checkpoint_slots > 0

    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block (0 for an ids-only pool)."""
        if self.kv_block_shape is None:
            return 0
        return _numel(self.kv_block_shape) * _itemsize(self.kv_dtype)

    def state_dtype_of(self, name: str) -> torch.dtype:
        """The dtype state `name`'s checkpoints are stored in: its `state_dtypes`
        entry, else `state_dtype`."""
        return self.state_dtypes.get(name, self.state_dtype)

    def state_bytes_per_slot(self) -> int:
        """Bytes of one checkpoint slot across all named states, each in its dtype."""
        return sum(
            _numel(shape) * _itemsize(self.state_dtype_of(name))
            for name, shape in self.state_shapes.items()
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: Any) -> int:
    return int(torch.empty((), dtype=dtype).element_size())
