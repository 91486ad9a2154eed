"""The ``blocktrie`` command: ``replay`` (the capacity planner) and ``demo``.

``blocktrie replay`` answers "how much KV and state memory does my workload
need, and what hit rate will I get?": it replays a workload (the built-in
synthetic one, or a trace) through an ids-only `cache.BlockTrie` at one or
several capacities and reports hit rate, tokens saved, evictions, checkpoint
hits and peak pins. See docs/replay.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from cache.replay import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    CheckpointPolicy,
    ReplayResult,
    run_replay,
)
from cache.workload import (
    TRACE_BLOCK_TOKENS,
    PrefixCount,
    SyntheticParams,
    TraceError,
    Workload,
    count_prefix_hits,
    load_trace,
    synthetic_workload,
)

__all__ = ["build_parser", "main"]

PROG = "blocktrie"
STANDARD_POLICIES: tuple[str, ...] = (
    "prompt-end",
    "branch-points",
    "branch-points+prompt-end",
    "chunk-boundaries",
    "every-block",
    "every-n",
    "branch-points+prompt-end+decode-end",
    DEFAULT_POLICY,
    DEFAULT_POLICY + "+spare-slots",
)
"""What ``--ckpt-policy all`` compares."""


class UsageError(Exception):
    """A flag value the parser could not reject by itself."""


# --------------------------------------------------------------------------
# Argument parsing


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def _int_list(text: str) -> list[int]:
    values: list[int] = []
    for part in text.split(","):
        part = part.strip().lower().replace("_", "")
        if not part:
            continue
        scale = 1
        if part[-1:] in ("k", "m"):
            scale = 1000 if part[-1] == "k" else 1000_000
            part = part[:-1]
        try:
            value = round(float(part) * scale)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated positive integers (e.g. 1000,4k,1m), got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"values must be positive, got {text!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return sorted(set(values))


def _policy_list(text: str) -> list[str]:
    specs = [s.strip() for s in text.split(",") if s.strip()]
    out: list[str] = []
    for spec in specs:
        if spec == "all":
            out.extend(STANDARD_POLICIES)
            continue
        try:
            out.append(CheckpointPolicy.parse(spec).name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one checkpoint policy")
    return list(dict.fromkeys(out))


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except unset ones (their help says what unset means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="blocktrie: a prefix cache for hybrid attention + SSM models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    rp = sub.add_parser(
        "replay",
        help="capacity planner: replay a workload, report hit rate and memory",
        description=(
            "Replay a workload through the cache and report how much KV (and SSM state) "
            "memory it needs and the hit rate it gets. Without --trace, a built-in "
            "synthetic chat + agentic workload is used."
        ),
        formatter_class=_DefaultsFormatter,
    )
    wl = rp.add_argument_group("workload")
    wl.add_argument("--trace", metavar="FILE", help="Mooncake jsonl or token-id jsonl trace")
    wl.add_argument(
        "--trace-format",
        choices=("auto", "mooncake", "tokens"),
        default="auto",
        help="trace format (auto: from the first line)",
    )
    wl.add_argument(
        "--trace-block-tokens",
        type=_positive,
        default=TRACE_BLOCK_TOKENS,
        metavar="N",
        help="tokens per hash id in a Mooncake trace",
    )
    wl.add_argument("--limit", type=_positive, metavar="N", help="replay only the first N requests")
    d = SyntheticParams()
    wl.add_argument("--users", type=_positive, default=d.users, help="built-in: sessions")
    wl.add_argument("--turns", type=_positive, default=d.turns, help="built-in: turns per session")
    wl.add_argument(
        "--system-prompts",
        type=_positive,
        default=d.system_prompts,
        help="built-in: distinct shared system prompts",
    )
    wl.add_argument(
        "--system-tokens",
        type=_non_negative,
        default=d.system_tokens,
        help="built-in: mean system prompt length",
    )
    wl.add_argument(
        "--user-tokens",
        type=_positive,
        default=d.user_tokens,
        help="built-in: mean user message length",
    )
    wl.add_argument(
        "--output-tokens",
        type=_non_negative,
        default=d.output_tokens,
        help="built-in: mean answer length",
    )
    wl.add_argument(
        "--agentic",
        type=_fraction,
        default=d.agentic,
        help="built-in: fraction of agentic (tool-call) sessions",
    )
    wl.add_argument(
        "--tool-calls",
        type=_non_negative,
        default=d.tool_calls,
        help="built-in: tool calls per agentic turn",
    )
    wl.add_argument(
        "--tool-result-tokens",
        type=_non_negative,
        default=d.tool_result_tokens,
        help="built-in: mean tool result length",
    )
    wl.add_argument("--seed", type=int, default=d.seed, help="built-in: random seed")

    ca = rp.add_argument_group("cache")
    ca.add_argument(
        "--capacity",
        type=_positive,
        metavar="BLOCKS",
        help="KV blocks in the pool (default: enough to never evict)",
    )
    ca.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block")
    ca.add_argument(
        "--concurrency",
        type=_positive,
        default=32,
        help="requests live at once (their blocks cannot be evicted)",
    )
    ca.add_argument(
        "--max-decode-tokens",
        type=_non_negative,
        metavar="N",
        help="decode at most N output tokens per request (default: all)",
    )
    ca.add_argument(
        "--sweep",
        type=_int_list,
        metavar="CAPACITIES",
        help="replay at each of these capacities (comma-separated blocks, e.g. 2k,8k,32k)",
    )

    ss = rp.add_argument_group("SSM state (hybrid models)")
    ss.add_argument(
        "--ssm",
        action="store_true",
        help="hybrid model: hits end at SSM checkpoints; compare to attention-only",
    )
    ss.add_argument(
        "--ckpt-policy",
        type=_policy_list,
        default=[DEFAULT_POLICY],
        metavar="POLICIES",
        help=(
            "comma-separated checkpoint placements to compare, each a '+' combination of "
            f"{', '.join(POLICY_NAMES)}; 'all' compares the standard set"
        ),
    )
    ss.add_argument(
        "--blocks-per-slot",
        type=_positive,
        default=8,
        metavar="R",
        help="state budget: one checkpoint slot per R KV blocks",
    )
    ss.add_argument(
        "--sweep-blocks-per-slot",
        type=_int_list,
        metavar="LIST",
        help="replay at each of these state budgets (comma-separated R values)",
    )
    ss.add_argument(
        "--state-slots",
        type=_positive,
        metavar="N",
        help="state budget in slots (overrides --blocks-per-slot)",
    )
    ss.add_argument(
        "--ckpt-interval",
        type=_positive,
        metavar="TOKENS",
        help="every-n: tokens between checkpoints (default: 2 x R x block size)",
    )
    ss.add_argument(
        "--chunk-size",
        type=_positive,
        default=2048,
        metavar="TOKENS",
        help="chunk-boundaries: prefill chunk size",
    )

    me = rp.add_argument_group("memory (optional, to report bytes)")
    me.add_argument(
        "--kv-bytes-per-token",
        type=_positive,
        metavar="BYTES",
        help="KV bytes per token of your model (all layers, K and V)",
    )
    me.add_argument(
        "--state-bytes-per-slot",
        type=_positive,
        metavar="BYTES",
        help="SSM state bytes per checkpoint (all layers)",
    )

    out = rp.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    out.add_argument("--plot", metavar="FILE", help="write a PNG of hit rate against capacity")
    prog = out.add_mutually_exclusive_group()
    prog.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show a progress bar (default: when stderr is a terminal)",
    )
    prog.add_argument("--no-progress", dest="progress", action="store_false")
    out.add_argument(
        "--check", action="store_true", help="verify every cache invariant after each replay (slow)"
    )
    rp.set_defaults(func=_cmd_replay)

    dm = sub.add_parser(
        "demo",
        help="serve a tiny hybrid model over a short chat; check outputs equal cold runs",
    )
    dm.add_argument("--seed", type=int, default=0, help="model weights and chat seed")
    dm.set_defaults(func=_cmd_demo)
    return parser


# --------------------------------------------------------------------------
# replay


@dataclass(frozen=True)
class _Run:
    capacity: int
    policy: str  # "kv" or a policy name
    blocks_per_slot: int | None
    slots: int


def _load_workload(args: argparse.Namespace) -> Workload[Any]:
    if args.trace is not None:
        workload = load_trace(args.trace, args.trace_format, args.trace_block_tokens)
    else:
        workload = synthetic_workload(
            SyntheticParams(
                users=args.users,
                turns=args.turns,
                system_prompts=args.system_prompts,
                system_tokens=args.system_tokens,
                user_tokens=args.user_tokens,
                output_tokens=args.output_tokens,
                agentic=args.agentic,
                tool_calls=args.tool_calls,
                tool_result_tokens=args.tool_result_tokens,
                seed=args.seed,
            )
        )
    if args.limit is not None:
        workload = workload.head(args.limit)
    return workload


def _plan_runs(args: argparse.Namespace, infinite: int) -> list[_Run]:
    capacities = args.sweep if args.sweep else [args.capacity or infinite]
    if args.capacity and args.sweep and args.capacity not in capacities:
        capacities = sorted({*capacities, args.capacity})
    runs: list[_Run] = []
    for cap in capacities:
        runs.append(_Run(cap, "kv", None, 0))
        if not args.ssm:
            continue
        if args.state_slots is not None:
            budgets: list[int | None] = [None]
        else:
            budgets = list(args.sweep_blocks_per_slot or [args.blocks_per_slot])
        for policy in args.ckpt_policy:
            for r in budgets:
                slots = args.state_slots if r is None else max(1, cap // r)
                runs.append(_Run(cap, policy, r, slots))
    return runs


def _gib(blocks: int, block_size: int, per_token: int | None) -> float | None:
    return None if per_token is None else blocks * block_size * per_token / 2**30


def _fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}G"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e4:
        return f"{n / 1e3:.1f}k"
    return f"{n:,.0f}"


def _run_label(run: _Run) -> str:
    return run.policy if run.policy == "kv" else f"{run.policy} @ {run.slots} slots"


def _result_dict(
    result: ReplayResult, args: argparse.Namespace, run: _Run, kv: ReplayResult | None
) -> dict[str, Any]:
    out = result.to_dict()
    out["blocks_per_slot"] = run.blocks_per_slot
    if args.kv_bytes_per_token:
        out["kv_bytes"] = result.capacity * result.block_size * args.kv_bytes_per_token
    if args.state_bytes_per_slot and result.state_slots:
        out["state_bytes"] = result.state_slots * args.state_bytes_per_slot
    if kv is not None and run.policy != "kv":
        out["kv_hit_rate"] = kv.hit_rate
        out["hit_rate_vs_kv"] = result.hit_rate - kv.hit_rate
    return out


def _recommend(results: list[tuple[_Run, ReplayResult]], ceiling: float) -> int | None:
    """Smallest swept capacity whose attention-only hit rate is within 1 point of the ceiling."""
    caps = sorted(
        r.capacity for run, r in results if run.policy == "kv" and r.hit_rate >= ceiling - 0.01
    )
    return caps[0] if caps else None


def _print_report(
    stream: TextIO,
    workload: Workload[Any],
    args: argparse.Namespace,
    count: PrefixCount,
    results: list[tuple[_Run, ReplayResult]],
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
        + (f" ({_fmt_bytes(count.unique_blocks * bs * per_token)})" if per_token else "")
        + f" and hit {count.hit_rate:.2%} of prompt tokens."
    )
    if len(results) == 1:
        run, r = results[0]
        table = Table(box=box.SIMPLE_HEAVY, show_header=False, title="replay summary")
        table.add_column("metric", style="bold")
        table.add_column("value", justify="right")
        cap = f"{r.capacity:,} blocks" + (
            f" ({_fmt_bytes(r.capacity * bs * per_token)})" if per_token else ""
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
                f"{r.requests_per_s:,.0f} req/s, {_fmt_count(r.tokens_per_s)} tok/s, "
                f"{r.us_per_block:.2f} us/block",
            ),
        ]
        for name, value in rows:
            table.add_row(name, value)
        console.print(table)
    else:
        ssm = any(run.policy != "kv" for run, _ in results)
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
                cells.append(_fmt_bytes(r.capacity * bs * per_token))
            if ssm:
                cells.append(run.policy)
                cells.append(f"{r.state_slots:,}" if r.state_slots else "-")
                if args.state_bytes_per_slot:
                    cells.append(
                        _fmt_bytes(r.state_slots * args.state_bytes_per_slot)
                        if r.state_slots
                        else "-"
                    )
            cells += [f"{r.requests:,}", _fmt_count(r.prompt_tokens), f"{r.hit_rate:.2%}"]
            if ssm:
                kv = kv_by_cap.get(r.capacity)
                cells.append(
                    ""
                    if run.policy == "kv" or kv is None
                    else f"{(r.hit_rate - kv.hit_rate) * 100:+.2f} pt"
                )
            cells += [_fmt_count(r.tokens_saved), _fmt_count(r.evicted_blocks)]
            if ssm:
                cells.append(f"{r.checkpoint_hits:,}" if run.policy != "kv" else "-")
            cells += [f"{r.peak_pinned_blocks:,}", f"{r.rejected:,}", f"{r.requests_per_s:,.0f}"]
            table.add_row(*cells)
        console.print(table)
    if len({run.capacity for run, _ in results}) > 1:
        best = _recommend(results, count.hit_rate)
        if best is not None:
            mem = f" ({_fmt_bytes(best * bs * per_token)})" if per_token else ""
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


def _write_plot(
    path: str,
    args: argparse.Namespace,
    workload: Workload[Any],
    count: PrefixCount,
    results: list[tuple[_Run, ReplayResult]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for run, r in results:
        label = "attention-only (KV)" if run.policy == "kv" else run.policy
        if run.policy != "kv" and (args.sweep_blocks_per_slot or args.state_slots):
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


def _progress_bar(
    enabled: bool, total: int, delay: float
) -> tuple[Callable[[str], Callable[[int], None]] | None, Callable[[], None]]:
    """(make a per-run progress callback, close); (None, no-op) when disabled."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(
        total=total, unit="req", file=sys.stderr, dynamic_ncols=True, mininterval=0.5, delay=delay
    )
    state = {"last": 0}

    def for_run(label: str) -> Callable[[int], None]:
        state["last"] = 0
        bar.set_description(label)

        def update(done: int) -> None:
            bar.update(done - state["last"])
            state["last"] = done

        return update

    return for_run, bar.close


