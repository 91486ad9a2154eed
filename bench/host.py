"""Host-tier cost (issue 10, item 6): the request loop with the host tier on vs off, and
the bandwidth of its store and load copies against a plain ``copy_`` of the same bytes.

`bench_host(...)` returns a dict; `print_host(result)` prints it. ``python -m
bench.run`` runs it as its ``host`` section (`bench.run.bench_host_section`).
Standalone: ``python -m bench.host [--json PATH]``. Every figure is a ratio to a
baseline measured in the same run, interleaved round by round.

- **loop**: the planner's request loop (`cache.planner.replay.replay`: match,
  load, allocate, commit, release, poll) over the built-in workload through an
  ids-only `BlockTrie`, host tier off (``num_host_blocks=0``) and on, same
  device capacity; cost = replay wall time per prompt+decode block. Two
  workloads: ``no_host``, at the never-evict capacity, where the host is never
  read (nothing is evicted, so nothing is loaded; write-through still queues a
  store per commit, so this is the store bookkeeping's overhead; issue 10's
  goal is <= 1.3x), and ``evicting``, at a fraction (default 1/4) of the
  distinct blocks the workload commits, with a host tier that holds
  everything, where evicted blocks go to the host and come back
  (`loaded_blocks` > 0; the host tier also raises the hit rate, reported).
  The ratio is the median over rounds of on / off.
- **copy**: a `BlockTrie` with real KV blocks (default 16 tokens x 8 heads x 128
  dims, fp16: 32 KiB a block) and a host tier. A round commits `blocks` blocks
  (the store copy: timed ``commit`` + ``poll``), evicts them from the device
  (offloaded, untimed), matches them again and loads them back (timed ``load``
  + ``wait`` + ``poll``), after checking the loaded blocks hold exactly what
  was stored. Against, in the same round and on the same blocks (the ids the
  round's copies used) between the pool and a CPU tensor: the gathered move
  alone (`cache.moves.BlockMove`, the copy without the API's bookkeeping), a
  hand-written ``copy_`` per block (what the copies did before they were
  gathered), a hand-written ``index_select`` + ``index_copy_``, and one
  contiguous ``copy_`` of the same bytes (the upper bound). Two layouts:
  ``fresh`` (a new trie's blocks, consecutive on both tiers: one run) and
  ``scattered`` (both free lists shuffled before each round). Bandwidth =
  bytes / best time over rounds; each ratio also as the median of the rounds'
  ratios. Issue 10's goal is >= 0.9x of plain ``copy_``. On CUDA the host
  buffer is pinned and every timing ends with a synchronize. ``--threads 1``
  keeps torch's intra-op pool out of the figures on a shared machine (its
  threads wait for busy cores: whole-tensor ops suffer, per-block ones do not).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/host.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from cache.planner.plan import never_evict_capacity
from cache.planner.replay import make_cache, replay
from cache.planner.workload import SyntheticParams, count_prefix_hits, synthetic_workload

DEFAULT_BLOCK_SHAPE = (16, 8, 128)
perf = time.perf_counter


# --------------------------------------------------------------------------
# loop: per-block cost with the host tier on vs off


def _loop_once(
    workload: Any, block_size: int, capacity: int, host_blocks: int, concurrency: int
) -> tuple[float, Any]:
    """One replay; (ns per prompt+decode block, its `ReplayResult`)."""
    gc.collect()
    cache = make_cache(block_size, capacity, host_capacity=host_blocks)
    r = replay(
        workload,
        cache,
        block_size=block_size,
        capacity=capacity,
        concurrency=concurrency,
        host_capacity=host_blocks,
    )
    return r.wall_s * 1e9 / r.blocks, r


def bench_loop(
    users: int = 48,
    block_size: int = 16,
    concurrency: int = 32,
    evict_fraction: float = 0.25,
    repeat: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """The **loop** measurements (module docstring): per workload, ns per block off and on
    (best of `repeat`), the median of the rounds' on / off ratios, hit rates, copies."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    workload = synthetic_workload(SyntheticParams(users=users, seed=seed))
    count = count_prefix_hits(workload, block_size)
    never = never_evict_capacity(count, concurrency)
    cases = {
        "no_host": (never, never),
        "evicting": (max(8, int(count.unique_blocks * evict_fraction)), never),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"off": [], "on": []} for k in cases}
    results: dict[str, dict[str, Any]] = {k: {} for k in cases}
    for _ in range(repeat):  # interleaved: each round runs off then on under the same load
        for name, (cap, host) in cases.items():
            for side, host_blocks in (("off", 0), ("on", host)):
                ns, r = _loop_once(workload, block_size, cap, host_blocks, concurrency)
                times[name][side].append(ns)
                results[name][side] = r
    out: dict[str, Any] = {
        "workload": workload.description,
        "blocks": results["no_host"]["off"].blocks,
        "repeat": repeat,
    }
    for name, (cap, host) in cases.items():
        off, on = results[name]["off"], results[name]["on"]
        out[name] = {
            "capacity": cap,
            "host_blocks": host,
            "off_ns_per_block": min(times[name]["off"]),
            "on_ns_per_block": min(times[name]["on"]),
            "ratio": statistics.median(
                a / b for a, b in zip(times[name]["on"], times[name]["off"], strict=True)
            ),
            "off_hit_rate": off.hit_rate,
            "on_hit_rate": on.hit_rate,
            "host_hit_rate": on.host_hit_rate,
            "evicted_blocks": on.evicted_blocks,
            "stored_blocks": on.stored_blocks,
            "loaded_blocks": on.loaded_blocks,
        }
    if out["no_host"]["loaded_blocks"] or out["no_host"]["evicted_blocks"]:
        raise RuntimeError("the no-host workload evicted or loaded: its capacity is too small")
    if not out["evicting"]["loaded_blocks"]:
        raise RuntimeError("the evicting workload loaded nothing from the host")
    return out


