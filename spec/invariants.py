"""The contract's numbered invariants as named predicates over a `Snapshot`.

Each predicate returns the list of problems it found (empty when it holds), so
a failure names the invariant and the object. `check_all` runs them in order
and raises `InvariantViolation` on the first problem. Both the reference model
and the cache produce snapshots, so the same predicates check both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable

from spec.errors import InvariantViolation
from spec.lifecycle import (
    CheckpointState,
    CopyState,
    NodeState,
    implied_checkpoint_state,
    implied_copy_state,
    implied_node_state,
)
from spec.snapshot import Snapshot

Problems = list[str]


def _attached(snap: Snapshot) -> dict[int, int]:
    """block id -> node id, for attached non-root nodes."""
    return {n["block"]: nid for nid, n in snap["nodes"].items() if n["block"] is not None}


def _receipts(snap: Snapshot) -> Counter[int]:
    """checkpoint id -> outstanding receipts (sequence match pins, copies, explicit)."""
    out: Counter[int] = Counter()
    for seq in snap["sequences"].values():
        if seq["holds_match_pin"] and seq["restore_checkpoint"] is not None:
            out[seq["restore_checkpoint"]] += 1
    for copy in snap["copies"].values():
        out.update(copy["pins"])
    out.update(snap["explicit_pins"])
    return out


def reference_conservation(snap: Snapshot) -> Problems:
    """1. Count = [attached node] + sequences + [frozen tail] + copies; 0 iff free, once."""
    expected: Counter[int] = Counter()
    for block in _attached(snap):
        expected[block] += 1
    for seq in snap["sequences"].values():
        expected.update(seq["blocks"])
    for ck in snap["checkpoints"].values():
        if ck["frozen_block"] is not None:
            expected[ck["frozen_block"]] += 1
    for copy in snap["copies"].values():
        expected.update(copy["blocks"])
    problems: Problems = []
    free = Counter(snap["free_blocks"])
    for block, count in free.items():
        if count > 1:
            problems.append(f"block {block} is in the free list {count} times")
    for block in range(snap["capacity"]):
        stored = snap["refcounts"].get(block, 0)
        if stored != expected[block]:
            problems.append(f"block {block}: stored count {stored} != {expected[block]} holders")
        if (stored == 0) != (block in free):
            problems.append(
                f"block {block}: count {stored} but free-list membership {block in free}"
            )
    return problems


def pin_safety(snap: Snapshot) -> Problems:
    """2. Pin counts equal outstanding receipts; pinned checkpoints are live; slots held once."""
    problems: Problems = []
    receipts = _receipts(snap)
    checkpoints = snap["checkpoints"]
    for cid, count in receipts.items():
        if cid not in checkpoints:
            problems.append(f"{count} receipt(s) pin checkpoint {cid}, which was released")
    slots: Counter[int] = Counter(ck["slot"] for ck in checkpoints.values())
    free_slots = set(snap["free_slots"])
    for cid, ck in checkpoints.items():
        if ck["pins"] != receipts[cid]:
            problems.append(f"checkpoint {cid}: pin count {ck['pins']} != {receipts[cid]} receipts")
        if slots[ck["slot"]] > 1:
            problems.append(f"checkpoint {cid}: slot {ck['slot']} is held by another checkpoint")
        if ck["slot"] in free_slots:
            problems.append(f"checkpoint {cid}: slot {ck['slot']} is also in the free list")
        if ck["frozen_block"] is not None and ck["frozen_block"] in snap["free_blocks"]:
            problems.append(f"checkpoint {cid}: frozen block {ck['frozen_block']} is free")
    return problems


def eviction_safety(snap: Snapshot) -> Problems:
    """3. The eviction index holds only attached leaves that only the trie holds, unpinned."""
    problems: Problems = []
    nodes = snap["nodes"]
    for nid in snap["evictable_index"]:
        node = nodes.get(nid)
        if node is None:
            problems.append(f"evictable index holds detached node {nid}")
            continue
        if node["children"]:
            problems.append(f"evictable node {nid} has children")
        if node["block"] is None or snap["refcounts"].get(node["block"], 0) != 1:
            problems.append(f"evictable node {nid}: its block is held beyond the trie")
        cid = node["checkpoint"]
        if cid is not None and snap["checkpoints"][cid]["pins"] > 0:
            problems.append(f"evictable node {nid}: its checkpoint {cid} is pinned")
    return problems


def topology(snap: Snapshot) -> Problems:
    """4. Parents attached, links agree, depth = parent depth + 1, sequence paths are chains."""
    problems: Problems = []
    nodes = snap["nodes"]
    for ns, rid in snap["roots"].items():
        root = nodes.get(rid)
        if root is None or root["parent"] is not None or root["namespace"] != ns:
            problems.append(f"root of namespace {ns!r} is missing or not a root")
    for nid, node in nodes.items():
        for cid in node["children"]:
            child = nodes.get(cid)
            if child is None or child["parent"] != nid:
                problems.append(f"node {nid}: child {cid} does not link back")
        parent_id = node["parent"]
        if parent_id is None:
            if node["depth"] != 0 or node["block"] is not None:
                problems.append(f"node {nid}: parentless but not a root")
            continue
        parent = nodes.get(parent_id)
        if parent is None:
            problems.append(f"node {nid}: parent {parent_id} is not attached")
            continue
        if nid not in parent["children"]:
            problems.append(f"node {nid}: parent {parent_id} does not list it")
        if node["depth"] != parent["depth"] + 1:
            problems.append(f"node {nid}: depth {node['depth']} != parent depth + 1")
        if node["namespace"] != parent["namespace"]:
            problems.append(f"node {nid}: namespace differs from its parent's")
    for sid, seq in snap["sequences"].items():
        expected_parent = snap["roots"].get(seq["namespace"])
        for i, nid in enumerate(seq["path"]):
            path_node = nodes.get(nid)
            if path_node is None:
                problems.append(f"sequence {sid}: path node {nid} is not attached")
                break
            if path_node["parent"] != expected_parent:
                problems.append(f"sequence {sid}: path is not a chain at block {i}")
            if i >= len(seq["blocks"]) or seq["blocks"][i] != path_node["block"]:
                problems.append(f"sequence {sid}: block table entry {i} is not its path block")
            expected_parent = nid
    return problems


def _block_identity(
    tokens: tuple[int, ...], extra: tuple[Hashable, ...] | None, i: int, size: int
) -> tuple[tuple[int, ...], Hashable]:
    ident = extra[i] if extra is not None and i < len(extra) else None
    return tokens[i * size : (i + 1) * size], ident


def exact_identity(snap: Snapshot) -> Problems:
    """5. A hit of n tokens: the request's first n tokens, namespace and extra equal the path's."""
    problems: Problems = []
    size = snap["block_size"]
    nodes = snap["nodes"]
    for sid, seq in snap["sequences"].items():
        if seq["num_cached_tokens"] > len(seq["tokens"]) - 1:
            problems.append(f"sequence {sid}: hit leaves no token to compute")
        for i, nid in enumerate(seq["path"]):
            node = nodes.get(nid)
            if node is None:
                continue
            if node["namespace"] != seq["namespace"]:
                problems.append(f"sequence {sid}: path node {nid} is in another namespace")
            if node["key"] != _block_identity(seq["tokens"], seq["extra"], i, size):
                problems.append(f"sequence {sid}: block {i} differs from path node {nid}")
    return problems


def ssm_soundness(snap: Snapshot) -> Problems:
    """6. An SSM hit ends exactly at a live checkpoint whose prefix equals the request's."""
    problems: Problems = []
    if snap["slot_capacity"] == 0:
        return problems
    size = snap["block_size"]
    for sid, seq in snap["sequences"].items():
        cid = seq["restore_checkpoint"]
        if cid is None:
            if seq["num_cached_tokens"] != 0:
                problems.append(f"sequence {sid}: SSM hit without a checkpoint (KV-only path)")
            continue
        if not seq["holds_match_pin"]:
            continue  # restored: the checkpoint's job for this sequence is done
        ck = snap["checkpoints"].get(cid)
        if ck is None:
            problems.append(f"sequence {sid}: its pinned restore checkpoint {cid} was released")
            continue
        if ck["step"] != seq["num_cached_tokens"]:
            problems.append(f"sequence {sid}: hit {seq['num_cached_tokens']} != step {ck['step']}")
        depth = ck["step"] // size
        if depth > len(seq["path"]):
            problems.append(f"sequence {sid}: checkpoint {cid} is deeper than its path")
            continue
        anchor = seq["path"][depth - 1] if depth else snap["roots"].get(seq["namespace"])
        if anchor != ck["anchor"]:
            problems.append(f"sequence {sid}: checkpoint {cid} is not anchored on its path")
        if tuple(seq["tokens"][depth * size : ck["step"]]) != ck["tail"]:
            problems.append(f"sequence {sid}: checkpoint {cid} tail differs from its tokens")
        if ck["step"] > len(seq["tokens"]) - 1:
            problems.append(f"sequence {sid}: checkpoint {cid} leaves no token to compute")
    return problems


