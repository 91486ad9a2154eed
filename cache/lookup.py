"""`Lookup`: what `match` finds in the trie and takes for the request ([R12]-[R14]).

`BlockTrie.match` takes its operation lock and calls `Lookup.match`, which
validates the request ([R1], [R57]), walks the namespace's tree for the
longest prefix of block keys cached ([R12]), bounds the hit ([R64], [R65]),
splits it at the host tier ([R50]) or ends it at the deepest matching
checkpoint (SSM, [R13]), and only then takes the references and the pin and
registers the live `Sequence` ([R6]). The walk inlines `NodeTable.child_of`
over the node table's columns: this is the hot path, one loop step per block.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable
from typing import TYPE_CHECKING

from cache.bounds import NO_SPANS, Spans, bounded_depth, hit_bounds
from cache.checkpoints import CheckpointStore
from cache.copies import Copy
from cache.eviction import Evictor
from cache.host_tier import HostTier
from cache.keys import request_keys, salted
from cache.kv_pool import KVBlockPool
from cache.node import MANY, NO_NODE, Checkpoint, Node, NodeTable, state_code
from cache.sequence import RestorePoint, Sequence
from cache.stats import CacheStats
from cache.validation import (
    U32,
    TokenIds,
    cache_salt_arg,
    extra_tuple,
    namespace_arg,
    token_list,
)
from spec.errors import InvalidArgument
from spec.lifecycle import NodeState

if TYPE_CHECKING:
    from cache.trie import BlockTrie

_EVICTABLE = state_code(NodeState.EVICTABLE.value)  # as `NodeTable.state` stores it


class Lookup:
    """The lookups of one `BlockTrie` (its parts, shared, not copied).

    `roots` and `live` are the trie's namespace roots (read here) and its
    registry of live sequences (each match adds one); `_seq_serial` numbers
    the sequences matches return.
    """

    def __init__(
        self,
        trie: BlockTrie,
        nodes: NodeTable,
        kv: KVBlockPool,
        host: HostTier | None,
        evictor: Evictor,
        checkpoints: CheckpointStore,
        roots: dict[str, Node],
        live: dict[int, Sequence],
        stats: CacheStats,
    ) -> None:
        self._trie = trie  # the owner of the sequences a match returns
        self._block_size = trie.config.block_size
        self._ssm = trie.config.ssm
        self._key_hash = trie.config.key_hash
        self._nodes = nodes
        self._kv = kv
        self._host = host
        self._evictor = evictor
        self._checkpoints = checkpoints
        self._roots = roots
        self._live = live
        self.stats = stats
        self._seq_serial = 0
        self._native = kv.native  # the native core's kernels, when the trie runs it
        self.fast = None
        """The native core's `FastLookup` (the whole of `match` for the usual request,
        else None), when the trie runs it without a host tier or SSM."""
        if self._native is not None and host is None and not self._ssm and self._key_hash is None:
            self.fast = self._native.FastLookup(
                nodes, kv.refs, roots, Sequence, array, U32, self._block_size
            )

    def match(
        self,
        tokens: TokenIds,
        namespace: str,
        extra: object,
        cache_salt: str | None,
        max_hit_tokens: int | None,
        atomic_spans: Spans | list[tuple[int, int]],
    ) -> Sequence:
        """`BlockTrie.match` past its lock: the live `Sequence` of the request's hit."""
        fast = self.fast
        if (
            fast is not None
            and extra is None
            and cache_salt is None
            and max_hit_tokens is None
            and atomic_spans is NO_SPANS
        ):
            seq = fast.match(
                tokens, namespace, self._trie, self.stats, self._live, self._evictor,
                self._seq_serial + 1,
            )  # fmt: skip
            if seq is not None:
                self._seq_serial += 1
                return seq  # type: ignore[no-any-return]
        toks = token_list(tokens)
        if not toks:
            raise InvalidArgument("match: tokens must hold at least one token")
        if type(namespace) is not str or not namespace.isascii():
            namespace = namespace_arg(namespace)  # [R57]: refused unless exactly a str
        ext = None if extra is None else extra_tuple(extra)  # [R57]: owned from here on
        if cache_salt is not None:
            salt = cache_salt_arg(cache_salt)  # [R57]
            if salt:
                ext = salted(ext, salt)  # [R70]
        bounded = max_hit_tokens is not None or atomic_spans is not NO_SPANS
        cap, spans = hit_bounds(max_hit_tokens, atomic_spans) if bounded else (None, ())
        size = self._block_size
        keys = request_keys(toks, ext, size, self._key_hash, 0, len(toks) // size)
        root = self._roots.get(namespace)
        path: list[Node] = []
        t = self._nodes
        if root is not None:  # [R12]: walk while a child with the exact key exists
            path = self._walk(root, keys, ext is None and self._key_hash is None)
        usable = min(len(path), (len(toks) - 1) // size)
        if bounded:  # [R64], [R65]; an SSM hit ends at a checkpoint: spans checked there
            usable = bounded_depth(usable, size, cap, NO_SPANS if self._ssm else spans)
        ck: Checkpoint | None = None
        host_nodes: list[Node] = []
        waits: list[Copy] = []
        waiting = 0
        if not self._ssm:
            depth = usable
            hit = usable * size
            if self._host is not None:
                depth, host_nodes, waits, waiting = self._host.split(path, usable)
                if bounded and depth + len(host_nodes) < usable:  # a failed load cut it
                    usable = bounded_depth(depth + len(host_nodes), size, cap, spans)
                    depth, host_nodes, waits, waiting = self._host.split(path, usable)
                hit = (depth + len(host_nodes)) * size  # shorter past a failed load
        else:
            if root is not None and t.checkpoint:
                ck = CheckpointStore.deepest_match(
                    t.checkpoint, root, path, toks, ext, usable, size, cap, spans
                )
            depth = ck.step // size if ck is not None else 0
            hit = ck.step if ck is not None else 0

        self._seq_serial += 1
        seq = Sequence(self._trie, self._seq_serial, toks, namespace, ext)
        seq.keys = keys
        seq.branch_step = len(path) * size
        held = path[:depth]
        if self._native is not None:
            blocks, idle = self._native.hold_path(held, t.block, t.state, self._kv.refs)
            for node in idle:
                self._evictor.settle(node)
        else:
            block = t.block
            blocks = [block[node] for node in held]
            self._kv.incref_all(blocks)
            state = t.state
            for node in held:
                if state[node] == _EVICTABLE:
                    self._evictor.settle(node)
        seq.path = held
        seq.blocks = blocks
        if host_nodes or waits:  # [R50]
            self._host.pin(host_nodes)  # type: ignore[union-attr]
            seq.host_path = host_nodes
            seq.loads = waits
            seq.num_host_tokens = (len(host_nodes) + waiting) * size
            self.stats.host_hit_tokens += seq.num_host_tokens
        if ck is not None:
            seq.match_receipt = self._checkpoints.pin(ck)
            seq.restore = RestorePoint(ck)
            self.stats.checkpoint_hits += 1
        seq.num_cached_tokens = hit
        seq.num_committed_tokens = hit
        seq.query_tokens = len(toks)
        stats = self.stats  # [R14]
        stats.queries += 1
        stats.query_tokens += len(toks)
        stats.hit_tokens += hit
        stats.recent.append((seq.serial, len(toks), hit))  # [R69]
        self._live[seq.serial] = seq
        return seq

    def _walk(self, root: Node, keys: list[Hashable], plain: bool) -> list[Node]:
        """The nodes under `root` whose keys are `keys`' leading ones, in order ([R12]):
        walks while a child with the exact key exists. `plain`: every key is bytes
        (no extra identity, no injected key hash)."""
        t = self._nodes
        only_child = t.child
        kids = t.kids
        width = t.width
        wide = t.wide
        holds = t.tokens.startswith  # `holds(key, at, at + width)`: row's tokens == key
        path: list[Node] = []
        node = root
        if plain and not wide:  # the usual case: every key and every node is bytes
            if self._native is not None:
                return self._native.walk(keys, root, only_child, t.tokens, kids, width)  # type: ignore[no-any-return]
            for key in keys:
                child = only_child[node]  # `NodeTable.child_of`, inlined
                if child >= 0:
                    at = child * width
                    if not holds(key, at, at + width):  # type: ignore[arg-type]
                        break
                elif child == MANY:
                    child = kids[node].get(key, NO_NODE)
                    if child < 0:
                        break
                else:
                    break
                path.append(child)
                node = child
            return path
        for key in keys:
            child = t.child_of(node, key)
            if child < 0:
                break
            path.append(child)
            node = child
        return path
