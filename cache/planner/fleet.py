"""Multi-replica planning: replay a workload across N replicas behind a router.

Each replica is its own ids-only `cache.BlockTrie` (events on, stable chained
block hashes) at the same capacity. For each request, in order:

1. the fleet's live window holds ``concurrency x N`` requests; when it is
   full, the oldest request in the whole fleet is released (first in, first
   out, whatever replica served it). A replica's *in-flight* count is how
   many of its requests are in that window;
2. the router picks a replica (`Router.choose`), which serves the request as
   `cache.planner.replay` does (match, allocate, commit prompt, decode; when
   its pool is short it releases its own live requests and retries, else
   rejects the request);
3. every replica's events are drained, encoded with
   `cache.kv_events.encode_batch` (vLLM's msgpack ``KVEventBatch``) and
   handed to the router as bytes (`Router.observe`), and to an optional
   callback (``--publish``).

Routers (`ROUTERS`):

- ``round-robin``: replica ``i mod N`` for the i-th request;
- ``least-loaded``: fewest in-flight requests, then fewest assigned, then
  lowest id;
- ``prefix``: the longest prefix of the request's chained block hashes
  (`cache.block_hash`, same scheme and seed as the replicas) found in the
  replica's index, which it builds **only** from the decoded wire bytes
  (`WireIndex`, a msgspec decoder declared from vLLM's published
  ``KVEventBatch`` schema), as llm-d's precise prefix-cache scorer and
  Dynamo's KV router do; ties go to fewest in-flight, then fewest assigned,
  then lowest id. Pure prefix scoring piles every request that shares a
  first block (a system prompt) onto one replica, so `PrefixRouter` takes an
  optional load bound ``max_load`` F (``--prefix-max-load``): a replica is a
  candidate only while its in-flight count plus one is at most
  ``ceil(F x (fleet in-flight + 1) / N)`` (the least-loaded replica always
  is one), the bound of consistent hashing with bounded loads, in the spirit
  of SGLang's cache-aware router.

With one replica the fleet replays exactly as `cache.planner.replay.replay`
does attention-only (the tests check it). Needs the ``events`` extra
(msgspec, xxhash); torch is imported when the replicas are built.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cache.block_hash import BlockHasher, to_wire
from cache.extras import requires_extra
from cache.planner.replay import ReplayResult, allocate_what_fits
from cache.planner.workload import Request, Workload

with requires_extra("events", "cache.planner.fleet"):
    import msgspec

__all__ = [
    "ROUTERS",
    "FleetResult",
    "LeastLoadedRouter",
    "PrefixRouter",
    "RoundRobinRouter",
    "Router",
    "WireIndex",
    "make_replicas",
    "make_router",
    "replay_fleet",
]

ROUTERS: tuple[str, ...] = ("round-robin", "least-loaded", "prefix")


# ------------------------------------------------------------ the wire schema
# Declared from vLLM's published `vllm/distributed/kv_events.py` (2026): the batch
# is an array [ts, events, data_parallel_rank]; each event a map tagged "type".


class _WireEvent(msgspec.Struct, tag=True, gc=False):
    pass


class _WireStored(_WireEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _WireRemoved(_WireEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _WireCleared(_WireEvent, tag="AllBlocksCleared"):
    pass


class _WireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_WireStored | _WireRemoved | _WireCleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(_WireBatch)


class WireIndex:
    """What a router knows of one replica: the wire hashes of its cached KV blocks.

    Fed only with `KVEventBatch` bytes (`apply`): ``BlockStored`` adds its
    hashes, ``BlockRemoved`` removes them, ``AllBlocksCleared`` empties the
    index. Only KV blocks count (``group_idx`` 0 or absent); checkpoint groups
    are ignored. A hash stored twice is counted twice (a multiset), so one
    removal does not hide the other copy. Raises `msgspec.DecodeError` /
    `msgspec.ValidationError` on bytes that are not a batch.
    """

    __slots__ = ("batches", "hashes")

    def __init__(self) -> None:
        self.hashes: Counter[int] = Counter()
        self.batches = 0

    def apply(self, payload: bytes) -> None:
        batch = _DECODER.decode(payload)
        self.batches += 1
        hashes = self.hashes
        for ev in batch.events:
            if isinstance(ev, _WireStored):
                if not ev.group_idx:
                    for h in ev.block_hashes:
                        hashes[h] += 1
            elif isinstance(ev, _WireRemoved):
                if not ev.group_idx:
                    for h in ev.block_hashes:
                        left = hashes[h] - 1
                        if left > 0:
                            hashes[h] = left
                        else:
                            del hashes[h]
            else:
                hashes.clear()

    def prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many of `block_hashes` (a request's chain, in order) are indexed, from the first."""
        hashes = self.hashes
        n = 0
        for h in block_hashes:
            if h not in hashes:
                break
            n += 1
        return n


