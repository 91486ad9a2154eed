"""The ``blocktrie`` command: ``replay`` (the capacity planner) and ``demo``.

``blocktrie replay`` answers "how much KV and state memory does my workload
need, and what hit rate will I get?": it replays a workload (the built-in
synthetic one, or a trace) through an ids-only `cache.BlockTrie` at one or
several capacities and reports hit rate, tokens saved, evictions, checkpoint
hits and peak pins. See docs/replay.md.

Every flag is checked before anything is loaded or replayed: a flag that
would be ignored is an error, and so is a plot path that cannot be written.
Errors are one line on stderr (``blocktrie replay: error: ...``), exit 2 for
bad usage or input, 1 for a failure while running, 130 on Ctrl-C. This module
imports neither torch nor the report libraries, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NoReturn

from cache.planner.execute import EXECUTORS, ReplaySettings, available_cores, run_all
from cache.planner.plan import Run, never_evict_capacity, plan_runs, recommend
from cache.planner.plot import check_plot_path, write_plot
from cache.planner.policy import DEFAULT_POLICY, KV, POLICY_NAMES, CheckpointPolicy
from cache.planner.report import build_report, render_csv, render_text
from cache.planner.traces import FORMATS, TraceError, detect_trace_format, load_trace
from cache.planner.workload import (
    PrefixCount,
    SyntheticParams,
    Workload,
    count_prefix_hits,
    synthetic_workload,
)
from spec.errors import CacheError

__all__ = ["MAX_BLOCKS", "build_parser", "main"]

PROG = "blocktrie"
MAX_BLOCKS = 100_000_000
"""Most KV blocks (and checkpoint slots) a replay's pool may have: above it the
planner's pools would not fit in memory (a million blocks take ~100 MB)."""
MAX_CONCURRENCY = 1_000_000
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

SYNTHETIC_FLAGS = {
    "users": "--users",
    "turns": "--turns",
    "system_prompts": "--system-prompts",
    "system_tokens": "--system-tokens",
    "user_tokens": "--user-tokens",
    "output_tokens": "--output-tokens",
    "agentic": "--agentic",
    "tool_calls": "--tool-calls",
    "tool_result_tokens": "--tool-result-tokens",
    "seed": "--seed",
}
SSM_FLAGS = {
    "ckpt_policy": "--ckpt-policy",
    "blocks_per_slot": "--blocks-per-slot",
    "sweep_blocks_per_slot": "--sweep-blocks-per-slot",
    "state_slots": "--state-slots",
    "ckpt_interval": "--ckpt-interval",
    "chunk_size": "--chunk-size",
    "state_bytes_per_slot": "--state-bytes-per-slot",
}
DEFAULT_BLOCKS_PER_SLOT = 8
DEFAULT_CHUNK = 2048


class UsageError(Exception):
    """A flag combination or value the parser could not reject by itself (exit 2)."""


# --------------------------------------------------------------------------
# Argument types


def _number(text: str, *, minimum: int, maximum: int) -> int:
    """An integer, optionally with a k (1000) or m (1,000,000) suffix: 4k, 1.5m, 2_000."""
    raw = text
    text = text.strip().lower().replace("_", "")
    scale = 1
    if text[-1:] in ("k", "m"):
        scale = 1000 if text[-1] == "k" else 1_000_000
        text = text[:-1]
    try:
        if not text or not all(c.isdigit() or c in ".-+" for c in text):
            raise ValueError
        value = Fraction(text) * scale
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 1000, 4k or 1.5m, got {raw!r}"
        ) from None
    if value.denominator != 1:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {raw!r}")
    if not minimum <= value <= maximum:
        raise argparse.ArgumentTypeError(
            f"expected a value in [{minimum:,}, {maximum:,}], got {raw!r}"
        )
    return int(value)


