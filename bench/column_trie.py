"""The dict trie's algorithm stored as columns: what issue 13's layout costs, measured.

`ColumnTrie` does exactly what `bench.baseline.DictTrie` does (same method
names, same LRU order, so the same replay drives both and their hits must
agree), with no Python object per cached block. A node *is* its block id and
lives in columns indexed by it:

- `tokens`: one `bytearray` of `block_size` native uint32 ids per block:
  exact keys, compared in place (`bytearray.startswith(key, start, end)`, no
  slice made);
- `parent`, `child` (its only child, `NO_CHILD`, or `MANY`), `refs`:
  `array("i")` columns;
- the children of a node with two or more, and of every namespace root, in
  one dict from a hash of (parent, key bytes) to the child (a list on a
  collision), always verified against `tokens`: a hash only narrows;
- the idle leaves, oldest first, in an `OrderedDict` of block ids.

It is a benchmark baseline, not a cache: no lifecycle table, no invariants,
no events, no checkpoints, no validation beyond token ids fitting 32 bits.
`bench.peers` runs it next to blocktrie and the dict trie, so each run shows
what the column layout alone costs in time and bytes per block (the floor a
column-stored `cache.BlockTrie` would start from; docs/architecture.md).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from bench.baseline import BaselineStats, DictTrieSequence, RefcountedBlocks

__all__ = ["MANY", "NO_CHILD", "ColumnTrie", "ColumnTrieSequence"]

NO_CHILD = -1
"""`child[p]` of a leaf."""
MANY = -2
"""`child[p]` of a node whose children are in the index."""


class ColumnTrieSequence(DictTrieSequence):
    """A request's view, plus its blocks' keys (packed once, carried to `commit`)."""

    __slots__ = ("keys",)

    def __init__(self, tokens: list[int], namespace: str) -> None:
        super().__init__(tokens, namespace)
        self.keys: list[bytes] = []


class ColumnTrie(RefcountedBlocks):
    """Refcounted blocks whose trie links and tokens are columns indexed by block id."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        if block_size < 1 or num_blocks < 0:
            raise ValueError(f"block_size >= 1 and num_blocks >= 0, got {block_size}, {num_blocks}")
        self.block_size = block_size
        self.capacity = num_blocks
        self._width = 4 * block_size  # bytes of one block's tokens
        self.free = array("i", range(num_blocks - 1, -1, -1))
        self.refs = array("i", bytes(4 * num_blocks))
        self.parent = array("i", bytes(4 * num_blocks))
        self.child = array("i", [NO_CHILD]) * num_blocks
        self.tokens = bytearray(self._width * num_blocks)
        self.index: dict[int, int | list[int]] = {}
        """hash((parent, key)) -> child, or the children sharing that hash."""
        self.fanout: dict[int, int] = {}
        """Children of each indexed parent (`MANY` nodes and roots)."""
        self.roots: dict[str, int] = {}
        """Namespace -> its root's id (below `MANY`: roots own no block)."""
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.cached = 0
        self.stats = BaselineStats()

    # ----------------------------------------------------------- the columns

    def _root(self, namespace: str) -> int:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = MANY - 1 - len(self.roots)
            self.fanout[root] = 0
        return root

    def _keys(self, tokens: list[int], n: int) -> list[bytes]:
        try:
            packed = array("I", tokens[: n * self.block_size]).tobytes()
        except OverflowError:
            raise ValueError("the column trie stores token ids below 2**32 only") from None
        w = self._width
        return [packed[i * w : i * w + w] for i in range(n)]

    def _holds(self, node: int, key: bytes) -> bool:
        at = node * self._width
        return self.tokens.startswith(key, at, at + self._width)

    def _find(self, parent: int, key: bytes) -> int:
        """The child of `parent` whose tokens are `key`, or `NO_CHILD`."""
        only = self.child[parent] if parent >= 0 else MANY
        if only >= 0:
            return only if self._holds(only, key) else NO_CHILD
        if only == NO_CHILD:
            return NO_CHILD
        hit = self.index.get(hash((parent, key)))
        if hit is None:
            return NO_CHILD
        if type(hit) is int:
            return hit if self._holds(hit, key) else NO_CHILD
        for node in hit:  # type: ignore[union-attr]
            if self._holds(node, key):
                return node
        return NO_CHILD

    def _key_of(self, node: int) -> bytes:
        at = node * self._width
        return bytes(self.tokens[at : at + self._width])

    def _index_add(self, parent: int, key: bytes, node: int) -> None:
        h = hash((parent, key))
        there = self.index.get(h)
        if there is None:
            self.index[h] = node
        elif type(there) is int:
            self.index[h] = [there, node]
        else:
            there.append(node)  # type: ignore[union-attr]

    def _index_remove(self, parent: int, key: bytes, node: int) -> None:
        h = hash((parent, key))
        there = self.index[h]
        if type(there) is int:
            del self.index[h]
            return
        there.remove(node)  # type: ignore[union-attr]
        if len(there) == 1:  # type: ignore[arg-type]
            self.index[h] = there[0]  # type: ignore[index]

    def _attach(self, parent: int, key: bytes, node: int) -> None:
        at = node * self._width
        self.tokens[at : at + self._width] = key
        self.parent[node] = parent
        self.child[node] = NO_CHILD
        only = self.child[parent] if parent >= 0 else MANY
        if only == NO_CHILD:
            self.child[parent] = node
            return
        if only >= 0:  # a second child: both go to the index
            self.child[parent] = MANY
            self._index_add(parent, self._key_of(only), only)
            self.fanout[parent] = 1
        self._index_add(parent, key, node)
        self.fanout[parent] += 1

    def _detach(self, node: int) -> int:
        """Unlink `node` from its parent; returns the parent."""
        parent = self.parent[node]
        if parent >= 0 and self.child[parent] == node:
            self.child[parent] = NO_CHILD
            return parent
        self._index_remove(parent, self._key_of(node), node)
        left = self.fanout[parent] - 1
        if parent >= 0 and left == 0:
            del self.fanout[parent]
            self.child[parent] = NO_CHILD
        else:
            self.fanout[parent] = left
        return parent

    # ------------------------------------------------------------------- API

    def match(self, tokens: list[int], namespace: str = "") -> ColumnTrieSequence:
        b = self.block_size
        toks = list(tokens)
        seq = ColumnTrieSequence(toks, namespace)
        full = len(toks) // b
        seq.keys = keys = self._keys(toks, full)
        node = self._root(namespace)
        usable = (len(toks) - 1) // b
        depth = 0
        refs = self.refs
        lru = self.lru
        find = self._find
        for i in range(full):
            child = find(node, keys[i])
            if child == NO_CHILD:
                break
            depth += 1
            node = child
            if i < usable:
                refs[child] += 1
                lru.pop(child, None)
                seq.path.append(child)
                seq.block_ids.append(child)
        seq.branch_step = depth * b
        seq.num_cached_tokens = seq.num_committed_tokens = len(seq.path) * b
        self.stats.query_tokens += len(toks)
        self.stats.hit_tokens += seq.num_cached_tokens
        return seq

    def commit(self, seq: ColumnTrieSequence, num_tokens: int) -> None:
        b = self.block_size
        refs = self.refs
        full = num_tokens // b
        if len(seq.keys) < full:  # tokens appended after match
            seq.keys = self._keys(seq.tokens, full)
        keys = seq.keys
        parent = seq.path[-1] if seq.path else self._root(seq.namespace)
        for i in range(len(seq.path), full):
            key = keys[i]
            child = self._find(parent, key)
            own = seq.block_ids[i]
            if child != NO_CHILD:
                refs[child] += 1
                self.lru.pop(child, None)
                refs[own] -= 1
                if refs[own] == 0:
                    self.free.append(own)
                seq.block_ids[i] = child
            else:
                if parent >= 0 and self.child[parent] == NO_CHILD:
                    self.lru.pop(parent, None)  # a leaf no more
                child = own
                self._attach(parent, key, child)
                refs[own] += 1
                self.cached += 1
            seq.path.append(child)
            parent = child
        seq.num_committed_tokens = num_tokens

    def _index_idle(self, path: list[int]) -> None:
        refs = self.refs
        lru = self.lru
        child = self.child
        for node in path:
            if refs[node] == 1 and child[node] == NO_CHILD:
                lru[node] = None
                lru.move_to_end(node)

    def evict(self, num_blocks: int) -> int:
        freed = 0
        lru = self.lru
        refs = self.refs
        child = self.child
        while freed < num_blocks and lru:
            node, _ = lru.popitem(last=False)
            parent = self._detach(node)
            refs[node] -= 1
            if refs[node] == 0:
                self.free.append(node)
                freed += 1
            self.cached -= 1
            if parent >= 0 and child[parent] == NO_CHILD and refs[parent] == 1:
                lru[parent] = None
                lru.move_to_end(parent, last=False)  # at least as old as its child
        self.stats.evicted_blocks += freed
        return freed