# ------------------------------------------------------------------ routers


@dataclass
class FleetLoad:
    """Per replica: requests in the fleet's live window, and requests assigned so far."""

    in_flight: list[int]
    assigned: list[int]

    def least(self, candidates: Sequence[int]) -> int:
        """The candidate with fewest in-flight, then fewest assigned, then lowest id."""
        return min(candidates, key=lambda r: (self.in_flight[r], self.assigned[r], r))


class Router:
    """Chooses a replica per request. Subclasses override `choose`; `observe` receives
    each replica's drained events as vLLM ``KVEventBatch`` bytes (routers that do not
    look at cache state ignore them, and set `wants_events` False so none are encoded)."""

    name = "router"
    wants_events = False

    def __init__(self, replicas: int) -> None:
        if type(replicas) is not int or replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {replicas!r}")
        self.replicas = replicas

    def choose(self, request: Request, load: FleetLoad) -> int:
        raise NotImplementedError

    def observe(self, replica: int, payload: bytes) -> None:
        """One batch of `replica`'s events, as wire bytes."""


class RoundRobinRouter(Router):
    """Replica ``i mod N`` for the i-th request."""

    name = "round-robin"

    def __init__(self, replicas: int) -> None:
        super().__init__(replicas)
        self._next = 0

    def choose(self, request: Request, load: FleetLoad) -> int:
        r = self._next
        self._next = (r + 1) % self.replicas
        return r


class LeastLoadedRouter(Router):
    """Fewest in-flight requests, then fewest assigned, then lowest id."""

    name = "least-loaded"

    def choose(self, request: Request, load: FleetLoad) -> int:
        return load.least(range(self.replicas))