def _bounded(minimum: int, maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        return _number(text, minimum=minimum, maximum=maximum)

    parse.__name__ = "number"
    return parse


_blocks = _bounded(1, MAX_BLOCKS)
_positive = _bounded(1, 2**40)
_non_negative = _bounded(0, 2**40)


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _list(item: Callable[[str], int]) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError("expected at least one value")
        return sorted({item(p) for p in parts})

    parse.__name__ = "list"
    return parse


def _policy_list(text: str) -> list[str]:
    out: list[str] = []
    for spec in text.split(","):
        spec = spec.strip()
        if not spec:
            continue
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


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (the usage block is what --help is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.HelpFormatter):
    """Help with the default of each valued option, written as it would be typed
    (switches and unset options say nothing; their help says what unset means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or action.nargs == 0
            or "default:" in text
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown})"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("blocktrie")
    except Exception:  # not installed (run from a checkout)
        return "unknown"


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked for (importlib.metadata is slow to load)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"{PROG} {_version()}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="blocktrie: a prefix cache for hybrid attention + SSM models."
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    rp = sub.add_parser(
        "replay",
        help="capacity planner: replay a workload, report hit rate and memory",
        description=(
            "Replay a workload through the cache and report how much KV (and SSM state) "
            "memory it needs and the hit rate it gets. Without --trace, a built-in "
            "synthetic chat + agentic workload is used. Counts take k and m suffixes "
            "(4k = 4,000)."
        ),
        formatter_class=_Formatter,
    )
    wl = rp.add_argument_group("workload")
    wl.add_argument(
        "--trace", metavar="FILE", help="Mooncake, Bailian (Qwen) or token-id jsonl trace"
    )
    wl.add_argument(
        "--trace-format",
        choices=("auto", *FORMATS),
        default="auto",
        help="trace format (auto: from the first line)",
    )
    wl.add_argument(
        "--trace-block-tokens",
        type=_positive,
        metavar="N",
        help="tokens per hash id of a Mooncake or Bailian trace (default: 512 Mooncake, 16 "
        "Bailian)",
    )
    wl.add_argument("--limit", type=_positive, metavar="N", help="replay only the first N requests")
    d = SyntheticParams()
    for dest, help_text, kind in (
        ("users", "sessions", _positive),
        ("turns", "turns per session", _positive),
        ("system_prompts", "distinct shared system prompts", _positive),
        ("system_tokens", "mean system prompt length", _non_negative),
        ("user_tokens", "mean user message length", _positive),
        ("output_tokens", "mean answer length", _non_negative),
        ("agentic", "fraction of agentic (tool-call) sessions", _fraction),
        ("tool_calls", "tool calls per agentic turn", _non_negative),
        ("tool_result_tokens", "mean tool result length", _non_negative),
        ("seed", "random seed", _seed),
    ):
        wl.add_argument(
            SYNTHETIC_FLAGS[dest],
            dest=dest,
            type=kind,
            metavar="N" if kind is not _fraction else "F",
            help=f"built-in: {help_text} (default: {getattr(d, dest)})",
        )

    ca = rp.add_argument_group("cache")
    ca.add_argument(
        "--capacity",
        type=_blocks,
        metavar="BLOCKS",
        help="KV blocks in the pool (default: the never-evict capacity)",
    )
    ca.add_argument(
        "--block-size", type=_bounded(1, 1 << 20), default=16, help="tokens per KV block"
    )
    ca.add_argument(
        "--concurrency",
        type=_bounded(1, MAX_CONCURRENCY),
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
        type=_list(_blocks),
        metavar="CAPACITIES",
        help="replay at each of these capacities (comma-separated blocks, e.g. 2k,8k,32k)",
    )

    ss = rp.add_argument_group("SSM state (hybrid models; these need --ssm)")
    ss.add_argument(
        "--ssm",
        action="store_true",
        help="hybrid model: hits end at SSM checkpoints; compare to attention-only",
    )
    ss.add_argument(
        "--ckpt-policy",
        type=_policy_list,
        metavar="POLICIES",
        help=(
            "comma-separated checkpoint placements to compare, each a '+' combination of "
            f"{', '.join(POLICY_NAMES)}; 'all' compares the standard set "
            f"(default: {DEFAULT_POLICY})"
        ),
    )
    ss.add_argument(
        "--blocks-per-slot",
        type=_blocks,
        metavar="R",
        help="state budget: one checkpoint slot per R KV blocks "
        f"(default: {DEFAULT_BLOCKS_PER_SLOT})",
    )
    ss.add_argument(
        "--sweep-blocks-per-slot",
        type=_list(_blocks),
        metavar="LIST",
        help="replay at each of these state budgets (comma-separated R values)",
    )
    ss.add_argument(
        "--state-slots",
        type=_blocks,
        metavar="N",
        help="state budget in slots (instead of --blocks-per-slot)",
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
        metavar="TOKENS",
        help=f"chunk-boundaries: prefill chunk size (default: {DEFAULT_CHUNK})",
    )
    ss.add_argument(
        "--state-bytes-per-slot",
        type=_positive,
        metavar="BYTES",
        help="SSM state bytes per checkpoint (all layers), to report state memory",
    )

    me = rp.add_argument_group("memory")
    me.add_argument(
        "--kv-bytes-per-token",
        type=_positive,
        metavar="BYTES",
        help="KV bytes per token of your model (all layers, K and V): report capacity in GiB",
    )

    ex = rp.add_argument_group("execution")
    ex.add_argument(
        "--jobs",
        type=_bounded(1, 4096),
        metavar="N",
        help="replay sweep points in N worker processes (default: the cores available)",
    )
    ex.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="process",
        help="where sweep points run: local worker processes, or a Ray cluster (needs ray)",
    )
    ex.add_argument(
        "--check", action="store_true", help="verify every cache invariant after each replay (slow)"
    )

    out = rp.add_argument_group("output")
    fmt = out.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json", action="store_true", help="print one JSON document (docs/replay.md), nothing else"
    )
    fmt.add_argument("--csv", action="store_true", help="print one CSV row per run, nothing else")
    out.add_argument(
        "--plot", metavar="FILE", help="write a PNG of hit rate against capacity (needs --sweep)"
    )
    prog = out.add_mutually_exclusive_group()
    prog.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show progress on stderr (default: when stderr is a terminal)",
    )
    prog.add_argument(
        "--no-progress", dest="progress", action="store_false", help="never show progress"
    )
    rp.set_defaults(func=_cmd_replay)

    dm = sub.add_parser(
        "demo",
        help="serve a tiny hybrid model over a short chat; check outputs equal cold runs",
        formatter_class=_Formatter,
    )
    dm.add_argument("--seed", type=_seed, default=0, help="model weights and chat seed")
    dm.set_defaults(func=_cmd_demo)
    return parser


def _attach_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--sweep -1k`` -> ``--sweep=-1k``, so that a value starting with '-' reaches the
    option's own check (and its clear message) instead of "expected one argument"."""
    valued: set[str] = set()
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if action.nargs is None and action.option_strings:
                valued.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in valued and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            nxt = argv[i + 1]
            if nxt not in valued and not nxt.startswith("--"):
                out.append(f"{arg}={nxt}")
                i += 2
                continue
        out.append(arg)
        i += 1
    return out


# --------------------------------------------------------------------------
# Progress


class _Progress:
    """Phases (loading, counting, replaying) as tqdm bars on stderr; silent when off or
    when tqdm is not installed."""

    def __init__(self, enabled: bool) -> None:
        self._tqdm: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm
            except ImportError:
                self._tqdm = None
        self._bar: Any = None
        self._last = 0

    def phase(
        self, label: str, total: int, unit: str, scale: bool = False
    ) -> Callable[[int], None]:
        """Start a phase of `total` units; returns ``update(done so far)``."""
        self.close()
        if self._tqdm is None:
            return lambda _done: None
        self._bar = self._tqdm(
            total=total,
            desc=label,
            unit=unit,
            unit_scale=scale,
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.25,
        )
        self._last = 0

        def update(done: int) -> None:
            if done > self._last:
                self._bar.update(done - self._last)
                self._last = done

        return update

    def label(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description(text, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# --------------------------------------------------------------------------
# replay


def _check_usage(args: argparse.Namespace) -> None:
    """Reject flags that would be ignored, and impossible combinations, before any work."""
    if not args.ssm:
        given = [flag for dest, flag in SSM_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply with --ssm")
    if args.state_slots is not None and (
        args.blocks_per_slot is not None or args.sweep_blocks_per_slot is not None
    ):
        raise UsageError("--state-slots replaces --blocks-per-slot / --sweep-blocks-per-slot")
    if args.blocks_per_slot is not None and args.sweep_blocks_per_slot is not None:
        raise UsageError("give --blocks-per-slot or --sweep-blocks-per-slot, not both")
    if args.trace is not None:
        given = [flag for dest, flag in SYNTHETIC_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} describe the built-in workload, not --trace")
    else:
        for flag, value in (
            ("--trace-block-tokens", args.trace_block_tokens),
            ("--trace-format", None if args.trace_format == "auto" else args.trace_format),
        ):
            if value is not None:
                raise UsageError(f"{flag} needs --trace")
    policies = args.ckpt_policy or [DEFAULT_POLICY]
    for flag, value, part in (
        ("--ckpt-interval", args.ckpt_interval, "every-n"),
        ("--chunk-size", args.chunk_size, "chunk-boundaries"),
    ):
        if value is not None and not any(part in p.split("+") for p in policies):
            raise UsageError(f"{flag} applies to the {part} placement, which no policy uses")
    if args.plot is not None:
        problem = check_plot_path(args.plot)
        if problem is not None:
            raise UsageError(f"--plot: {problem}")
        if len(_capacities(args, 0)) < 2:
            raise UsageError("--plot draws hit rate against capacity: give --sweep with 2+ values")
        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("--plot needs matplotlib: pip install 'blocktrie[cli]'")
    if args.executor == "ray" and importlib.util.find_spec("ray") is None:
        raise UsageError("--executor ray needs ray: pip install 'blocktrie[ray]'")


def _capacities(args: argparse.Namespace, never_evict: int) -> list[int]:
    caps = list(args.sweep or [])
    if args.capacity is not None:
        caps.append(args.capacity)
    if not caps:
        caps.append(never_evict)
    return sorted(set(caps))


def _load_workload(args: argparse.Namespace, progress: _Progress) -> tuple[Workload[Any], str]:
    if args.trace is None:
        d = SyntheticParams()
        params = SyntheticParams(
            **{
                dest: getattr(d, dest) if getattr(args, dest) is None else getattr(args, dest)
                for dest in SYNTHETIC_FLAGS
            }
        )
        progress.phase("generating", 0, "req")
        workload = synthetic_workload(params)
        fmt = "synthetic"
    else:
        fmt = args.trace_format
        if fmt == "auto":
            fmt = detect_trace_format(args.trace)
        if fmt == "tokens" and args.trace_block_tokens is not None:
            raise UsageError("--trace-block-tokens applies to Mooncake and Bailian traces only")
        try:
            size = os.path.getsize(args.trace)
        except OSError:
            size = 0
        update = progress.phase("loading", size, "B", scale=True)
        workload = load_trace(args.trace, fmt, args.trace_block_tokens, update)
    if args.limit is not None:
        workload = workload.head(args.limit)
    return workload, fmt


def _count(workload: Workload[Any], args: argparse.Namespace, progress: _Progress) -> PrefixCount:
    update = progress.phase("counting", len(workload), "req")
    return count_prefix_hits(workload, args.block_size, args.max_decode_tokens, update)


def _cmd_replay(args: argparse.Namespace) -> int:
    _check_usage(args)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = _Progress(show and not args.json and not args.csv)
    try:
        workload, fmt = _load_workload(args, progress)
        count = _count(workload, args, progress)
        r_values = args.sweep_blocks_per_slot or [args.blocks_per_slot or DEFAULT_BLOCKS_PER_SLOT]
        never_evict = never_evict_capacity(
            count,
            args.concurrency,
            ssm=args.ssm,
            state_slots=args.state_slots,
            min_blocks_per_slot=min(r_values),
        )
        capacities = _capacities(args, never_evict)
        if max(capacities) > MAX_BLOCKS:
            raise UsageError(
                f"this workload needs {never_evict:,} blocks never to evict, above the "
                f"planner's limit of {MAX_BLOCKS:,}: give --capacity or --sweep"
            )
        runs = plan_runs(
            capacities,
            ssm=args.ssm,
            policies=args.ckpt_policy or [DEFAULT_POLICY],
            blocks_per_slot=r_values,
            state_slots=args.state_slots,
        )
        settings = ReplaySettings(
            block_size=args.block_size,
            concurrency=args.concurrency,
            max_decode_tokens=args.max_decode_tokens,
            ckpt_interval=args.ckpt_interval,
            chunk_size=args.chunk_size or DEFAULT_CHUNK,
            default_blocks_per_slot=args.blocks_per_slot or DEFAULT_BLOCKS_PER_SLOT,
            check=args.check,
        )
        jobs = args.jobs if args.jobs is not None else available_cores()
        results = _run(workload, runs, settings, jobs, args.executor, progress)
    finally:
        progress.close()

    per_token = args.kv_bytes_per_token
    state_bytes = args.state_bytes_per_slot

    def cost(run: Run) -> float:
        if per_token is None:
            return 0.0
        kv = run.capacity * args.block_size * per_token
        return float(kv + (run.slots * state_bytes if state_bytes and run.policy != KV else 0))

    recommendation = recommend(list(zip(runs, results, strict=True)), count.hit_rate, cost)
    doc = build_report(
        workload,
        fmt,
        count,
        never_evict,
        runs,
        results,
        recommendation,
        block_size=args.block_size,
        concurrency=args.concurrency,
        max_decode_tokens=args.max_decode_tokens,
        kv_bytes_per_token=per_token,
        state_bytes_per_slot=state_bytes,
    )
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    elif args.csv:
        sys.stdout.write(render_csv(doc))
    else:
        width = shutil.get_terminal_size((200, 24)).columns
        sys.stdout.write(render_text(doc, width) + "\n")
    sys.stdout.flush()
    if args.plot is not None:
        try:
            write_plot(args.plot, doc)
        except OSError as exc:
            raise _RunError(f"--plot {args.plot}: {exc.strerror or exc}") from None
        if not (args.json or args.csv):
            print(f"plot written to {args.plot}")
    return 0


def _run(
    workload: Workload[Any],
    runs: list[Run],
    settings: ReplaySettings,
    jobs: int,
    executor: str,
    progress: _Progress,
) -> list[Any]:
    n = len(workload)
    if jobs == 1 or len(runs) == 1 or executor == "ray":
        total = n * len(runs)
        update = progress.phase("replaying", total, "req")
        done_before = [0]

        def per_run(done: int, label: str) -> None:
            progress.label(f"replaying {label}")
            update(done_before[0] + done)

        def finished(_index: int) -> None:
            done_before[0] += n
            update(done_before[0])

        return run_all(
            workload,
            runs,
            settings,
            jobs=1 if executor != "ray" else jobs,
            executor=executor,
            progress=per_run,
            on_done=finished,
        )
    update = progress.phase(f"replaying ({min(jobs, len(runs))} jobs)", len(runs), "run")
    finished_runs = [0]

    def one_done(_index: int) -> None:
        finished_runs[0] += 1
        update(finished_runs[0])

    return run_all(workload, runs, settings, jobs=jobs, executor=executor, on_done=one_done)


class _RunError(Exception):
    """A failure after the arguments were accepted (exit 1)."""


# --------------------------------------------------------------------------
# demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from cache.planner import demo  # torch and the test kit: only this subcommand needs them

    result = demo.run_demo(seed=args.seed)
    print(demo.format_demo(result))
    return 0 if result.identical else 1


# --------------------------------------------------------------------------


def _quiet_stdout() -> None:
    """After a broken pipe: send further output (and the exit flush) to /dev/null."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blocktrie`` console script."""
    command = "?"
    try:
        parser = build_parser()
        args = parser.parse_args(
            _attach_values(parser, list(sys.argv[1:] if argv is None else argv))
        )
        command = args.command
        code: int = args.func(args)
    except (TraceError, UsageError) as exc:
        print(f"{PROG} {command}: error: {exc}", file=sys.stderr)
        return 2
    except (CacheError, _RunError) as exc:
        print(f"{PROG} {command}: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"{PROG} {command}: error: out of memory", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