def _cmd_replay(args: argparse.Namespace) -> int:
    if args.plot is not None:
        parent = Path(args.plot).resolve().parent
        if not parent.is_dir():
            raise UsageError(f"--plot {args.plot}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise UsageError(f"--plot {args.plot}: directory {parent} is not writable")
    if (args.sweep_blocks_per_slot or args.state_slots) and not args.ssm:
        raise UsageError("--sweep-blocks-per-slot and --state-slots need --ssm")
    workload = _load_workload(args)
    bs = args.block_size
    count = count_prefix_hits(workload, bs, args.max_decode_tokens)
    # Never evicts: every distinct block, plus what the live window holds privately.
    infinite = count.unique_blocks + (args.concurrency + 1) * (count.max_request_blocks + 1)
    if args.ssm:
        r_min = min(args.sweep_blocks_per_slot or [args.blocks_per_slot])
        infinite += args.state_slots or infinite // r_min  # frozen tails of partial checkpoints
    runs = _plan_runs(args, infinite)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    if args.json:
        show = False
    # Automatic bars appear only on runs long enough to need one (after 1 s).
    delay = 0.0 if args.progress else 1.0
    make_progress, close = _progress_bar(show, len(workload) * len(runs), delay)
    results: list[tuple[_Run, ReplayResult]] = []
    kv_by_cap: dict[int, ReplayResult] = {}
    try:
        for run in runs:
            policy = None
            if run.policy != "kv":
                # Periodic checkpoints take at most half the budget: one per 2R blocks.
                ratio = run.blocks_per_slot or args.blocks_per_slot
                interval = args.ckpt_interval or 2 * ratio * bs
                policy = CheckpointPolicy.parse(run.policy, interval, args.chunk_size)
            progress = (
                make_progress(f"{_fmt_count(run.capacity)} blocks {run.policy}")
                if make_progress
                else None
            )
            result = run_replay(
                workload,
                block_size=bs,
                capacity=run.capacity,
                concurrency=args.concurrency,
                max_decode_tokens=args.max_decode_tokens,
                policy=policy,
                state_slots=run.slots,
                progress=progress,
                check=args.check,
            )
            results.append((run, result))
            if run.policy == "kv":
                kv_by_cap[run.capacity] = result
    finally:
        close()

    if args.plot is not None:
        _write_plot(args.plot, args, workload, count, results)
    if args.json:
        dicts = [_result_dict(r, args, run, kv_by_cap.get(run.capacity)) for run, r in results]
        primary_index = max(
            range(len(results)),
            key=lambda i: (
                results[i][0].capacity,
                results[i][0].policy != "kv" if args.ssm else 0,
                -i,
            ),
        )
        doc: dict[str, Any] = dict(dicts[primary_index])
        doc["workload_description"] = workload.description
        doc["unbounded_hit_rate"] = count.hit_rate
        doc["unbounded_blocks"] = count.unique_blocks
        if len(dicts) > 1:
            doc["runs"] = dicts
            best = _recommend(results, count.hit_rate)
            doc["recommended_capacity"] = best
        json.dump(doc, sys.stdout, indent=None if len(dicts) == 1 else 1)
        sys.stdout.write("\n")
    else:
        _print_report(sys.stdout, workload, args, count, results, kv_by_cap, infinite)
        if args.plot is not None:
            print(f"plot written to {args.plot}")
    return 0


# --------------------------------------------------------------------------
# demo


def _cmd_demo(args: argparse.Namespace) -> int:
    import importlib

    demo = importlib.import_module("cache.demo")  # lazily: only this subcommand needs it
    result = demo.run_demo(seed=args.seed)
    print(demo.format_demo(result))
    return 0 if result.identical else 1


# --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blocktrie`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except (TraceError, UsageError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
