"""The event log: what the trie tells the outside world about its cached blocks.

Owns the list of emitted-but-undrained events and, for `check()`, the block
sets that every event emitted so far replays to (one per group and medium; each
a `BlockBitmap`: a byte per block id, not a Python `set`, whose ~70 bytes a
cached block would be a third of the cache's memory with events on), so
invariant 10 ("replaying the events yields exactly the cached block set") can
be checked at any time. An event is applied to them when it is recorded, from
the block ids it carries, while the commit or eviction still has them in hand:
draining moves the records out and touches nothing else (applying them there
walked every record a second time, through `replay_views` for each removal).
When events are disabled every emitter is a no-op and nothing accumulates.

A commit's `BlockStored` (the hot one: one per commit that attaches blocks) is
recorded as a *stored run* (`StoredRun`: the parent's hash, the new blocks'
hashes, their token ids as one packed `bytes`, their block ids, the block size
and the namespace), read off the new nodes while the commit still has them in
hand, and built only when read: `drain` builds every event, as it always
returned them; `drain_records` hands the records over unbuilt
(`EventRecords`), for a publisher that encodes them straight to the wire
(`cache.kv_events.encode_batch`, `cache.kv_publisher`) or in another process
(`cache.kv_publisher_process`). A run holds only values (no node), so it
builds the same event whenever it is read. Blocks whose keys are not plain
uint32 blocks (an extra identity, an injected key hash, 64-bit ids) are
recorded as their built `BlockStored` instead.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from itertools import compress
from typing import TYPE_CHECKING, Any, TypeAlias

from cache.events import (
    CHECKPOINT_GROUP,
    KIND_FULL_ATTENTION,
    KV_GROUP,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    checkpoint_removed,
    checkpoint_stored,
    replay_views,
)
from cache.keys import PackedTokens, joined_tokens, key_extra, key_packed

StoredRun: TypeAlias = tuple[Any, ...]
# (parent hash | None, block hashes: `packed_hashes`, token ids: bytes (native uint32),
#  block ids, block size, namespace)
"""A commit's `BlockStored` as recorded (a plain tuple: only events are NamedTuples);
`stored_event` builds it."""

PackedHashes: TypeAlias = bytes | list[int]


def packed_hashes(hashes: list[int]) -> PackedHashes:
    """A stored run's block hashes: one `bytes` of native-order uint64s (`array("Q")`)
    when every hash fits in 64 bits, as every `xxh3` chain value does, else the list
    itself (`vllm` digests, 256 bits). Packed, a run holds no `int` per block, and
    the native commit makes none unless the pins index hashes (with the handles
    `FastAttach` keeps, its events cost 66 ns a block over events off, down from
    87: docs/events.md, "Cost")."""
    try:
        return array("Q", hashes).tobytes()
    except OverflowError:
        return hashes


def run_hashes(hashes: PackedHashes) -> list[int]:
    """The block hashes `packed_hashes` packed, as ints."""
    if isinstance(hashes, bytes):
        return array("Q", hashes).tolist()
    return hashes


if TYPE_CHECKING:
    from cache.block_hash import BlockHasher, ChainFn, PackedChainFn
    from cache.node import Checkpoint, Node, NodeTable


class BlockBitmap:
    """A set of int block ids (or slots): a byte per id up to the largest added.

    What `EventLog` replays recorded events into for `check()` (invariant 10):
    with events on, a `set[int]` of every cached block cost about 70 bytes a
    block; this costs one byte per id of the pool. It has what `replay_views`
    uses (`update`, `difference_update`, `clear`), with a set's meaning;
    iterating gives the ids in increasing order. A negative id (which no pool
    hands out) is kept in a small set beside the bytes, so a wrong event still
    shows in `check()` as it would with a set.
    """

    __slots__ = ("_bits", "_negative")

    def __init__(self) -> None:
        self._bits = bytearray()
        self._negative: set[int] = set()

    def update(self, ids: Sequence[int], /) -> None:
        """Add `ids`."""
        bits = self._bits
        try:  # the usual case: every id is in the bytes already
            for i in ids:
                if i < 0:
                    raise IndexError(i)  # (indexing would wrap around)
                bits[i] = 1
        except IndexError:  # a negative id, or one past the end: all of them again
            self._update_outside(ids)

    def _update_outside(self, ids: Sequence[int]) -> None:
        """`update` when an id is negative or past the end of the bytes."""
        self._negative.update(i for i in ids if i < 0)
        ids = [i for i in ids if i >= 0]
        if not ids:
            return
        bits = self._bits
        top = max(ids)
        if top >= len(bits):  # grow (doubling)
            bits.extend(bytes(max(top + 1, 2 * len(bits)) - len(bits)))
        for i in ids:
            bits[i] = 1

    def difference_update(self, ids: Sequence[int], /) -> None:
        """Remove `ids` (those held; the others are ignored, as by a set)."""
        bits = self._bits
        try:  # the usual case: every id is in the bytes
            for i in ids:
                if i < 0:
                    raise IndexError(i)  # (indexing would wrap around)
                bits[i] = 0
        except IndexError:  # a negative id, or one past the end: all of them again
            size = len(bits)
            for i in ids:
                if 0 <= i < size:
                    bits[i] = 0
                elif i < 0:
                    self._negative.discard(i)

    def clear(self) -> None:
        """Remove every id."""
        self._bits = bytearray()
        self._negative.clear()

    def __iter__(self) -> Iterator[int]:
        yield from sorted(self._negative)
        yield from compress(range(len(self._bits)), self._bits)

    def __len__(self) -> int:
        return len(self._negative) + len(self._bits) - self._bits.count(0)

    def __contains__(self, block: object) -> bool:
        if type(block) is not int:
            return False
        if block < 0:
            return block in self._negative
        return block < len(self._bits) and self._bits[block] == 1

    def __repr__(self) -> str:
        return f"BlockBitmap({list(self)!r})"


class EventLog:
    """Emitted events until drained. Single-threaded, like the trie that owns it.

    With events on it also owns the block hasher (`cache.block_hash`): `root`
    and `chain` give the stable chained hashes that nodes and checkpoints
    carry, so events name blocks the same way in every process and replica.
    """

    __slots__ = (
        "_checkpoint_view",
        "_events",
        "_gpu_view",
        "_host_checkpoint_view",
        "_host_view",
        "_views",
        "chain",
        "chain_packed",
        "enabled",
        "hasher",
        "lora_ids",
        "nodes",
        "plain_digest",
    )

    def __init__(self, enabled: bool, scheme: str = "xxh3", seed: int = 0) -> None:
        self.enabled = enabled
        self.nodes: NodeTable | None = None
        """The trie's nodes, which events name (set by the trie once it has them)."""
        self._events: list[Event | StoredRun] = []
        self.lora_ids: dict[str, int] = {}
        """Namespace -> the `lora_id` its events carry (`BlockTrie.bind_lora`, [R70])."""
        # What every event recorded so far replays to, per group and medium.
        self._gpu_view = BlockBitmap()
        self._checkpoint_view = BlockBitmap()
        self._host_view = BlockBitmap()
        self._host_checkpoint_view = BlockBitmap()
        # (group_idx, medium) -> the view its events apply to (`replay_views`)
        self._views: dict[tuple[int, str], BlockBitmap] = {
            (KV_GROUP, MEDIUM_GPU): self._gpu_view,
            (CHECKPOINT_GROUP, MEDIUM_GPU): self._checkpoint_view,
            (KV_GROUP, MEDIUM_CPU): self._host_view,
            (CHECKPOINT_GROUP, MEDIUM_CPU): self._host_checkpoint_view,
        }
        self.hasher: BlockHasher | None = None
        self.chain: ChainFn | None = None
        self.chain_packed: PackedChainFn | None = None
        self.plain_digest: Callable[[bytes, int], int] | None = None
        if enabled:
            from cache.block_hash import BlockHasher

            self.hasher = BlockHasher(scheme, seed)
            self.chain = self.hasher.chain_fn
            self.chain_packed = self.hasher.packed_fn
            self.plain_digest = self.hasher.plain_digest

    def _table(self) -> NodeTable:
        nodes = self.nodes
        if nodes is None:
            raise RuntimeError("EventLog: the trie has not given it its nodes")
        return nodes

    def _parent_hash(self, node: Node) -> int | None:
        """The hash of `node`'s parent, None when the parent is a root."""
        t = self._table()
        parent = t.parent[node]
        return None if parent < 0 or t.is_root(parent) else t.block_hash[parent]

    def root_hash(self, namespace: str) -> int:
        """The chain seed of `namespace` (0 with events off)."""
        return self.hasher.root(namespace) if self.hasher is not None else 0

    def _emit(self, event: Event) -> None:
        """Record `event` and apply it to the views `check()` compares."""
        self._events.append(event)
        replay_views((event,), self._views)

    @contextmanager
    def muted(self) -> Iterator[None]:
        """Emit nothing inside the block (`clear` emits one `AllBlocksCleared` instead)."""
        enabled = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = enabled

    def chain_hashes(
        self,
        parent_hash: int,
        keys: Sequence[Hashable],
        start: int,
        stop: int,
        plain: bool,
        namespace: str,
    ) -> list[int] | None:
        """The block hashes of a chain of new blocks under a node whose hash is
        `parent_hash` (a root's: its namespace's seed), parent first: what a
        commit gives the nodes it attaches; None without a hasher (events off:
        the nodes' hashes stay 0 and nothing is computed).

        `keys[start:stop]` are the blocks' keys (`cache.keys.block_key`), which
        carry each block's packed token ids and extra identity; `plain` says
        every key is its packed token bytes (no extra identity, no injected key
        hash), which the `xxh3` scheme hashes in one C call per block.
        `namespace` is the chain's (`vllm` hashes it into a root block's extra keys).
        """
        if self.hasher is None:
            return None
        h = parent_hash
        hashes: list[int] = []
        append = hashes.append
        digest = self.plain_digest
        if plain and digest is not None:
            for i in range(start, stop):
                h = digest(keys[i], h)  # type: ignore[arg-type]  # plain: bytes
                append(h)
            return hashes
        chain = self.chain_packed
        for i in range(start, stop):
            key = keys[i]
            h = chain(h, key_packed(key), key_extra(key), namespace)  # type: ignore[misc]
            append(h)
        return hashes

    def stored(
        self,
        parent_hash: int | None,
        hashes: PackedHashes,
        keys: Sequence[Hashable],
        blocks: Sequence[int],
        start: int,
        stop: int,
        block_size: int,
        namespace: str,
    ) -> None:
        """Record the `BlockStored` of a chain of nodes one commit attached, parent
        first, as a stored run (built when read: `stored_event`).

        `parent_hash` is the hash of the node they hang from (None for a root);
        `hashes` are theirs (`chain_hashes`'s list, or already `packed_hashes`, as
        the native commit hands them; recorded packed); `keys[start:stop]`
        and `blocks[start:stop]` are their keys and blocks (the commit's keys and
        block table, read here, while they are still hot in the CPU's caches);
        `namespace` is theirs. Everything is passed in because the commit has
        it in hand (no lookup through the node table per commit).
        """
        if not self.enabled or start >= stop:
            return
        keys = keys[start:stop]
        try:  # a key is its packed bytes unless the block has an extra identity or
            # a test injected a key hash (`cache.keys.block_key`)
            tokens = b"".join(keys)  # type: ignore[arg-type]
        except TypeError:
            tokens = b""
        lora_ids = self.lora_ids
        if len(tokens) != 4 * block_size * len(keys) or (lora_ids and namespace in lora_ids):
            # not plain uint32 blocks, or a bound LoRA id: built now, not a stored run
            event = _stored_from_keys(
                parent_hash, run_hashes(hashes), keys, blocks[start:stop], block_size, namespace
            )
            lora_id = lora_ids.get(namespace) if lora_ids else None
            self._emit(event if lora_id is None else event._replace(lora_id=lora_id))
            return
        stored = blocks[start:stop]
        if type(hashes) is list:
            hashes = packed_hashes(hashes)
        self._events.append((parent_hash, hashes, tokens, stored, block_size, namespace))
        self._gpu_view.update(stored)

    def removed(self, hashes: list[int], blocks: list[int], namespaces: list[str]) -> None:
        """Evicted device blocks, in eviction order: block `blocks[i]`, hash `hashes[i]`,
        in namespace `namespaces[i]`. One `BlockRemoved` per run of one namespace (so
        one in all when they share it, the usual case)."""
        if not self.enabled or not hashes:
            return
        count = len(hashes)
        if not len(blocks) == len(namespaces) == count:
            raise ValueError(
                f"EventLog.removed: {count} hashes, {len(blocks)} blocks, "
                f"{len(namespaces)} namespaces"
            )
        self._gpu_view.difference_update(blocks)  # what the events below replay to
        first = namespaces[0]
        if namespaces.count(first) == count:  # one namespace: one event
            self._events.append(BlockRemoved(tuple(hashes), tuple(blocks), first))
            return
        start = 0
        for i in range(1, count + 1):
            if i == count or namespaces[i] != namespaces[start]:
                self._events.append(
                    BlockRemoved(tuple(hashes[start:i]), tuple(blocks[start:i]), namespaces[start])
                )
                start = i

    def removed_blocks(self, node: Node, block: int) -> None:
        """`node`'s device `block` was freed while the node stays (offloaded to host)."""
        if self.enabled:
            t = self._table()
            self._emit(BlockRemoved((t.block_hash[node],), (block,), t.namespace_of(node)))

    def host_stored(self, nodes: Sequence[Node]) -> None:
        """A store copy finished: `nodes` are now in the host tier (medium CPU)."""
        if self.enabled:
            self._single_blocks(nodes, [self._table().host[nd] for nd in nodes], MEDIUM_CPU)

    def back_on_device(self, nodes: Sequence[Node]) -> None:
        """`nodes` own a device block again (a load finished, or a commit adopted
        them): medium GPU."""
        if self.enabled:
            self._single_blocks(nodes, [self._table().block[nd] for nd in nodes], MEDIUM_GPU)

    def host_removed(self, nodes: Sequence[Node]) -> None:
        """Host eviction freed the host blocks of `nodes` (medium CPU)."""
        if not self.enabled or not nodes:
            return
        t = self._table()
        for nd in nodes:
            self._emit(
                BlockRemoved((t.block_hash[nd],), (t.host[nd],), t.namespace_of(nd), MEDIUM_CPU)
            )

    def _single_blocks(self, nodes: Sequence[Node], blocks: Sequence[int], medium: str) -> None:
        """One `BlockStored` per node (the host tier moves blocks one by one)."""
        if not self.enabled:
            return
        from cache.block_hash import extra_keys

        t = self._table()
        for nd, block in zip(nodes, blocks, strict=True):
            namespace = t.namespace_of(nd)
            extra = t.extra_of(nd)
            tokens = t.tokens_of(nd)
            self._emit(
                BlockStored(
                    (t.block_hash[nd],),
                    (block,),
                    self._parent_hash(nd),
                    tokens,
                    len(tokens),
                    namespace,
                    medium,
                    KV_GROUP,
                    KIND_FULL_ATTENTION,
                    (extra_keys(extra, namespace),) if namespace or extra is not None else None,
                    self.lora_ids.get(namespace),
                )
            )

    def checkpoint_published(self, ck: Checkpoint, block_size: int, host: bool = False) -> None:
        """`ck` became matchable: a `BlockStored` in the checkpoint group (with `host`,
        its host copy did: medium "CPU", its host slot; [R53]).

        At a block boundary the checkpoint is named by the KV block it ends at;
        with a partial tail, by the tail's hash chained under its anchor
        (`cache.events.checkpoint_stored`). The hash is kept on `ck` for its
        removal.
        """
        if not self.enabled or self.chain is None:
            return
        anchor = ck.anchor
        from cache.block_hash import extra_keys

        t = self._table()
        namespace = t.namespace_of(anchor)
        if host:  # named as on the device (a host copy is block-aligned)
            self._emit(
                checkpoint_stored(
                    ck.block_hash,
                    ck.host_slot,
                    self._parent_hash(anchor),
                    t.tokens_of(anchor),
                    block_size,
                    namespace,
                    extra_keys=extra_keys(t.extra_of(anchor), namespace),
                    medium=MEDIUM_CPU,
                    lora_id=self.lora_ids.get(namespace),
                )
            )
            return
        if ck.tail:
            ck.block_hash = self.chain(t.block_hash[anchor], ck.tail, ck.tail_extra, namespace)
            parent_hash = None if t.is_root(anchor) else t.block_hash[anchor]
            tokens, extra = ck.tail, ck.tail_extra
        else:
            ck.block_hash = t.block_hash[anchor]
            parent_hash = self._parent_hash(anchor)
            tokens, extra = t.tokens_of(anchor), t.extra_of(anchor)

        self._emit(
            checkpoint_stored(
                ck.block_hash,
                ck.slot,
                parent_hash,
                tokens,
                block_size,
                namespace,
                extra_keys=extra_keys(extra, namespace),
                lora_id=self.lora_ids.get(namespace),
            )
        )

    def checkpoint_dropped(self, ck: Checkpoint, host: bool = False) -> None:
        """A published `ck` left its device slot (released, replaced, evicted or
        offloaded), or with `host` its host slot: a `BlockRemoved`."""
        if self.enabled:
            slot, medium = (ck.host_slot, MEDIUM_CPU) if host else (ck.slot, MEDIUM_GPU)
            self._emit(
                checkpoint_removed(
                    (ck.block_hash,), (slot,), self._table().namespace_of(ck.anchor), medium=medium
                )
            )

    def cleared(self) -> None:
        """`AllBlocksCleared`: every cached block was dropped."""
        if self.enabled:
            self._emit(AllBlocksCleared())

    def drain(self) -> list[Event]:
        """Return and forget the events emitted since the last drain."""
        events = built_events(self._events)
        self._events = []
        return events

    def drain_records(self) -> EventRecords:
        """Return and forget the events emitted since the last drain, unbuilt (the
        views `check()` compares took them in when they were recorded)."""
        items = self._events
        self._events = []
        return EventRecords(items)

    def replayed_blocks(self) -> set[int] | None:
        """The block set all events so far replay to (None when events are off)."""
        return set(self._gpu_view) if self.enabled else None

    def replayed_host_blocks(self) -> set[int] | None:
        """The host-tier block set all events so far replay to (None when events are off)."""
        return set(self._host_view) if self.enabled else None

    def replayed_checkpoint_slots(self) -> set[int] | None:
        """The checkpoint slots all events so far replay to (None when events are off)."""
        return set(self._checkpoint_view) if self.enabled else None

    def replayed_host_checkpoint_slots(self) -> set[int] | None:
        """The host checkpoint slots all events so far replay to (None when events are off)."""
        return set(self._host_checkpoint_view) if self.enabled else None


