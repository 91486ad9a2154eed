"""A plain dict-of-children prefix trie: the baseline the benchmark compares against.

It does the same work as `cache.BlockTrie` on the attention-only path (exact
block keys, reference counts, LRU eviction of idle leaves, deduplicating
commits) with nothing else: no lifecycle table, no invariants, no events, no
checkpoints, no validation. The same replay loop drives it (same method
names), so per-block costs are comparable.

`RefcountedBlocks` is what it shares with `bench.column_trie.ColumnTrie` (the
same algorithm stored as columns): the block pool and the request calls that
touch only the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import MutableSequence
from typing import Any

from spec.errors import OutOfBlocks

__all__ = ["BaselineStats", "DictTrie", "DictTrieSequence", "RefcountedBlocks"]


class _Node:
    __slots__ = ("block", "children", "key", "parent")

    def __init__(self, key: Any, parent: _Node | None, block: int) -> None:
        self.key = key
        self.parent = parent
        self.block = block
        self.children: dict[Any, _Node] = {}


class DictTrieSequence:
    """A request's view: tokens, block table, the trie path it holds."""

    __slots__ = (
        "block_ids",
        "branch_step",
        "namespace",
        "num_cached_tokens",
        "num_committed_tokens",
        "path",
        "restore",
        "tokens",
    )

    def __init__(self, tokens: list[int], namespace: str) -> None:
        self.tokens = tokens
        self.namespace = namespace
        self.block_ids: list[int] = []
        self.path: list[Any] = []  # the trie's nodes (objects, or ids in the column trie)
        self.num_cached_tokens = 0
        self.num_committed_tokens = 0
        self.branch_step = 0
        self.restore = None


class BaselineStats:
    """The counters a replay reads from a baseline trie."""

    __slots__ = ("evicted_blocks", "hit_tokens", "query_tokens")

    def __init__(self) -> None:
        self.evicted_blocks = 0
        self.hit_tokens = 0
        self.query_tokens = 0


class RefcountedBlocks:
    """What the baseline tries share: refcounted blocks taken from a free list, and
    the request calls that touch only them (`allocate`, `append`, `release`,
    `abort`). A subclass stores the trie: `match`, `commit`, `evict`, and `_drop`
    (give back a request's references and index the leaves it left idle)."""

    block_size: int
    free: MutableSequence[int]
    refs: MutableSequence[int]
    cached: int
    stats: BaselineStats

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_cached_blocks(self) -> int:
        return self.cached

    @property
    def num_free_checkpoint_slots(self) -> int:
        """No checkpoints: attention-only replays only."""
        return 0

    def save(self, seq: DictTrieSequence, num_tokens: int, runtime_state: Any) -> None:
        raise ValueError("the baseline trie keeps no SSM checkpoints (attention-only replays)")

    def restore(self, seq: DictTrieSequence, runtime_state: Any) -> None:
        raise ValueError("the baseline trie keeps no SSM checkpoints (attention-only replays)")

    def evict(self, num_blocks: int) -> int:
        raise NotImplementedError

    def _index_idle(self, path: list[Any]) -> None:
        raise NotImplementedError

    def append(self, seq: DictTrieSequence, tokens: list[int]) -> None:
        seq.tokens.extend(tokens)

    def allocate(self, seq: DictTrieSequence, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return
        short = need - len(self.free)
        if short > 0:
            self.evict(short)
            if len(self.free) < need:
                raise OutOfBlocks(f"need {need} blocks, {len(self.free)} free")
        free = self.free
        refs = self.refs
        for _ in range(need):
            block = free.pop()
            refs[block] = 1
            seq.block_ids.append(block)

    def _drop(self, seq: DictTrieSequence) -> None:
        refs = self.refs
        for block in seq.block_ids:
            refs[block] -= 1
            if refs[block] == 0:
                self.free.append(block)
        self._index_idle(seq.path)
        seq.block_ids = []
        seq.path = []

    def release(self, seq: DictTrieSequence) -> None:
        self._drop(seq)

    def abort(self, seq: DictTrieSequence) -> None:
        self.stats.hit_tokens -= seq.num_cached_tokens
        self.stats.query_tokens -= len(seq.tokens)
        self._drop(seq)

    def poll(self) -> int:
        return 0


class DictTrie(RefcountedBlocks):
    """Refcounted blocks, `dict` children keyed by block tokens, an `OrderedDict` LRU."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.capacity = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.refs: list[int] = [0] * num_blocks
        self.roots: dict[str, _Node] = {}
        self.lru: OrderedDict[_Node, None] = OrderedDict()  # idle leaves, oldest first
        self.cached = 0
        self.stats = BaselineStats()

    def _root(self, namespace: str) -> _Node:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = _Node(None, None, -1)
        return root

    def match(self, tokens: list[int], namespace: str = "") -> DictTrieSequence:
        b = self.block_size
        toks = list(tokens)
        seq = DictTrieSequence(toks, namespace)
        node = self._root(namespace)
        usable = (len(toks) - 1) // b
        depth = 0
        refs = self.refs
        lru = self.lru
        for i in range(len(toks) // b):
            child = node.children.get(tuple(toks[i * b : (i + 1) * b]))
            if child is None:
                break
            depth += 1
            node = child
            if i < usable:
                refs[child.block] += 1
                lru.pop(child, None)
                seq.path.append(child)
                seq.block_ids.append(child.block)
        seq.branch_step = depth * b
        seq.num_cached_tokens = seq.num_committed_tokens = len(seq.path) * b
        self.stats.query_tokens += len(toks)
        self.stats.hit_tokens += seq.num_cached_tokens
        return seq

    def commit(self, seq: DictTrieSequence, num_tokens: int) -> None:
        b = self.block_size
        refs = self.refs
        toks = seq.tokens
        parent = seq.path[-1] if seq.path else self._root(seq.namespace)
        for i in range(len(seq.path), num_tokens // b):
            key = tuple(toks[i * b : (i + 1) * b])
            child = parent.children.get(key)
            own = seq.block_ids[i]
            if child is not None:
                refs[child.block] += 1
                self.lru.pop(child, None)
                refs[own] -= 1
                if refs[own] == 0:
                    self.free.append(own)
                seq.block_ids[i] = child.block
            else:
                if not parent.children and parent.parent is not None:
                    self.lru.pop(parent, None)
                child = _Node(key, parent, own)
                parent.children[key] = child
                refs[own] += 1
                self.cached += 1
            seq.path.append(child)
            parent = child
        seq.num_committed_tokens = num_tokens

    def _index_idle(self, path: list[_Node]) -> None:
        refs = self.refs
        lru = self.lru
        for node in path:
            if refs[node.block] == 1 and not node.children:
                lru[node] = None
                lru.move_to_end(node)

    def evict(self, num_blocks: int) -> int:
        freed = 0
        lru = self.lru
        refs = self.refs
        while freed < num_blocks and lru:
            node, _ = lru.popitem(last=False)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            refs[node.block] -= 1
            if refs[node.block] == 0:
                self.free.append(node.block)
                freed += 1
            self.cached -= 1
            if parent.parent is not None and not parent.children and refs[parent.block] == 1:
                lru[parent] = None
                lru.move_to_end(parent, last=False)  # at least as old as its child
        self.stats.evicted_blocks += freed
        return freed
