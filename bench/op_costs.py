"""The cost of each operation per call, on each core: ``python -m bench.op_costs``.

What is left of issue 47's per-block goal is per-call cost (the Python objects
around each native call), which the replay rows mix with the workload's own
shape. This times the calls one by one on a fixed request, so a change to one
operation shows in its own figure:

- a trie of `block_size`-token blocks caches `prompts` distinct prompts of
  `blocks` full blocks and 5 tokens more (random ids below 50,000);
- then, `calls` times, in turns between the cores (so both see the same machine
  load), each prompt in turn is matched (a full hit), then either aborted
  (``abort``) or allocated its one missing block, committed and released
  (``allocate``, ``commit``, ``release``);
- each call is timed alone with `time.perf_counter_ns` (the clock's own cost,
  measured, is taken off) and Python's garbage collector is paused, so that a
  collection is charged to no call.

Figures are medians over `repeat` rounds, in ns per call; ``per_block`` divides
``match`` by the prompt's full blocks. Absolute times move with the machine;
compare the cores, or one core before and after a change, within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

OPS = ("match", "abort", "allocate", "commit", "release")
"""The operations timed, in the order a result lists them."""

BACKENDS = ("native", "python")
"""The cores compared (`CacheConfig.backend`); one that cannot run is left out."""


def _clock_overhead_ns() -> float:
    """What one `perf_counter_ns` read costs (the smallest of a few batches)."""
    clock = time.perf_counter_ns
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(1000):
            clock()
        best = min(best, (clock() - t0) / 1000)
    return best


def _make(backend: str, block_size: int, prompts: list[list[int]]) -> Any:
    """A trie on `backend` with every prompt cached (None when that core cannot run)."""
    from cache import BlockTrie, CacheConfig
    from spec.errors import ConfigError

    blocks = sum(len(p) // block_size + 1 for p in prompts) * 2
    try:
        trie = BlockTrie(
            CacheConfig(
                block_size=block_size, num_blocks=blocks, kv_block_shape=None, backend=backend
            )
        )
    except ConfigError:
        return None
    for p in prompts:
        seq = trie.match(p)
        trie.allocate(seq, len(p))
        trie.commit(seq, len(p))
        trie.release(seq)
    return trie


def _round(trie: Any, prompts: list[list[int]], calls: int, overhead: float) -> dict[str, float]:
    """Mean ns per call of each operation over `calls` requests."""
    clock = time.perf_counter_ns
    total = dict.fromkeys(OPS, 0)
    n = len(prompts)
    for i in range(calls):
        p = prompts[i % n]
        t0 = clock()
        seq = trie.match(p)
        t1 = clock()
        total["match"] += t1 - t0
        if i % 2:
            t0 = clock()
            trie.abort(seq)
            total["abort"] += clock() - t0
            continue
        t0 = clock()
        trie.allocate(seq, len(p))
        t1 = clock()
        trie.commit(seq, len(p))
        t2 = clock()
        trie.release(seq)
        t3 = clock()
        total["allocate"] += t1 - t0
        total["commit"] += t2 - t1
        total["release"] += t3 - t2
    aborted = calls // 2
    counts = {"match": calls, "abort": aborted}
    counts.update(dict.fromkeys(("allocate", "commit", "release"), calls - aborted))
    return {op: total[op] / counts[op] - overhead for op in OPS if counts[op]}


def bench_op_costs(
    blocks: int = 23,
    block_size: int = 16,
    prompts: int = 200,
    calls: int = 4000,
    repeat: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Per-call costs of each operation on each core that runs here (module docstring)."""
    if blocks < 1 or block_size < 1 or prompts < 1 or calls < 2 or repeat < 1:
        raise ValueError("blocks, block_size, prompts and repeat must be >= 1, calls >= 2")
    rng = random.Random(seed)
    length = blocks * block_size + 5
    requests = [[rng.randrange(50_000) for _ in range(length)] for _ in range(prompts)]
    tries = {b: _make(b, block_size, requests) for b in BACKENDS}
    tries = {b: t for b, t in tries.items() if t is not None and t.backend == b}
    overhead = _clock_overhead_ns()
    rounds: dict[str, list[dict[str, float]]] = {b: [] for b in tries}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for backend, trie in tries.items():
                rounds[backend].append(_round(trie, requests, calls, overhead))
    finally:
        if was_enabled:
            gc.enable()
    for trie in tries.values():
        trie.check()
    ns = {b: {op: statistics.median(r[op] for r in rs) for op in OPS} for b, rs in rounds.items()}
    for figures in ns.values():
        figures["per_block"] = figures["match"] / blocks
    return {
        "blocks": blocks,
        "block_size": block_size,
        "prompts": prompts,
        "calls": calls,
        "repeat": repeat,
        "clock_overhead_ns": overhead,
        "ns_per_call": ns,
    }


def print_op_costs(result: dict[str, Any]) -> None:
    """A table of `bench_op_costs`'s result: one row per operation, one column per core."""
    ns = result["ns_per_call"]
    cores = list(ns)
    print(
        f"per call, ns (a hit of {result['blocks']} blocks of {result['block_size']} tokens; "
        f"median of {result['repeat']} rounds of {result['calls']} requests)"
    )
    print(f"{'operation':<12}" + "".join(f"{c:>12}" for c in cores))
    for op in (*OPS, "per_block"):
        label = "match/block" if op == "per_block" else op
        print(f"{label:<12}" + "".join(f"{ns[c][op]:>12,.0f}" for c in cores))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.op_costs", description=__doc__)
    parser.add_argument("--blocks", type=int, default=23, help="full blocks a prompt hits")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--calls", type=int, default=4000, help="requests per round and core")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    result = bench_op_costs(args.blocks, args.block_size, args.prompts, args.calls, args.repeat)
    print_op_costs(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