def stored_event(run: StoredRun) -> BlockStored:
    """The `BlockStored` a stored run records (see `EventLog.stored`)."""
    parent_hash, hashes, tokens, blocks, block_size, namespace = run
    return device_stored(
        tuple(run_hashes(hashes)),
        tuple(blocks),
        parent_hash,
        PackedTokens(tokens),
        block_size,
        namespace,
        plain_extra_keys(namespace, len(blocks)),
    )


def _stored_from_keys(
    parent_hash: int | None,
    hashes: Sequence[int],
    keys: Sequence[Hashable],
    blocks: Sequence[int],
    block_size: int,
    namespace: str,
) -> BlockStored:
    """The `BlockStored` of blocks whose keys are not all plain uint32 blocks: each
    key's packed ids (a tuple of token ids when any needs 64 bits), and the extra
    keys of each block's identity (read from its key)."""
    token_ids = joined_tokens([key_packed(k) for k in keys], block_size)
    extras = None
    identities = [key_extra(k) for k in keys]
    if namespace or any(extra is not None for extra in identities):
        from cache.block_hash import extra_keys

        extras = tuple(extra_keys(extra, namespace) for extra in identities)
    return device_stored(
        tuple(hashes), tuple(blocks), parent_hash, token_ids, block_size, namespace, extras
    )


