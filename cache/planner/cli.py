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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cache.planner.plan import Run, never_evict_capacity, plan_runs, recommend
from cache.planner.plot import write_plot
from cache.planner.policy import DEFAULT_POLICY, KV, POLICY_NAMES, CheckpointPolicy
from cache.planner.replay import ReplayResult, run_replay
from cache.planner.report import fmt_count, print_report, result_dict
from cache.planner.traces import TRACE_BLOCK_TOKENS, TraceError, load_trace
from cache.planner.workload import SyntheticParams, Workload, count_prefix_hits, synthetic_workload

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
    infinite = never_evict_capacity(
        count,
        args.concurrency,
        ssm=args.ssm,
        state_slots=args.state_slots,
        min_blocks_per_slot=min(args.sweep_blocks_per_slot or [args.blocks_per_slot]),
    )
    capacities = args.sweep if args.sweep else [args.capacity or infinite]
    if args.capacity and args.sweep and args.capacity not in capacities:
        capacities = sorted({*capacities, args.capacity})
    runs = plan_runs(
        capacities,
        ssm=args.ssm,
        policies=args.ckpt_policy,
        blocks_per_slot=args.sweep_blocks_per_slot or [args.blocks_per_slot],
        state_slots=args.state_slots,
    )
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    if args.json:
        show = False
    # Automatic bars appear only on runs long enough to need one (after 1 s).
    delay = 0.0 if args.progress else 1.0
    make_progress, close = _progress_bar(show, len(workload) * len(runs), delay)
    results: list[tuple[Run, ReplayResult]] = []
    kv_by_cap: dict[int, ReplayResult] = {}
    try:
        for run in runs:
            policy = None
            if run.policy != KV:
                # Periodic checkpoints take at most half the budget: one per 2R blocks.
                ratio = run.blocks_per_slot or args.blocks_per_slot
                interval = args.ckpt_interval or 2 * ratio * bs
                policy = CheckpointPolicy.parse(run.policy, interval, args.chunk_size)
            progress = (
                make_progress(f"{fmt_count(run.capacity)} blocks {run.policy}")
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
            if run.policy == KV:
                kv_by_cap[run.capacity] = result
    finally:
        close()

    if args.plot is not None:
        write_plot(args.plot, args, workload, count, results)
    if args.json:
        dicts = [result_dict(r, args, run, kv_by_cap.get(run.capacity)) for run, r in results]
        primary_index = max(
            range(len(results)),
            key=lambda i: (
                results[i][0].capacity,
                results[i][0].policy != KV if args.ssm else 0,
                -i,
            ),
        )
        doc: dict[str, Any] = dict(dicts[primary_index])
        doc["workload_description"] = workload.description
        doc["unbounded_hit_rate"] = count.hit_rate
        doc["unbounded_blocks"] = count.unique_blocks
        if len(dicts) > 1:
            doc["runs"] = dicts
            best = recommend(results, count.hit_rate)
            doc["recommended_capacity"] = best
        json.dump(doc, sys.stdout, indent=None if len(dicts) == 1 else 1)
        sys.stdout.write("\n")
    else:
        print_report(sys.stdout, workload, args, count, results, kv_by_cap, infinite)
        if args.plot is not None:
            print(f"plot written to {args.plot}")
    return 0


# --------------------------------------------------------------------------
# demo


def _cmd_demo(args: argparse.Namespace) -> int:
    import importlib

    demo = importlib.import_module("cache.planner.demo")  # lazily: only this subcommand needs it
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