def explicit_state(snap: Snapshot) -> Problems:
    """7. Stored states (nodes, roots, checkpoints, copies) equal the states the facts
    imply; the indexes hold exactly the eligible objects."""
    problems: Problems = []
    nodes = snap["nodes"]
    checkpoints = snap["checkpoints"]
    evictable: list[tuple[int, int, int]] = []
    for nid, node in nodes.items():
        cid = node["checkpoint"]
        pins = checkpoints[cid]["pins"] if cid is not None else 0
        block = node["block"]
        refs = snap["refcounts"].get(block, 0) if block is not None else 0
        implied = implied_node_state(
            attached=True,
            leaf=not node["children"],
            block_refs=refs,
            pins=pins,
            root=node["parent"] is None,
        ).value
        if node["state"] != implied:
            problems.append(f"node {nid}: stored state {node['state']!r}, facts imply {implied!r}")
        if implied == NodeState.EVICTABLE.value:
            evictable.append((node["tick"], node["serial"], nid))
    expected_order = [nid for _, _, nid in sorted(evictable)]
    if snap["evictable_index"] != expected_order:
        problems.append(
            f"eviction index {snap['evictable_index']} != evictable nodes by (tick, serial) "
            f"{expected_order}"
        )
    published: list[tuple[int, int, int]] = []
    for cid, ck in checkpoints.items():
        withdrawn = ck["state"] == CheckpointState.WITHDRAWN.value
        implied_ck = implied_checkpoint_state(
            present=True,
            published=ck["state"] != CheckpointState.RESERVED.value,
            pins=ck["pins"],
            withdrawn=withdrawn,
        ).value
        if ck["state"] != implied_ck:
            problems.append(f"checkpoint {cid}: stored state {ck['state']!r} != {implied_ck!r}")
        anchor = nodes.get(ck["anchor"])
        if anchor is None or anchor["checkpoint"] != cid:
            problems.append(f"checkpoint {cid}: its anchor does not point back to it")
        if implied_ck == CheckpointState.PUBLISHED.value:
            published.append((ck["tick"], ck["serial"], cid))
    expected_ck = [cid for _, _, cid in sorted(published)]
    if snap["checkpoint_index"] != expected_ck:
        problems.append(
            f"checkpoint index {snap['checkpoint_index']} != published checkpoints {expected_ck}"
        )
    for copy_id, copy in snap["copies"].items():
        failed = copy["state"] == CopyState.FAILED.value
        implied_copy = implied_copy_state(reaped=False, failed=failed, moved=copy["done"]).value
        if copy["state"] != implied_copy or copy["done"] != (copy["state"] != CopyState.QUEUED):
            problems.append(
                f"copy {copy_id}: stored state {copy['state']!r}, done={copy['done']} "
                f"imply {implied_copy!r}"
            )
    return problems


