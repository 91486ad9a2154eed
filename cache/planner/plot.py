"""The --plot figure: hit rate against KV capacity, one line per policy (matplotlib, lazily)."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from cache.planner.plan import Run
from cache.planner.policy import KV
from cache.planner.replay import ReplayResult
from cache.planner.workload import PrefixCount, Workload

__all__ = ["write_plot"]


def write_plot(
    path: str,
    args: argparse.Namespace,
    workload: Workload[Any],
    count: PrefixCount,
    results: list[tuple[Run, ReplayResult]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for run, r in results:
        label = "attention-only (KV)" if run.policy == KV else run.policy
        if run.policy != KV and (args.sweep_blocks_per_slot or args.state_slots):
            label += (
                f", {r.state_slots} slots"
                if args.state_slots
                else f", 1 slot/{run.blocks_per_slot} blocks"
            )
        series.setdefault(label, []).append((r.capacity, r.hit_rate * 100))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for label, points in series.items():
        points.sort()
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        style = "-o" if label.startswith("attention") else "--."
        ax.plot(xs, ys, style, label=label, linewidth=2 if label.startswith("attention") else 1.2)
    ax.axhline(count.hit_rate * 100, color="grey", linestyle=":", label="unbounded cache")
    caps = sorted({run.capacity for run, _ in results})
    if len(caps) > 1 and caps[-1] / caps[0] >= 20:
        ax.set_xscale("log")
    xlabel = f"KV capacity (blocks of {args.block_size} tokens)"
    if args.kv_bytes_per_token:
        gib = args.block_size * args.kv_bytes_per_token / 2**30
        xlabel += f"; 1k blocks = {gib * 1000:.2f} GiB"
    ax.set_xlabel(xlabel)
    ax.set_ylabel("prompt-token hit rate (%)")
    ax.set_title(f"blocktrie replay: {workload.name}, {count.requests:,} requests", fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".blocktrie-plot-", suffix=".png", dir=target.parent or ".")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