# --------------------------------------------------------------------------
# copy: store and load bandwidth vs a plain copy_

LAYOUTS = ("fresh", "scattered")
"""``fresh``: the blocks a new trie hands out (consecutive on both tiers); ``scattered``:
both free lists shuffled before each round (seeded), so a copy's blocks are scattered."""


def _shuffle_free_lists(trie: Any, seed: int) -> None:
    """Permute the device and host free lists (same free blocks, another order): the next
    allocations are scattered over the pools. A benchmark-only reach into the pools."""
    rng = random.Random(seed)
    for pool in (trie._kv, trie._host.pool):
        rng.shuffle(pool._free)


def bench_copy(
    blocks: int = 2048,
    block_shape: tuple[int, ...] = DEFAULT_BLOCK_SHAPE,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    repeat: int = 5,
    block_size: int = 16,
    layout: str = "fresh",
) -> dict[str, Any]:
    """The **copy** measurements (module docstring): bytes per second of the host tier's
    store and load copies through the public API, of the gathered move alone, and of
    hand-written copies of the same blocks (a ``copy_`` per block, a gathered
    ``index_select`` + ``index_copy_``, one contiguous ``copy_``); ratios of the API
    to each (best over rounds, and the median of the rounds' ratios)."""
    from cache import BlockTrie, CacheConfig
    from cache.moves import BlockMove

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    dev = torch.device(device)
    scattered = layout == "scattered"
    n_device = 2 * blocks + 1 if scattered else blocks + 1  # + the prompt's partial block
    n_host = 2 * blocks if scattered else blocks
    config = CacheConfig(
        block_size=block_size,
        num_blocks=n_device,
        num_host_blocks=n_host,
        kv_block_shape=block_shape,
        kv_dtype=dtype,
        device=dev,
        enable_events=False,
    )
    trie = BlockTrie(config)
    pool = trie.kv_cache
    assert pool is not None
    nbytes = blocks * pool[0].numel() * pool.element_size()
    gen = torch.Generator().manual_seed(0)
    data = torch.randn((blocks, *block_shape), generator=gen).to(dtype=dtype, device=dev)
    pinned = dev.type == "cuda"
    host_buf = torch.empty((n_host, *block_shape), dtype=dtype, pin_memory=pinned)
    tokens = list(range(1, blocks * block_size + 2))
    # The blocks the last API round used: (device ids, host ids), pair by pair.
    ids: dict[str, list[int]] = {"device": list(range(blocks)), "host": list(range(blocks))}
    rounds = [0]

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def round_trip() -> tuple[float, float]:
        """Store `blocks` blocks, offload them, load them back; (store s, load s)."""
        rounds[0] += 1
        if scattered:
            _shuffle_free_lists(trie, rounds[0])
        seq = trie.match(tokens)
        trie.allocate(seq, len(tokens))
        device_ids = list(seq.block_ids[:blocks])
        pool[torch.tensor(device_ids, device=dev)] = data
        stored = trie.stats.stored_blocks
        sync()
        t0 = perf()
        trie.commit(seq, len(tokens))
        sync()
        trie.poll()
        store = perf() - t0
        trie.release(seq)
        host_of: dict[int, int] = {
            n["block"]: n["block_host"]
            for n in trie.snapshot()["nodes"].values()
            if n["block"] is not None and n["block_host"] is not None
        }
        ids["device"], ids["host"] = device_ids, [host_of[b] for b in device_ids]
        if trie.stats.stored_blocks - stored != blocks or trie.evict(blocks) != blocks:
            raise RuntimeError("the store copy did not finish, or the blocks did not offload")
        pool.zero_()  # the device copies are gone: only a load can bring the bytes back
        seq = trie.match(tokens)
        if seq.num_host_tokens != blocks * block_size:
            raise RuntimeError(f"expected a host hit of {blocks} blocks, got {seq!r}")
        sync()
        t0 = perf()
        copy = trie.load(seq)
        if copy is not None:
            copy.wait()
        sync()
        trie.poll()
        load = perf() - t0
        got = pool[torch.tensor(seq.block_ids[:blocks], device=dev)]
        if not torch.equal(got, data):
            raise RuntimeError("the loaded blocks differ from the stored ones")
        trie.release(seq)
        trie.clear()
        return store, load

    def plain_blocks() -> tuple[float, float]:
        """A hand-written ``copy_`` per block, the same blocks (today's baseline)."""
        pairs = list(zip(ids["device"], ids["host"], strict=True))
        sync()
        t0 = perf()
        for d, h in pairs:
            host_buf[h].copy_(pool[d], non_blocking=pinned)
        sync()
        t1 = perf()
        for d, h in pairs:
            pool[d].copy_(host_buf[h], non_blocking=pinned)
        sync()
        return t1 - t0, perf() - t1

    def gathered() -> tuple[float, float]:
        """A hand-written ``index_select`` + ``index_copy_`` of the same blocks."""
        sync()
        t0 = perf()
        src = torch.tensor(ids["device"], device=dev)
        values = pool.index_select(0, src).to("cpu", non_blocking=pinned)
        sync()
        host_buf.index_copy_(0, torch.tensor(ids["host"]), values)
        t1 = perf()
        values = host_buf.index_select(0, torch.tensor(ids["host"]))
        values = values.to(dev, non_blocking=pinned)
        pool.index_copy_(0, torch.tensor(ids["device"], device=dev), values)
        sync()
        return t1 - t0, perf() - t1

    def moves() -> tuple[float, float]:
        """The trie's gathered move (`BlockMove`) alone, the same blocks: the copy without
        the API's bookkeeping (no side stream on CUDA: timed to a synchronize)."""
        sync()
        t0 = perf()
        with torch.no_grad():
            store = BlockMove(pool, ids["device"], host_buf, ids["host"])
            store.run()
            sync()
            store.release()
            t1 = perf()
            load = BlockMove(host_buf, ids["host"], pool, ids["device"])
            load.run()
            sync()
            load.release()
        return t1 - t0, perf() - t1

    def plain_whole() -> tuple[float, float]:
        """One contiguous ``copy_`` of the same bytes (the upper bound)."""
        sync()
        t0 = perf()
        host_buf[:blocks].copy_(pool[:blocks], non_blocking=pinned)
        sync()
        t1 = perf()
        pool[:blocks].copy_(host_buf[:blocks], non_blocking=pinned)
        sync()
        return t1 - t0, perf() - t1

    runs: dict[str, Callable[[], tuple[float, float]]] = {
        "api": round_trip,
        "move": moves,
        "plain_blocks": plain_blocks,
        "gathered": gathered,
        "plain_whole": plain_whole,
    }
    for fn in runs.values():  # warm up: first-touch page faults are not copies
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(repeat):  # interleaved: every variant runs once per round
        for name, fn in runs.items():
            gc.collect()
            times[name].append(fn())
    out: dict[str, Any] = {
        "blocks": blocks,
        "block_shape": list(block_shape),
        "dtype": str(dtype).removeprefix("torch."),
        "block_bytes": nbytes // blocks,
        "bytes": nbytes,
        "device": str(dev),
        "pinned": pinned,
        "repeat": repeat,
        "layout": layout,
        "threads": torch.get_num_threads(),
        "device_runs": _count_runs(ids["device"]),
        "host_runs": _count_runs(ids["host"]),
    }
    for i, direction in enumerate(("store", "load")):
        best = {name: nbytes / min(t[i] for t in ts) for name, ts in times.items()}
        api = best["api"]
        d: dict[str, Any] = {"bytes_per_s": api}
        for name, key in (
            ("move", "move"),
            ("plain_blocks", "plain_blocks"),
            ("gathered", "gathered"),
            ("plain_whole", "plain_whole"),
        ):
            d[f"{key}_bytes_per_s"] = best[name]
            d[f"vs_{key}"] = api / best[name]
            ratios = [b[i] / a[i] for a, b in zip(times["api"], times[name], strict=True)]
            d[f"vs_{key}_median"] = statistics.median(ratios)
            d[f"vs_{key}_range"] = [min(ratios), max(ratios)]
        d["move_vs_plain_blocks"] = best["move"] / best["plain_blocks"]
        d["move_vs_plain_whole"] = best["move"] / best["plain_whole"]
        out[direction] = d
    return out