class PrefixRouter(Router):
    """Longest cached prefix, scored only from each replica's decoded event bytes.

    The request's chained block hashes (full blocks of the prompt) are computed
    with `cache.block_hash.BlockHasher(scheme, seed)`, as the replicas compute
    theirs; a replica scores the number of leading hashes its `WireIndex`
    holds. Ties: `FleetLoad.least`. `last_scores` keeps the scores of the
    latest choice (for reports and tests).
    """

    name = "prefix"
    wants_events = True

    def __init__(
        self,
        replicas: int,
        block_size: int,
        scheme: str = "xxh3",
        seed: int = 0,
        max_load: float | None = None,
    ) -> None:
        super().__init__(replicas)
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if max_load is not None and not max_load >= 1.0:  # also rejects nan
            raise ValueError(f"max_load must be >= 1, got {max_load!r}")
        self.max_load = max_load
        self.block_size = block_size
        self.hasher = BlockHasher(scheme, seed)
        self.indexes = [WireIndex() for _ in range(replicas)]
        self.last_scores: list[int] = [0] * replicas

    def request_hashes(self, request: Request) -> list[int]:
        """Wire hashes of the request's full prompt blocks, in order."""
        b = self.block_size
        ns = request.namespace
        chain = self.hasher.chain_fn
        h = self.hasher.root(ns)
        prompt = request.prompt
        out: list[int] = []
        for i in range(len(prompt) // b):
            h = chain(h, prompt[i * b : (i + 1) * b], None, ns)
            out.append(to_wire(h))
        return out

    def scores(self, request: Request) -> list[int]:
        hashes = self.request_hashes(request)
        return [index.prefix_blocks(hashes) for index in self.indexes]

    def candidates(self, load: FleetLoad) -> list[int]:
        """Replicas within the load bound (all of them without `max_load`)."""
        n = self.replicas
        if self.max_load is None:
            return list(range(n))
        bound = math.ceil(self.max_load * (sum(load.in_flight) + 1) / n)
        least = load.least(range(n))
        return [r for r in range(n) if r == least or load.in_flight[r] + 1 <= bound]

    def choose(self, request: Request, load: FleetLoad) -> int:
        scores = self.last_scores = self.scores(request)
        allowed = self.candidates(load)
        best = max(scores[r] for r in allowed)
        return load.least([r for r in allowed if scores[r] == best])

    def observe(self, replica: int, payload: bytes) -> None:
        self.indexes[replica].apply(payload)


def make_router(
    name: str,
    replicas: int,
    *,
    block_size: int,
    scheme: str = "xxh3",
    seed: int = 0,
    max_load: float | None = None,
) -> Router:
    """The router called `name` (one of `ROUTERS`); `ValueError` for another name.
    `max_load` applies to ``prefix`` only."""
    if name == "round-robin":
        return RoundRobinRouter(replicas)
    if name == "least-loaded":
        return LeastLoadedRouter(replicas)
    if name == "prefix":
        return PrefixRouter(replicas, block_size, scheme, seed, max_load)
    raise ValueError(f"unknown router {name!r} (choose from {', '.join(ROUTERS)})")


# ------------------------------------------------------------------- replay


@dataclass
class FleetResult:
    """What a fleet replay measured: one `ReplayResult` per replica, the choices."""

    router: str
    capacity: int
    """KV blocks per replica."""
    replicas: list[ReplayResult]
    choices: list[int] = field(default_factory=list)
    """The replica each request went to, in order."""
    wall_s: float = 0.0

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.replicas)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.replicas)

    @property
    def hit_tokens(self) -> int:
        return sum(r.hit_tokens for r in self.replicas)

    @property
    def hit_rate(self) -> float:
        p = self.prompt_tokens
        return self.hit_tokens / p if p else 0.0

    @property
    def load_balance(self) -> float:
        """Most requests any replica served / the mean (1.0 is perfectly even)."""
        counts = [r.requests for r in self.replicas]
        total = sum(counts)
        return max(counts) * len(counts) / total if total else 1.0


def make_replicas(
    n: int,
    block_size: int,
    capacity: int,
    *,
    scheme: str = "xxh3",
    seed: int = 0,
    events: bool = True,
) -> list[Any]:
    """`n` ids-only `BlockTrie`s of `capacity` blocks, hashing with (scheme, seed); events
    on unless `events` is False."""
    from cache import BlockTrie, CacheConfig

    config = CacheConfig(
        block_size=block_size,
        num_blocks=capacity,
        kv_block_shape=None,
        enable_events=events,
        block_hash=scheme,
        hash_seed=seed,
    )
    return [BlockTrie(config) for _ in range(n)]


class _Live:
    __slots__ = ("alive", "replica", "seq")

    def __init__(self, replica: int, seq: Any) -> None:
        self.replica = replica
        self.seq = seq
        self.alive = True


