"""The ``blocktrie`` command: ``replay`` (the capacity planner) and ``demo``.

``blocktrie replay`` answers "how much KV and state memory does my workload
need, and what hit rate will I get?": it replays a workload (the built-in
synthetic one, or a trace) through an ids-only `cache.BlockTrie` at one or
several capacities and reports hit rate, tokens saved, evictions, checkpoint
hits and peak pins. See docs/replay.md.

Every flag is checked before anything is loaded or replayed: a flag that
would be ignored is an error, and so is a plot path that cannot be written.
A workload whose estimated memory (`cache.planner.resources`) exceeds what the
machine has available is refused before it is generated or counted.
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
from typing import Any

from cache.planner.args import (
    DEFAULT_BLOCKS_PER_SLOT,
    DEFAULT_CHUNK,
    DEFAULT_PUBLISH_WAIT,
    FLEET_FLAGS,
    MAX_BLOCKS,
    PROG,
    SSM_FLAGS,
    SYNTHETIC_FLAGS,
    attach_values,
    build_parser,
)
from cache.planner.execute import ReplaySettings, available_cores, default_jobs, run_all
from cache.planner.plan import Run, never_evict_capacity, plan_runs, recommend
from cache.planner.plot import check_plot_path, write_plot
from cache.planner.policy import DEFAULT_POLICY, KV
from cache.planner.publish import replica_endpoints
from cache.planner.replay import ReplayResult
from cache.planner.report import (
    build_fleet,
    build_report,
    fmt_bytes,
    render_csv,
    render_fleet_text,
    render_text,
)
from cache.planner.resources import (
    Estimate,
    WorkloadShape,
    available_memory,
    estimate,
    file_shape,
    synthetic_shape,
    trace_shape,
)
from cache.planner.traces import TraceError, detect_trace_format, load_trace
from cache.planner.workload import (
    PrefixCount,
    SyntheticParams,
    Workload,
    count_prefix_hits,
    synthetic_workload,
)
from spec.errors import CacheError

__all__ = ["MAX_BLOCKS", "UsageError", "build_parser", "estimate_replay", "main"]


class UsageError(Exception):
    """A flag combination or value the parser could not reject by itself (exit 2)."""


# --------------------------------------------------------------------------
# Progress


class _Progress:
    """Phases (loading, counting, replaying) as tqdm bars on stderr; silent when off or
    when tqdm is not installed.

    The bars start no thread. tqdm's monitor thread (it only resets a bar's
    dynamic `miniters` after 10 s without a refresh) would be running when
    `run_all` forks its workers, and a fork copies the locks another thread
    holds at that instant into the child still locked: the monitor refreshing
    a bar holds stderr's, and the child would hang at its first write to stderr
    or at exit. Python 3.12 and later warn of this at every such fork."""

    def __init__(self, enabled: bool) -> None:
        self._tqdm: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                # A subclass, so that no other tqdm user in the process is changed.
                self._tqdm = type("_Bar", (tqdm,), {"monitor_interval": 0})
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


def _flags(given: list[str], singular: str, plural: str) -> str:
    """``--a does`` / ``--a, --b do``: the flags and the verb that agrees with them."""
    return f"{', '.join(given)} {singular if len(given) == 1 else plural}"


def _check_usage(args: argparse.Namespace) -> None:
    """Reject flags that would be ignored, and impossible combinations, before any work."""
    if not args.ssm:
        given = [flag for dest, flag in SSM_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{_flags(given, 'applies', 'apply')} only with --ssm")
    if args.host_capacity and args.ssm:
        raise UsageError(
            "--host-capacity with --ssm: an SSM trie serves no hit from the host tier (SSM "
            "checkpoints live on the device only, docs/host-tier.md), so its runs would not "
            "use it; replay attention-only (without --ssm) to size a host tier"
        )
    if args.state_slots is not None and (
        args.blocks_per_slot is not None or args.sweep_blocks_per_slot is not None
    ):
        raise UsageError("--state-slots replaces --blocks-per-slot / --sweep-blocks-per-slot")
    if args.blocks_per_slot is not None and args.sweep_blocks_per_slot is not None:
        raise UsageError("give --blocks-per-slot or --sweep-blocks-per-slot, not both")
    if args.trace is not None:
        given = [flag for dest, flag in SYNTHETIC_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(
                f"{_flags(given, 'describes', 'describe')} the built-in workload, not --trace"
            )
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
    _check_fleet_usage(args)


def _check_fleet_usage(args: argparse.Namespace) -> None:
    """--replicas / --router / --publish and their companions."""
    fleet = args.replicas is not None or args.publish is not None
    if args.router is not None and args.replicas is None:
        raise UsageError("--router needs --replicas")
    if args.prefix_max_load is not None and (args.router or "prefix") != "prefix":
        raise UsageError("--prefix-max-load applies to the prefix router only")
    if args.publish_wait is not None and args.publish is None:
        raise UsageError("--publish-wait needs --publish")
    if not fleet:
        given = [flag for dest, flag in FLEET_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{_flags(given, 'needs', 'need')} --replicas or --publish")
        return
    what = "--replicas" if args.replicas is not None else "--publish"
    if args.host_capacity:
        raise UsageError(
            f"--host-capacity is not supported with {what} (the fleet replay has no host tier)"
        )
    if args.ssm:
        raise UsageError(f"{what} replays attention-only: --ssm is not supported with it")
    if args.sweep is not None:
        raise UsageError(f"{what} replays one capacity per replica: give --capacity, not --sweep")
    if args.csv:
        raise UsageError(f"--csv has no fleet columns: use --json with {what}")
    if args.publish is not None:
        try:
            replica_endpoints(args.publish, args.replicas or 1)
        except ValueError as exc:
            raise UsageError(f"--publish: {exc}") from None
    needs = ["msgspec", "xxhash"] + (["zmq"] if args.publish is not None else [])
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"{what} needs {', '.join('pyzmq' if m == 'zmq' else m for m in missing)}: "
            "pip install 'blocktrie[events]'"
        )


def _capacities(args: argparse.Namespace, never_evict: int) -> list[int]:
    caps = list(args.sweep or [])
    if args.capacity is not None:
        caps.append(args.capacity)
    if not caps:
        caps.append(never_evict)
    return sorted(set(caps))


def _synthetic_params(args: argparse.Namespace) -> SyntheticParams:
    d = SyntheticParams()
    return SyntheticParams(
        **{
            dest: getattr(d, dest) if getattr(args, dest) is None else getattr(args, dest)
            for dest in SYNTHETIC_FLAGS
        }
    )


def _load_workload(args: argparse.Namespace, progress: _Progress) -> tuple[Workload[Any], str, int]:
    """The workload, its format, and the size of the trace file (0: built-in)."""
    size = 0
    if args.trace is None:
        params = _synthetic_params(args)
        update = progress.phase("generating", params.users, "session")
        workload = synthetic_workload(params, update)
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
        _check_resources(args, file_shape(size))
        update = progress.phase("loading", size, "B", scale=True)
        workload = load_trace(args.trace, fmt, args.trace_block_tokens, update)
    if args.limit is not None:
        workload = workload.head(args.limit)
    return workload, fmt, size


MAX_REQUEST_TOKENS = 1_000_000_000
"""Most tokens (prompt plus decoded output) one request may replay."""


def _check_sizes(workload: Workload[Any], cap: int | None) -> None:
    """Refuse a request too long to replay (before anything is built for it)."""
    for i, (plen, olen) in enumerate(
        zip(workload.prompt_lengths, workload.output_lengths, strict=True)
    ):
        total = plen + (olen if cap is None else min(olen, cap))
        if total > MAX_REQUEST_TOKENS:
            raise UsageError(
                f"request {i + 1} has {total:,} tokens to replay (at most "
                f"{MAX_REQUEST_TOKENS:,}); --max-decode-tokens caps the decoded output"
            )


def _count(workload: Workload[Any], args: argparse.Namespace, progress: _Progress) -> PrefixCount:
    update = progress.phase("counting", len(workload), "req")
    return count_prefix_hits(workload, args.block_size, args.max_decode_tokens, update)


def _plan(args: argparse.Namespace, count: PrefixCount) -> tuple[int, list[int], list[Run]]:
    """The never-evict capacity, the capacities to replay and the runs, for `count` (the
    real one, or what `_check_resources` predicts)."""
    r_values = args.sweep_blocks_per_slot or [args.blocks_per_slot or DEFAULT_BLOCKS_PER_SLOT]
    never_evict = never_evict_capacity(
        count,
        args.concurrency,
        ssm=args.ssm,
        state_slots=args.state_slots,
        min_blocks_per_slot=min(r_values),
    )
    capacities = _capacities(args, never_evict)
    runs = plan_runs(
        capacities,
        ssm=args.ssm,
        policies=args.ckpt_policy or [DEFAULT_POLICY],
        blocks_per_slot=r_values,
        state_slots=args.state_slots,
    )
    return never_evict, capacities, runs


def estimate_replay(
    args: argparse.Namespace, shape: WorkloadShape, jobs: int | None = None
) -> tuple[Estimate, int]:
    """The estimate of the command `args` replaying a workload of `shape`, and the
    number of worker processes it was made for (``--jobs``, else `jobs`, else the
    default: `default_jobs`)."""
    blocks = -(-shape.longest_tokens // args.block_size)
    predicted = PrefixCount(shape.requests, shape.prompt_tokens, 0, shape.distinct_blocks, blocks)
    runs = _plan(args, predicted)[2]
    cores = available_cores()
    if args.jobs is not None:
        jobs = args.jobs
    if jobs is None:
        one = estimate(shape, runs, concurrency=args.concurrency, jobs=1, cores=cores)
        jobs = default_jobs(len(runs), one.replay_s / max(1, len(runs)))
    return estimate(shape, runs, concurrency=args.concurrency, jobs=jobs, cores=cores), jobs


def _check_resources(args: argparse.Namespace, shape: WorkloadShape) -> int:
    """The number of worker processes to replay with, after refusing a workload whose
    estimated peak memory exceeds ``--max-memory`` (default: what the machine has
    available). A default ``--jobs`` is lowered until the workers' caches fit."""
    guess, jobs = estimate_replay(args, shape)
    found = available_memory() if args.max_memory is None else (args.max_memory, "--max-memory")
    if found is None:
        return jobs
    limit, source = found
    while guess.peak_bytes > limit and args.jobs is None and jobs > 1:
        guess, jobs = estimate_replay(args, shape, jobs - 1)
    if guess.peak_bytes > limit:
        raise UsageError(_too_big(args, guess, limit, source, jobs))
    if guess.seconds > 60:
        print(
            f"{PROG} replay: estimated {_duration(guess.seconds)} and "
            f"{fmt_bytes(guess.peak_bytes)} at the peak ({guess.parts()})",
            file=sys.stderr,
        )
    return jobs


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"about {seconds / size:,.1f} {unit}"
    return f"about {seconds:.0f} s"


