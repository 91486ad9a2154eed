"""Bounded exhaustive exploration: every sequence of operations up to a depth, over a
tiny cache, with `cache.BlockTrie` and `spec.model.ReferenceCache` driven side by side.

Hypothesis samples sequences of operations; the spec is small enough to enumerate
them. `explore` does a breadth-first search over the states a tiny cache can reach
(block size 2, a few blocks, two checkpoint slots, at most two live sequences, the
token alphabet {0, 1}, `ManualCopies`): from each state it applies *every*
operation of the alphabet below, with every argument, and checks the state it
reaches, then deduplicates the reached states by an id-free canonical form of
their snapshot (`state_key`), so each state is expanded once.

It drives the two implementations through the differential test's own adapters
(`tests.test_differential.CacheVersusModel`: the same rules, the same "both raise
the same error class, and a refusal changes nothing" comparison, the same
restore-data oracle), and in every reached state checks what that machine's
invariants check: `trie.check()` (every spec invariant on the cache), the same
predicates on the model's snapshot, that both observe the same (`observe`), and
the pin promise (no copy's checkpoint released, no pinned slot reused).

The operation alphabet, from a state (`operations`):

- ``match(p)`` for every prompt `p` (every token list of `prompt_lengths` over
  {0, 1}), while fewer than `max_live` sequences are live;
- for each live sequence: ``prefill`` (allocate and commit every token),
  ``append`` of one token (0 or 1), ``save`` at every step 1..committed,
  ``restore`` and ``pin`` (when its match found a checkpoint), ``release``,
  ``abort``;
- for each pending copy: ``complete``, ``fail`` ([R46]), ``interrupt`` (a
  `KeyboardInterrupt` inside its data movement);
- for each unused receipt: ``unpin``;
- ``evict(1)``, ``evict(all)``, ``evict_checkpoints(1)``, ``poll``.

Dedup key: the cache's snapshot reduced to names instead of ids (`observe`'s
view without the statistics counters), plus, in the explorer's handle order,
each live sequence's view, each pending copy's kind / step / state / pinned
checkpoint and each receipt's state and checkpoint. Statistics are left out:
an operation changes them by an amount that depends on the state, not on
their values, and both implementations are compared on them in every state,
so two states equal but for their counters have the same futures.

The search starts from a named state (`STARTS`): the empty cache, or "warm", two
requests served so that every slot is taken and a request that hits must restore
(a depth-4 search from the empty cache reaches no restore: that takes about
eight operations). A violation stops the search and raises
`ExplorationFailure` naming the operations that lead to it. ``python -m
tools.explore --depth 4`` prints the figures (states, transitions, per depth,
seconds) for each start as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from spec.snapshot import Snapshot, node_path, observe, sequence_view

Op = tuple[Any, ...]
"""One operation: its name, then its arguments (indexes into the explorer's handle
lists, token lists, counts)."""


class ExplorationFailure(AssertionError):
    """A reached state broke an invariant, or the implementations disagreed."""

    def __init__(self, path: Sequence[Op], cause: BaseException) -> None:
        self.path = list(path)
        self.cause = cause
        steps = "\n  ".join(repr(op) for op in self.path)
        super().__init__(f"after {len(self.path)} operations:\n  {steps}\n{cause!r}")


def _serve(tokens: tuple[int, ...], step: int) -> tuple[Op, ...]:
    """A request that computes `tokens`, saves a checkpoint after `step` of them, waits
    for its copy and finishes: the operations, as a start path."""
    return (
        ("match", tokens),
        ("prefill", 0),
        ("save", 0, step),
        ("complete", 0),
        ("poll",),
        ("release", 0),
    )


STARTS: dict[str, tuple[Op, ...]] = {
    "empty": (),
    # Two requests served, each leaving a block cached with a checkpoint at its end
    # (step 2): both slots are taken, one block of 3 is free, and a request that
    # hits must restore.
    "warm": _serve((0, 0, 1), 2) + _serve((1, 1, 0), 2),
}
"""Named start states, as the operations that reach them from the empty cache; the
exploration covers every sequence of up to `depth` operations from each."""


@dataclass(frozen=True)
class Bounds:
    """The tiny cache, the operation alphabet and the start state (module docstring)."""

    depth: int = 3
    block_size: int = 2
    num_blocks: int = 3
    slots: int = 2
    max_live: int = 2
    prompt_lengths: tuple[int, ...] = (3,)
    start: str = "empty"

    def prompts(self) -> list[list[int]]:
        """Every token list of each of `prompt_lengths` over {0, 1}."""
        return [list(p) for n in self.prompt_lengths for p in itertools.product((0, 1), repeat=n)]


@dataclass
class Report:
    """What one exploration covered."""

    bounds: Bounds
    depth_reached: int = 0
    states: int = 1  # the empty cache
    transitions: int = 0
    refusals: int = 0  # transitions where both implementations raised the same error
    per_depth: list[dict[str, int]] = field(default_factory=list)
    seconds: float = 0.0
    complete: bool = False  # every state up to `depth` expanded

    def as_dict(self) -> dict[str, Any]:
        b = self.bounds
        return {
            "bounds": {
                "start": b.start,
                "depth": b.depth,
                "block_size": b.block_size,
                "num_blocks": b.num_blocks,
                "slots": b.slots,
                "max_live": b.max_live,
                "prompt_lengths": list(b.prompt_lengths),
                "prompts": len(b.prompts()),
            },
            "depth_reached": self.depth_reached,
            "complete": self.complete,
            "states": self.states,
            "transitions": self.transitions,
            "refusals": self.refusals,
            "per_depth": self.per_depth,
            "seconds": round(self.seconds, 2),
        }


def _machine_class() -> type:
    """The differential test's machine, with a `both` that skips its before/after
    comparison while a path is replayed (it was checked when first explored)."""
    from tests.test_differential import CacheVersusModel

    class Explored(CacheVersusModel):  # type: ignore[misc,valid-type]
        replaying = False
        refused = False

        def both(self, real: Any, model: Any, *, evictions_stay: bool = False) -> Any:
            if not self.replaying:
                out = super().both(real, model, evictions_stay=evictions_stay)
                self.refused = self.refused or out is None
                return out
            try:
                r = real()
            except Exception:
                try:
                    model()
                except Exception:
                    return None
                raise
            return r, model()

    return Explored


class Explorer:
    """Replays paths of operations on a fresh machine and enumerates their successors."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self._cls = _machine_class()
        self._prompts = bounds.prompts()

    # ------------------------------------------------------------ one machine

    def fresh(self) -> Any:
        """A new machine (cache + model) in the empty state, with empty handle lists."""
        b = self.bounds
        m = self._cls()
        m.setup(
            block_size=b.block_size,
            num_blocks=b.num_blocks,
            slots=b.slots,
            collide=False,
            host=0,
            write_back=False,
            host_slots=0,
        )
        m.live_handles = []
        m.copy_handles = []
        m.receipt_handles = []
        return m

    def apply(self, m: Any, op: Op) -> None:
        """Apply one operation through the machine's rules (and keep the handle lists)."""
        name = op[0]
        live: list[Any] = m.live_handles
        if name == "match":
            live.append(m.match(list(op[1]), "", None))
        elif name == "prefill":
            m.allocate_and_commit_all(live[op[1]])
        elif name == "append":
            m.append(live[op[1]], [op[2]])
        elif name == "save":
            seq = live[op[1]]
            copy = m.save(seq, "any", op[2] / len(seq.real.tokens))
            if copy is not None and not _is_multiple(copy):
                m.copy_handles.append(copy)
        elif name == "restore":
            copy = m.restore(live[op[1]])
            if not _is_multiple(copy):
                m.copy_handles.append(copy)
        elif name == "pin":
            receipt = m.pin(live[op[1]])
            if not _is_multiple(receipt):
                m.receipt_handles.append(receipt)
        elif name == "release":
            m.release(live.pop(op[1]))
        elif name == "abort":
            m.abort(live.pop(op[1]))
        elif name == "complete":
            m.complete_one_copy(m.copy_handles[op[1]])
        elif name == "fail":
            m.fail_one_copy(m.copy_handles[op[1]])
        elif name == "interrupt":
            m.a_copy_raises_while_it_runs(m.copy_handles[op[1]], True)
        elif name == "unpin":
            m.unpin(m.receipt_handles.pop(op[1]))
        elif name == "evict":
            m.evict(op[1])
        elif name == "evict_checkpoints":
            m.evict_checkpoints(op[1])
        elif name == "poll":
            m.poll()
        else:  # pragma: no cover - the alphabet below names only these
            raise ValueError(f"unknown operation {op!r}")
        # copies no longer pending and used receipts take no further operation
        m.copy_handles = [c for c in m.copy_handles if not c.real.done]
        m.receipt_handles = [r for r in m.receipt_handles if not r.real.used]

    def replay(self, path: Sequence[Op]) -> Any:
        """A fresh machine brought to the state `path` reaches (checked when first seen)."""
        m = self.fresh()
        m.replaying = True
        for op in path:
            self.apply(m, op)
        m.replaying = False
        return m

    def check(self, m: Any) -> None:
        """Every invariant of the differential machine, in the state `m` is in."""
        m.cache_invariants_hold()
        m.model_invariants_hold()
        m.both_observe_the_same()
        m.pinned_checkpoints_are_never_released_nor_their_slots_reused()

    # ------------------------------------------------------------ the alphabet

    def operations(self, m: Any) -> Iterator[Op]:
        """Every operation of the alphabet from the state `m` is in."""
        b = self.bounds
        live = m.live_handles
        if len(live) < b.max_live:
            for p in self._prompts:
                yield ("match", tuple(p))
        for i, seq in enumerate(live):
            real = seq.real
            yield ("prefill", i)
            yield ("append", i, 0)
            yield ("append", i, 1)
            for step in range(1, real.num_committed_tokens + 1):
                yield ("save", i, step)
            if real.restore is not None:
                yield ("restore", i)
                yield ("pin", i)
            yield ("release", i)
            yield ("abort", i)
        for j in range(len(m.copy_handles)):
            yield ("complete", j)
            yield ("fail", j)
            yield ("interrupt", j)
        for k in range(len(m.receipt_handles)):
            yield ("unpin", k)
        yield ("evict", 1)
        yield ("evict", b.num_blocks)
        yield ("evict_checkpoints", 1)
        yield ("poll",)


