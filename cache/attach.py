"""`Attach`: what `commit` attaches to the trie ([R7], [R18], [R19]), and namespace roots.

`BlockTrie.commit` takes its operation lock and checks the sequence is live,
then calls `Attach.commit`, which validates the count, waits on no load
([R50]), ticks the clock, and walks the request's committed blocks under its
path: a block equal to a cached child is deduplicated ([R18]), one whose node
lives only on the host is adopted ([R49]), and the first new one starts a
chain of new nodes, attached at once with their events ([R19]). `root`
creates a namespace's root on first use ([R11]), for commits and saves.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from cache.block_pins import BlockPins
from cache.event_log import EventLog
from cache.eviction import Evictor
from cache.host_tier import HostTier
from cache.keys import request_keys
from cache.kv_pool import KVBlockPool
from cache.native import xxh3_address
from cache.node import MANY, NO_BLOCK, NO_NODE, Node, NodeTable, state_code
from cache.offload import Offload, refuse_unloaded
from cache.sequence import Sequence
from cache.validation import U32, int_arg
from spec.errors import InvalidArgument
from spec.lifecycle import NodeState

if TYPE_CHECKING:
    from cache.trie import BlockTrie

_CACHED = NodeState.CACHED.value
_CACHED_CODE = state_code(_CACHED)
_ROOT = NodeState.ROOT.value


class Attach:
    """The commits of one `BlockTrie` (its parts, shared, not copied).

    `roots` is the trie's map of namespace roots (`root` adds to it); the
    trie keeps the logical clock, which `commit` ticks; `_node_serial`
    numbers the nodes attached.
    """

    def __init__(
        self,
        trie: BlockTrie,
        nodes: NodeTable,
        kv: KVBlockPool,
        host: HostTier | None,
        evictor: Evictor,
        events: EventLog,
        block_pins: BlockPins,
        offload: Offload,
        roots: dict[str, Node],
        write_back: bool,
    ) -> None:
        self._trie = trie  # its logical clock
        self._block_size = trie.config.block_size
        self._key_hash = trie.config.key_hash
        self._nodes = nodes
        self._kv = kv
        self._host = host
        self._evictor = evictor
        self._events = events
        self._block_pins = block_pins
        self._offload = offload
        self._roots = roots
        self._write_back = write_back
        self._node_serial = 0
        self.fast = None
        """The native core's `FastAttach` (the whole of `BlockTrie.commit` for the usual
        commit), when the trie runs it without a host tier or key hash, with events off
        or on the `xxh3` scheme (hashed by xxhash's own C function)."""
        native = kv.native
        if native is not None and host is None and self._key_hash is None:
            # events on: the plain xxh3 chain, hashed by xxhash's own C function
            xxh3 = xxh3_address() if events.plain_digest is not None else 0
            if not events.enabled or xxh3:
                self.fast = native.FastAttach(
                    nodes, kv.refs, kv._free, evictor.owner, Sequence, U32, self._block_size,
                    _CACHED_CODE, events if events.enabled else None, xxh3,
                )  # fmt: skip

    def namespace_root(self, namespace: str) -> Node:
        """The namespace's root, created on first use ([R11])."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._nodes.new(
                NO_NODE,
                None,  # a root has no key and owns no block; its state is `root`
                NO_BLOCK,
                -1 - len(self._roots),
                0,
                self._events.root_hash(namespace),
                _ROOT,
                namespace,
            )
            self._roots[namespace] = root
        return root

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """`BlockTrie.commit` past its checks (`seq` is live)."""
        n = int_arg("num_tokens", num_tokens)
        if seq.host_path or seq.load_failed:
            refuse_unloaded("commit", seq)
        size = self._block_size
        covered = min(len(seq.token_list), len(seq.blocks) * size)
        if not seq.num_committed_tokens <= n <= covered:
            raise InvalidArgument(
                f"commit: num_tokens={n} must be in {seq.num_committed_tokens}..{covered} "
                f"(committed so far .. allocated and known tokens) for {seq!r}"
            )
        full = n // size
        path = seq.path
        start = len(path)
        keys = seq.keys
        if len(keys) < full:  # blocks completed by tokens appended after match
            ext = seq.extra
            keys.extend(request_keys(seq.token_list, ext, size, self._key_hash, len(keys), full))
        host = self._host
        if host is not None and start < full:
            self._offload.check_loads_done(seq, keys, start, full)
        self._trie._clock += 1  # [R7]
        tick = self._trie._clock
        if start >= full:
            seq.num_committed_tokens = n
            return
        parent = path[-1] if path else self.namespace_root(seq.namespace)
        plain = seq.extra is None and self._key_hash is None
        kv = self._kv
        t = self._nodes
        only_child = t.child
        block_of = t.block
        tokens = t.tokens
        width = t.width
        wide = t.wide
        stored: list[Node] = []
        for i in range(start, full):
            key = keys[i]
            child = only_child[parent]  # `NodeTable.child_of`, inlined
            if child >= 0:
                if wide and child in wide:
                    if wide[child] != key:
                        child = NO_NODE
                elif type(key) is not bytes or not tokens.startswith(
                    key, child * width, child * width + width
                ):
                    child = NO_NODE
            elif child == MANY:
                child = t.kids[parent].get(key, NO_NODE)
            if child < 0:  # [R19]: this block and every later one are new
                # (a new node has no children): hash them, then attach them as
                # one chain under `parent`
                events = self._events
                hashes = None
                parent_hash = 0
                if events.hasher is not None:  # events on (else `block_hash` is
                    # a `Constant`, whose reads cost a Python call)
                    parent_hash = t.block_hash[parent]
                    hashes = events.chain_hashes(parent_hash, keys, i, full, plain, seq.namespace)
                stored = self._attach_chain(parent, keys, i, full, seq.blocks, tick, hashes)
                path.extend(stored)
                if hashes is not None:
                    if self._block_pins.indexing:  # [R66]: findable by hash
                        self._block_pins.added(seq.namespace, hashes, stored)
                    under_root = t.is_root(parent)
                    events.stored(
                        None if under_root else parent_hash,
                        hashes,
                        keys,
                        seq.blocks,
                        i,
                        full,
                        size,
                        seq.namespace,
                    )
                break
            if block_of[child] == NO_BLOCK:  # [R49]
                self._offload.adopt(child, seq.blocks[i], tick)
            else:  # [R18]
                own = seq.blocks[i]
                cached = block_of[child]
                kv.incref(cached)
                seq.blocks[i] = cached
                kv.decref(own)
                self._evictor.settle(child)
                t.tick[child] = tick  # [R8]
            path.append(child)
            parent = child
        seq.num_committed_tokens = n
        if host is not None and stored and not self._write_back:
            self._offload.store(stored)

    def _attach_chain(
        self,
        parent: Node,
        keys: list[Hashable],
        start: int,
        stop: int,
        blocks: list[int],
        tick: int,
        hashes: list[int] | None,
    ) -> list[Node]:
        """Attach blocks `start..stop-1` of a commit (keys and blocks from the
        request's) as a chain of new nodes under `parent`, each the only child of
        the one before; returns them, parent first. Each takes the trie's
        reference on its block and starts `cached` (the request holds its block).

        No state changes: the parent is a root or on the committing sequence's
        path (held, so `cached` or `pinned` with or without children).
        """
        chain = blocks[start:stop]
        serial = self._node_serial
        t = self._nodes
        native = self._kv.native
        if native is not None and (hashes is None or len(hashes) == len(chain)):
            # [R19] one native call: the rows, their trie references and owners (None
            # when a key is not plain bytes: then the Python path below)
            rows: list[Node] | None = native.attach_chain(
                t, parent, keys, start, chain, serial + 1, tick, _CACHED_CODE,
                self._evictor.owner, self._kv.refs,
            )  # fmt: skip
            if rows is not None:
                if hashes is not None:
                    block_hash = t.block_hash
                    for j, node in enumerate(rows):
                        block_hash[node] = hashes[j]
                t.attach_child(parent, keys[start], rows[0])
                self._node_serial += stop - start
                self._evictor.num_cached += len(rows)
                return rows
        nodes = self._nodes.new_chain(
            parent,
            keys,
            start,
            chain,
            serial + 1,
            tick,
            hashes,
            _CACHED,
        )
        self._node_serial += stop - start
        self._kv.incref_all(chain)  # held by the request: cannot fail
        self._evictor.adopt_all(nodes, chain)
        return nodes
