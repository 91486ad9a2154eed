"""Rendering a replay report: the terminal table (rich) and the --json form.

Only `print_report` imports rich, when called.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from cache.planner.plan import Run, recommend
from cache.planner.policy import KV
from cache.planner.replay import ReplayResult
from cache.planner.workload import PrefixCount, Workload

__all__ = ["fmt_bytes", "fmt_count", "print_report", "result_dict"]


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}G"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e4:
        return f"{n / 1e3:.1f}k"
    return f"{n:,.0f}"


def result_dict(
    result: ReplayResult, args: argparse.Namespace, run: Run, kv: ReplayResult | None
) -> dict[str, Any]:
    out = result.to_dict()
    out["blocks_per_slot"] = run.blocks_per_slot
    if args.kv_bytes_per_token:
        out["kv_bytes"] = result.capacity * result.block_size * args.kv_bytes_per_token
    if args.state_bytes_per_slot and result.state_slots:
        out["state_bytes"] = result.state_slots * args.state_bytes_per_slot
    if kv is not None and run.policy != KV:
        out["kv_hit_rate"] = kv.hit_rate
        out["hit_rate_vs_kv"] = result.hit_rate - kv.hit_rate
    return out


def print_report(
    stream: TextIO,
    workload: Workload[Any],
    args: argparse.Namespace,
    count: PrefixCount,
    results: list[tuple[Run, ReplayResult]],
    kv_by_cap: dict[int, ReplayResult],
    infinite: int,
) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    probe = Console(file=stream)
    console = Console(file=stream, width=probe.width if probe.is_terminal else 200, highlight=False)
    per_token = args.kv_bytes_per_token
    bs = args.block_size
    console.print(f"[bold]workload[/bold]: {workload.description}")
    console.print(
        f"{count.requests:,} requests, {count.prompt_tokens:,} prompt tokens; "
        f"an unbounded cache would hold {count.unique_blocks:,} blocks of {bs} tokens"
        + (f" ({fmt_bytes(count.unique_blocks * bs * per_token)})" if per_token else "")
        + f" and hit {count.hit_rate:.2%} of prompt tokens."
    )
    if len(results) == 1:
        run, r = results[0]
        table = Table(box=box.SIMPLE_HEAVY, show_header=False, title="replay summary")
        table.add_column("metric", style="bold")
        table.add_column("value", justify="right")
        cap = f"{r.capacity:,} blocks" + (
            f" ({fmt_bytes(r.capacity * bs * per_token)})" if per_token else ""
        )
        if args.capacity is None:
            cap += " (never evicts)"
        rows: list[tuple[str, str]] = [
            ("capacity", cap),
            (
                "requests",
                f"{r.requests:,}" + (f" ({r.rejected:,} rejected: too big)" if r.rejected else ""),
            ),
            ("prompt tokens", f"{r.prompt_tokens:,}"),
            ("hit rate", f"{r.hit_rate:.2%}"),
            ("tokens saved", f"{r.tokens_saved:,}"),
            ("evictions", f"{r.evicted_blocks:,} blocks"),
            ("peak pins", f"{r.peak_pinned_blocks:,} blocks held by live requests"),
            *(
                [
                    ("checkpoint policy", f"{r.policy} ({r.state_slots:,} slots)"),
                    ("checkpoint hits", f"{r.checkpoint_hits:,}"),
                    (
                        "checkpoints saved",
                        f"{r.checkpoints_saved:,} ({r.checkpoints_skipped:,} skipped, "
                        f"{r.evicted_checkpoints:,} evicted)",
                    ),
                    ("peak pins", f"{r.peak_pins:,} checkpoint pins"),
                ]
                if r.state_slots
                else []
            ),
            ("peak cached blocks", f"{r.peak_cached_blocks:,}"),
            (
                "throughput",
                f"{r.requests_per_s:,.0f} req/s, {fmt_count(r.tokens_per_s)} tok/s, "
                f"{r.us_per_block:.2f} us/block",
            ),
        ]
        for name, value in rows:
            table.add_row(name, value)
        console.print(table)
    else:
        ssm = any(run.policy != KV for run, _ in results)
        table = Table(box=box.SIMPLE_HEAVY, title="replay summary")
        table.add_column("capacity", justify="right")
        if per_token:
            table.add_column("KV mem", justify="right")
        if ssm:
            table.add_column("policy")
            table.add_column("slots", justify="right")
            if args.state_bytes_per_slot:
                table.add_column("state mem", justify="right")
        table.add_column("requests", justify="right")
        table.add_column("prompt tok", justify="right")
        table.add_column("hit rate", justify="right")
        if ssm:
            table.add_column("vs KV", justify="right")
        table.add_column("tok saved", justify="right")
        table.add_column("evicted", justify="right")
        if ssm:
            table.add_column("ckpt hits", justify="right")
        table.add_column("peak pins", justify="right")
        table.add_column("rejected", justify="right")
        table.add_column("req/s", justify="right")
        for run, r in results:
            cells = [f"{r.capacity:,}"]
            if per_token:
                cells.append(fmt_bytes(r.capacity * bs * per_token))
            if ssm:
                cells.append(run.policy)
                cells.append(f"{r.state_slots:,}" if r.state_slots else "-")
                if args.state_bytes_per_slot:
                    cells.append(
                        fmt_bytes(r.state_slots * args.state_bytes_per_slot)
                        if r.state_slots
                        else "-"
                    )
            cells += [f"{r.requests:,}", fmt_count(r.prompt_tokens), f"{r.hit_rate:.2%}"]
            if ssm:
                kv = kv_by_cap.get(r.capacity)
                cells.append(
                    ""
                    if run.policy == KV or kv is None
                    else f"{(r.hit_rate - kv.hit_rate) * 100:+.2f} pt"
                )
            cells += [fmt_count(r.tokens_saved), fmt_count(r.evicted_blocks)]
            if ssm:
                cells.append(f"{r.checkpoint_hits:,}" if run.policy != KV else "-")
            cells += [f"{r.peak_pinned_blocks:,}", f"{r.rejected:,}", f"{r.requests_per_s:,.0f}"]
            table.add_row(*cells)
        console.print(table)
    if len({run.capacity for run, _ in results}) > 1:
        best = recommend(results, count.hit_rate)
        if best is not None:
            mem = f" ({fmt_bytes(best * bs * per_token)})" if per_token else ""
            console.print(
                "Smallest swept capacity within 1 point of the unbounded hit rate: "
                f"{best:,} blocks{mem}."
            )
        else:
            console.print(
                f"No swept capacity reaches within 1 point of the unbounded hit rate "
                f"({count.hit_rate:.2%}); {infinite:,} blocks never evict."
            )
    console.print(
        "[dim]hit rate = prompt tokens served from cache / all prompt tokens; "
        "'peak pins' = most KV blocks live requests held at once (a capacity below it "
        "rejects requests).[/dim]"
    )
