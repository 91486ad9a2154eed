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
from cache.planner.execute import ReplaySettings, available_cores, run_all
from cache.planner.plan import Run, never_evict_capacity, plan_runs, recommend
from cache.planner.plot import check_plot_path, write_plot
from cache.planner.policy import DEFAULT_POLICY, KV
from cache.planner.publish import replica_endpoints
from cache.planner.replay import ReplayResult
from cache.planner.report import (
    build_fleet,
    build_report,
    render_csv,
    render_fleet_text,
    render_text,
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

__all__ = ["MAX_BLOCKS", "UsageError", "build_parser", "main"]


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


def _check_usage(args: argparse.Namespace) -> None:
    """Reject flags that would be ignored, and impossible combinations, before any work."""
    if not args.ssm:
        given = [flag for dest, flag in SSM_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply with --ssm")
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
            verb = "needs" if len(given) == 1 else "need"
            raise UsageError(f"{', '.join(given)} {verb} --replicas or --publish")
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
    _check_sizes(workload, args.max_decode_tokens)
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
            host_capacity=args.host_capacity or 0,
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
        width = shutil.get_terminal_size((200, 24)).columns
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
    update = progress.phase(f"replaying ({min(jobs, len(runs))} jobs)", len(runs), "run")
    finished_runs = [0]

    def one_done(_index: int) -> None:
        finished_runs[0] += 1
        update(finished_runs[0])

    return run_all(workload, runs, settings, jobs=jobs, executor=executor, on_done=one_done)


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
