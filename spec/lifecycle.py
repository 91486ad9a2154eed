"""Every lifecycle of the cache, written once as data: node, KV residency,
checkpoint, pin receipt and copy.

The transition lists below are the single source of truth. At import they are
built into flat `transitions.Machine`s (one per lifecycle; used for rendering
diagrams and to cross-check), and from those machines we derive an O(1)
``(trigger, state) -> state`` table. The cache's hot path calls `Lifecycle.step`,
a dict lookup, never a `transitions` object per node.

Flat machines on purpose: with a hierarchical machine a transition declared on a
parent state would also fire from `pinned`, which is exactly the bug class this
project exists to rule out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from transitions import Machine

from spec.errors import IllegalTransition


class NodeState(str, Enum):
    """Lifecycle state of a trie node (one full KV block of one prefix)."""

    CACHED = "cached"
    """Attached, and a sequence shares its block or it has children."""
    EVICTABLE = "evictable"
    """Attached leaf, only the trie holds its block, its checkpoint (if any) is unpinned."""
    PINNED = "pinned"
    """Attached and its checkpoint holds at least one pin. Never evicted."""
    OFFLOADED = "offloaded"
    """Attached, its KV only in the host tier (residency `host`): it owns no device
    block and holds no checkpoint. Device eviction never touches it; host eviction
    may free it once it has no children and no request reads its host block."""
    FREED = "freed"
    """Detached, block returned, checkpoint released. Terminal."""
    ROOT = "root"
    """A namespace root: owns no block, is never evicted; no transition enters or leaves it."""

    def __hash__(self) -> int:
        # Hash as the plain string it equals, so table lookups accept either.
        return str.__hash__(self)


class Residency(str, Enum):
    """Where a node's KV lives, between the device pool and the host tier.

    Only a trie with a host tier (`CacheConfig.num_host_blocks > 0`) leaves
    `device`. An in-flight copy holds the blocks it reads and writes on both
    tiers until it is reaped (the pins of each state, `RESIDENCY_PINS`).
    """

    DEVICE = "device"
    """A device block only (no host tier, or no host block was free)."""
    STORING = "storing"
    """Device block valid; a device -> host copy writes its host block (not loadable yet)."""
    MIRRORED = "mirrored"
    """Valid on both tiers: device eviction frees only the device block."""
    HOST = "host"
    """A host block only: a request that matches it must `load` it first."""
    LOADING = "loading"
    """Host block valid; a host -> device copy writes its (new) device block, which
    no request may read until the copy has finished."""

    def __hash__(self) -> int:
        return str.__hash__(self)


class CheckpointState(str, Enum):
    """Lifecycle state of an SSM checkpoint (a slot in the state pool)."""

    ABSENT = "absent"
    """No slot held (never reserved, or released / replaced / evicted)."""
    RESERVED = "reserved"
    """Slot held, data not yet queued; not matchable."""
    PUBLISHED = "published"
    """Matchable; no pins; may be released, replaced or evicted."""
    PINNED = "pinned"
    """Matchable; at least one pin (an in-flight copy or an explicit receipt)."""
    WITHDRAWN = "withdrawn"
    """Its data will never arrive (its save copy failed): not matchable, and
    released when its last pin goes. Pinned ones stay until then."""

    def __hash__(self) -> int:
        return str.__hash__(self)


class ReceiptState(str, Enum):
    """Lifecycle of a pin receipt: the single-use proof of one pin on one checkpoint."""

    ISSUED = "issued"
    """Counted in its checkpoint's pin count; held by a sequence, a copy or the engine."""
    REDEEMED = "redeemed"
    """Its pin was dropped. Terminal: a second unpin is an illegal transition."""

    def __hash__(self) -> int:
        return str.__hash__(self)


class CopyState(str, Enum):
    """Lifecycle of an asynchronous copy (checkpoint save or restore)."""

    QUEUED = "queued"
    """Submitted; its data may be moving. Holds its pins and block references."""
    FINISHED = "finished"
    """Its data has moved. Still holds its pins and references until reaped."""
    FAILED = "failed"
    """It did not move its data (the copy raised, or the engine failed it)."""
    REAPED = "reaped"
    """Its pins and references are released. Terminal."""

    def __hash__(self) -> int:
        return str.__hash__(self)


