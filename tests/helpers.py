"""Small builders shared by the unit tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cache import BlockTrie, CacheConfig, IllegalTransition, ManualCopies
from cache.node import NO_NODE, Node, state_code, state_name
from spec.snapshot import Snapshot

ROOT = Path(__file__).resolve().parent.parent


def python_without(blocked: Sequence[str], code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter, from the checkout's root, where the top-level
    packages `blocked` cannot be imported, as where they are not installed: ``import``
    raises `ModuleNotFoundError` and `importlib.util.find_spec` returns None."""
    block = f"import sys\nsys.modules.update(dict.fromkeys({tuple(blocked)!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", block + code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def kv_trie(num_blocks: int = 16, block_size: int = 4, **overrides: Any) -> BlockTrie:
    """An attention-only trie with a tiny KV tensor (events on, so `check()` replays them)."""
    overrides.setdefault("enable_events", True)
    config = CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_block_shape=overrides.pop("kv_block_shape", (block_size, 2)),
        kv_dtype=torch.float32,
        **overrides,
    )
    return BlockTrie(config)


def ssm_trie(
    num_blocks: int = 16, slots: int = 4, block_size: int = 4, manual: bool = True, **kw: Any
) -> tuple[BlockTrie, ManualCopies | None]:
    """An SSM trie with tiny KV and state tensors; ManualCopies unless manual=False."""
    kw.setdefault("enable_events", True)
    config = CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_block_shape=(block_size, 2),
        kv_dtype=torch.float64,
        num_checkpoint_slots=slots,
        state_shapes={"conv": (2, 3), "ssm": (3,)},
        state_dtype=torch.float64,
        **kw,
    )
    copies = ManualCopies() if manual else None
    return BlockTrie(config, copies=copies), copies


def state(value: float, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A runtime state filled with `value` (a recognisable pattern)."""
    return {
        "conv": torch.full((2, 3), value, dtype=torch.float64, device=device),
        "ssm": torch.arange(3, dtype=torch.float64, device=device) + value,
    }


def empty_state(device: str = "cpu") -> dict[str, torch.Tensor]:
    """A zeroed runtime state (the restore target)."""
    return {
        "conv": torch.zeros(2, 3, dtype=torch.float64, device=device),
        "ssm": torch.zeros(3, dtype=torch.float64, device=device),
    }


def serve(trie: BlockTrie, tokens: list[int], namespace: str = "", extra: Any = None) -> int:
    """match + allocate + commit + release; returns the hit."""
    seq = trie.match(tokens, namespace=namespace, extra=extra)
    trie.allocate(seq, len(tokens))
    trie.commit(seq, len(tokens))
    trie.release(seq)
    return seq.num_cached_tokens


def frozen(snap: Snapshot) -> dict[str, Any]:
    """Everything in a snapshot that a failed or undone operation must leave as it was."""
    return {k: v for k, v in snap.items() if k not in ("event_blocks", "event_checkpoint_slots")}


def hit(trie: BlockTrie, tokens: list[int], namespace: str = "") -> int:
    """The tokens a match of `tokens` finds cached; the match is aborted (nothing changes)."""
    seq = trie.match(tokens, namespace=namespace)
    cached = seq.num_cached_tokens
    trie.abort(seq)
    return cached


def refused_changing_nothing(
    trie: BlockTrie, step: Callable[[], object], transition: tuple[str, str, str], node: NodeRef
) -> None:
    """`step()` raises the spec's `IllegalTransition` for `transition` (machine,
    trigger, state), naming `node`, and leaves the trie as it was."""
    before = frozen(trie.snapshot())
    with pytest.raises(IllegalTransition) as info:
        step()
    error = info.value
    assert (error.machine, error.trigger, error.state) == transition
    assert error.subject == repr(node)
    assert frozen(trie.snapshot()) == before


SMALL_WORKLOAD = ["--users", "6", "--turns", "2", "--system-tokens", "64", "--user-tokens", "16"]
SMALL_WORKLOAD += ["--output-tokens", "12", "--tool-result-tokens", "24"]
"""Flags for a built-in workload small enough for CLI tests."""


def run_cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """`blocktrie ARGV` in-process: (exit code, stdout, stderr); argparse exits included."""
    from cache.planner.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@dataclass(frozen=True)
class Finished:
    """A finished `blocktrie` child process: exit code, output, wall time."""

    code: int
    out: str
    err: str
    seconds: float


def run_cli_process(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 120
) -> Finished:
    """``python -m cache.planner ARGV`` run as a user runs it: a child process started
    from the checkout root (so it imports this checkout), stdout and stderr pipes
    (not a terminal)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "cache.planner", *argv], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return Finished(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)


class NodeRef:
    """A test's handle on one node of a trie: reads (and, to corrupt on purpose,
    writes) the node's columns in the trie's `cache.node.NodeTable` by name.
    `id` is the node itself, as the trie's modules take it."""

    _COLUMNS = ("block", "host", "tick", "serial", "block_hash", "residency")

    def __init__(self, trie: BlockTrie, node: Node) -> None:
        object.__setattr__(self, "table", trie._nodes)
        object.__setattr__(self, "trie", trie)
        object.__setattr__(self, "id", node)

    def __getattr__(self, name: str) -> Any:
        if name == "state":
            return state_name(self.table.state[self.id])
        if name == "namespace":
            return self.table.namespace_of(self.id)
        if name in NodeRef._COLUMNS:
            return getattr(self.table, name)[self.id]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "parent":
            object.__setattr__(self, name, value)  # the property
        elif name == "state":
            self.table.state[self.id] = state_code(value)
        elif name in NodeRef._COLUMNS:
            getattr(self.table, name)[self.id] = value
        else:
            raise AttributeError(name)

    def _get_parent(self) -> NodeRef | None:
        parent = self.table.parent[self.id]
        return None if parent == NO_NODE else NodeRef(self.trie, parent)

    def _set_parent(self, value: NodeRef | None) -> None:
        self.table.parent[self.id] = NO_NODE if value is None else value.id

    parent = property(_get_parent, _set_parent)

    @property
    def checkpoint(self) -> Any:
        return self.table.checkpoint.get(self.id)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.table.tokens_of(self.id))

    @property
    def key(self) -> Any:
        return self.table.key(self.id)

    def child_nodes(self) -> list[NodeRef]:
        return [NodeRef(self.trie, n) for n in self.table.child_nodes(self.id)]

    def child_count(self) -> int:
        return int(self.table.child_count(self.id))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeRef) and (other.table, other.id) == (self.table, self.id)

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return str(self.table.describe(self.id))


def root_of(trie: BlockTrie, namespace: str = "") -> NodeRef:
    """A handle on `trie`'s root of `namespace`."""
    return NodeRef(trie, trie._roots[namespace])


def spy_gather_ops(monkeypatch: Any) -> list[str]:
    """Record each ``torch.index_select`` / ``Tensor.index_copy_`` call (by name) that
    follows, for tests of which copy path a `cache.moves.BlockMove` takes."""
    calls: list[str] = []
    real_select, real_index_copy = torch.index_select, torch.Tensor.index_copy_

    def spy_select(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("index_select")
        return real_select(*args, **kwargs)

    def spy_index_copy(self: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append("index_copy_")
        return real_index_copy(self, *args)

    monkeypatch.setattr(torch, "index_select", spy_select)
    monkeypatch.setattr(torch.Tensor, "index_copy_", spy_index_copy)
    return calls