def accounting(snap: Snapshot) -> Problems:
    """9. free + cached + in use = capacity for each pool."""
    problems: Problems = []
    cached = len(_attached(snap))
    free = len(snap["free_blocks"])
    in_use = sum(
        1
        for block, count in snap["refcounts"].items()
        if count > 0 and block not in _attached(snap)
    )
    if free + cached + in_use != snap["capacity"]:
        problems.append(
            f"KV pool: free {free} + cached {cached} + in use {in_use} != {snap['capacity']}"
        )
    held = len(snap["checkpoints"])
    if len(snap["free_slots"]) + held != snap["slot_capacity"]:
        problems.append(
            f"slot pool: free {len(snap['free_slots'])} + held {held} != {snap['slot_capacity']}"
        )
    return problems


def events(snap: Snapshot) -> Problems:
    """10. Replaying the emitted events yields exactly the cached block set (and, for
    checkpoint events, exactly the slots of the matchable checkpoints)."""
    problems: Problems = []
    replayed = snap["event_blocks"]
    if replayed is not None:
        cached = set(_attached(snap))
        if replayed != cached:
            problems.append(
                f"events replay to {sorted(replayed - cached)} extra / "
                f"{sorted(cached - replayed)} missing blocks"
            )
    slots = snap.get("event_checkpoint_slots")
    if slots is not None:
        unannounced = (CheckpointState.RESERVED.value, CheckpointState.WITHDRAWN.value)
        matchable = {
            ck["slot"] for ck in snap["checkpoints"].values() if ck["state"] not in unannounced
        }
        if slots != matchable:
            problems.append(
                f"checkpoint events replay to slots {sorted(slots - matchable)} extra / "
                f"{sorted(matchable - slots)} missing"
            )
    return problems


def rollback(before: Snapshot, after: Snapshot) -> Problems:
    """8. `match` then `abort` restores counts, pins, indexes and statistics exactly."""
    fields = (
        "free_blocks",
        "refcounts",
        "free_slots",
        "checkpoints",
        "evictable_index",
        "checkpoint_index",
        "stats",
        "explicit_pins",
    )
    old: dict[str, object] = dict(before)
    new: dict[str, object] = dict(after)
    return [f"{field} differs after match + abort" for field in fields if old[field] != new[field]]


SnapshotPredicate = Callable[[Snapshot], Problems]

INVARIANTS: tuple[tuple[str, SnapshotPredicate], ...] = (
    ("reference_conservation", reference_conservation),
    ("pin_safety", pin_safety),
    ("eviction_safety", eviction_safety),
    ("topology", topology),
    ("exact_identity", exact_identity),
    ("ssm_soundness", ssm_soundness),
    ("explicit_state", explicit_state),
    ("accounting", accounting),
    ("events", events),
)
"""Every single-snapshot invariant, by name, in the contract's order (8 compares two)."""


def violations(snap: Snapshot) -> list[tuple[str, str]]:
    """Every (invariant name, problem) in `snap`."""
    return [(name, p) for name, predicate in INVARIANTS for p in predicate(snap)]


def check_all(snap: Snapshot) -> None:
    """Raise `InvariantViolation` for the first broken invariant in `snap`."""
    for name, predicate in INVARIANTS:
        problems = predicate(snap)
        if problems:
            raise InvariantViolation(name, problems[0])
