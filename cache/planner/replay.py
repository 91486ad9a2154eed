"""The replay loop: drive a workload through a prefix cache the way an engine does.

For each request, in order:

1. ``seq = cache.match(prompt, namespace)``; SSM: ``restore`` from the hit checkpoint.
   With a host tier (``host_capacity > 0``), a hit that reaches into the host
   (``seq.num_host_tokens``) is loaded first: ``copy = load(seq)``,
   ``copy.wait()``, ``poll()`` (``OutOfBlocks`` is handled as for allocate).
2. ``allocate(seq, len(prompt))``. When the pool is short even after eviction
   (`OutOfBlocks`), the requests still in the concurrency window are released
   and the allocation retried; if it still fails the request is rejected
   (``abort``), counted, and its prompt counts as a miss.
3. Prefill. SSM: at each step the `CheckpointPolicy` chooses, ``commit`` up to
   the step then ``save`` the state there. Then ``commit(seq, len(prompt))``.
4. Decode: ``append`` the output tokens (up to `max_decode_tokens`),
   ``allocate`` and ``commit`` them (as far as the pool allows). SSM with the
   ``decode-end`` policy: ``save`` at the last block boundary decode crossed.
5. The request joins the window of `concurrency` live requests; the oldest is
   ``release``d when the window is full. ``poll()`` runs once per request.

The loop is written against the cache's public API only, so the benchmark can
pass a timing proxy or a baseline trie with the same methods.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cache.planner.policy import KV, CheckpointPolicy
from cache.planner.workload import Request, Workload
from spec.errors import OutOfBlocks

if TYPE_CHECKING:
    import torch

__all__ = [
    "STATE_SHAPES",
    "CacheLike",
    "ReplayResult",
    "make_cache",
    "make_state",
    "replay",
    "run_replay",
]

STATE_SHAPES: dict[str, tuple[int, ...]] = {"ssm": (1,)}
"""Tiny per-slot SSM state for planning: the slot count matters, not the bytes."""


class CacheLike(Protocol):
    """The part of the `BlockTrie` API the replay uses.

    A cache without checkpoints (the benchmark's baseline) has
    ``num_free_checkpoint_slots == 0`` and may raise from `save` / `restore`:
    an attention-only replay (``policy=None``) never calls them; `load` is
    called only by a replay with ``host_capacity > 0``. `stats` needs
    ``evicted_blocks``; the checkpoint counters of `cache.CacheStats` are read
    when present.
    """

    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_free_checkpoint_slots(self) -> int: ...
    @property
    def stats(self) -> Any: ...

    def match(self, tokens: list[int], namespace: str = "") -> Any: ...
    def append(self, seq: Any, tokens: list[int]) -> None: ...
    def allocate(self, seq: Any, num_tokens: int) -> None: ...
    def commit(self, seq: Any, num_tokens: int) -> None: ...
    def release(self, seq: Any) -> None: ...
    def abort(self, seq: Any) -> None: ...
    def poll(self) -> int: ...
    def load(self, seq: Any) -> Any: ...
    def save(self, seq: Any, num_tokens: int, runtime_state: Mapping[str, torch.Tensor]) -> Any: ...
    def restore(self, seq: Any, runtime_state: Mapping[str, torch.Tensor] | None) -> Any: ...


def allocate_what_fits(cache: CacheLike, seq: Any, want: int, block_size: int) -> int:
    """Grow `seq`'s block table toward `want` tokens one block at a time, as far
    as the pool allows; returns the tokens it covers (at most `want`)."""
    n = len(seq.block_ids) * block_size
    while n < want:
        n = min(n + block_size, want)
        try:
            cache.allocate(seq, n)
        except OutOfBlocks:
            break
    return min(want, len(seq.block_ids) * block_size)


@dataclass
class ReplayResult:
    """What one replay measured. `to_dict` is the --json form."""

    workload: str
    block_size: int
    capacity: int
    state_slots: int
    policy: str  # "kv" for attention-only, else the checkpoint policy
    concurrency: int
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    decode_tokens: int = 0
    evicted_blocks: int = 0
    evicted_checkpoints: int = 0
    checkpoint_hits: int = 0
    checkpoints_saved: int = 0
    checkpoints_skipped: int = 0
    peak_pins: int = 0
    peak_pinned_blocks: int = 0
    """Most distinct KV blocks held by live requests at once (not evictable)."""
    peak_cached_blocks: int = 0
    peak_used_blocks: int = 0
    host_capacity: int = 0
    """Host-tier blocks (0: no host tier)."""
    host_hit_tokens: int = 0
    """The part of `hit_tokens` loaded from the host tier (`CacheStats.host_hit_tokens`)."""
    loaded_blocks: int = 0
    stored_blocks: int = 0
    host_evicted_blocks: int = 0
    blocks: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_tokens(self) -> int:
        """Hit tokens already on the device at match time."""
        return self.hit_tokens - self.host_hit_tokens

    @property
    def device_hit_rate(self) -> float:
        return self.device_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_saved(self) -> int:
        """Prompt tokens served from cache instead of recomputed."""
        return self.hit_tokens

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.decode_tokens) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def us_per_block(self) -> float:
        """Replay wall time per block of prompt and decode (a cost per block)."""
        return self.wall_s * 1e6 / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        extra = out.pop("extra")
        out.update(
            hit_rate=self.hit_rate,
            tokens_saved=self.tokens_saved,
            requests_per_s=self.requests_per_s,
            tokens_per_s=self.tokens_per_s,
            us_per_block=self.us_per_block,
        )
        out.update(extra)
        return out


def make_cache(block_size: int, capacity: int, state_slots: int = 0, host_capacity: int = 0) -> Any:
    """An ids-only `BlockTrie` for planning: no KV storage, tiny state, no events;
    `host_capacity` host-tier blocks (0: none). Its copies move no data: on the CPU
    they finish when queued."""
    from cache import BlockTrie, CacheConfig

    config = CacheConfig(
        block_size=block_size,
        num_blocks=capacity,
        kv_block_shape=None,
        num_checkpoint_slots=state_slots,
        state_shapes=STATE_SHAPES if state_slots else {},
        enable_events=False,
        num_host_blocks=host_capacity,
    )
    return BlockTrie(config)


def make_state(
    state_shapes: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """A runtime state for one sequence: zeros of each named shape (float32 by default)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    return {
        name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in state_shapes.items()
    }


def _stat(stats: Any, name: str) -> int:
    """A counter of `stats`; 0 when this cache does not keep it (the baseline)."""
    value = getattr(stats, name, 0)
    return int(value) if isinstance(value, int) else 0


def replay(
    workload: Iterable[Request],
    cache: CacheLike,
    *,
    block_size: int,
    capacity: int,
    concurrency: int = 32,
    max_decode_tokens: int | None = None,
    policy: CheckpointPolicy | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
    state_slots: int = 0,
    host_capacity: int = 0,
    progress: Callable[[int], None] | None = None,
    name: str = "",
) -> ReplayResult:
    """Replay `workload` through `cache` (see the module docstring).

    `policy` None replays attention-only; otherwise the cache must have
    checkpoint slots and `state` is the runtime state passed to save/restore.
    `host_capacity` > 0 says the cache has that many host-tier blocks: hits in
    the host are loaded before allocation (an SSM trie serves none).
    `progress(n)` is called with the number of requests done, every 64.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    b = block_size
    result = ReplayResult(
        workload=name or getattr(workload, "name", "workload"),
        block_size=b,
        capacity=capacity,
        state_slots=state_slots,
        policy=policy.name if policy is not None else KV,
        concurrency=concurrency,
        host_capacity=host_capacity,
    )
    runtime: Mapping[str, torch.Tensor] = state if state is not None else {}
    save = cache.save
    restore = cache.restore
    window: deque[Any] = deque()
    window_blocks: deque[list[int]] = deque()
    held: dict[int, int] = {}  # block id -> live requests whose block table holds it
    peak_held = peak_cached = peak_used = 0
    requests = rejected = prompt_tokens = hit_tokens = decode_tokens = ckpt_hits = nblocks = 0
    poll = cache.poll
    t0 = time.perf_counter()

    def leave() -> None:
        cache.release(window.popleft())
        for block in window_blocks.popleft():
            left = held[block] - 1
            if left:
                held[block] = left
            else:
                del held[block]

    def release_window() -> None:
        while window:
            leave()

    def allocate(seq: Any, n: int) -> bool:
        try:
            cache.allocate(seq, n)
            return True
        except OutOfBlocks:
            if not window:
                return False
        release_window()
        try:
            cache.allocate(seq, n)
            return True
        except OutOfBlocks:
            return False

    def load(seq: Any) -> bool:
        """Bring the host part of `seq`'s hit onto the device, as `allocate` makes room."""
        try:
            copy = cache.load(seq)
        except OutOfBlocks:
            if not window:
                return False
            release_window()
            try:
                copy = cache.load(seq)
            except OutOfBlocks:
                return False
        if copy is not None:
            copy.wait()
        poll()
        return True

    host = host_capacity > 0
    for req in workload:
        poll()
        if len(window) >= concurrency:
            leave()
        prompt = req.prompt
        plen = len(prompt)
        requests += 1
        prompt_tokens += plen
        seq = cache.match(prompt, req.namespace)
        if host and seq.num_host_tokens and not load(seq):
            cache.abort(seq)
            rejected += 1
            continue
        if not allocate(seq, plen):
            cache.abort(seq)
            rejected += 1
            continue
        hit = seq.num_cached_tokens
        hit_tokens += hit
        if policy is not None:
            if seq.restore is not None:
                ckpt_hits += 1
                restore(seq, runtime)
            plan = policy.plan(plen, hit, seq.branch_step, b, req.branch_steps)
            for step in sorted(plan):
                if not plan[step] and cache.num_free_checkpoint_slots == 0:
                    continue
                cache.commit(seq, step)
                save(seq, step, runtime)
        cache.commit(seq, plen)
        total = plen
        output = list(req.output if max_decode_tokens is None else req.output[:max_decode_tokens])
        if output:
            cache.append(seq, output)
            want = plen + len(output)
            if not allocate(seq, want):
                want = allocate_what_fits(cache, seq, want, b)
            cache.commit(seq, want)
            total = want
            decode_tokens += want - plen
            if policy is not None and policy.decode_end:
                step = (total - 1) // b * b
                if step > plen and step > hit:
                    save(seq, step, runtime)
        nblocks += -(-total // b)
        blocks_here = list(seq.block_ids)
        window.append(seq)
        window_blocks.append(blocks_here)
        for block in blocks_here:
            held[block] = held.get(block, 0) + 1
        if len(held) > peak_held:
            peak_held = len(held)
        free = cache.num_free_blocks
        cached = cache.num_cached_blocks
        if cached > peak_cached:
            peak_cached = cached
        if capacity - free > peak_used:
            peak_used = capacity - free
        if progress is not None and requests % 64 == 0:
            progress(requests)
    release_window()
    poll()
    result.wall_s = time.perf_counter() - t0
    if progress is not None:
        progress(requests)
    stats = cache.stats
    result.requests = requests
    result.rejected = rejected
    result.prompt_tokens = prompt_tokens
    result.hit_tokens = hit_tokens
    result.decode_tokens = decode_tokens
    result.checkpoint_hits = ckpt_hits
    result.blocks = nblocks
    result.evicted_blocks = _stat(stats, "evicted_blocks")
    result.evicted_checkpoints = _stat(stats, "evicted_checkpoints")
    result.checkpoints_saved = _stat(stats, "checkpoints_saved")
    result.checkpoints_skipped = _stat(stats, "checkpoints_skipped")
    result.peak_pins = _stat(stats, "peak_pins")
    result.peak_pinned_blocks = peak_held
    result.peak_cached_blocks = peak_cached
    result.peak_used_blocks = peak_used
    result.host_hit_tokens = _stat(stats, "host_hit_tokens")
    result.loaded_blocks = _stat(stats, "loaded_blocks")
    result.stored_blocks = _stat(stats, "stored_blocks")
    result.host_evicted_blocks = _stat(stats, "host_evicted_blocks")
    return result


def run_replay(
    workload: Workload[Any],
    *,
    block_size: int,
    capacity: int,
    concurrency: int = 32,
    max_decode_tokens: int | None = None,
    policy: CheckpointPolicy | None = None,
    state_slots: int = 0,
    host_capacity: int = 0,
    progress: Callable[[int], None] | None = None,
    check: bool = False,
) -> ReplayResult:
    """Build an ids-only `BlockTrie` of `capacity` blocks (and `state_slots` for SSM,
    `host_capacity` host-tier blocks) and replay."""
    if policy is not None and state_slots < 1:
        raise ValueError("an SSM replay needs at least one state slot")
    slots = state_slots if policy is not None else 0
    cache = make_cache(block_size, capacity, slots, host_capacity)
    result = replay(
        workload,
        cache,
        block_size=block_size,
        capacity=capacity,
        concurrency=concurrency,
        max_decode_tokens=max_decode_tokens,
        policy=policy,
        state=make_state(STATE_SHAPES) if slots else None,
        state_slots=slots,
        host_capacity=host_capacity,
        progress=progress,
        name=workload.name,
    )
    if check:
        cache.check()
    return result
