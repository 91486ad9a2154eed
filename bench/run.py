"""blocktrie benchmark: ``python -m bench.run`` (never part of pytest).

Six sections by default (``--sections peers,replay,evict,ckpt,events,host``), and ``soak``
on request:

- **peers**: the issue-13 table (`bench.peers`): blocktrie vs the naive dict
  trie on the Mooncake conversation trace at 20k / 60k / 200k blocks, the
  shared-prefix trace at 100k and a 10^6-block evicting run, each as a ratio
  to the dict trie in the same run; bytes per cached block at ~10^6 blocks;
  the cost of events (xxh3 hashing) on vs off. ``--quick`` shrinks it.
- **replay**: the built-in synthetic workload (the same as ``blocktrie
  replay``; or ``--trace`` a Mooncake / token jsonl) replayed through
  `cache.BlockTrie` and through the plain dict-of-children trie in
  `bench.baseline`, at several capacities (fractions of what never evicts).
  Per-block cost (ns) of match / allocate / commit / release / evict, the
  total, the ratio to the baseline, and peak Python memory (tracemalloc, in a
  second, untimed run).
- **evict**: eviction cost per block with 10^3 .. 10^6 blocks cached (idle
  chains of 16 blocks; evict in batches of 32), for both tries.
- **ckpt**: SSM checkpoint save and restore throughput (copies/s and bytes/s)
  for a realistic state (default 64 layers x 2 MiB), against a plain torch
  ``copy_`` of the same bytes in the same run; and a restore of a host-only
  checkpoint (host checkpoint slots, [R56]) against a plain ``copy_`` from the
  same host tensors.
- **events**: KV events per stored block (hash, build, encode, publish on
  loopback) as a ratio to the cache's own per-block cost in the same run
  (`bench.events`; needs the ``events`` extra, skipped without it).
- **host**: the host-memory tier (`bench.host`): the request loop's cost per
  block with the host tier on vs off in the same run (a workload that never
  reads the host, goal <= 1.3x, and one that evicts to it and loads back), and
  its store / load copy bandwidth against a ``copy_`` per block, a hand-written
  ``index_select`` + ``index_copy_`` and one contiguous ``copy_`` of the same
  blocks, consecutive and scattered (goal >= 0.9x; ``--device cuda`` when there
  is one).
- **soak**: `bench.soak.run_soak`: millions of random operations with
  ``ManualCopies`` completing in random order, ``check()`` every N steps;
  steps/s, memory at start and end, failures (``--soak-steps``).

After each section a line says how busy the machine was meanwhile
(`bench.load`: the cores other processes kept busy, and the hypervisor's
steal); a section past ``--max-other-cores`` / ``--max-steal`` is flagged
NOISY (and in the JSON under ``load``), and ``--require-quiet`` then makes the
run exit 3. Quote no figure from a flagged section.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/run.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import default_traces_dir, load
from bench.baseline import DictTrie
from bench.load import DEFAULT_MAX_OTHER_CORES, DEFAULT_MAX_STEAL
from cache.planner.replay import replay
from cache.planner.traces import TRACE_BLOCK_TOKENS, load_trace
from cache.planner.workload import (
    SyntheticParams,
    Workload,
    count_prefix_hits,
    synthetic_workload,
)

OPS = ("match", "allocate", "commit", "release", "evict")
perf_ns = time.perf_counter_ns


# --------------------------------------------------------------------------
# Timing proxy


@dataclass
class OpTimes:
    ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    other_ns: int = 0
    calls: int = 0  # timed intervals (each carries about one clock read of overhead)

    def per_block(self, op: str) -> float:
        return self.ns[op] / self.blocks[op] if self.blocks[op] else 0.0

    @property
    def total_ns(self) -> int:
        return sum(self.ns.values()) + self.other_ns


class TimedCache:
    """Wraps a cache; times each call with `perf_counter_ns` and counts its blocks.

    Eviction is made explicit: before `allocate`, the shortfall is evicted with
    `evict` (timed as evict), so allocate's own time excludes eviction.
    """

    def __init__(
        self, cache: Any, block_size: int, clock: Callable[[], int] = time.perf_counter_ns
    ) -> None:
        self.cache = cache
        self.b = block_size
        self.t = OpTimes()
        self.clock = clock

    @property
    def num_free_blocks(self) -> int:
        return int(self.cache.num_free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return int(self.cache.num_cached_blocks)

    @property
    def num_free_checkpoint_slots(self) -> int:
        return int(self.cache.num_free_checkpoint_slots)

    @property
    def stats(self) -> Any:
        return self.cache.stats

    def save(self, seq: Any, num_tokens: int, runtime_state: Any) -> Any:
        return self.cache.save(seq, num_tokens, runtime_state)

    def restore(self, seq: Any, runtime_state: Any) -> Any:
        return self.cache.restore(seq, runtime_state)

    def match(self, tokens: list[int], namespace: str = "") -> Any:
        t0 = self.clock()
        seq = self.cache.match(tokens, namespace)
        self.t.ns["match"] += self.clock() - t0
        self.t.calls += 1
        self.t.blocks["match"] += len(tokens) // self.b
        return seq

    def allocate(self, seq: Any, num_tokens: int) -> None:
        need = -(-num_tokens // self.b) - len(seq.block_ids)
        if need <= 0:
            return
        short = need - self.cache.num_free_blocks
        if short > 0:
            t0 = self.clock()
            freed = self.cache.evict(short)
            self.t.ns["evict"] += self.clock() - t0
            self.t.calls += 1
            self.t.blocks["evict"] += freed
        t0 = self.clock()
        try:
            self.cache.allocate(seq, num_tokens)
        finally:
            self.t.ns["allocate"] += self.clock() - t0
            self.t.calls += 1
        self.t.blocks["allocate"] += need

    def commit(self, seq: Any, num_tokens: int) -> None:
        before = seq.num_committed_tokens // self.b
        t0 = self.clock()
        self.cache.commit(seq, num_tokens)
        self.t.ns["commit"] += self.clock() - t0
        self.t.calls += 1
        self.t.blocks["commit"] += num_tokens // self.b - before

    def release(self, seq: Any) -> None:
        n = len(seq.block_ids)
        t0 = self.clock()
        self.cache.release(seq)
        self.t.ns["release"] += self.clock() - t0
        self.t.calls += 1
        self.t.blocks["release"] += n

    def _other(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = self.clock()
        try:
            return fn(*args)
        finally:
            self.t.other_ns += self.clock() - t0
            self.t.calls += 1

    def append(self, seq: Any, tokens: list[int]) -> None:
        self._other(self.cache.append, seq, tokens)

    def abort(self, seq: Any) -> None:
        self._other(self.cache.abort, seq)

    def load(self, seq: Any) -> Any:
        return self._other(self.cache.load, seq)

    def poll(self) -> int:
        return int(self._other(self.cache.poll))


def make_blocktrie(block_size: int, capacity: int) -> Any:
    from cache import BlockTrie, CacheConfig

    return BlockTrie(
        CacheConfig(
            block_size=block_size, num_blocks=capacity, kv_block_shape=None, enable_events=False
        )
    )


def make_dicttrie(block_size: int, capacity: int) -> Any:
    return DictTrie(block_size, capacity)


IMPLS: dict[str, Callable[[int, int], Any]] = {
    "blocktrie": make_blocktrie,
    "dict-trie": make_dicttrie,
}


# --------------------------------------------------------------------------
# Section: replay


def bench_replay(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from rich.table import Table

    workload = load_workload(args)
    b = args.block_size
    count = count_prefix_hits(workload, b, args.max_decode_tokens)
    unbounded = count.unique_blocks + (args.concurrency + 1) * (count.max_request_blocks + 1)
    console.print(
        f"[bold]replay[/bold]: {workload.description}; {len(workload):,} requests, "
        f"{workload.prompt_tokens:,} prompt tokens, block size {b}; never evicts at "
        f"{unbounded:,} blocks; unbounded hit rate {count.hit_rate:.2%}"
    )
    table = Table(title="per-block cost (ns) of each operation", show_lines=False)
    for col in ("capacity", "impl", "hit rate", *OPS, "total/block", "vs dict", "peak MiB"):
        table.add_column(col, justify="right" if col != "impl" else "left")
    rows = []
    for frac in args.capacities:
        cap = max(64, int(unbounded * frac))
        totals: dict[str, float] = {}
        best: dict[str, tuple[float, TimedCache, Any]] = {}
        for _ in range(args.repeats):  # interleaved, best of N: shared machines are noisy
            for name, make in IMPLS.items():
                gc.collect()
                timed = TimedCache(make(b, cap), b)
                result = replay(
                    workload,
                    timed,
                    block_size=b,
                    capacity=cap,
                    concurrency=args.concurrency,
                    max_decode_tokens=args.max_decode_tokens,
                )
                total = timed.t.total_ns / result.blocks if result.blocks else 0.0
                if name not in best or total < best[name][0]:
                    best[name] = (total, timed, result)
        for name, make in IMPLS.items():
            per_block_total, timed, result = best[name]
            totals[name] = per_block_total
            peak = measure_peak(workload, make, b, cap, args) if args.memory else None
            row = {
                "capacity": cap,
                "fraction": frac,
                "impl": name,
                "hit_rate": result.hit_rate,
                "evicted_blocks": result.evicted_blocks,
                "rejected": result.rejected,
                **{f"{op}_ns_per_block": timed.t.per_block(op) for op in OPS},
                **{f"{op}_blocks": timed.t.blocks[op] for op in OPS},
                "total_ns_per_block": per_block_total,
                "peak_mib": peak,
            }
            rows.append(row)
            ratio = per_block_total / totals["blocktrie"] if name != "blocktrie" else None
            table.add_row(
                f"{cap:,} ({frac:g})",
                name,
                f"{result.hit_rate:.2%}",
                *(f"{timed.t.per_block(op):,.0f}" for op in OPS),
                f"{per_block_total:,.0f}",
                "" if ratio is None else f"{1 / ratio:.2f}x",
                "-" if peak is None else f"{peak:,.1f}",
            )
        # "vs dict" on the blocktrie row: blocktrie total / dict-trie total.
        ratio = totals["blocktrie"] / totals["dict-trie"] if totals["dict-trie"] else float("nan")
        rows[-2]["vs_dict"] = ratio
        console.print(
            f"  capacity {cap:,}: blocktrie / dict-trie total cost per block = {ratio:.2f}x",
            highlight=False,
        )
    console.print(table)
    console.print(
        "[dim]per-block denominators: match = prompt blocks looked up; allocate = blocks "
        "taken; commit = blocks committed; release = blocks released; evict = blocks "
        "evicted; total = all time (incl. append/poll) / prompt+decode blocks. "
        "'vs dict' on the dict-trie row = blocktrie total / dict-trie total.[/dim]"
    )
    out["replay"] = {"workload": workload.description, "unbounded_blocks": unbounded, "rows": rows}


def measure_peak(
    workload: Workload[Any],
    make: Callable[[int, int], Any],
    b: int,
    cap: int,
    args: argparse.Namespace,
) -> float:
    """Peak traced Python memory (MiB) of an untimed replay, including the workload's tokens."""
    gc.collect()
    tracemalloc.start()
    try:
        cache = make(b, cap)
        replay(
            workload,
            cache,
            block_size=b,
            capacity=cap,
            concurrency=args.concurrency,
            max_decode_tokens=args.max_decode_tokens,
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del cache
    return peak / 2**20


def load_workload(args: argparse.Namespace) -> Workload[Any]:
    if args.trace:
        w = load_trace(args.trace, "auto", args.trace_block_tokens)
    else:
        w = synthetic_workload(SyntheticParams(users=args.users, seed=args.seed))
    return w.head(args.limit) if args.limit else w


# --------------------------------------------------------------------------
# Section: eviction cost vs cache size


def fill(cache: Any, n_blocks: int, b: int, chain: int) -> None:
    """Cache `n_blocks` idle blocks as chains of `chain` blocks (distinct first tokens)."""
    positions = list(range(1, b * chain))
    base = b * chain
    for s in range(n_blocks // chain):
        tokens = [base + s, *positions]
        seq = cache.match(tokens)
        cache.allocate(seq, len(tokens))
        cache.commit(seq, len(tokens))
        cache.release(seq)


def _evict_round_robin(
    make: Callable[[int, int], Any],
    sizes: list[int],
    b: int,
    chain: int,
    batch: int,
    blocks: int,
) -> dict[int, tuple[float, int, float]]:
    """Eviction cost per block of one implementation at each size in `sizes`: one
    cache per size, filled with idle chains, and `evict(batch)` called on each in
    turn, so the machine's drifting speed lands on every size alike (one size
    after another drifts by more than the 1.5x target). Each size evicts `blocks`
    blocks; a cache that has given half its blocks is built again (untimed). The
    garbage collector is paused during the calls: a collection costs with the
    heap, not with eviction. Returns size -> (ns per block, blocks, build s)."""
    caches: dict[int, Any] = {}
    left: dict[int, int] = {}
    freed = dict.fromkeys(sizes, 0)
    ns = dict.fromkeys(sizes, 0)
    build = dict.fromkeys(sizes, 0.0)

    def rebuild(n: int) -> None:
        caches.pop(n, None)
        gc.collect()
        t0 = time.perf_counter()
        cache = make(b, n + chain)
        fill(cache, n, b, chain)
        build[n] += time.perf_counter() - t0
        assert cache.num_cached_blocks == n // chain * chain
        caches[n] = cache
        left[n] = n // 2

    for n in sizes:
        rebuild(n)
    active = list(sizes)
    fresh = set(sizes)  # built, not evicted from yet
    while active:
        for n in list(active):
            if left[n] <= 0:
                rebuild(n)
                fresh.add(n)
            gc.disable()
            t1 = perf_ns()
            got = caches[n].evict(min(batch, left[n]))
            ns[n] += perf_ns() - t1
            gc.enable()
            freed[n] += got
            left[n] = left[n] - got if got else 0  # nothing evictable: build again
            if freed[n] >= blocks or (n in fresh and not got):
                active.remove(n)
                del caches[n]
            fresh.discard(n)
    return {n: (ns[n] / freed[n] if freed[n] else float("nan"), freed[n], build[n]) for n in sizes}


def bench_evict(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from rich.table import Table

    b, chain, batch = 16, 16, 32
    table = Table(
        title=f"eviction cost per block (idle chains of {chain} blocks, evict({batch}) calls "
        f"to every size in turn; best of {max(1, args.repeats)}, GC paused while evicting)"
    )
    for col in ("cached blocks", "impl", "evicted", "ns/block", "build s"):
        table.add_column(col, justify="right" if col != "impl" else "left")
    results: dict[str, dict[int, float]] = {name: {} for name in IMPLS}
    rows: dict[tuple[int, str], tuple[int, float]] = {}
    sizes = list(args.eviction_sizes)
    for _ in range(max(1, args.repeats)):
        for name, make in IMPLS.items():
            timed = _evict_round_robin(make, sizes, b, chain, batch, args.evict_blocks)
            for n, (per, freed, build) in timed.items():
                if per < results[name].get(n, float("inf")):
                    results[name][n] = per
                    rows[(n, name)] = (freed, build)
    for n in sizes:
        for name in IMPLS:
            freed, build = rows.get((n, name), (0, float("nan")))
            per = results[name].get(n, float("nan"))
            table.add_row(f"{n:,}", name, f"{freed:,}", f"{per:,.0f}", f"{build:.1f}")
    console.print(table)
    summary = {}
    for name, by_size in results.items():
        values = list(by_size.values())
        spread = max(values) / min(values) if values else float("nan")
        summary[name] = spread
        console.print(
            f"  {name}: max/min eviction cost per block across sizes = {spread:.2f}x "
            f"({'flat' if spread <= 1.5 else 'NOT flat'} by the 1.5x target)",
            highlight=False,
        )
    ratios = {n: results["blocktrie"][n] / results["dict-trie"][n] for n in args.eviction_sizes}
    console.print(
        "  blocktrie / dict-trie eviction cost: "
        + ", ".join(f"{n:,}: {r:.2f}x" for n, r in ratios.items()),
        highlight=False,
    )
    out["evict"] = {
        "ns_per_block": {k: {str(n): v for n, v in d.items()} for k, d in results.items()},
        "spread": summary,
        "ratio_to_dict": {str(n): r for n, r in ratios.items()},
    }


# --------------------------------------------------------------------------
# Section: checkpoint save / restore throughput


def bench_ckpt(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from rich.table import Table

    from cache import BlockTrie, CacheConfig

    device = torch.device(args.device)
    layers = args.state_layers
    elems = int(args.state_layer_mib * 2**20) // 4
    shapes = {f"layer{i:02d}": (elems,) for i in range(layers)}
    state_bytes = layers * elems * 4
    slots = args.ckpt_slots
    b = 16
    n_anchor = 2 * slots + 1  # more anchors than slots: every save recycles an LRU slot
    config = CacheConfig(
        block_size=b,
        num_blocks=4 * n_anchor + 8,
        kv_block_shape=None,
        num_checkpoint_slots=slots,
        state_shapes=shapes,
        state_dtype=torch.float32,
        device=device,
        enable_events=False,
    )
    trie = BlockTrie(config)
    src = {k: torch.randn(s, device=device) for k, s in shapes.items()}
    dst = {k: torch.empty(s, device=device) for k, s in shapes.items()}
    total_mib = (slots + 2) * state_bytes / 2**20
    console.print(
        f"[bold]checkpoints[/bold]: {layers} layers x {args.state_layer_mib:g} MiB = "
        f"{state_bytes / 2**20:.0f} MiB per checkpoint, {slots} slots, device {device}; "
        f"~{total_mib:,.0f} MiB of state allocated"
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    tokens = list(range(1, n_anchor * b + 2))
    owner = trie.match(tokens)
    trie.allocate(owner, len(tokens))
    trie.commit(owner, len(tokens))
    iters = args.ckpt_iters
    pool = trie.checkpoint_states
    anchor = [1]  # next anchor (block index) to save at; cycles over more anchors than slots

    def time_saves(n: int) -> tuple[int, float]:
        done = 0
        t0 = time.perf_counter()
        while done < n:
            copy = trie.save(owner, anchor[0] * b, src)
            sync()
            trie.poll()
            done += copy is not None
            anchor[0] = anchor[0] % n_anchor + 1
        return done, time.perf_counter() - t0

    def time_restores(n: int) -> tuple[int, float]:
        done = 0
        secs = 0.0
        back = 1
        while done < n:
            # The most recently saved checkpoints are still present; match one of them.
            step = ((anchor[0] - 1 - back) % n_anchor + 1) * b
            back = back % slots + 1
            seq = trie.match(tokens[: step + 1])
            if seq.restore is None:
                trie.abort(seq)
                continue
            t0 = time.perf_counter()
            trie.restore(seq, dst)
            sync()
            trie.poll()
            secs += time.perf_counter() - t0
            trie.release(seq)
            done += 1
        return done, secs

    def time_plain(n: int, into_pool: bool) -> tuple[int, float]:
        t0 = time.perf_counter()
        for i in range(n):
            slot = i % slots
            for name, tensor in (src if into_pool else dst).items():
                if into_pool:
                    pool[name][slot].copy_(tensor)
                else:
                    tensor.copy_(pool[name][slot])
            sync()
        return n, time.perf_counter() - t0

    # A restore from the host tier ([R56]): one device slot, the same checkpoints stored
    # in host slots as they are saved, then offloaded; each restore reads a host slot.
    host_trie = BlockTrie(replace(config, num_checkpoint_slots=1, num_host_checkpoint_slots=slots))
    host_owner = host_trie.match(tokens)
    host_trie.allocate(host_owner, len(tokens))
    host_trie.commit(host_owner, len(tokens))
    for i in range(1, slots + 1):
        host_trie.save(host_owner, i * b, src)
        sync()
        host_trie.poll()
    host_trie.evict_checkpoints(1)
    host_trie.release(host_owner)
    host_pool = host_trie.host_checkpoint_states

    def time_host_restores(n: int) -> tuple[int, float]:
        secs = 0.0
        for i in range(n):
            seq = host_trie.match(tokens[: (i % slots + 1) * b + 1])
            t0 = time.perf_counter()
            host_trie.restore(seq, dst).wait()
            sync()
            host_trie.poll()
            secs += time.perf_counter() - t0
            host_trie.release(seq)
        return n, secs

    def time_plain_host(n: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        for i in range(n):
            for name, tensor in dst.items():
                tensor.copy_(host_pool[name][i % slots], non_blocking=True)
            sync()
        return n, time.perf_counter() - t0

    # Warm up: touch every slot and buffer once (first-touch page faults are not copies).
    time_host_restores(slots)
    if not torch.equal(dst[next(iter(shapes))], src[next(iter(shapes))]):
        raise RuntimeError("a restore from the host tier did not copy the state back")
    time_plain_host(slots)
    time_saves(slots + 1)
    time_restores(2)
    # The copies really move the bytes: a slot holds `src`, and a restore filled `dst`.
    first = next(iter(shapes))
    if not any(torch.equal(pool[first][i], src[first]) for i in range(slots)):
        raise RuntimeError("checkpoint save did not copy the state into a slot")
    if not torch.equal(dst[first], src[first]):
        raise RuntimeError("checkpoint restore did not copy the state back")
    time_plain(slots, True)
    time_plain(2, False)
    best: dict[str, tuple[int, float]] = {}
    for _ in range(args.repeats):  # interleaved, best of N
        runs: list[tuple[str, Callable[[], tuple[int, float]]]] = [
            ("save", lambda: time_saves(iters)),
            ("plain_save", lambda: time_plain(iters, True)),
            ("restore", lambda: time_restores(iters)),
            ("plain_restore", lambda: time_plain(iters, False)),
            ("host_restore", lambda: time_host_restores(iters)),
            ("plain_host_restore", lambda: time_plain_host(iters)),
        ]
        for key, fn in runs:
            n, secs = fn()
            if key not in best or n / secs > best[key][0] / best[key][1]:
                best[key] = (n, secs)
    trie.release(owner)

    table = Table(title="checkpoint copy throughput")
    for col in ("operation", "copies/s", "GiB/s", "vs plain copy_"):
        table.add_column(col, justify="right" if col != "operation" else "left")
    rows = {}
    for name in ("save", "restore", "host_restore"):
        cps = best[name][0] / best[name][1]
        plain_cps = best["plain_" + name][0] / best["plain_" + name][1]
        rows[name] = {
            "copies_per_s": cps,
            "bytes_per_s": cps * state_bytes,
            "plain_copies_per_s": plain_cps,
            "plain_bytes_per_s": plain_cps * state_bytes,
            "ratio": cps / plain_cps,
        }
        table.add_row(
            f"blocktrie {name}",
            f"{cps:,.1f}",
            f"{cps * state_bytes / 2**30:,.2f}",
            f"{cps / plain_cps:.2f}x",
        )
        table.add_row(
            f"plain copy_ ({name} direction)",
            f"{plain_cps:,.1f}",
            f"{plain_cps * state_bytes / 2**30:,.2f}",
            "1.00x",
        )
    console.print(table)
    out["ckpt"] = {
        "state_bytes": state_bytes,
        "layers": layers,
        "slots": slots,
        "device": str(device),
        **rows,
    }


# --------------------------------------------------------------------------


def bench_peers_section(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from bench.peers import bench_peers

    if args.quick:
        args.repeats = 1
    bench_peers(args, out, console.print)


def bench_events_section(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from bench.events import bench_events, print_events

    try:
        result = bench_events()
    except ImportError as exc:
        console.print(f"events: skipped ({exc}); pip install 'blocktrie[events]'")
        return
    out["events"] = result
    print_events(result, console.print)


def bench_host_section(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from bench.host import bench_host, print_host

    result = bench_host(
        users=args.host_users,
        blocks=args.host_blocks,
        block_shape=tuple(args.host_block_shape),
        device=args.device,
        repeat=args.repeats,
        seed=args.seed,
    )
    out["host"] = result
    print_host(result, console.print)
    if args.host_model_blocks > 0:
        model = bench_host(
            blocks=args.host_model_blocks,
            block_shape=tuple(args.host_model_block_shape),
            device=args.device,
            repeat=args.repeats,
            seed=args.seed,
            loop=False,
        )
        out["host_model"] = model
        print_host(model, console.print)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def bench_soak(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from bench.soak import run_soak

    result = run_soak(args.soak_steps, args.seed, args.soak_check_every, trace_memory=args.memory)
    out["soak"] = result
    console.print(
        f"[bold]soak[/bold]: {result['steps']:,} steps in {result['seconds']} s "
        f"({result['steps_per_s']:,} steps/s), {result['checks']} checks, "
        f"{result['failures']} failures, {result['restores_verified']:,} restores verified; "
        f"RSS {result['rss_kib_start'] // 1024} -> {result['rss_kib_end'] // 1024} MiB"
        + (
            f"; traced {result['traced_kib_warm']} KiB after warm-up -> "
            f"{result['traced_kib_end']} KiB at the end"
            if "traced_kib_end" in result
            else ""
        )
    )
    for sample in result["failure_samples"]:
        console.print(f"  [red]failure[/red] {sample}")


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sections",
        default="peers,replay,evict,ckpt,events,host",
        help="comma-separated: peers, replay, evict, ckpt, events, host, soak",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="peers: best of 1, a 2x10^5-block evicting row and 2^18-block memory runs",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="peers: a Python with vLLM installed, to run vLLM's KVCacheManager as a peer "
        "(bench.vllm_peer); default: this Python if it has vLLM, else $BLOCKTRIE_VLLM_PYTHON, "
        "else the vLLM columns are skipped",
    )
    p.add_argument(
        "--traces-dir",
        default=str(default_traces_dir()),
        help="peers: folder of the Mooncake traces (default: $BLOCKTRIE_TRACES_DIR, else "
        "../shared/traces beside the checkout; rows whose file is missing are skipped)",
    )
    p.add_argument("--trace", help="Mooncake or token jsonl (default: built-in synthetic workload)")
    p.add_argument(
        "--trace-block-tokens",
        type=int,
        help=f"tokens per hash id (default: {TRACE_BLOCK_TOKENS} Mooncake, 16 Bailian)",
    )
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--users", type=int, default=SyntheticParams().users, help="built-in workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-decode-tokens", type=int)
    p.add_argument(
        "--capacities",
        type=_floats,
        default=[0.1, 0.25, 0.5, 1.0],
        help="fractions of the never-evicting capacity",
    )
    p.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the tracemalloc peak-memory runs",
    )
    p.add_argument("--eviction-sizes", type=_ints, default=[1000, 10_000, 100_000, 1_000_000])
    p.add_argument(
        "--evict-blocks",
        type=int,
        default=8192,
        help="blocks evicted per size (at most half of a cache: small ones are built again)",
    )
    p.add_argument("--state-layers", type=int, default=64)
    p.add_argument("--state-layer-mib", type=float, default=2.0)
    p.add_argument("--ckpt-slots", type=int, default=8)
    p.add_argument("--ckpt-iters", type=int, default=40)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="replay, evict, ckpt and host: best (host loop: median) of N interleaved runs",
    )
    p.add_argument(
        "--host-users",
        type=int,
        default=SyntheticParams().users,
        help="host: sessions of the built-in workload the request loop replays",
    )
    p.add_argument(
        "--host-blocks", type=int, default=2048, help="host: KV blocks per store/load round trip"
    )
    p.add_argument(
        "--host-block-shape",
        type=_ints,
        default=[16, 8, 128],
        help="host: one KV block's shape (fp16), e.g. 16,8,128 (tokens, heads, head dim)",
    )
    p.add_argument(
        "--host-model-blocks",
        type=int,
        default=256,
        help="host: blocks per round trip at the model-sized block shape (0: skip that row)",
    )
    p.add_argument(
        "--host-model-block-shape",
        type=_ints,
        default=[16, 32, 2, 8, 64],
        help="host: a model-sized block (fp16; default 16 tokens x 32 layers x K,V x 8 heads x "
        "64 dims = 1 MiB, one block of a 7-8B GQA model)",
    )
    p.add_argument("--device", default="cpu", help="ckpt and host: the pool's device")
    p.add_argument("--soak-steps", type=int, default=1_000_000)
    p.add_argument("--soak-check-every", type=int, default=10_000)
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument(
        "--max-other-cores",
        type=_limit,
        default=DEFAULT_MAX_OTHER_CORES,
        help="flag a section during which other processes kept more cores than this busy "
        "on average (default: %(default)s; `bench.load`)",
    )
    p.add_argument(
        "--max-steal",
        type=_limit,
        default=DEFAULT_MAX_STEAL,
        help="flag a section during which the hypervisor took more than this share of the "
        "CPU time (default: %(default)s)",
    )
    p.add_argument(
        "--require-quiet",
        action="store_true",
        help="exit 3 when any section was flagged (the figures are still printed)",
    )
    return p


def _limit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


console: Any = None


def main(argv: Sequence[str] | None = None) -> int:
    global console
    from rich.console import Console

    args = build_parser().parse_args(argv)
    console = Console(width=160 if not sys.stdout.isatty() else None, highlight=False)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    loads: dict[str, dict[str, Any]] = out.setdefault("load", {})
    for name in sections:
        before = load.sample()
        {
            "peers": bench_peers_section,
            "replay": bench_replay,
            "evict": bench_evict,
            "ckpt": bench_ckpt,
            "events": bench_events_section,
            "host": bench_host_section,
            "soak": bench_soak,
        }[name](args, out)
        seen = load.measure(before, load.sample(), args.max_other_cores, args.max_steal)
        loads[name] = asdict(seen)
        style = "bold yellow" if seen.noisy else "dim"
        console.print(f"[{style}]({name}: {seen.seconds:.1f} s; {seen.describe()})[/{style}]\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    noisy = [name for name, seen in loads.items() if seen["noisy"]]
    if noisy and args.require_quiet:
        console.print(
            f"[bold yellow]--require-quiet: other processes or the hypervisor took CPU during "
            f"{', '.join(noisy)}; run again on a quiet machine[/bold yellow]"
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