def _is_multiple(value: object) -> bool:
    """Whether a rule returned Hypothesis's `multiple()` (nothing to keep)."""
    return type(value).__name__ == "MultipleResults"


def _names(snap: Snapshot) -> tuple[dict[int, Any], dict[int, Any]]:
    """Id-free names of every node and checkpoint of `snap`."""
    nodes = {nid: node_path(snap, nid) for nid in snap["nodes"]}
    checkpoints = {
        cid: (nodes[c["anchor"]], c["step"], c["tail"], c["tail_extra"])
        for cid, c in snap["checkpoints"].items()
    }
    return nodes, checkpoints


def state_key(m: Any) -> str:
    """The id-free canonical form of the state `m` is in (see the module docstring)."""
    snap: Snapshot = m.cache.snapshot()
    view = observe(snap)
    del view["stats"]
    nodes, checkpoints = _names(snap)
    seqs = []
    for pair in m.live_handles:
        s = snap["sequences"][pair.real.serial]
        restore = s["restore_checkpoint"]
        seqs.append(
            (
                sequence_view(s, nodes),
                s["extra"],
                checkpoints.get(restore, "gone") if restore is not None else None,
                pair.real.branch_step,
            )
        )
    copies = []
    for pair in m.copy_handles:
        c = snap["copies"][pair.real.serial]
        copies.append(
            (c["kind"], pair.real.step, c["state"], tuple(checkpoints[p] for p in c["pins"]))
        )
    receipts = [
        (r.real.state, checkpoints.get(r.real.checkpoint.serial, "gone")) for r in m.receipt_handles
    ]
    return repr((sorted(view.items()), seqs, copies, receipts))