def _too_big(args: argparse.Namespace, guess: Estimate, limit: int, source: str, jobs: int) -> str:
    where = (
        f"--max-memory ({fmt_bytes(limit)})"
        if source == "--max-memory"
        else f"the {fmt_bytes(limit)} available ({source})"
    )
    if args.trace is None:
        smaller = "make the workload smaller (--users, --turns, --system-tokens, ...)"
    else:
        smaller = "replay part of the trace (--limit N)"
    if jobs > 1:
        smaller += f", replay in fewer processes (--jobs {jobs} now)"
    gib = -(-guess.peak_bytes // 2**30)
    size = f"{gib}G" if gib < 1024 else f"{-(-gib // 1024)}T"
    return (
        f"this workload needs about {fmt_bytes(guess.peak_bytes)} of memory at its peak "
        f"({guess.parts()}) and {_duration(guess.seconds)}, more than {where}: {smaller}, "
        f"or give --max-memory {size} to run it anyway"
    )


def _cmd_replay(args: argparse.Namespace) -> int:
    _check_usage(args)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = _Progress(show and not args.json and not args.csv)
    try:
        if args.trace is None:  # before a token is drawn: from the parameters alone
            params = _synthetic_params(args)
            shape = synthetic_shape(params, args.block_size, args.max_decode_tokens)
            jobs = _check_resources(args, shape)
        workload, fmt, file_bytes = _load_workload(args, progress)
        _check_sizes(workload, args.max_decode_tokens)
        if args.trace is not None:  # before counting: from its lengths and file size
            shape = trace_shape(workload, args.block_size, args.max_decode_tokens, file_bytes)
            jobs = _check_resources(args, shape)
        count = _count(workload, args, progress)
        never_evict, capacities, runs = _plan(args, count)
        if max(capacities) > MAX_BLOCKS:
            raise UsageError(
                f"this workload needs {never_evict:,} blocks never to evict, above the "
                f"planner's limit of {MAX_BLOCKS:,}: give --capacity or --sweep"
            )
        settings = ReplaySettings(
            block_size=args.block_size,
            concurrency=args.concurrency,
            max_decode_tokens=args.max_decode_tokens,
            ckpt_interval=args.ckpt_interval,
            chunk_size=args.chunk_size or DEFAULT_CHUNK,
            default_blocks_per_slot=args.blocks_per_slot or DEFAULT_BLOCKS_PER_SLOT,
            check=args.check,
            host_capacity=args.host_capacity or 0,
        )
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

    fleet = None
    if args.replicas is not None or args.publish is not None:
        progress = _Progress(show and not args.json)
        try:
            fleet = _run_fleet(workload, capacities[0], args, progress)
        finally:
            progress.close()
    recommendation = recommend(list(zip(runs, results, strict=True)), count.hit_rate, cost)
    doc = build_report(
        workload,
        fmt,
        count,
        never_evict,
        runs,
        results,
        recommendation,
        fleet=fleet,
        block_size=args.block_size,
        concurrency=args.concurrency,
        max_decode_tokens=args.max_decode_tokens,
        kv_bytes_per_token=per_token,
        state_bytes_per_slot=state_bytes,
        host_capacity=args.host_capacity or 0,
    )
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    elif args.csv:
        sys.stdout.write(render_csv(doc))
    else:
        width = _text_width()
        sys.stdout.write(render_text(doc, width) + "\n")
        if fleet is not None:
            sys.stdout.write("\n" + render_fleet_text(fleet, width) + "\n")
    sys.stdout.flush()
    if args.plot is not None:
        try:
            write_plot(args.plot, doc)
        except OSError as exc:
            raise _RunError(f"--plot {args.plot}: {exc.strerror or exc}") from None
        if not (args.json or args.csv):
            print(f"plot written to {args.plot}")
    return 0


def _text_width() -> int:
    """Columns to fit the report to: the terminal's; when stdout is not one (a pipe, a
    file), $COLUMNS if set, else unlimited (prose is not wrapped, tables not split)."""
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    columns = os.environ.get("COLUMNS", "").strip()
    return int(columns) if columns.isdigit() and int(columns) > 0 else sys.maxsize


def _run(
    workload: Workload[Any],
    runs: list[Run],
    settings: ReplaySettings,
    jobs: int,
    executor: str,
    progress: _Progress,
) -> list[ReplayResult]:
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
    workers = min(jobs, len(runs))
    update = progress.phase(f"replaying ({workers} jobs)", n * len(runs), "req")

    def all_runs(done: int, label: str) -> None:
        progress.label(f"replaying ({workers} jobs, {label})")
        update(done)

    return run_all(workload, runs, settings, jobs=jobs, executor=executor, progress=all_runs)


def _run_fleet(
    workload: Workload[Any], capacity: int, args: argparse.Namespace, progress: _Progress
) -> dict[str, Any]:
    """The ``fleet`` document: the chosen router's replay (streamed with --publish), and
    a round-robin replay to compare with when the router is another one."""
    from cache.planner.fleet import make_router, replay_fleet
    from cache.planner.publish import Publishers

    n = args.replicas or 1
    name = args.router or ("prefix" if args.replicas is not None else "round-robin")
    scheme = args.block_hash or "xxh3"
    seed = args.hash_seed or 0

    def one(router_name: str, publishers: Publishers | None) -> Any:
        router = make_router(
            router_name,
            n,
            block_size=args.block_size,
            scheme=scheme,
            seed=seed,
            max_load=args.prefix_max_load if router_name == "prefix" else None,
        )
        update = progress.phase(f"replaying {n} x {router_name}", len(workload), "req")
        return replay_fleet(
            workload,
            router,
            block_size=args.block_size,
            capacity=capacity,
            concurrency=args.concurrency,
            max_decode_tokens=args.max_decode_tokens,
            scheme=scheme,
            seed=seed,
            on_events=None if publishers is None else publishers.publish,
            progress=update,
        )

    publish = None
    if args.publish is not None:
        import zmq

        wait = DEFAULT_PUBLISH_WAIT if args.publish_wait is None else args.publish_wait
        try:
            with Publishers(replica_endpoints(args.publish, n), wait) as publishers:
                if not args.json:
                    for i, endpoint in enumerate(publishers.bound):
                        note = f"{PROG} replay: replica {i} publishes on {endpoint}"
                        print(note, file=sys.stderr)
                result = one(name, publishers)
        except zmq.ZMQError as exc:
            raise _RunError(f"--publish {args.publish}: {exc}") from None
        publish = publishers.stats()
    else:
        result = one(name, None)
    baseline = result if name == "round-robin" else one("round-robin", None)
    return build_fleet(result, baseline, block_hash=scheme, hash_seed=seed, publish=publish)


class _RunError(Exception):
    """A failure after the arguments were accepted (exit 1)."""


# --------------------------------------------------------------------------
# demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from cache.planner import demo  # torch and the test kit: only this subcommand needs them

    if args.model is None:
        result = demo.run_demo(seed=args.seed)
    else:
        if importlib.util.find_spec("transformers") is None:
            raise UsageError("--model needs transformers: pip install 'blocktrie[hf]'")
        import torch
        import transformers

        torch.set_num_threads(1)  # tiny models: more threads only contend
        hf_logging: Any = transformers.logging
        hf_logging.set_verbosity_error()  # not its kernel-fallback notices
        result = demo.run_hf_demo(args.model, seed=args.seed)
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
            attach_values(parser, list(sys.argv[1:] if argv is None else argv))
        )
        command = args.command
        code: int = _cmd_replay(args) if command == "replay" else _cmd_demo(args)
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