def _count_runs(ids: list[int]) -> int:
    """How many runs of consecutive blocks `ids` (non-empty) fall into."""
    s = sorted(ids)
    return 1 + sum(b != a + 1 for a, b in itertools.pairwise(s))


# --------------------------------------------------------------------------


def bench_host(
    users: int = 48,
    blocks: int = 2048,
    block_shape: tuple[int, ...] = DEFAULT_BLOCK_SHAPE,
    device: str | torch.device = "cpu",
    repeat: int = 5,
    seed: int = 0,
    layouts: tuple[str, ...] = LAYOUTS,
    loop: bool = True,
) -> dict[str, Any]:
    """The measurements: ``{"loop": bench_loop(...), "copy": bench_copy(...)}`` and, for
    each further layout in `layouts`, ``"copy_<layout>"`` (``copy`` is the first
    layout's). `loop=False` skips the request loop."""
    out: dict[str, Any] = {}
    if loop:
        out["loop"] = bench_loop(users=users, repeat=repeat, seed=seed)
    for i, layout in enumerate(layouts):
        out["copy" if i == 0 else f"copy_{layout}"] = bench_copy(
            blocks=blocks, block_shape=block_shape, device=device, repeat=repeat, layout=layout
        )
    return out


def _gib(bps: float) -> str:
    return f"{bps / 2**30:6.2f} GiB/s"