class NodeTrigger(str, Enum):
    """Node triggers. The cache fires only FREE by name; the rest are routed."""

    IDLE = "idle"
    SHARE = "share"
    PIN = "pin"
    UNPIN = "unpin"
    OFFLOAD = "offload"
    LOAD = "load"
    FREE = "free"

    def __hash__(self) -> int:
        return str.__hash__(self)


class ResidencyTrigger(str, Enum):
    """KV residency triggers: each names the copy or eviction that fires it."""

    STORE = "store"
    STORED = "stored"
    STORE_FAILED = "store_failed"
    OFFLOAD = "offload"
    LOAD = "load"
    LOADED = "loaded"
    LOAD_FAILED = "load_failed"
    ADOPT = "adopt"
    DROP_COPY = "drop_copy"

    def __hash__(self) -> int:
        return str.__hash__(self)


class CheckpointTrigger(str, Enum):
    """Checkpoint triggers: each names the operation that fires it."""

    RESERVE = "reserve"
    PUBLISH = "publish"
    PIN = "pin"
    UNPIN = "unpin"
    RELEASE = "release"
    REPLACE = "replace"
    EVICT = "evict"
    WITHDRAW = "withdraw"

    def __hash__(self) -> int:
        return str.__hash__(self)


class ReceiptTrigger(str, Enum):
    """Receipt triggers."""

    REDEEM = "redeem"

    def __hash__(self) -> int:
        return str.__hash__(self)


class CopyKind(str, Enum):
    """What a copy moves (`Copy.kind`): a checkpoint's state, or KV to / from the host tier."""

    SAVE = "save"
    """Runtime state (and a partial block) into a checkpoint slot (and its frozen tail)."""
    RESTORE = "restore"
    """A checkpoint slot (and frozen tail) into runtime state (and the request's block)."""
    STORE = "store"
    """Device KV blocks into host-tier blocks (write-through, [R47])."""
    LOAD = "load"
    """Host-tier blocks into device KV blocks ([R50])."""

    def __hash__(self) -> int:
        return str.__hash__(self)


class CopyTrigger(str, Enum):
    """Copy triggers."""

    FINISH = "finish"
    FAIL = "fail"
    REAP = "reap"

    def __hash__(self) -> int:
        return str.__hash__(self)


# (trigger, sources, destination) -- the whole node lifecycle. A node's state
# is implied by its facts (`implied_node_state`); the cache routes to it.
NODE_TRANSITIONS: tuple[tuple[NodeTrigger, tuple[NodeState, ...], NodeState], ...] = (
    (NodeTrigger.IDLE, (NodeState.CACHED,), NodeState.EVICTABLE),
    (NodeTrigger.SHARE, (NodeState.EVICTABLE,), NodeState.CACHED),
    (NodeTrigger.PIN, (NodeState.CACHED, NodeState.EVICTABLE), NodeState.PINNED),
    (NodeTrigger.UNPIN, (NodeState.PINNED,), NodeState.CACHED),
    (NodeTrigger.OFFLOAD, (NodeState.EVICTABLE,), NodeState.OFFLOADED),
    (NodeTrigger.LOAD, (NodeState.OFFLOADED,), NodeState.CACHED),
    (NodeTrigger.FREE, (NodeState.EVICTABLE, NodeState.OFFLOADED), NodeState.FREED),
)
"""The whole node lifecycle as `(trigger, sources, destination)`; any other pair is illegal.

`offload` (device eviction of a leaf whose KV is mirrored on the host) and
`free` leave only from `evictable`, or from `offloaded` for host eviction: a
node a request holds, or a pinned one, is never freed nor offloaded. `load`
gives an offloaded node a device block again (a request loads it, or computed
the same block itself).
"""