def replay_fleet(
    workload: Workload[Any],
    router: Router,
    *,
    block_size: int,
    capacity: int,
    concurrency: int = 32,
    max_decode_tokens: int | None = None,
    scheme: str = "xxh3",
    seed: int = 0,
    caches: Sequence[Any] | None = None,
    on_events: Callable[[int, list[Any]], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> FleetResult:
    """Replay `workload` across ``router.replicas`` replicas (see the module docstring).

    `caches` default to `make_replicas`, with events on when the router reads them or
    `on_events` is given (given caches must then have events on). `on_events(replica,
    events)` receives every non-empty drained batch (the ``--publish`` hook).
    `progress(n)` is called with the requests done, every 64.
    """
    from spec.errors import OutOfBlocks

    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    n = router.replicas
    events = router.wants_events or on_events is not None
    tries = (
        list(caches)
        if caches is not None
        else make_replicas(n, block_size, capacity, scheme=scheme, seed=seed, events=events)
    )
    if len(tries) != n:
        raise ValueError(f"the router has {n} replicas but {len(tries)} caches were given")
    from cache.kv_events import encode_batch

    b = block_size
    results = [
        ReplayResult(
            workload=workload.name,
            block_size=b,
            capacity=capacity,
            state_slots=0,
            policy="kv",
            concurrency=concurrency,
        )
        for _ in range(n)
    ]
    load = FleetLoad([0] * n, [0] * n)
    window: deque[_Live] = deque()
    mine: list[deque[_Live]] = [deque() for _ in range(n)]  # each replica's live, oldest first
    live = 0
    limit = concurrency * n
    encode = router.wants_events
    choices: list[int] = []
    t0 = time.perf_counter()

    def leave(entry: _Live) -> None:
        nonlocal live
        entry.alive = False
        tries[entry.replica].release(entry.seq)
        load.in_flight[entry.replica] -= 1
        live -= 1

    def leave_oldest() -> None:
        while window:
            entry = window.popleft()
            if entry.alive:
                mine[entry.replica].popleft()  # the fleet's oldest is its replica's oldest
                leave(entry)
                return

    def release_replica(r: int) -> bool:
        had = False
        for entry in mine[r]:
            if entry.alive:
                leave(entry)
                had = True
        mine[r].clear()
        return had

    def allocate(r: int, seq: Any, want: int) -> bool:
        cache = tries[r]
        try:
            cache.allocate(seq, want)
            return True
        except OutOfBlocks:
            if not release_replica(r):
                return False
        try:
            cache.allocate(seq, want)
            return True
        except OutOfBlocks:
            return False

    def drain() -> None:
        for r, cache in enumerate(tries):
            events = cache.drain_events()
            if not events:
                continue
            if encode:
                router.observe(r, encode_batch(events, ts=0.0))
            if on_events is not None:
                on_events(r, events)

    done = 0
    for req in workload:
        if live >= limit:
            leave_oldest()
        r = router.choose(req, load)
        if type(r) is not int or not 0 <= r < n:
            raise ValueError(f"router {router.name} chose replica {r!r} of {n}")
        choices.append(r)
        load.assigned[r] += 1
        cache = tries[r]
        res = results[r]
        cache.poll()
        prompt = req.prompt
        plen = len(prompt)
        res.requests += 1
        res.prompt_tokens += plen
        seq = cache.match(prompt, req.namespace)
        if not allocate(r, seq, plen):
            cache.abort(seq)
            res.rejected += 1
        else:
            res.hit_tokens += seq.num_cached_tokens
            cache.commit(seq, plen)
            total = plen
            output = list(
                req.output if max_decode_tokens is None else req.output[:max_decode_tokens]
            )
            if output:
                cache.append(seq, output)
                want = plen + len(output)
                if not allocate(r, seq, want):
                    want = allocate_what_fits(cache, seq, want, b)
                cache.commit(seq, want)
                total = want
                res.decode_tokens += want - plen
            res.blocks += -(-total // b)
            entry = _Live(r, seq)
            window.append(entry)
            mine[r].append(entry)
            load.in_flight[r] += 1
            live += 1
            cached = cache.num_cached_blocks
            if cached > res.peak_cached_blocks:
                res.peak_cached_blocks = cached
        drain()
        done += 1
        if progress is not None and done % 64 == 0:
            progress(done)
    while window:
        leave_oldest()
    for cache in tries:
        cache.poll()
    drain()
    wall = time.perf_counter() - t0
    for res, cache in zip(results, tries, strict=True):
        res.evicted_blocks = int(cache.stats.evicted_blocks)
        res.wall_s = wall
    if progress is not None:
        progress(done)
    return FleetResult(router.name, capacity, results, choices, wall)
