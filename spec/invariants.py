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
    RESIDENCY_PINS,
    CheckpointState,
    CopyState,
    NodeState,
    Residency,
    implied_checkpoint_state,
    implied_copy_state,
    implied_node_state,
)
from spec.snapshot import Snapshot

Problems = list[str]


def _attached(snap: Snapshot) -> dict[int, int]:
    """block id -> node id, for attached non-root nodes."""
    return {n["block"]: nid for nid, n in snap["nodes"].items() if n["block"] is not None}


def _device_leaf(snap: Snapshot, node_id: int) -> bool:
    """No child of the node owns a device block (with no host tier: no children)."""
    nodes = snap["nodes"]
    return all(nodes[c]["block"] is None for c in nodes[node_id]["children"] if c in nodes)


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
    """1. Count = [attached node] + sequences + [frozen tail] + copies + block pins ([R66]);
    0 iff free, once."""
    expected: Counter[int] = Counter()
    for block in _attached(snap):
        expected[block] += 1
    expected.update(snap["block_pins"])
    for seq in snap["sequences"].values():
        expected.update(seq["blocks"])
    for ck in snap["checkpoints"].values():
        if ck["frozen_block"] is not None:
            expected[ck["frozen_block"]] += 1
    for copy in snap["copies"].values():
        expected.update(copy["blocks"])
    return _counts_agree(
        "block", expected, snap["refcounts"], snap["free_blocks"], snap["capacity"]
    )