# (trigger, sources, destination) -- where a node's KV lives (host tier).
RESIDENCY_TRANSITIONS: tuple[tuple[ResidencyTrigger, tuple[Residency, ...], Residency], ...] = (
    (ResidencyTrigger.STORE, (Residency.DEVICE,), Residency.STORING),
    (ResidencyTrigger.STORED, (Residency.STORING,), Residency.MIRRORED),
    (ResidencyTrigger.STORE_FAILED, (Residency.STORING,), Residency.DEVICE),
    (ResidencyTrigger.OFFLOAD, (Residency.MIRRORED,), Residency.HOST),
    (ResidencyTrigger.LOAD, (Residency.HOST,), Residency.LOADING),
    (ResidencyTrigger.LOADED, (Residency.LOADING,), Residency.MIRRORED),
    (ResidencyTrigger.LOAD_FAILED, (Residency.LOADING,), Residency.HOST),
    (ResidencyTrigger.ADOPT, (Residency.HOST,), Residency.MIRRORED),
    (ResidencyTrigger.DROP_COPY, (Residency.MIRRORED,), Residency.DEVICE),
)
"""The KV residency lifecycle as `(trigger, sources, destination)`.

A checkpoint's residency (`Checkpoint.residency`, with host checkpoint slots:
[R53]-[R56]) follows the same table without `load`: a restore reads a host
slot directly. `store` is queued when a block is committed (write-through); `offload` is
device eviction of a mirrored block (only its device block is freed); `load`
is `BlockTrie.load` taking a device block for a host-resident one; `adopt` is a
commit that computed a host-resident block itself (its block becomes the
device copy); `drop_copy` is host pressure reclaiming the host copy of a
block still on the device, which host eviction takes before any host-only
block ([R71]). No transition leaves `storing` or `loading` except the copy's
own outcome: nothing evicts, frees or reuses a block a copy still reads or
writes (`RESIDENCY_PINS`).
"""

RESIDENCY_PINS: dict[Residency, tuple[str, ...]] = {
    Residency.DEVICE: (),
    Residency.STORING: ("device block: read by the store copy", "host block: written by it"),
    Residency.MIRRORED: (),
    Residency.HOST: (),
    Residency.LOADING: ("host block: read by the load copy", "device block: written by it"),
}
"""Per residency, the blocks an in-flight copy holds a reference on until it is reaped."""

RESIDENCY_EVICTIONS: dict[Residency, str] = {
    Residency.DEVICE: "device eviction frees the node (and any host-only nodes below it)",
    Residency.STORING: "none: the store copy holds the device block",
    Residency.MIRRORED: (
        "device eviction frees the device block; the node stays, `host`; host eviction "
        "frees the host block first ([R71]); the node stays, `device`"
    ),
    Residency.HOST: "host eviction frees the node once it is a leaf no request reads",
    Residency.LOADING: "none: the load copy holds both blocks",
}
"""Per residency, which eviction may touch a node in it."""

# (trigger, sources, destination) -- the whole checkpoint lifecycle. Commands
# (reserve, publish, pin, release, replace, evict) fire their trigger; a pin
# count dropping is routed to the implied state (`implied_checkpoint_state`),
# so `unpin` fires only when the last pin goes.
CHECKPOINT_TRANSITIONS: tuple[
    tuple[CheckpointTrigger, tuple[CheckpointState, ...], CheckpointState], ...
] = (
    (CheckpointTrigger.RESERVE, (CheckpointState.ABSENT,), CheckpointState.RESERVED),
    (CheckpointTrigger.PUBLISH, (CheckpointState.RESERVED,), CheckpointState.PUBLISHED),
    (
        CheckpointTrigger.PIN,
        (CheckpointState.PUBLISHED, CheckpointState.PINNED),
        CheckpointState.PINNED,
    ),
    (CheckpointTrigger.UNPIN, (CheckpointState.PINNED,), CheckpointState.PUBLISHED),
    (
        CheckpointTrigger.RELEASE,
        (CheckpointState.RESERVED, CheckpointState.PUBLISHED, CheckpointState.WITHDRAWN),
        CheckpointState.ABSENT,
    ),
    (CheckpointTrigger.REPLACE, (CheckpointState.PUBLISHED,), CheckpointState.ABSENT),
    (CheckpointTrigger.EVICT, (CheckpointState.PUBLISHED,), CheckpointState.ABSENT),
    (
        CheckpointTrigger.WITHDRAW,
        (CheckpointState.PUBLISHED, CheckpointState.PINNED),
        CheckpointState.WITHDRAWN,
    ),
)
"""The whole checkpoint lifecycle as `(trigger, sources, destination)`.

No transition leaves `pinned` except `pin`, `unpin` (the last pin going) and
`withdraw` (its save failed): releasing, replacing or evicting a pinned
checkpoint is illegal (invariant 2, pin safety). A `withdrawn` checkpoint is
only released, never pinned again.
"""

