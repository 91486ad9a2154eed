"""Generate docs/lifecycle.md from the lifecycles in `spec.lifecycle`.

    python -m spec.docgen            # rewrite docs/lifecycle.md
    python -m spec.docgen --check    # exit 1 when the committed file is stale
    python -m spec.docgen --path OUT # write elsewhere (needed outside a source checkout)

Without ``--path`` it writes ``docs/lifecycle.md`` of the source checkout it
runs from; from an installed package (no checkout around it) it refuses
rather than write into site-packages.

The mermaid diagrams come from `transitions`' mermaid graph engine, so the
picture is drawn from the same machines that the cache's tables derive from.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

from spec.lifecycle import (
    LIFECYCLES,
    RESIDENCY_EVICTIONS,
    RESIDENCY_PINS,
    Lifecycle,
    Residency,
    implied_checkpoint_state,
    implied_copy_state,
    implied_node_state,
)

_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATH = _ROOT / "docs" / "lifecycle.md"
"""docs/lifecycle.md of the source checkout (only meaningful inside one)."""


def in_checkout(root: Path = _ROOT) -> bool:
    """Whether `root` is a source checkout of the project (not an installed package)."""
    return (root / "pyproject.toml").is_file() and (root / "docs").is_dir()


STATE_ID_PREFIX = "s_"
"""Prefix of every state's Mermaid id (the box shows the state's name). Mermaid keeps
ids of its own: a state whose id is ``root`` (its top-level document's id) is
declared but never drawn, so no state is drawn under its bare name."""

DIRECTION = "TB"
"""Diagrams run top to bottom: laid out left to right, the residency and
checkpoint machines came out about twice the page's width, and Mermaid scales a
diagram down to fit, its labels with it (unreadable at a 1280 px window)."""

ISOLATED_NOTE = "no transition enters or leaves it"
"""The note drawn beside a state that no transition touches (the node's ``root``)."""

_STATE_LINE = re.compile(r'^state "(?P<label>[^"]*)" as (?P<id>\S+)$')
_EDGE_LINE = re.compile(r"^(?P<source>\S+) --> (?P<dest>\S+)(?P<label>: .*)?$")


def _state_id(state: str) -> str:
    return STATE_ID_PREFIX + state


def _diagram(life: Lifecycle) -> str:
    """`life`'s machine as transitions' Mermaid engine draws it, with each state under
    a prefixed id, top to bottom, and a note on each state no transition touches."""
    machine = life.machine(graph=True)
    text: str = machine.get_graph().draw(None)
    # Drop the front matter (a bare title mermaid would reject) and the styling
    # lines (they only mark the machine's current state).
    text = text[text.index("stateDiagram") :]
    out: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        indent = raw[: len(raw) - len(raw.lstrip())]
        if line.startswith(("classDef", "Class ")):
            continue
        if line.startswith("direction "):
            line = f"direction {DIRECTION}"
        elif declared := _STATE_LINE.match(line):
            line = f'state "{declared["label"]}" as {_state_id(declared["id"])}'
        elif edge := _EDGE_LINE.match(line):
            ends = [e if e == "[*]" else _state_id(e) for e in (edge["source"], edge["dest"])]
            line = f"{ends[0]} --> {ends[1]}{edge['label'] or ''}"
        out.append(indent + line if line else "")
    touched = {s for _, sources, dest in life.transitions for s in (*sources, dest)}
    touched.add(life.initial)
    for state in life.states:
        if state not in touched:
            out += [
                f"  note right of {_state_id(state)}",
                f"    {ISOLATED_NOTE}",
                "  end note",
            ]
    return "\n".join(out).rstrip()


def _table(life: Lifecycle) -> str:
    rows = ["| trigger | from | to |", "|---|---|---|"]
    for trigger, sources, dest in life.transitions:
        rows.append(f"| `{trigger}` | {', '.join(f'`{s}`' for s in sources)} | `{dest}` |")
    return "\n".join(rows)


def _implied_tables() -> list[str]:
    """Truth tables of the `implied_*` functions, computed by calling them."""
    node_rows = [
        "| root | attached | on device | leaf | block refs | pins | state |",
        "|---|---|---|---|---|---|---|",
    ]
    for root, attached, on_device, leaf, refs, pins in itertools.product(
        (False, True), (True, False), (True, False), (True, False), (1, 2), (0, 1)
    ):
        if (root and not attached) or (not on_device and (root or not attached or refs > 1)):
            continue
        state = implied_node_state(
            attached=attached,
            leaf=leaf,
            block_refs=refs,
            pins=pins,
            root=root,
            on_device=on_device,
        ).value
        node_rows.append(
            f"| {root} | {attached} | {on_device} | {leaf} | {refs} | {pins} | `{state}` |"
        )
    ck_rows = ["| present | published | pins | state |", "|---|---|---|---|"]
    for present, published, pins in itertools.product((True, False), (True, False), (0, 1)):
        state = implied_checkpoint_state(present=present, published=published, pins=pins).value
        ck_rows.append(f"| {present} | {published} | {pins} | `{state}` |")
    copy_rows = ["| reaped | failed | moved | state |", "|---|---|---|---|"]
    for reaped, failed, moved in itertools.product((False, True), (False, True), (False, True)):
        state = implied_copy_state(reaped=reaped, failed=failed, moved=moved).value
        copy_rows.append(f"| {reaped} | {failed} | {moved} | `{state}` |")
    return [
        "## Implied states",
        "",
        "The cache never picks a node state, nor a checkpoint state after a pin is",
        "dropped, by hand: it computes the state the facts imply and fires the",
        "triggers of the spec's route there. These tables are computed by calling",
        "`implied_node_state`, `implied_checkpoint_state` and `implied_copy_state`.",
        "",
        "### Node",
        "",
        *node_rows,
        "",
        "### Checkpoint",
        "",
        *ck_rows,
        "",
        "### Copy",
        "",
        *copy_rows,
        "",
    ]


def render() -> str:
    """The whole page, as it should be committed."""
    parts = [
        "# Lifecycles",
        "",
        "Generated by `python -m spec.docgen` from `spec/lifecycle.py`; do not edit.",
        "A test fails when this file differs from what the spec generates.",
        "",
        "Any (trigger, state) pair not listed is an illegal transition: the cache",
        "raises `IllegalTransition` naming the trigger and the state.",
        "",
    ]
    for life in LIFECYCLES:
        parts += [
            f"## {life.name.capitalize()} lifecycle",
            "",
            f"Initial state: `{life.initial}`.",
            "",
            "```mermaid",
            _diagram(life),
            "```",
            "",
            _table(life),
            "",
        ]
    parts += _residency_tables()
    parts += _implied_tables()
    return "\n".join(parts)


def _residency_tables() -> list[str]:
    """What each residency pins and which eviction may touch it (`spec.lifecycle`)."""
    rows = [
        "## What each residency holds",
        "",
        "With a host tier, a node's KV residency composes with its node state: a",
        "node is `offloaded` exactly when its residency is `host`. An in-flight copy",
        "holds a reference on every block it reads or writes until it is reaped",
        "(`RESIDENCY_PINS`), and each eviction touches only the residencies listed",
        "(`RESIDENCY_EVICTIONS`).",
        "",
        "| residency | held by its copy | eviction |",
        "|---|---|---|",
    ]
    for residency in Residency:
        pins = "; ".join(RESIDENCY_PINS[residency]) or "nothing"
        rows.append(f"| `{residency.value}` | {pins} | {RESIDENCY_EVICTIONS[residency]} |")
    return [*rows, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    parser.add_argument(
        "--path",
        type=Path,
        help="file to write or check (default: docs/lifecycle.md of the source checkout)",
    )
    args = parser.parse_args(argv)
    if args.path is None:
        if not in_checkout():
            parser.error(
                "not running from a source checkout (an installed package): give --path FILE"
            )
        args.path = DEFAULT_PATH
    text = render()
    if args.check:
        current = args.path.read_text() if args.path.exists() else ""
        if current != text:
            print(f"{args.path} is stale: run python -m spec.docgen", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