def explore(bounds: Bounds, *, time_limit: float | None = None) -> Report:
    """Explore every operation sequence up to `bounds.depth` (see the module docstring).

    Raises `ExplorationFailure` at the first violation. With `time_limit` (seconds),
    stops after the first depth that ends past it (`Report.complete` False then).
    """
    explorer = Explorer(bounds)
    report = Report(bounds)
    t0 = time.perf_counter()
    start = STARTS[bounds.start]
    root = explorer.fresh()
    explorer.check(root)
    for i, op in enumerate(start):  # the start path, checked on the way
        try:
            explorer.apply(root, op)
            explorer.check(root)
        except Exception as exc:
            raise ExplorationFailure(start[: i + 1], exc) from exc
    seen = {state_key(root)}
    frontier: list[tuple[Op, ...]] = [start]
    for depth in range(1, bounds.depth + 1):
        next_frontier: list[tuple[Op, ...]] = []
        transitions = refusals = 0
        for path in frontier:
            ops = list(explorer.operations(explorer.replay(path)))
            for op in ops:
                m = explorer.replay(path)
                new = (*path, op)
                try:
                    explorer.apply(m, op)
                    explorer.check(m)
                except Exception as exc:
                    raise ExplorationFailure(new, exc) from exc
                transitions += 1
                refusals += m.refused
                key = state_key(m)
                if key not in seen:
                    seen.add(key)
                    next_frontier.append(new)
        report.transitions += transitions
        report.refusals += refusals
        report.states = len(seen)
        report.depth_reached = depth
        report.per_depth.append(
            {"depth": depth, "transitions": transitions, "new_states": len(next_frontier)}
        )
        frontier = next_frontier
        if not frontier:
            break
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
    report.complete = report.depth_reached == bounds.depth or not frontier
    report.seconds = time.perf_counter() - t0
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tools.explore``: explore, print the figures as JSON; exit 1 on a violation."""
    p = argparse.ArgumentParser(prog="python -m tools.explore", description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--max-live", type=int, default=2)
    p.add_argument(
        "--prompt-lengths", default="3", help="comma-separated token-list lengths (default 3)"
    )
    p.add_argument(
        "--start", default="empty,warm", help=f"comma-separated start states, of {list(STARTS)}"
    )
    p.add_argument("--time-limit", type=float, default=None, help="stop after the depth past it")
    args = p.parse_args(argv)
    reports = []
    for start in args.start.split(","):
        if start not in STARTS:
            p.error(f"unknown start state {start!r}; expected one of {list(STARTS)}")
        bounds = Bounds(
            depth=args.depth,
            num_blocks=args.blocks,
            slots=args.slots,
            max_live=args.max_live,
            prompt_lengths=tuple(int(n) for n in args.prompt_lengths.split(",")),
            start=start,
        )
        try:
            reports.append(explore(bounds, time_limit=args.time_limit).as_dict())
        except ExplorationFailure as exc:
            print(str(exc), file=sys.stderr)
            return 1
    print(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