# (trigger, sources, destination) -- a pin receipt is redeemed exactly once.
RECEIPT_TRANSITIONS: tuple[tuple[ReceiptTrigger, tuple[ReceiptState, ...], ReceiptState], ...] = (
    (ReceiptTrigger.REDEEM, (ReceiptState.ISSUED,), ReceiptState.REDEEMED),
)
"""The pin-receipt lifecycle: issued by a pin, redeemed by exactly one unpin."""

# (trigger, sources, destination) -- a copy finishes or fails, then is reaped,
# which is the only place its pins and block references are released.
COPY_TRANSITIONS: tuple[tuple[CopyTrigger, tuple[CopyState, ...], CopyState], ...] = (
    (CopyTrigger.FINISH, (CopyState.QUEUED,), CopyState.FINISHED),
    (CopyTrigger.FAIL, (CopyState.QUEUED,), CopyState.FAILED),
    (CopyTrigger.REAP, (CopyState.FINISHED, CopyState.FAILED), CopyState.REAPED),
)
"""The copy lifecycle: queued, finished or failed, then reaped (pins released)."""


@dataclass(frozen=True)
class Lifecycle:
    """One lifecycle: its states, its transitions, the machine, and the derived tables."""

    name: str
    states: tuple[str, ...]
    initial: str
    transitions: tuple[tuple[str, tuple[str, ...], str], ...]
    table: dict[tuple[str, str], str] = field(default_factory=dict)
    routes: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)

    @property
    def triggers(self) -> tuple[str, ...]:
        """Every trigger name, in declaration order."""
        return tuple(dict.fromkeys(t for t, _, _ in self.transitions))

    def machine(self, model: object | None = None, *, graph: bool = False) -> Machine:
        """A fresh flat `transitions` machine for this lifecycle (no auto transitions)."""
        kwargs: dict[str, Any] = {
            "states": list(self.states),
            "transitions": [
                {"trigger": t, "source": list(src), "dest": dst} for t, src, dst in self.transitions
            ],
            "initial": self.initial,
            "auto_transitions": False,
        }
        if model is not None:
            kwargs["model"] = model
        if graph:
            from transitions.extensions import GraphMachine

            return GraphMachine(graph_engine="mermaid", title=f"{self.name} lifecycle", **kwargs)
        return Machine(**kwargs)

    def can(self, trigger: str, state: str) -> bool:
        """Whether `trigger` may fire from `state`."""
        return (trigger, state) in self.table

    def step(self, trigger: str, state: str, subject: object = "") -> str:
        """The state after `trigger` fires from `state`; raises `IllegalTransition` if it can't.

        `subject` (any object) names what is transitioning in the error; it is
        only formatted when the transition is illegal.
        """
        try:
            return self.table[(trigger, state)]
        except KeyError:
            raise IllegalTransition(self.name, _name(trigger), _name(state), str(subject)) from None

    def route(self, source: str, dest: str, subject: object = "") -> tuple[str, ...]:
        """Shortest trigger sequence from `source` to `dest` (empty when equal)."""
        try:
            return self.routes[(source, dest)]
        except KeyError:
            raise IllegalTransition(
                self.name, f"-> {_name(dest)}", _name(source), str(subject)
            ) from None


def _derive_table(
    machine: Machine, states: Iterable[str], triggers: Iterable[str]
) -> dict[tuple[str, str], str]:
    table: dict[tuple[str, str], str] = {}
    for trigger in triggers:
        event = machine.events[trigger]
        for state in states:
            candidates = event.transitions.get(state, [])
            if candidates:
                table[(trigger, state)] = str(candidates[0].dest)
    return table


