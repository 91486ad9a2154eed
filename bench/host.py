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
  was stored. Against, in the same round: a plain ``copy_`` per block between
  the pool and a CPU tensor (what the store and load copies do, one move per
  block), and one ``copy_`` of all the blocks at once. Bandwidth = bytes /
  best time over rounds; issue 10's goal is >= 0.9x of plain ``copy_``. On
  CUDA the host buffer is pinned and every timing ends with a synchronize.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def bench_copy(
    blocks: int = 2048,
    block_shape: tuple[int, ...] = DEFAULT_BLOCK_SHAPE,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    repeat: int = 5,
    block_size: int = 16,
) -> dict[str, Any]:
    """The **copy** measurements (module docstring): bytes per second of the host tier's
    store and load copies through the public API, and of plain ``copy_`` of the same
    bytes, per block and all at once; ratios of the API to each."""
    from cache import BlockTrie, CacheConfig

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    dev = torch.device(device)
    config = CacheConfig(
        block_size=block_size,
        num_blocks=blocks + 1,  # the prompt's partial last block
        num_host_blocks=blocks,
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
    host_buf = torch.empty((blocks, *block_shape), dtype=dtype, pin_memory=pinned)
    tokens = list(range(1, blocks * block_size + 2))

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def round_trip() -> tuple[float, float]:
        """Store `blocks` blocks, offload them, load them back; (store s, load s)."""
        seq = trie.match(tokens)
        trie.allocate(seq, len(tokens))
        ids = torch.tensor(seq.block_ids[:blocks], device=dev)
        pool[ids] = data
        stored = trie.stats.stored_blocks
        sync()
        t0 = perf()
        trie.commit(seq, len(tokens))
        sync()
        trie.poll()
        store = perf() - t0
        trie.release(seq)
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
        sync()
        t0 = perf()
        for i in range(blocks):
            host_buf[i].copy_(pool[i], non_blocking=pinned)
        sync()
        t1 = perf()
        for i in range(blocks):
            pool[i].copy_(host_buf[i], non_blocking=pinned)
        sync()
        return t1 - t0, perf() - t1

    def plain_whole() -> tuple[float, float]:
        sync()
        t0 = perf()
        host_buf.copy_(pool[:blocks], non_blocking=pinned)
        sync()
        t1 = perf()
        pool[:blocks].copy_(host_buf, non_blocking=pinned)
        sync()
        return t1 - t0, perf() - t1

    runs: dict[str, Callable[[], tuple[float, float]]] = {
        "api": round_trip,
        "plain_blocks": plain_blocks,
        "plain_whole": plain_whole,
    }
    for fn in runs.values():  # warm up: first-touch page faults are not copies
        fn()
    best = {name: [float("inf"), float("inf")] for name in runs}
    for _ in range(repeat):  # interleaved, best of N
        for name, fn in runs.items():
            gc.collect()
            store, load = fn()
            best[name][0] = min(best[name][0], store)
            best[name][1] = min(best[name][1], load)
    out: dict[str, Any] = {
        "blocks": blocks,
        "block_shape": list(block_shape),
        "dtype": str(dtype).removeprefix("torch."),
        "block_bytes": nbytes // blocks,
        "bytes": nbytes,
        "device": str(dev),
        "pinned": pinned,
        "repeat": repeat,
    }
    for i, direction in enumerate(("store", "load")):
        api = nbytes / best["api"][i]
        per_block = nbytes / best["plain_blocks"][i]
        whole = nbytes / best["plain_whole"][i]
        out[direction] = {
            "bytes_per_s": api,
            "plain_blocks_bytes_per_s": per_block,
            "plain_whole_bytes_per_s": whole,
            "vs_plain_blocks": api / per_block,
            "vs_plain_whole": api / whole,
        }
    return out


# --------------------------------------------------------------------------


def bench_host(
    users: int = 48,
    blocks: int = 2048,
    block_shape: tuple[int, ...] = DEFAULT_BLOCK_SHAPE,
    device: str | torch.device = "cpu",
    repeat: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Both measurements: ``{"loop": bench_loop(...), "copy": bench_copy(...)}``."""
    return {
        "loop": bench_loop(users=users, repeat=repeat, seed=seed),
        "copy": bench_copy(blocks=blocks, block_shape=block_shape, device=device, repeat=repeat),
    }


def _gib(bps: float) -> str:
    return f"{bps / 2**30:7.2f} GiB/s"


def print_host(r: dict[str, Any], emit: Callable[[str], object] = print) -> None:
    """Human-readable summary of `bench_host`'s result."""
    loop = r["loop"]
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
    cp = r["copy"]
    emit(
        f"host tier, copies: {cp['blocks']:,} blocks of {'x'.join(map(str, cp['block_shape']))} "
        f"{cp['dtype']} ({cp['block_bytes'] / 1024:g} KiB each, {cp['bytes'] / 2**20:.0f} MiB), "
        f"device {cp['device']}{' (pinned host buffer)' if cp['pinned'] else ''}; "
        f"best of {cp['repeat']}"
    )
    for direction, api in (("store", "commit + poll"), ("load", "load + wait + poll")):
        d = cp[direction]
        emit(
            f"  {direction:<5} ({api:<18}) {_gib(d['bytes_per_s'])}   plain copy_ per block "
            f"{_gib(d['plain_blocks_bytes_per_s'])} ({d['vs_plain_blocks']:.2f}x)   all at "
            f"once {_gib(d['plain_whole_bytes_per_s'])} ({d['vs_plain_whole']:.2f}x)"
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
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    r = bench_host(a.users, a.blocks, a.block_shape, a.device, a.repeat)
    print_host(r)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
