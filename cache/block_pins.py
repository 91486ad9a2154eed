"""KV pins without a request ([R66], [R67]): cached blocks pinned by the hash that
events published for them.

A router, or the prefill side of a disaggregated deployment, names blocks by
the hash it saw in a `BlockStored` event, not by a request. `BlockPins` owns

- the receipts (`BlockPinReceipt`) of `BlockTrie.pin_blocks`: each holds one
  reference on the device block of every node it pinned, exactly as a
  request's block table does, so the node is held (`cached`: never
  evictable, nor its ancestors) and reference conservation (invariant 1)
  counts the receipt as a holder;
- the index from published hash to node that finds those nodes. It is built
  on the first `pin_blocks` (one pass over the nodes) and from then on every
  commit adds the nodes it attaches (`added`); until then nothing on the hot
  path pays for it. Entries are never removed: a lookup checks that the row
  still holds an attached node of that namespace and hash, so an entry left
  by an evicted node is only skipped, and the index is rebuilt when its
  entries outnumber twice the rows in use.

Hashes are the ones events carry, so pinning by hash needs
`CacheConfig(enable_events=True)` (`ConfigError` otherwise): computing a
node's chained hash on demand would hash its whole path, for every node a
lookup might find. It must not evict anything or touch sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cache.block_hash import MASK64
from cache.kv_pool import KVBlockPool
from cache.node import NO_BLOCK, NO_NODE, Node, NodeTable
from spec.errors import ConfigError, InvalidArgument, InvalidType
from spec.lifecycle import RECEIPT, ReceiptState, ReceiptTrigger


class BlockPinReceipt:
    """The single-use receipt of `BlockTrie.pin_blocks` (redeem with `unpin_blocks`).

    `pinned`: how many cached blocks it pins (hashes of blocks not cached on
    the device were skipped). `state` follows `spec.lifecycle.RECEIPT`:
    `issued` while its pins hold, `redeemed` once dropped (terminal).
    """

    __slots__ = ("blocks", "owner", "state")

    def __init__(self, owner: object, blocks: list[int]) -> None:
        self.owner = owner
        self.blocks = blocks
        """The device blocks it holds a reference on, one each."""
        self.state: str = ReceiptState.ISSUED.value

    @property
    def pinned(self) -> int:
        """How many cached blocks this receipt pins."""
        return len(self.blocks)

    @property
    def used(self) -> bool:
        """Whether the receipt was redeemed (its pins dropped)."""
        return self.state == ReceiptState.REDEEMED.value

    def __repr__(self) -> str:
        return f"<BlockPinReceipt pinned={len(self.blocks)}{' used' if self.used else ''}>"


def block_hashes_arg(block_hashes: object) -> list[int]:
    """Validate `pin_blocks`' hashes ([R1]): a list or tuple of ints (not bool), none
    negative; returns their wire values (low 64 bits: `cache.block_hash.to_wire`), so
    a `vllm` scheme's full digest, as `BlockStored` carries it in Python, names the
    same block as the 64-bit value on the wire."""
    if not isinstance(block_hashes, (list, tuple)):
        raise InvalidType(
            f"block_hashes must be a list or tuple of ints, got {type(block_hashes).__name__}"
        )
    for h in block_hashes:
        if isinstance(h, bool) or not isinstance(h, int):
            raise InvalidType(f"block_hashes must hold ints, got {type(h).__name__}")
    for h in block_hashes:
        if h < 0:
            raise InvalidArgument(f"a block hash is never negative, got {h}")
    return [h & MASK64 for h in block_hashes]


class BlockPins:
    """Outstanding `pin_blocks` receipts and the hash -> node index they are found by."""

    __slots__ = (
        "_entries",
        "_index",
        "_kv",
        "_nodes",
        "_settle",
        "_settle_block",
        "enabled",
        "receipts",
    )

    def __init__(
        self,
        nodes: NodeTable,
        kv: KVBlockPool,
        settle: Callable[[Node], None],
        settle_block: Callable[[int], None],
        enabled: bool,
    ) -> None:
        self._nodes = nodes
        self._kv = kv
        self._settle = settle
        self._settle_block = settle_block
        self.enabled = enabled
        """Whether nodes carry their published hashes (events on)."""
        self.receipts: dict[int, BlockPinReceipt] = {}
        """Outstanding receipts by id (snapshots list their blocks)."""
        self._index: dict[str, dict[int, Node]] | None = None
        self._entries = 0

    # ------------------------------------------------------------ the index

    @property
    def indexing(self) -> bool:
        """Whether commits must report the nodes they attach (`added`)."""
        return self._index is not None

    def added(self, namespace: str, hashes: Sequence[int], nodes: Sequence[Node]) -> None:
        """A commit attached `nodes`, whose chained hashes are `hashes`."""
        index = self._index
        if index is None:
            return
        by_hash = index.get(namespace)
        if by_hash is None:
            by_hash = index[namespace] = {}
        before = len(by_hash)
        for h, node in zip(hashes, nodes, strict=True):
            by_hash[h & MASK64] = node
        self._entries += len(by_hash) - before

    def _lookup(self, namespace: str) -> dict[int, Node]:
        """The namespace's hash -> node map, built (or rebuilt, when stale entries
        have piled up) over every attached node in one pass."""
        t = self._nodes
        index = self._index
        if index is None or self._entries > 2 * (t.fresh - len(t.free_rows)) + 64:
            index = {}
            parent = t.parent
            for node in t.used():
                if parent[node] != NO_NODE:  # not a root
                    index.setdefault(t.namespace_of(node), {})[t.block_hash[node] & MASK64] = node
            self._index = index
            self._entries = sum(len(d) for d in index.values())
        return index.get(namespace, {})

    # ------------------------------------------------------------ pins

    def pin(self, owner: object, block_hashes: list[int], namespace: str) -> BlockPinReceipt:
        """Pin the device block of each attached node of `namespace` whose published hash
        is in `block_hashes` (each once; others skipped) ([R66])."""
        if not self.enabled:
            raise ConfigError(
                "pin_blocks: blocks are named by the hashes events publish; build the cache "
                "with CacheConfig(enable_events=True)"
            )
        by_hash = self._lookup(namespace)
        t = self._nodes
        blocks: list[int] = []
        nodes: list[Node] = []
        seen: set[Node] = set()
        for h in block_hashes:
            node = by_hash.get(h, NO_NODE)
            if node == NO_NODE or node in seen:
                continue
            if (
                t.parent[node] == NO_NODE  # evicted since it was indexed
                or t.block_hash[node] & MASK64 != h
                or t.namespace_of(node) != namespace
                or t.block[node] == NO_BLOCK  # host-only: nothing on the device to pin
            ):
                continue
            seen.add(node)
            nodes.append(node)
            blocks.append(t.block[node])
        self._kv.incref_all(blocks)
        for node in nodes:
            self._settle(node)  # held now: out of the eviction index
        receipt = BlockPinReceipt(owner, blocks)
        self.receipts[id(receipt)] = receipt
        return receipt

    def unpin(self, receipt: BlockPinReceipt) -> None:
        """Redeem `receipt`, an outstanding one ([R67]): drop its references."""
        receipt.state = RECEIPT.step(ReceiptTrigger.REDEEM, receipt.state, receipt)
        del self.receipts[id(receipt)]
        self._kv.decref_all(receipt.blocks)
        for block in receipt.blocks:
            self._settle_block(block)  # its node may be evictable again

    def held_blocks(self) -> list[int]:
        """Every block an outstanding receipt holds, once per receipt (for snapshots)."""
        return [b for r in self.receipts.values() for b in r.blocks]