def plain_extra_keys(namespace: str, blocks: int) -> tuple[tuple[object, ...] | None, ...] | None:
    """`BlockStored.extra_keys` of `blocks` blocks with no extra identity: None in the
    default namespace, else the namespace's extra keys once per block."""
    if not namespace:
        return None
    from cache.block_hash import extra_keys

    return (extra_keys(None, namespace),) * blocks


def device_stored(
    hashes: tuple[int, ...],
    blocks: tuple[int, ...],
    parent_hash: int | None,
    token_ids: Sequence[int],
    block_size: int,
    namespace: str,
    extras: tuple[tuple[object, ...] | None, ...] | None,
) -> BlockStored:
    """A commit's `BlockStored`: KV blocks on the device (a stored run's, or one
    rebuilt from a frame by `cache.kv_publisher_process`)."""
    return BlockStored(  # positional: a NamedTuple built by keyword costs twice as much
        hashes,
        blocks,
        parent_hash,
        token_ids,
        block_size,
        namespace,
        MEDIUM_GPU,
        KV_GROUP,
        KIND_FULL_ATTENTION,
        extras,
    )


def built_events(items: Sequence[Event | StoredRun]) -> list[Event]:
    """`items` (events and stored runs, in order) as events."""
    return [stored_event(x) if type(x) is tuple else x for x in items]  # type: ignore[misc]


class EventRecords:
    """Drained events, not yet built (`EventLog.drain_records`).

    `events()` builds them (what `drain` returns); `len()` counts them. A
    stored run stays as the commit recorded it until then, which is what lets
    `cache.kv_publisher_process` ship a batch to another process without
    building an event object per commit in the engine's.
    """

    __slots__ = ("items",)

    def __init__(self, items: list[Event | StoredRun]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def events(self) -> list[Event]:
        """The events, built."""
        return built_events(self.items)