def _derive_routes(
    states: Sequence[str], table: dict[tuple[str, str], str]
) -> dict[tuple[str, str], tuple[str, ...]]:
    routes: dict[tuple[str, str], tuple[str, ...]] = {}
    for source in states:
        routes[(source, source)] = ()
        queue: deque[str] = deque([source])
        while queue:
            here = queue.popleft()
            for (trigger, state), dest in table.items():
                if state == here and (source, dest) not in routes:
                    routes[(source, dest)] = (*routes[(source, here)], trigger)
                    queue.append(dest)
    return routes


def _name(state: str | Enum) -> str:
    return state.value if isinstance(state, Enum) else state


def _build(
    name: str,
    states: Sequence[str],
    initial: str,
    transitions: Sequence[tuple[str, Sequence[str], str]],
) -> Lifecycle:
    flat = tuple(
        (_name(t), tuple(_name(s) for s in src), _name(dst)) for t, src, dst in transitions
    )
    life = Lifecycle(name, tuple(_name(s) for s in states), _name(initial), flat)
    machine = life.machine()
    table = _derive_table(machine, life.states, life.triggers)
    life.table.update(table)
    life.routes.update(_derive_routes(life.states, table))
    return life


NODE = _build("node", [s.value for s in NodeState], NodeState.CACHED.value, NODE_TRANSITIONS)
"""The node lifecycle; `NODE.step(trigger, state)` is the O(1) transition the cache uses."""
CHECKPOINT = _build(
    "checkpoint",
    [s.value for s in CheckpointState],
    CheckpointState.ABSENT.value,
    CHECKPOINT_TRANSITIONS,
)
"""The checkpoint lifecycle; `CHECKPOINT.step(trigger, state)` as for `NODE`."""
RECEIPT = _build(
    "receipt", [s.value for s in ReceiptState], ReceiptState.ISSUED.value, RECEIPT_TRANSITIONS
)
"""The pin-receipt lifecycle (`PinReceipt.state`)."""
COPY = _build("copy", [s.value for s in CopyState], CopyState.QUEUED.value, COPY_TRANSITIONS)
"""The copy lifecycle (`Copy.state`)."""
RESIDENCY = _build(
    "residency", [s.value for s in Residency], Residency.DEVICE.value, RESIDENCY_TRANSITIONS
)
"""The KV residency lifecycle (a node's `residency` column), for tries with a host tier."""
LIFECYCLES: tuple[Lifecycle, ...] = (NODE, RESIDENCY, CHECKPOINT, RECEIPT, COPY)
"""Every lifecycle, in the order the generated lifecycle page draws them."""


def implied_node_state(
    *,
    attached: bool,
    leaf: bool,
    block_refs: int,
    pins: int,
    root: bool = False,
    on_device: bool = True,
) -> NodeState:
    """The node state that the facts imply (the contract's "Lifecycles").

    `leaf`: no child owns a device block (without a host tier: no children).
    `block_refs` is the node's KV block reference count (the trie's own reference
    included); `pins` is its checkpoint's pin count (0 without a checkpoint).
    `on_device`: the node owns a device block (False only for residency `host`).
    A namespace root is always `root`, whatever its checkpoint's pins.
    """
    if root:
        return NodeState.ROOT
    if not attached:
        return NodeState.FREED
    if not on_device:
        return NodeState.OFFLOADED
    if pins > 0:
        return NodeState.PINNED
    if leaf and block_refs == 1:
        return NodeState.EVICTABLE
    return NodeState.CACHED


def implied_checkpoint_state(
    *, present: bool, published: bool, pins: int, withdrawn: bool = False
) -> CheckpointState:
    """The checkpoint state that the facts imply.

    A withdrawn checkpoint (its save failed) stays `withdrawn` while pinned and
    is `absent` (to be released) once its last pin has gone.
    """
    if not present:
        return CheckpointState.ABSENT
    if withdrawn:
        return CheckpointState.WITHDRAWN if pins > 0 else CheckpointState.ABSENT
    if pins > 0:
        return CheckpointState.PINNED
    return CheckpointState.PUBLISHED if published else CheckpointState.RESERVED


def implied_copy_state(*, reaped: bool, failed: bool, moved: bool) -> CopyState:
    """The copy state that the facts imply: reaped, else failed, else whether it moved."""
    if reaped:
        return CopyState.REAPED
    if failed:
        return CopyState.FAILED
    return CopyState.FINISHED if moved else CopyState.QUEUED