def _counts_agree(
    what: str,
    expected: Counter[int],
    refcounts: dict[int, int],
    free_list: list[int],
    capacity: int,
) -> Problems:
    """Each of `capacity` blocks: its stored count equals its holders, it is free
    iff that count is 0, and in the free list at most once."""
    problems: Problems = []
    free = Counter(free_list)
    for block, count in free.items():
        if count > 1:
            problems.append(f"{what} {block} is in the free list {count} times")
    for block in range(capacity):
        stored = refcounts.get(block, 0)
        if stored != expected[block]:
            problems.append(f"{what} {block}: stored count {stored} != {expected[block]} holders")
        if (stored == 0) != (block in free):
            problems.append(
                f"{what} {block}: count {stored} but free-list membership {block in free}"
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
    device = {cid: ck["slot"] for cid, ck in checkpoints.items()}
    host = {cid: ck["host_slot"] for cid, ck in checkpoints.items()}
    problems += _slots_held_once("slot", device, snap["free_slots"])
    problems += _slots_held_once("host slot", host, snap["free_host_slots"])
    for cid, ck in checkpoints.items():
        if ck["pins"] != receipts[cid]:
            problems.append(f"checkpoint {cid}: pin count {ck['pins']} != {receipts[cid]} receipts")
        if ck["frozen_block"] is not None and ck["frozen_block"] in snap["free_blocks"]:
            problems.append(f"checkpoint {cid}: frozen block {ck['frozen_block']} is free")
    return problems


def _slots_held_once(what: str, held_by: dict[int, int | None], free_list: list[int]) -> Problems:
    """Each held slot (None: none) is held by one checkpoint and not in the free list."""
    problems: Problems = []
    held: Counter[int] = Counter(slot for slot in held_by.values() if slot is not None)
    free = set(free_list)
    for cid, slot in held_by.items():
        if slot is None:
            continue
        if held[slot] > 1:
            problems.append(f"checkpoint {cid}: {what} {slot} is held by another checkpoint")
        if slot in free:
            problems.append(f"checkpoint {cid}: {what} {slot} is also in the free list")
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
        if not _device_leaf(snap, nid):
            problems.append(f"evictable node {nid} has children on the device")
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
            leaf=_device_leaf(snap, nid),
            block_refs=refs,
            pins=pins,
            root=node["parent"] is None,
            on_device=block is not None,
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
    host_leaves = sorted(
        (node["tick"], node["serial"], nid)
        for nid, node in nodes.items()
        if node["state"] == NodeState.OFFLOADED.value
        and not node["children"]
        and node["block_host"] is not None
        and snap["host_refcounts"].get(node["block_host"], 0) == 1
    )
    expected_host = [nid for _, _, nid in host_leaves]
    if snap["host_index"] != expected_host:
        problems.append(
            f"host eviction index {snap['host_index']} != offloaded leaves no request reads, "
            f"by (tick, serial) {expected_host}"
        )
    published: list[tuple[int, int, int]] = []
    host_only: list[tuple[int, int, int]] = []
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
            (published if ck["slot"] is not None else host_only).append(
                (ck["tick"], ck["serial"], cid)
            )
    expected_ck = [cid for _, _, cid in sorted(published)]
    if snap["checkpoint_index"] != expected_ck:
        problems.append(
            f"checkpoint index {snap['checkpoint_index']} != published checkpoints with a device "
            f"slot {expected_ck}"
        )
    expected_host_ck = [cid for _, _, cid in sorted(host_only)]
    if snap["host_checkpoint_index"] != expected_host_ck:
        problems.append(
            f"host checkpoint index {snap['host_checkpoint_index']} != published host-only "
            f"checkpoints {expected_host_ck}"
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
    checkpoints = snap["checkpoints"].values()
    for pool, held, free, capacity in (
        (
            "slot pool",
            sum(1 for ck in checkpoints if ck["slot"] is not None),
            len(snap["free_slots"]),
            snap["slot_capacity"],
        ),
        (
            "host slot pool",
            sum(1 for ck in checkpoints if ck["host_slot"] is not None),
            len(snap["free_host_slots"]),
            snap["host_slot_capacity"],
        ),
    ):
        if free + held != capacity:
            problems.append(f"{pool}: free {free} + held {held} != {capacity}")
    return problems


def events(snap: Snapshot) -> Problems:
    """10. Replaying the emitted events yields exactly the cached block set (blocks
    still loading from the host tier excluded), and, for checkpoint events, exactly
    the slots of the matchable checkpoints; no two cached blocks publish one block
    hash ([R61]), or removing one would tell a router both are gone."""
    problems: Problems = []
    hashes = snap.get("event_block_hashes")
    if hashes is not None:
        named: dict[int, int] = {}
        for nid, h in hashes.items():
            other = named.setdefault(h, nid)
            if other != nid:
                problems.append(f"nodes {other} and {nid} publish the same block hash {h:#x}")
    replayed = snap["event_blocks"]
    if replayed is not None:
        loading = Residency.LOADING.value  # announced once its load has finished ([R50])
        cached = {
            block
            for block, nid in _attached(snap).items()
            if snap["nodes"][nid]["residency"] != loading
        }
        if replayed != cached:
            problems.append(
                f"events replay to {sorted(replayed - cached)} extra / "
                f"{sorted(cached - replayed)} missing blocks"
            )
    slots = snap.get("event_checkpoint_slots")
    if slots is not None:
        unannounced = (CheckpointState.RESERVED.value, CheckpointState.WITHDRAWN.value)
        matchable = {
            ck["slot"]
            for ck in snap["checkpoints"].values()
            if ck["state"] not in unannounced and ck["slot"] is not None
        }
        if slots != matchable:
            problems.append(
                f"checkpoint events replay to slots {sorted(slots - matchable)} extra / "
                f"{sorted(matchable - slots)} missing"
            )
    host_slots = snap["event_host_checkpoint_slots"]
    if host_slots is not None:
        unannounced = (CheckpointState.RESERVED.value, CheckpointState.WITHDRAWN.value)
        stored = {
            ck["host_slot"]
            for ck in snap["checkpoints"].values()
            if ck["state"] not in unannounced
            and ck["residency"] in _ANNOUNCED_CHECKPOINT
            and ck["host_slot"] is not None
        }
        if host_slots != stored:
            problems.append(
                f"host checkpoint events replay to slots {sorted(host_slots - stored)} extra / "
                f"{sorted(stored - host_slots)} missing"
            )
    return problems


_ON_DEVICE = frozenset(
    r.value for r in (Residency.DEVICE, Residency.STORING, Residency.MIRRORED, Residency.LOADING)
)
_ON_HOST = frozenset(
    r.value for r in (Residency.STORING, Residency.MIRRORED, Residency.HOST, Residency.LOADING)
)
_ANNOUNCED_CHECKPOINT = frozenset(r.value for r in (Residency.MIRRORED, Residency.HOST))
_ANNOUNCED_ON_HOST = frozenset(
    r.value for r in (Residency.MIRRORED, Residency.HOST, Residency.LOADING)
)


def host_tier(snap: Snapshot) -> Problems:
    """11. Host conservation and residency: each host block's count = [owning node] +
    requests that matched it + copies; 0 iff free; a node's blocks agree with its
    residency; a block an in-flight copy reads or writes is held by that copy, on
    both tiers; device-resident nodes hang only under device-resident ones."""
    problems: Problems = []
    nodes = snap["nodes"]
    expected: Counter[int] = Counter()
    owners: Counter[int] = Counter()
    for node in nodes.values():
        if node["block_host"] is not None:
            expected[node["block_host"]] += 1
            owners[node["block_host"]] += 1
    for sid, seq in snap["sequences"].items():
        for nid in seq["host_path"]:
            matched = nodes.get(nid)
            if matched is None or matched["block_host"] is None:
                problems.append(f"sequence {sid}: matched host node {nid} has no host block")
                continue
            expected[matched["block_host"]] += 1
    copy_holds: dict[tuple[str, int | None], set[str]] = {}
    for copy in snap["copies"].values():
        expected.update(copy["host_blocks"])
        for block in copy["blocks"]:
            copy_holds.setdefault(("block", block), set()).add(copy["kind"])
        for block in copy["host_blocks"]:
            copy_holds.setdefault(("host", block), set()).add(copy["kind"])
    problems += _counts_agree(
        "host block",
        expected,
        snap["host_refcounts"],
        snap["free_host_blocks"],
        snap["host_capacity"],
    )
    for block, owned in owners.items():
        if owned > 1:
            problems.append(f"host block {block} is owned by {owned} nodes")
    for nid, node in nodes.items():
        if node["parent"] is None:
            continue
        residency = node["residency"]
        if (node["block"] is not None) != (residency in _ON_DEVICE):
            problems.append(f"node {nid}: {residency} but device block {node['block']}")
        if (node["block_host"] is not None) != (residency in _ON_HOST):
            problems.append(f"node {nid}: {residency} but host block {node['block_host']}")
        if node["block"] is not None:
            parent = nodes.get(node["parent"])
            if parent is not None and parent["parent"] is not None and parent["block"] is None:
                problems.append(f"node {nid} is on the device under host-only {node['parent']}")
        if residency == Residency.HOST.value and node["checkpoint"] is not None:
            problems.append(f"node {nid}: host-only with a checkpoint")
        if RESIDENCY_PINS[Residency(residency)]:  # storing / loading: a copy holds both
            kind = "store" if residency == Residency.STORING.value else "load"
            if kind not in copy_holds.get(("block", node["block"]), set()) or (
                kind not in copy_holds.get(("host", node["block_host"]), set())
            ):
                problems.append(f"node {nid} is {residency} but no {kind} copy holds its blocks")
    replayed = snap["event_host_blocks"]
    if replayed is not None:
        announced = {
            node["block_host"]
            for node in nodes.values()
            if node["residency"] in _ANNOUNCED_ON_HOST and node["block_host"] is not None
        }
        if replayed != announced:
            problems.append(
                f"host events replay to {sorted(replayed - announced)} extra / "
                f"{sorted(announced - replayed)} missing host blocks"
            )
    problems += _checkpoint_residency(snap)
    return problems


_CHECKPOINT_ON_DEVICE = frozenset(
    r.value for r in (Residency.DEVICE, Residency.STORING, Residency.MIRRORED)
)
_CHECKPOINT_ON_HOST = frozenset(
    r.value for r in (Residency.STORING, Residency.MIRRORED, Residency.HOST)
)


def _checkpoint_residency(snap: Snapshot) -> Problems:
    """Part of 11 ([R53]-[R56]): a checkpoint's slots agree with its residency (it
    never loads: a restore reads a host slot directly); a storing one is pinned by
    its store copy; only a block-aligned one leaves the device; a host-only one
    hangs on a device-resident anchor."""
    problems: Problems = []
    store_pins: Counter[int] = Counter()
    for copy in snap["copies"].values():
        if copy["kind"] == "store":
            store_pins.update(copy["pins"])
    for cid, ck in snap["checkpoints"].items():
        residency = ck["residency"]
        if (ck["slot"] is not None) != (residency in _CHECKPOINT_ON_DEVICE):
            problems.append(f"checkpoint {cid}: {residency} but device slot {ck['slot']}")
        if (ck["host_slot"] is not None) != (residency in _CHECKPOINT_ON_HOST):
            problems.append(f"checkpoint {cid}: {residency} but host slot {ck['host_slot']}")
        if (residency == Residency.STORING.value) != (store_pins[cid] > 0):
            problems.append(
                f"checkpoint {cid}: {residency}, pinned by {store_pins[cid]} store copies"
            )
        if residency != Residency.DEVICE.value and (ck["tail"] or ck["frozen_block"] is not None):
            problems.append(f"checkpoint {cid}: a partial one is {residency} (device only)")
        anchor = snap["nodes"].get(ck["anchor"])
        if residency == Residency.HOST.value and (anchor is None or anchor["block"] is None):
            problems.append(f"checkpoint {cid}: host-only on an anchor without a device block")
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
        "block_pins",
        "free_host_blocks",
        "host_refcounts",
        "host_index",
        "free_host_slots",
        "host_checkpoint_index",
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
    ("host_tier", host_tier),
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
