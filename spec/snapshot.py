"""The neutral snapshot: plain dicts and tuples that both the reference model
(`spec.model.ReferenceCache.snapshot`) and the real cache (`cache.BlockTrie.snapshot`)
produce, so that the invariants in `spec.invariants` run over either, and
`observe` reduces either to an id-free view the differential tests compare.

Ids (block ids, node ids, slot ids, ...) are each implementation's own; only
`observe` output is comparable across implementations.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, TypedDict


class NodeView(TypedDict):
    """One trie node. Roots have depth 0, `block` None, `parent` None, `key` None."""

    namespace: str
    parent: int | None
    depth: int
    key: tuple[tuple[int, ...], Hashable] | None  # (block tokens, block extra identity)
    block: int | None
    children: list[int]
    state: str  # stored `spec.lifecycle.NodeState` value (roots: `NodeState.ROOT`)
    tick: int
    serial: int
    checkpoint: int | None
    block_host: int | None  # its host-tier block (None: none, or a root)
    residency: str  # `spec.lifecycle.Residency` value (roots and tries without a host tier: device)


class CheckpointView(TypedDict):
    """One live checkpoint (absent ones are not listed)."""

    anchor: int  # node id (a root for anchor 0)
    step: int
    tail: tuple[int, ...]
    tail_extra: Hashable
    slot: int | None  # its device slot (None: host-only)
    host_slot: int | None  # its host slot (None: none)
    residency: str  # `spec.lifecycle.Residency` value (device without a checkpoint host tier)
    frozen_block: int | None
    pins: int  # the stored pin count
    state: str  # stored lifecycle state
    tick: int
    serial: int


class SequenceView(TypedDict):
    """One live sequence."""

    namespace: str
    tokens: tuple[int, ...]
    extra: tuple[Hashable, ...] | None
    blocks: list[int]
    path: list[int]  # node ids of its committed/matched blocks, root excluded
    num_cached_tokens: int
    num_committed_tokens: int
    restore_checkpoint: int | None  # checkpoint id of seq.restore
    holds_match_pin: bool
    host_path: list[int]  # node ids of its matched host-only blocks, not yet loaded
    num_host_tokens: int


class CopyView(TypedDict):
    """One copy not yet reaped."""

    kind: str  # "save" | "restore"
    blocks: list[int]  # block references it holds
    pins: list[int]  # checkpoint ids it holds one receipt on, each
    done: bool  # no longer pending: finished or failed
    state: str  # stored `spec.lifecycle.CopyState` value (never "reaped": reaped copies go)
    host_blocks: list[int]  # host-tier block references it holds (store / load copies)
    nodes: list[int]  # node ids whose KV a store / load copy moves


class Snapshot(TypedDict):
    """The whole cache, as plain data."""

    block_size: int
    capacity: int
    free_blocks: list[int]
    refcounts: dict[int, int]  # every block id -> its stored reference count
    slot_capacity: int
    free_slots: list[int]
    roots: dict[str, int]
    nodes: dict[int, NodeView]
    checkpoints: dict[int, CheckpointView]
    sequences: dict[int, SequenceView]
    copies: dict[int, CopyView]
    explicit_pins: list[int]  # checkpoint id of each outstanding explicit receipt
    block_pins: list[int]  # block held by each outstanding `pin_blocks` receipt, per receipt
    evictable_index: list[int]  # node ids, in eviction order
    checkpoint_index: list[int]  # checkpoint ids, in eviction order
    event_blocks: set[int] | None  # blocks cached according to the emitted events
    # node id -> the block hash its events publish (the 64 wire bits; None: events off)
    event_block_hashes: dict[int, int] | None
    # checkpoint slots published according to the emitted checkpoint events (None: not emitted)
    event_checkpoint_slots: set[int] | None
    stats: dict[str, Any]
    host_capacity: int  # host-tier blocks (0: no host tier)
    free_host_blocks: list[int]
    host_refcounts: dict[int, int]  # every host block id -> its stored reference count
    host_index: list[int]  # node ids in the host eviction index, in eviction order
    event_host_blocks: set[int] | None  # host blocks cached according to the events
    host_slot_capacity: int  # host checkpoint slots (0: no checkpoint host tier)
    free_host_slots: list[int]
    host_checkpoint_index: list[int]  # host-only checkpoint ids, in host eviction order
    event_host_checkpoint_slots: set[int] | None  # host slots published according to events


def node_path(snap: Snapshot, node_id: int) -> tuple[str, tuple[Any, ...]]:
    """(namespace, keys from the root down to the node): an id-free name for a node."""
    keys: list[Any] = []
    node = snap["nodes"][node_id]
    while node["parent"] is not None:
        keys.append(node["key"])
        node = snap["nodes"][node["parent"]]
    keys.reverse()
    return node["namespace"], tuple(keys)


def sequence_view(s: SequenceView, named: dict[int, Any]) -> tuple[Any, ...]:
    """An id-free view of one sequence, its nodes named by `named` (node id -> name)."""
    return (
        s["namespace"],
        s["tokens"],
        len(s["blocks"]),
        s["num_cached_tokens"],
        s["num_committed_tokens"],
        tuple(named[p] for p in s["path"]),
        s["holds_match_pin"],
        tuple(named[p] for p in s["host_path"]),
        s["num_host_tokens"],
    )


def observe(snap: Snapshot) -> dict[str, Any]:
    """An id-free view of a snapshot: what two implementations must agree on."""
    nodes = snap["nodes"]
    named = {nid: node_path(snap, nid) for nid in nodes}
    owner = {n["block"]: nid for nid, n in nodes.items() if n["block"] is not None}
    checkpoints = {
        (named[c["anchor"]], c["step"], c["tail"], c["tail_extra"]): (
            c["state"],
            c["pins"],
            c["residency"],
        )
        for c in snap["checkpoints"].values()
    }
    return {
        "free_blocks": len(snap["free_blocks"]),
        "cached_blocks": sum(1 for n in nodes.values() if n["parent"] is not None),
        "free_slots": len(snap["free_slots"]),
        "nodes": {named[nid]: n["state"] for nid, n in nodes.items() if n["parent"] is not None},
        "residency": {
            named[nid]: n["residency"] for nid, n in nodes.items() if n["parent"] is not None
        },
        "free_host_blocks": len(snap["free_host_blocks"]),
        "host_order": [named[nid] for nid in snap["host_index"]],
        "free_host_slots": len(snap["free_host_slots"]),
        "host_checkpoint_order": [
            (named[snap["checkpoints"][c]["anchor"]], snap["checkpoints"][c]["step"])
            for c in snap["host_checkpoint_index"]
        ],
        "checkpoints": checkpoints,
        "evictable_order": [named[nid] for nid in snap["evictable_index"]],
        "checkpoint_order": [
            (named[snap["checkpoints"][c]["anchor"]], snap["checkpoints"][c]["step"])
            for c in snap["checkpoint_index"]
        ],
        "sequences": sorted(
            [sequence_view(s, named) for s in snap["sequences"].values()],
            key=repr,  # extra identities may mix None and other types
        ),
        "copies": sorted(
            (c["kind"], len(c["blocks"]), len(c["pins"]), c["state"], len(c["host_blocks"]))
            for c in snap["copies"].values()
        ),
        "block_pins": sorted(
            (repr(named[owner[b]]) if b in owner else "private" for b in snap["block_pins"]),
        ),
        "stats": dict(snap["stats"]),
    }


STAT_COUNTERS: tuple[str, ...] = (
    "queries",  # match calls (abort subtracts)
    "query_tokens",  # tokens passed to match
    "hit_tokens",  # num_cached_tokens summed over matches
    "checkpoint_hits",  # matches that hit an SSM checkpoint
    "evicted_blocks",  # KV blocks freed by eviction (node blocks + frozen tails)
    "evicted_checkpoints",  # released by any eviction: evict_checkpoints, save, KV evict
    "checkpoints_saved",  # saves that queued a copy
    "checkpoints_skipped",  # saves skipped: no slot / no frozen block / pinned anchor
    "checkpoints_deduplicated",  # saves skipped: the same checkpoint already exists
    "restores",  # restore copies queued
    "copies_reaped",  # copies whose pins and references were released
    "copies_failed",  # reaped copies that failed (their data never arrived)
    "host_hit_tokens",  # num_host_tokens summed over matches (the hit to load from host)
    "loaded_blocks",  # blocks a finished load copy brought back from the host tier
    "stored_blocks",  # blocks a finished store copy wrote to the host tier
    "host_evicted_blocks",  # host blocks freed by host eviction
    "checkpoints_stored",  # checkpoints a finished store copy wrote to a host slot ([R53])
    "checkpoints_offloaded",  # mirrored checkpoints that gave their device slot back ([R54])
    "host_evicted_checkpoints",  # host-only checkpoints dropped for a host slot ([R55])
)
"""The counters every implementation keeps, under these names, in `stats`."""
