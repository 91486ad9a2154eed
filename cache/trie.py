"""`BlockTrie`: the prefix cache. See DESIGN.md for the contract and
docs/semantics.md for every rule the reference model (`spec.model`) shares.

Structure: per-namespace root nodes; each node owns one reference to one KV
block; children are a dict keyed by the block's exact key (token tuple, plus
extra identity), so Python's hash narrows and equality decides. Node and
checkpoint states change only through the `spec.lifecycle` tables (`_settle`,
`CheckpointStore.move`), and entering or leaving `evictable` / unpinned `published` is what
adds or removes an object from its LRU index.

Every public operation validates and plans first, then takes resources (the
pools' `take` is the only place an allocation can fail), then mutates; so an
operation completes or raises with nothing changed. Eviction needed to make
room (KV leaves, frozen tails, a checkpoint for a slot) is itself a complete
operation and happens before the takes, so an injected failure at a take
leaves those evictions done (and everything else as it was).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from collections.abc import Sequence as SequenceABC

import torch

from cache.checkpoints import CheckpointStore
from cache.config import CacheConfig
from cache.copies import Copy, CopyEngine, DeviceCopies, Resource
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, replay
from cache.faults import Faults
from cache.kv_pool import KVBlockPool
from cache.lru import LRUIndex
from cache.node import Checkpoint, HashedKey, Node
from cache.sequence import PinReceipt, RestorePoint, Sequence
from cache.state_pool import CheckpointSlotPool
from cache.stats import CacheStats
from cache.validation import extra_tuple, int_arg, token_list
from spec import invariants
from spec.errors import (
    CacheError,
    CheckpointError,
    InvalidArgument,
    InvalidType,
    InvariantViolation,
    OutOfBlocks,
    PinError,
    SequenceNotLive,
)
from spec.lifecycle import CHECKPOINT, NODE, NodeState, implied_node_state
from spec.snapshot import (
    CheckpointView,
    CopyView,
    NodeView,
    SequenceView,
    Snapshot,
)

_EVICTABLE = NodeState.EVICTABLE.value
_CACHED = NodeState.CACHED.value
_ROOT_STATE = "root"


class BlockTrie:
    """A prefix cache of KV blocks and SSM checkpoints (DESIGN.md, "Public API")."""

    def __init__(self, config: CacheConfig, copies: CopyEngine | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidType(f"config must be a CacheConfig, got {type(config).__name__}")
        if copies is not None and not isinstance(copies, CopyEngine):
            raise InvalidType(f"copies must be a CopyEngine, got {type(copies).__name__}")
        self.config = config
        self.device = torch.device(config.device)
        self._block_size = config.block_size
        self._ssm = config.ssm
        self._key_hash = config.key_hash
        self.faults = Faults()
        self.stats = CacheStats()
        self._kv = KVBlockPool(
            config.num_blocks, config.kv_block_shape, config.kv_dtype, self.device, self.faults
        )
        self._slots = CheckpointSlotPool(
            config.num_checkpoint_slots,
            config.state_shapes,
            config.state_dtype,
            self.device,
            self.faults,
        )
        self.copies: CopyEngine = copies if copies is not None else DeviceCopies()
        self.copies.bind(self.device)
        self._roots: dict[str, Node] = {}
        # block id -> the attached node that owns it, to settle it when a count drops.
        self._owner: list[Node | None] = [None] * config.num_blocks
        self._evictable: LRUIndex[Node] = LRUIndex()
        self._checkpoints = CheckpointStore(self._slots, self._kv, self.stats, self._settle, self)
        self._clock = 0
        self._node_serial = 0
        self._seq_serial = 0
        self._copy_serial = 0
        self._live: dict[int, Sequence] = {}
        self._inflight: dict[int, Copy] = {}
        self._explicit: dict[int, PinReceipt] = {}
        self._num_cached = 0
        self._events_on = config.enable_events
        self._events: list[Event] = []
        self._drained_view: set[int] = set()

    # ------------------------------------------------------------------ counts

    @property
    def num_free_blocks(self) -> int:
        """KV blocks in the free list."""
        return self._kv.num_free

    @property
    def num_cached_blocks(self) -> int:
        """KV blocks owned by attached trie nodes."""
        return self._num_cached

    @property
    def num_free_checkpoint_slots(self) -> int:
        """Checkpoint slots in the free list."""
        return self._slots.num_free

    @property
    def num_evictable_blocks(self) -> int:
        """Nodes in the eviction index (evictable leaves right now)."""
        return len(self._evictable)

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """The KV pool tensor `[num_blocks, *kv_block_shape]` (None for ids only)."""
        return self._kv.tensor

    @property
    def checkpoint_states(self) -> dict[str, torch.Tensor]:
        """Per state name, the checkpoint pool tensor `[num_checkpoint_slots, *shape]`."""
        return dict(self._slots.tensors)

    @property
    def clock(self) -> int:
        """The logical clock (ticks on commit, release, and copy-queuing save/restore)."""
        return self._clock

    # ------------------------------------------------------------- validation

    def _check_live(self, seq: object) -> Sequence:
        if not isinstance(seq, Sequence):
            raise InvalidType(f"expected a Sequence from this cache, got {type(seq).__name__}")
        if seq.owner is not self:
            raise SequenceNotLive(f"{seq!r} belongs to another cache")
        if not seq.live:
            raise SequenceNotLive(f"{seq!r} was already released or aborted")
        return seq

    def _key(self, tokens: tuple[int, ...], extra: Hashable) -> Hashable:
        key: Hashable = tokens if extra is None else (tokens, extra)
        if self._key_hash is not None:
            key = HashedKey(key, self._key_hash(key))
        return key

    def _root(self, namespace: str) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = Node(
                parent=None,
                key=None,
                tokens=(),
                extra=None,
                block=-1,  # roots own no block; `block < 0` marks a root everywhere
                namespace=namespace,
                depth=0,
                serial=-1 - len(self._roots),
                tick=0,
                block_hash=hash(("blocktrie-namespace", namespace)),
                state=_ROOT_STATE,
            )
            self._roots[namespace] = root
        return root

    # ---------------------------------------------------------------- lookups

    def _walk(
        self, root: Node | None, toks: list[int], extra: tuple[Hashable, ...] | None, limit: int
    ) -> list[Node]:
        """Nodes of the longest cached path of full blocks, at most `limit` blocks."""
        path: list[Node] = []
        if root is None:
            return path
        size = self._block_size
        node = root
        plain = extra is None and self._key_hash is None
        for i in range(limit):
            tokens = tuple(toks[i * size : (i + 1) * size])
            if plain:
                child = node.children.get(tokens)
            else:
                e = extra[i] if extra is not None and i < len(extra) else None
                child = node.children.get(self._key(tokens, e))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    @staticmethod
    def _block_extra(extra: tuple[Hashable, ...] | None, index: int) -> Hashable:
        return extra[index] if extra is not None and index < len(extra) else None

    def _matching_checkpoint(
        self,
        root: Node | None,
        path: list[Node],
        toks: list[int],
        extra: tuple[Hashable, ...] | None,
        max_depth: int,
    ) -> Checkpoint | None:
        """The deepest matchable checkpoint on `path[:max_depth]` (or the root) for `toks`."""
        if root is None:
            return None
        size = self._block_size
        last = len(toks) - 1
        for depth in range(max_depth, -1, -1):
            anchor = path[depth - 1] if depth else root
            ck = anchor.checkpoint
            if ck is None or ck.step > last:
                continue
            if not CHECKPOINT.can("pin", ck.state):  # matchable: published or pinned
                continue
            if ck.tail:
                start = depth * size
                if tuple(toks[start : ck.step]) != ck.tail:
                    continue
                if ck.tail_extra != self._block_extra(extra, depth):
                    continue
            return ck
        return None

    # ------------------------------------------------------------ lifecycles

    def _settle(self, node: Node) -> None:
        """Move `node` to the state its facts imply, through the spec's table."""
        if node.block < 0:
            return
        ck = node.checkpoint
        implied = implied_node_state(
            attached=True,
            leaf=not node.children,
            block_refs=self._kv.refs[node.block],
            pins=ck.pins if ck is not None else 0,
        )
        state = node.state
        if implied == state:
            return
        for trigger in NODE.route(state, implied, node):
            state = NODE.step(trigger, state, node)
        if node.state == _EVICTABLE:
            self._evictable.remove(node)
        node.state = state
        if state == _EVICTABLE:
            self._evictable.add(node)

    # ----------------------------------------------------------------- match

    def match(
        self, tokens: SequenceABC[int], namespace: str = "", extra: object = None
    ) -> Sequence:
        """Look up the longest usable cached prefix; takes refs (and a pin) at once.

        Leaves at least one token to compute. See docs/semantics.md, "match".
        """
        toks = token_list(tokens)
        if not toks:
            raise InvalidArgument("match needs at least one token")
        if not isinstance(namespace, str):
            raise InvalidType(f"namespace must be a str, got {type(namespace).__name__}")
        ext = extra_tuple(extra)
        size = self._block_size
        root = self._roots.get(namespace)
        path = self._walk(root, toks, ext, len(toks) // size)
        usable = min(len(path), (len(toks) - 1) // size)
        ck: Checkpoint | None = None
        if self._ssm:
            ck = self._matching_checkpoint(root, path, toks, ext, usable)
            depth = ck.step // size if ck is not None else 0
            hit = ck.step if ck is not None else 0
        else:
            depth = usable
            hit = usable * size

        self._seq_serial += 1
        seq = Sequence(self, self._seq_serial, toks, namespace, ext)
        seq.branch_step = len(path) * size
        held = path[:depth]
        kv = self._kv
        for node in held:
            kv.incref(node.block)
            if node.state == _EVICTABLE:
                self._settle(node)
        seq.path = held
        seq.blocks = [node.block for node in held]
        if ck is not None:
            seq.match_receipt = self._checkpoints.pin(ck)
            seq.restore = RestorePoint(ck)
            self.stats.checkpoint_hits += 1
        seq.num_cached_tokens = hit
        seq.num_committed_tokens = hit
        seq.query_tokens = len(toks)
        stats = self.stats
        stats.queries += 1
        stats.query_tokens += len(toks)
        stats.hit_tokens += hit
        self._live[seq.serial] = seq
        return seq

    # ------------------------------------------------------- append/allocate

    def append(self, seq: Sequence, tokens: SequenceABC[int]) -> None:
        """Extend `seq.tokens` (decode)."""
        self._check_live(seq)
        seq.token_list.extend(token_list(tokens))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Make the block table cover `tokens[:num_tokens]`, evicting LRU leaves if short.

        Raises `OutOfBlocks` (nothing changed) when even eviction cannot make room.
        """
        self._check_live(seq)
        n = int_arg("num_tokens", num_tokens)
        if not 0 <= n <= len(seq.token_list):
            raise InvalidArgument(
                f"allocate: num_tokens={n} outside 0..{len(seq.token_list)} for {seq!r}"
            )
        need = -(-n // self._block_size) - len(seq.blocks)
        if need <= 0:
            return
        self._make_room(need)
        seq.blocks.extend(self._kv.take(need))

    def _reclaimable(self, limit: int, doomed: set[int] | None = None) -> int:
        """KV blocks that evictions could free, counted up to `limit` (no change made).

        With `doomed`, the serials of the nodes counted are added to it.
        """
        refs = self._kv.refs
        count = 0
        gone: dict[int, int] = {}
        for leaf in self._evictable.unordered():  # any order counts the same cascade
            node: Node | None = leaf
            while node is not None and count < limit:
                count += 1
                if doomed is not None:
                    doomed.add(node.serial)
                ck = node.checkpoint
                if ck is not None and ck.frozen_block is not None:
                    count += 1
                parent = node.parent
                if parent is None or parent.block < 0:
                    break
                seen = gone.get(parent.serial, 0) + 1
                gone[parent.serial] = seen
                pck = parent.checkpoint
                # Would the parent be evictable once all counted children are gone?
                after = implied_node_state(
                    attached=True,
                    leaf=seen == len(parent.children),
                    block_refs=refs[parent.block],
                    pins=pck.pins if pck is not None else 0,
                )
                if after != _EVICTABLE:
                    break
                node = parent
            if count >= limit:
                break
        return count

    def _room_possible(self, short: int) -> bool:
        """Whether `_make_room` can free `short` blocks (no change made)."""
        # Each evictable leaf frees at least its own block; count deeper only when short.
        if len(self._evictable) >= short or self._reclaimable(short) >= short:
            return True
        doomed: set[int] = set()
        total = self._reclaimable(self._kv.capacity + 1, doomed)
        total += sum(1 for ck in self._checkpoints.frozen_tails() if ck.anchor.serial not in doomed)
        return total >= short

    def _make_room(self, need: int) -> None:
        """Make `need` blocks free: KV eviction first, then the frozen tails of
        unpinned checkpoints; raises `OutOfBlocks`, changing nothing, when impossible."""
        short = need - self._kv.num_free
        if short <= 0:
            return
        if not self._room_possible(short):
            raise OutOfBlocks(
                f"need {need} KV blocks: {self._kv.num_free} free and fewer than {short} "
                f"reclaimable by eviction (capacity {self._kv.capacity})"
            )
        freed = self._evict_blocks(short)
        if freed < short:
            self.stats.evicted_blocks += self._checkpoints.evict_frozen_tails(short - freed)

    # ---------------------------------------------------------------- commit

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """`tokens[:num_tokens]` have computed KV: attach their full blocks to the trie.

        A block equal to an existing child is deduplicated: the sequence switches
        to the cached block and its own copy is freed.
        """
        self._check_live(seq)
        n = int_arg("num_tokens", num_tokens)
        size = self._block_size
        covered = min(len(seq.token_list), len(seq.blocks) * size)
        if not seq.num_committed_tokens <= n <= covered:
            raise InvalidArgument(
                f"commit: num_tokens={n} must be in {seq.num_committed_tokens}..{covered} "
                f"(committed so far .. allocated and known tokens) for {seq!r}"
            )
        self._clock += 1
        tick = self._clock
        full = n // size
        path = seq.path
        start = len(path)
        if start < full:
            parent = path[-1] if path else self._root(seq.namespace)
            toks = seq.token_list
            ext = seq.extra
            plain = ext is None and self._key_hash is None
            kv = self._kv
            stored: list[Node] = []
            for i in range(start, full):
                tokens = tuple(toks[i * size : (i + 1) * size])
                if plain:
                    e: Hashable = None
                    key: Hashable = tokens
                else:
                    e = self._block_extra(ext, i)
                    key = self._key(tokens, e)
                child = parent.children.get(key)
                if child is not None:
                    own = seq.blocks[i]
                    kv.incref(child.block)
                    seq.blocks[i] = child.block
                    kv.decref(own)
                    self._settle(child)
                    child.tick = tick
                else:
                    child = self._attach(parent, key, tokens, e, seq.blocks[i], tick)
                    stored.append(child)
                path.append(child)
                parent = child
            if stored and self._events_on:
                first_parent = stored[0].parent
                self._events.append(
                    BlockStored(
                        block_hashes=tuple(nd.block_hash for nd in stored),
                        block_ids=tuple(nd.block for nd in stored),
                        parent_block_hash=(
                            None
                            if first_parent is None or first_parent.block < 0
                            else first_parent.block_hash
                        ),
                        token_ids=tuple(t for nd in stored for t in nd.tokens),
                        block_size=size,
                        namespace=seq.namespace,
                    )
                )
        seq.num_committed_tokens = n

    def _attach(
        self,
        parent: Node,
        key: Hashable,
        tokens: tuple[int, ...],
        extra: Hashable,
        block: int,
        tick: int,
    ) -> Node:
        self._kv.incref(block)
        self._node_serial += 1
        node = Node(
            parent,
            key,
            tokens,
            extra,
            block,
            parent.namespace,
            parent.depth + 1,
            self._node_serial,
            tick,
            hash((parent.block_hash, key)) if self._events_on else 0,
            _CACHED,
        )
        parent.children[key] = node
        self._owner[block] = node
        self._num_cached += 1
        # No state changes: the parent is a root or on the committing sequence's
        # path (held, so `cached` or `pinned` with or without children), and the
        # new node starts `cached`, as the sequence still holds its block.
        return node

    # ------------------------------------------------------- release / abort

    def release(self, seq: Sequence) -> None:
        """The request is done: drop its references; committed blocks stay cached."""
        self._check_live(seq)
        self._clock += 1
        tick = self._clock
        for node in seq.path:
            node.tick = tick  # held by seq, so in no index while it changes
        self._drop(seq)

    def abort(self, seq: Sequence) -> None:
        """Reject a tentative match: undo its references, pin and statistics."""
        self._check_live(seq)
        stats = self.stats
        stats.queries -= 1
        stats.query_tokens -= seq.query_tokens
        stats.hit_tokens -= seq.num_cached_tokens
        if seq.restore is not None:
            stats.checkpoint_hits -= 1
        self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        if seq.match_receipt is not None:
            self._checkpoints.unpin(seq.match_receipt)
            seq.match_receipt = None
        kv = self._kv
        for block in seq.blocks:
            kv.decref(block)
        if seq.path:
            # Every other path node has a child (the next one), so it stays
            # `cached` or `pinned`; only the deepest can have become a leaf
            # that nobody else holds.
            self._settle(seq.path[-1])
        seq.live = False
        del self._live[seq.serial]

    # ---------------------------------------------------------------- evict

    def evict(self, num_blocks: int) -> int:
        """Evict LRU evictable leaves until `num_blocks` KV blocks are freed.

        Returns the blocks freed (node blocks plus frozen tails); fewer when
        nothing more is evictable. Pinned or shared nodes are never touched.
        """
        n = int_arg("num_blocks", num_blocks)
        if n < 0:
            raise InvalidArgument(f"evict: num_blocks must be >= 0, got {n}")
        return self._evict_blocks(n)

    def _evict_blocks(self, n: int) -> int:
        freed = 0
        index = self._evictable
        removed: list[Node] | None = [] if self._events_on else None
        while freed < n and index:
            node = index.oldest()
            freed += self._free_node(node)
            if removed is not None:
                removed.append(node)
        if removed:
            self._emit_removed(removed)
        self.stats.evicted_blocks += freed
        return freed

    def _emit_removed(self, removed: list[Node]) -> None:
        """One `BlockRemoved` per run of evicted nodes from the same namespace."""
        start = 0
        for i in range(1, len(removed) + 1):
            if i == len(removed) or removed[i].namespace != removed[start].namespace:
                run = removed[start:i]
                self._events.append(
                    BlockRemoved(
                        tuple(nd.block_hash for nd in run),
                        tuple(nd.block for nd in run),
                        run[0].namespace,
                    )
                )
                start = i

    def _free_node(self, node: Node) -> int:
        freed_state = NODE.step("free", node.state, node)
        self._evictable.remove(node)
        freed = 0
        ck = node.checkpoint
        if ck is not None:
            freed += self._checkpoints.drop(ck, "evict")
            self.stats.evicted_checkpoints += 1
        parent = node.parent
        if parent is None:
            raise InvariantViolation("topology", f"evictable {node!r} has no parent")
        del parent.children[node.key]
        node.state = freed_state
        node.parent = None
        self._owner[node.block] = None
        self._num_cached -= 1
        if self._kv.decref(node.block):
            freed += 1
        self._settle(parent)
        return freed

    def evict_checkpoints(self, n: int) -> int:
        """Release up to `n` LRU unpinned checkpoints (slots and frozen tails); nodes stay."""
        count = int_arg("n", n)
        if count < 0:
            raise InvalidArgument(f"evict_checkpoints: n must be >= 0, got {count}")
        return self._checkpoints.evict_lru(count)

    def clear(self) -> None:
        """Drop every cached block and checkpoint. Needs no live sequence, copy or pin."""
        if self._live or self._inflight or self._explicit:
            raise CacheError(
                f"clear: {len(self._live)} live sequences, {len(self._inflight)} copies in "
                f"flight and {len(self._explicit)} explicit pins must be finished first"
            )
        events = self._events_on
        self._events_on = False
        try:
            self._evict_blocks(self._kv.capacity)
            for root in self._roots.values():
                if root.checkpoint is not None:
                    self._checkpoints.drop(root.checkpoint, "evict")
                    self.stats.evicted_checkpoints += 1
        finally:
            self._events_on = events
        if events:
            self._events.append(AllBlocksCleared())

    # ----------------------------------------------------------- checkpoints

    def save(
        self, seq: Sequence, step: int, runtime_state: Mapping[str, torch.Tensor] | None
    ) -> Copy | None:
        """Checkpoint `seq`'s SSM state after exactly `step` tokens.

        Returns the queued copy, or None when skipped (duplicate, pinned anchor,
        or no slot / frozen block even after eviction); skips are counted in stats.
        """
        self._check_live(seq)
        step = int_arg("step", step)
        if not self._ssm:
            raise CheckpointError("save: SSM checkpoints are disabled (num_checkpoint_slots=0)")
        if not 1 <= step <= len(seq.token_list):
            raise InvalidArgument(f"save: step={step} outside 1..{len(seq.token_list)} for {seq!r}")
        size = self._block_size
        depth, rem = divmod(step, size)
        if depth > seq.num_committed_tokens // size:
            raise CheckpointError(
                f"save: step={step} anchors at block {depth}, but {seq!r} has committed only "
                f"{seq.num_committed_tokens // size} blocks"
            )
        if rem and len(seq.blocks) <= depth:
            raise CheckpointError(
                f"save: step={step} needs the partial block {depth} allocated in {seq!r}"
            )
        runtime = self._slots.check_runtime(runtime_state)

        anchor = seq.path[depth - 1] if depth else self._root(seq.namespace)
        tail = tuple(seq.token_list[depth * size : step])
        tail_extra = self._block_extra(seq.extra, depth) if rem else None
        old = anchor.checkpoint
        stats = self.stats
        if old is not None:
            if old.step == step and old.tail == tail and old.tail_extra == tail_extra:
                stats.checkpoints_deduplicated += 1
                return None
            if not CHECKPOINT.can("replace", old.state):
                stats.checkpoints_skipped += 1
                return None
        reuse_frozen = old is not None and old.frozen_block is not None and rem > 0
        need_block = rem > 0 and not reuse_frozen
        need_slot = old is None
        if need_slot and self._slots.num_free == 0 and not self._checkpoints.lru:
            stats.checkpoints_skipped += 1
            return None
        if need_block and self._kv.num_free == 0 and not self._room_possible(1):
            stats.checkpoints_skipped += 1
            return None

        if need_slot and self._slots.num_free == 0:
            self._checkpoints.evict_lru(1)
        if need_block:
            self._make_room(1)
        slot = self._slots.take() if old is None else old.slot
        frozen: int | None = old.frozen_block if reuse_frozen and old is not None else None
        if need_block:
            try:
                frozen = self._kv.take(1)[0]
            except CacheError:
                if need_slot:
                    self._slots.give(slot)
                raise

        if old is not None:
            self._checkpoints.move(old, "replace")
            anchor.checkpoint = None
            if old.frozen_block is not None and not reuse_frozen:
                self._kv.decref(old.frozen_block)
        self._clock += 1
        ck = self._checkpoints.reserve(anchor, step, tail, tail_extra, slot, frozen, self._clock)

        moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, dst in self._slots.views(slot).items():
            moves.append((runtime[name], dst))
        resources: list[Resource] = [("slot", slot)]
        source_block = seq.blocks[depth] if rem else -1
        if frozen is not None:
            resources += [("block", source_block), ("block", frozen)]
            src_view, dst_view = self._kv.view(source_block), self._kv.view(frozen)
            if src_view is not None and dst_view is not None:
                moves.append((src_view, dst_view))
        copy = self._new_copy("save", step, moves, resources)
        if frozen is not None:
            self._kv.incref(source_block)
            copy.blocks.append(source_block)
        self._checkpoints.move(ck, "publish")
        copy.receipts.append(self._checkpoints.pin(ck))
        stats.checkpoints_saved += 1

        def undo() -> None:
            # Its data never arrived: take the checkpoint out again. A replaced
            # one cannot come back: its slot was being overwritten.
            self._checkpoints.unpin(copy.receipts[0])
            self._checkpoints.drop(ck, "release")
            for block in copy.blocks:
                self._kv.decref(block)
            self._clock -= 1
            stats.checkpoints_saved -= 1

        self._launch(copy, undo)
        return copy

    def restore(self, seq: Sequence, runtime_state: Mapping[str, torch.Tensor] | None) -> Copy:
        """Queue checkpoint -> `runtime_state` (and frozen tail -> the sequence's block).

        The match's pin moves to the copy and is released when the copy finishes.
        """
        self._check_live(seq)
        point = seq.restore
        if point is None:
            raise CheckpointError(f"restore: {seq!r} matched no checkpoint")
        receipt = seq.match_receipt
        if receipt is None:
            raise CheckpointError(f"restore: {seq!r} was already restored")
        runtime = self._slots.check_runtime(runtime_state, written=True)
        ck = point.checkpoint
        depth = ck.step // self._block_size
        if ck.frozen_block is not None and len(seq.path) > depth:
            raise CheckpointError(
                f"restore: {seq!r} already committed block {depth}, where the frozen tail "
                "would be written; restore before prefill"
            )
        allocated = ck.frozen_block is not None and len(seq.blocks) == depth
        if allocated:
            self._make_room(1)
            seq.blocks.extend(self._kv.take(1))
        old_tick = ck.tick
        self._clock += 1
        ck.tick = self._clock  # pinned, so in no index while it changes
        moves = [(src, runtime[name]) for name, src in self._slots.views(ck.slot).items()]
        resources: list[Resource] = [("slot", ck.slot)]
        target = -1
        if ck.frozen_block is not None:
            target = seq.blocks[depth]
            resources += [("block", ck.frozen_block), ("block", target)]
            src_view, dst_view = self._kv.view(ck.frozen_block), self._kv.view(target)
            if src_view is not None and dst_view is not None:
                moves.append((src_view, dst_view))
        copy = self._new_copy("restore", ck.step, moves, resources)
        if target >= 0:
            self._kv.incref(target)
            copy.blocks.append(target)
        copy.receipts.append(receipt)
        seq.match_receipt = None
        seq.restored = True
        self.stats.restores += 1

        def undo() -> None:
            seq.match_receipt = receipt
            seq.restored = False
            if target >= 0:
                self._kv.decref(target)
            if allocated:
                self._kv.decref(seq.blocks.pop())
            ck.tick = old_tick
            self._clock -= 1
            self.stats.restores -= 1

        self._launch(copy, undo)
        return copy

    def _new_copy(
        self,
        kind: str,
        step: int,
        moves: list[tuple[torch.Tensor, torch.Tensor]],
        resources: list[Resource],
    ) -> Copy:
        self._copy_serial += 1
        return Copy(kind, step, moves, resources, self._copy_serial)

    def _launch(self, copy: Copy, undo: Callable[[], None]) -> None:
        """Queue `copy`; if queuing it fails (a copy that runs at once raised),
        `undo` puts back what the operation changed and `CacheError` is raised."""
        self._inflight[copy.serial] = copy
        try:
            self.copies.queue(copy)
        except Exception as exc:
            self.copies.forget(copy)
            del self._inflight[copy.serial]
            undo()
            raise CacheError(f"{copy.kind}: the copy failed and was undone: {exc}") from exc
        if copy.done:
            self.copies.forget(copy)
            self._reap(copy)

    def _reap(self, copy: Copy) -> None:
        del self._inflight[copy.serial]
        for receipt in copy.receipts:
            self._checkpoints.unpin(receipt)
        for block in copy.blocks:
            self._kv.decref(block)
            owner = self._owner[block]
            if owner is not None:
                self._settle(owner)
        self.stats.copies_reaped += 1

    def poll(self) -> int:
        """Reap finished copies, oldest first, releasing their pins and references."""
        finished = self.copies.collect()
        for copy in finished:
            self._reap(copy)
        return len(finished)

    def pin(self, seq: Sequence) -> PinReceipt:
        """Pin `seq`'s restore checkpoint; returns a single-use receipt for `unpin`."""
        self._check_live(seq)
        if seq.restore is None:
            raise CheckpointError(f"pin: {seq!r} matched no checkpoint")
        receipt = self._checkpoints.pin(seq.restore.checkpoint)
        self._explicit[id(receipt)] = receipt
        return receipt

    def unpin(self, receipt: PinReceipt) -> None:
        """Consume a receipt from `pin`; a second use raises `PinError`."""
        if not isinstance(receipt, PinReceipt):
            raise InvalidType(f"unpin takes a PinReceipt, got {type(receipt).__name__}")
        if receipt.owner is not self or self._explicit.get(id(receipt)) is not receipt:
            if receipt.used and receipt.owner is self:
                raise PinError(f"unpin: {receipt!r} was already used")
            raise PinError(f"unpin: {receipt!r} was not issued by this cache's pin()")
        del self._explicit[id(receipt)]
        self._checkpoints.unpin(receipt)

    # ---------------------------------------------------------------- events

    def drain_events(self) -> list[Event]:
        """Return and forget the events emitted since the last drain."""
        events = self._events
        self._events = []
        replay(events, self._drained_view)
        return events

    # ------------------------------------------------------------ inspection

    def snapshot(self) -> Snapshot:
        """The whole cache as plain data (`spec.snapshot.Snapshot`)."""
        nodes: dict[int, NodeView] = {}
        checkpoints: dict[int, CheckpointView] = {}
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            nid = node.serial
            ck = node.checkpoint
            nodes[nid] = {
                "namespace": node.namespace,
                "parent": None if node.parent is None else node.parent.serial,
                "depth": node.depth,
                "key": None if node.block < 0 else (node.tokens, node.extra),
                "block": None if node.block < 0 else node.block,
                "children": [c.serial for c in node.children.values()],
                "state": node.state,
                "tick": node.tick,
                "serial": node.serial,
                "checkpoint": None if ck is None else ck.serial,
            }
            if ck is not None:
                checkpoints[ck.serial] = {
                    "anchor": nid,
                    "step": ck.step,
                    "tail": ck.tail,
                    "tail_extra": ck.tail_extra,
                    "slot": ck.slot,
                    "frozen_block": ck.frozen_block,
                    "pins": ck.pins,
                    "state": ck.state,
                    "tick": ck.tick,
                    "serial": ck.serial,
                }
            stack.extend(node.children.values())
        sequences: dict[int, SequenceView] = {}
        for sid, seq in self._live.items():
            sequences[sid] = {
                "namespace": seq.namespace,
                "tokens": tuple(seq.token_list),
                "extra": seq.extra,
                "blocks": list(seq.blocks),
                "path": [n.serial for n in seq.path],
                "num_cached_tokens": seq.num_cached_tokens,
                "num_committed_tokens": seq.num_committed_tokens,
                "restore_checkpoint": None
                if seq.restore is None
                else seq.restore.checkpoint.serial,
                "holds_match_pin": seq.match_receipt is not None,
            }
        copies: dict[int, CopyView] = {
            cid: {
                "kind": c.kind,
                "blocks": list(c.blocks),
                "pins": [r.checkpoint.serial for r in c.receipts],
                "done": c.done,
            }
            for cid, c in self._inflight.items()
        }
        return {
            "block_size": self._block_size,
            "capacity": self._kv.capacity,
            "free_blocks": self._kv.free_ids(),
            "refcounts": dict(enumerate(self._kv.refs)),
            "slot_capacity": self._slots.capacity,
            "free_slots": self._slots.free_ids(),
            "roots": {ns: r.serial for ns, r in self._roots.items()},
            "nodes": nodes,
            "checkpoints": checkpoints,
            "sequences": sequences,
            "copies": copies,
            "explicit_pins": [r.checkpoint.serial for r in self._explicit.values()],
            "evictable_index": [n.serial for n in self._evictable],
            "checkpoint_index": [c.serial for c in self._checkpoints.lru],
            "event_blocks": (
                replay(self._events, set(self._drained_view)) if self._events_on else None
            ),
            "stats": dict(self.stats.counters()),
        }

    def check(self) -> None:
        """Verify every spec invariant on the live structure; raises `InvariantViolation`."""
        invariants.check_all(self.snapshot())

    def __repr__(self) -> str:
        return (
            f"<BlockTrie B={self._block_size} blocks free={self.num_free_blocks} "
            f"cached={self.num_cached_blocks}/{self._kv.capacity} "
            f"slots free={self.num_free_checkpoint_slots}/{self._slots.capacity}>"
        )