def print_host(r: dict[str, Any], emit: Callable[[str], object] = print) -> None:
    """Human-readable summary of `bench_host`'s result."""
    if "loop" in r:
        _print_loop(r["loop"], emit)
    for key in sorted(k for k in r if k.startswith("copy")):
        _print_copy(r[key], emit)


def _print_loop(loop: dict[str, Any], emit: Callable[[str], object]) -> None:
    emit(
        f"host tier, request loop: {loop['workload']}; {loop['blocks']:,} prompt+decode "
        f"blocks; median of {loop['repeat']} interleaved rounds"
    )
    for name, what in (
        ("no_host", "never evicts (write-through stores only)"),
        ("evicting", "evicts to and loads from the host"),
    ):
        c = loop[name]
        emit(
            f"  {name:<9} {c['capacity']:>7,} blocks, host {c['host_blocks']:,}: "
            f"off {c['off_ns_per_block']:7.0f} ns/block, on {c['on_ns_per_block']:7.0f} "
            f"ns/block = {c['ratio']:.2f}x  ({what}; hit rate {c['off_hit_rate']:.2%} -> "
            f"{c['on_hit_rate']:.2%}, {c['stored_blocks']:,} stored, "
            f"{c['loaded_blocks']:,} loaded)"
        )
    emit(
        f"  host tier on / off, never touching the host: {loop['no_host']['ratio']:.2f}x "
        "(goal <= 1.3x)"
    )


