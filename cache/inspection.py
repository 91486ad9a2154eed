"""Inspection: the whole cache as plain data, and every spec invariant checked on it.

`snapshot` reads a `BlockTrie` (never changes it: not even a CUDA copy's state,
which `poll()` brings up to date) into the neutral
`spec.snapshot.Snapshot` that the reference model also produces, so the same
predicates (`spec.invariants`) check both, and `observe` compares them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache.block_hash import to_wire
from cache.node import NO_NODE, state_name
from spec import invariants
from spec.errors import InvariantViolation
from spec.lifecycle import CopyState, Residency
from spec.snapshot import CheckpointView, CopyView, NodeView, SequenceView, Snapshot

_QUEUED = CopyState.QUEUED.value

if TYPE_CHECKING:
    from cache.node import Node
    from cache.trie import BlockTrie


def snapshot(trie: BlockTrie) -> Snapshot:
    """The whole of `trie` as plain data (ids as in [R43])."""
    nodes: dict[int, NodeView] = {}
    hashes: dict[int, int] | None = {} if trie._events.enabled else None
    checkpoints: dict[int, CheckpointView] = {}
    t = trie._nodes
    serial = t.serial
    stack: list[tuple[Node, int]] = [(root, 0) for root in trie._roots.values()]
    while stack:
        node, depth = stack.pop()
        nid = serial[node]
        ck = t.checkpoint.get(node)
        parent = t.parent[node]
        children = t.child_nodes(node)
        root = t.is_root(node)
        nodes[nid] = {
            "namespace": t.namespace_of(node),
            "parent": None if parent == NO_NODE else serial[parent],
            "depth": depth,
            "key": None if root else (t.tokens_of(node), t.extra_of(node)),
            "block": None if t.block[node] < 0 else t.block[node],
            "children": [serial[c] for c in children],
            "state": state_name(t.state[node]),
            "tick": t.tick[node],
            "serial": nid,
            "checkpoint": None if ck is None else ck.serial,
            "block_host": None if t.host[node] < 0 else t.host[node],
            "residency": t.residency[node],
        }
        if hashes is not None and not root:
            hashes[nid] = to_wire(t.block_hash[node])
        if ck is not None:
            checkpoints[ck.serial] = {
                "anchor": nid,
                "step": ck.step,
                "tail": ck.tail,
                "tail_extra": ck.tail_extra,
                "slot": None if ck.slot < 0 else ck.slot,
                "host_slot": None if ck.host_slot < 0 else ck.host_slot,
                "residency": ck.residency,
                "frozen_block": ck.frozen_block,
                "pins": ck.pins,
                "state": ck.state,
                "tick": ck.tick,
                "serial": ck.serial,
            }
        stack.extend((child, depth + 1) for child in children)
    sequences: dict[int, SequenceView] = {}
    for sid, seq in trie._live.items():
        sequences[sid] = {
            "namespace": seq.namespace,
            "tokens": tuple(seq.token_list),
            "extra": seq.extra,
            "blocks": list(seq.blocks),
            "path": [serial[n] for n in seq.path],
            "num_cached_tokens": seq.num_cached_tokens,
            "num_committed_tokens": seq.num_committed_tokens,
            "restore_checkpoint": None if seq.restore is None else seq.restore.checkpoint.serial,
            "holds_match_pin": seq.match_receipt is not None,
            "host_path": [serial[n] for n in seq.host_path],
            "num_host_tokens": seq.num_host_tokens,
        }
    copies: dict[int, CopyView] = {}
    for cid, c in trie._transfers.inflight.items():
        copies[cid] = {
            "kind": c.kind,
            "blocks": list(c.blocks),
            "pins": [r.checkpoint.serial for r in c.receipts],
            "done": c.state != _QUEUED,  # as last seen: looking at a CUDA event is poll's
            "state": c.state,
            "host_blocks": list(c.host_blocks),
            "nodes": [serial[n] for n in c.nodes],
        }
    kv = trie._kv
    slots = trie._slots
    host = trie._host
    host_pool = trie._host_pool
    return {
        "block_size": trie.config.block_size,
        "capacity": kv.capacity,
        "free_blocks": kv.free_ids(),
        "refcounts": dict(enumerate(kv.counts())),
        "slot_capacity": slots.capacity,
        "free_slots": slots.free_ids(),
        "roots": {ns: serial[r] for ns, r in trie._roots.items()},
        "nodes": nodes,
        "checkpoints": checkpoints,
        "sequences": sequences,
        "copies": copies,
        "explicit_pins": [r.checkpoint.serial for r in trie._explicit.values()],
        "block_pins": trie._block_pins.held_blocks(),
        "evictable_index": [serial[n] for n in trie._evictor.index],
        "checkpoint_index": [c.serial for c in trie._checkpoints.lru],
        "event_blocks": trie._events.replayed_blocks(),
        "event_block_hashes": hashes,
        "event_checkpoint_slots": trie._events.replayed_checkpoint_slots(),
        "stats": dict(trie.stats.counters()),
        "host_capacity": host_pool.capacity,
        "free_host_blocks": host_pool.free_ids(),
        "host_refcounts": dict(enumerate(host_pool.counts())),
        "host_index": [] if host is None else [serial[n] for n in host.index],
        "event_host_blocks": trie._events.replayed_host_blocks() if host is not None else None,
        "host_slot_capacity": trie._host_slots.capacity,
        "free_host_slots": trie._host_slots.free_ids(),
        "host_checkpoint_index": [c.serial for c in trie._checkpoints.host_lru],
        "event_host_checkpoint_slots": (
            trie._events.replayed_host_checkpoint_slots() if trie.config.host_checkpoints else None
        ),
    }


def check(trie: BlockTrie) -> None:
    """Verify every spec invariant on `trie`; raises `InvariantViolation`."""
    snap = snapshot(trie)
    invariants.check_all(snap)
    host = trie._host
    if host is not None and host.duplicates_first:  # [R71]: the duplicates index
        serial = trie._nodes.serial
        have = sorted(serial[n] for n in host.duplicates)
        want = sorted(
            nid
            for nid, node in snap["nodes"].items()
            if node["residency"] == Residency.MIRRORED.value
            and node["block_host"] is not None
            and snap["host_refcounts"].get(node["block_host"], 0) == 1
        )
        if have != want:
            raise InvariantViolation(
                "explicit_state",
                f"host duplicates index {have} != mirrored nodes only they hold {want}",
            )
