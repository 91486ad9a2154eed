"""Hit rate against the number of replicas, per router: ``python -m bench.fleet``.

Replays a workload (default: the Mooncake conversation trace, blocks of 512
tokens, one per hash id) across 1, 2, 4, 8 replicas of `--capacity` blocks
each with `cache.planner.fleet`, for round-robin, prefix (pure: longest
cached prefix, ties by load) and prefix with a load bound
(``--prefix-max-load``), prints a markdown table and draws the PNG used in
docs/events.md:

    python -m bench.fleet --trace ../shared/traces/conversation_trace.jsonl \\
        --out docs/fleet_hit_rate.png

Needs the ``events`` and ``cli`` extras (msgspec, xxhash, matplotlib).
With one replica every router gives the same replay, so it runs once.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/fleet.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import default_traces_dir
from cache.planner.fleet import FleetResult, make_router, replay_fleet
from cache.planner.traces import load_trace
from cache.planner.workload import count_prefix_hits

SERIES: tuple[tuple[str, str, float | None], ...] = (
    ("round-robin", "round-robin", None),
    ("prefix", "prefix (ties by load)", None),
    ("prefix", "prefix, --prefix-max-load {load:g}", 0.0),  # 0.0: the --max-load value
)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    workload = load_trace(args.trace, args.format, None)
    if args.limit:
        workload = workload.head(args.limit)
    count = count_prefix_hits(workload, args.block_size, None)
    print(
        f"{workload.name}: {len(workload):,} requests, ceiling {count.hit_rate:.2%}, "
        f"{count.unique_blocks:,} distinct blocks of {args.block_size}",
        file=sys.stderr,
    )
    rows: list[dict[str, Any]] = []
    single: FleetResult | None = None
    for n in args.replicas:
        for router, label, load in SERIES:
            max_load = args.max_load if load is not None else None
            t0 = time.perf_counter()
            if n == 1 and single is not None:
                result = single
            else:
                result = replay_fleet(
                    workload,
                    make_router(router, n, block_size=args.block_size, max_load=max_load),
                    block_size=args.block_size,
                    capacity=args.capacity,
                    concurrency=args.concurrency,
                )
                if n == 1:
                    single = result
            row = {
                "replicas": n,
                "series": label.format(load=args.max_load),
                "hit_rate": result.hit_rate,
                "load_balance": result.load_balance,
                "evicted_blocks": sum(r.evicted_blocks for r in result.replicas),
                "ceiling": count.hit_rate,
            }
            rows.append(row)
            print(
                f"{n} x {row['series']}: {row['hit_rate']:.2%}, max/mean "
                f"{row['load_balance']:.2f} ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    series = list(dict.fromkeys(r["series"] for r in rows))
    ns = sorted({r["replicas"] for r in rows})
    at = {(r["replicas"], r["series"]): r for r in rows}
    out = ["| replicas | " + " | ".join(series) + " |", "|---:|" + "---:|" * len(series)]
    for n in ns:
        cells = [f"{at[n, s]['hit_rate']:.2%} ({at[n, s]['load_balance']:.2f})" for s in series]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for label in dict.fromkeys(r["series"] for r in rows):
            pts = sorted((r["replicas"], r["hit_rate"] * 100) for r in rows if r["series"] == label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=label)
        ceiling = rows[0]["ceiling"] * 100
        ax.axhline(
            ceiling, color="grey", linestyle=":", label=f"ceiling (unbounded) {ceiling:.1f}%"
        )
        ns = sorted({r["replicas"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("replicas")
        ax.set_ylabel("prompt-token hit rate (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--trace",
        default=str(default_traces_dir() / "conversation_trace.jsonl"),
        help="default: conversation_trace.jsonl in $BLOCKTRIE_TRACES_DIR, else in "
        "../shared/traces beside the checkout",
    )
    p.add_argument("--format", default="mooncake", choices=("mooncake", "bailian", "tokens"))
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--capacity", type=int, default=20_000, help="KV blocks per replica")
    p.add_argument("--concurrency", type=int, default=32, help="live requests per replica")
    p.add_argument(
        "--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8]
    )
    p.add_argument("--max-load", type=float, default=1.25, help="the bounded series' F")
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    p.add_argument("--out", default="docs/fleet_hit_rate.png")
    args = p.parse_args(argv)
    rows = run(args)
    print(table(rows))
    title = (
        f"{Path(args.trace).name}: {args.capacity:,} blocks of {args.block_size} tokens "
        f"per replica, {args.concurrency} live requests per replica"
    )
    plot(rows, args.out, title)
    print(f"plot written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