def _print_copy(cp: dict[str, Any], emit: Callable[[str], object]) -> None:
    emit(
        f"host tier, copies ({cp.get('layout', 'fresh')} blocks: {cp.get('device_runs', '?')} "
        f"device / {cp.get('host_runs', '?')} host runs): {cp['blocks']:,} blocks of "
        f"{'x'.join(map(str, cp['block_shape']))} {cp['dtype']} ({cp['block_bytes'] / 1024:g} "
        f"KiB each, {cp['bytes'] / 2**20:.0f} MiB), device {cp['device']}"
        f"{' (pinned host buffer)' if cp['pinned'] else ''}, {cp.get('threads', '?')} "
        f"thread(s); best of {cp['repeat']} interleaved rounds (median ratio in brackets)"
    )
    for direction, api in (("store", "commit + poll"), ("load", "load + wait + poll")):
        d = cp[direction]
        emit(
            f"  {direction:<5} API ({api}) {_gib(d['bytes_per_s'])}; the gathered move "
            f"alone {_gib(d['move_bytes_per_s'])}"
        )
        for key, what in (
            ("plain_blocks", "copy_ per block"),
            ("gathered", "index_select + index_copy_"),
            ("plain_whole", "one contiguous copy_"),
        ):
            emit(
                f"        vs {what:<27} {_gib(d[f'{key}_bytes_per_s'])}: API "
                f"{d[f'vs_{key}']:.2f}x [{d[f'vs_{key}_median']:.2f}x], move "
                f"{d['move_bytes_per_s'] / d[f'{key}_bytes_per_s']:.2f}x"
            )
    emit("  goal: >= 0.9x of plain copy_")


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--users", type=int, default=48, help="built-in workload sessions")
    p.add_argument("--blocks", type=int, default=2048, help="blocks per store/load round trip")
    p.add_argument("--block-shape", type=_shape, default=DEFAULT_BLOCK_SHAPE)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help=f"copy: comma-separated block layouts, of {', '.join(LAYOUTS)}",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--copy-only", action="store_true", help="skip the request loop")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    layouts = tuple(x.strip() for x in a.layouts.split(",") if x.strip())
    r = bench_host(
        a.users, a.blocks, a.block_shape, a.device, a.repeat, layouts=layouts, loop=not a.copy_only
    )
    print_host(r)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
