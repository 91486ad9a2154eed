"""The event log: what the trie tells the outside world about its cached blocks.

Owns the list of emitted-but-undrained events and, for `check()`, the block set
that the drained events replayed to, so invariant 10 ("replaying the events
yields exactly the cached block set") can be checked at any time. When events
are disabled every `emit_*` is a no-op and nothing accumulates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, replay

if TYPE_CHECKING:
    from cache.node import Node


class EventLog:
    """Emitted events until drained. Single-threaded, like the trie that owns it."""

    __slots__ = ("_drained_view", "_events", "enabled")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[Event] = []
        self._drained_view: set[int] = set()

    def stored(self, nodes: Sequence[Node], block_size: int) -> None:
        """One `BlockStored` for a chain of nodes attached by one commit, parent first."""
        if not self.enabled or not nodes:
            return
        parent = nodes[0].parent
        self._events.append(
            BlockStored(
                block_hashes=tuple(nd.block_hash for nd in nodes),
                block_ids=tuple(nd.block for nd in nodes),
                parent_block_hash=(
                    None if parent is None or parent.block < 0 else parent.block_hash
                ),
                token_ids=tuple(t for nd in nodes for t in nd.tokens),
                block_size=block_size,
                namespace=nodes[0].namespace,
            )
        )

    def removed(self, nodes: Sequence[Node]) -> None:
        """One `BlockRemoved` per run of evicted nodes from the same namespace."""
        if not self.enabled or not nodes:
            return
        start = 0
        for i in range(1, len(nodes) + 1):
            if i == len(nodes) or nodes[i].namespace != nodes[start].namespace:
                run = nodes[start:i]
                self._events.append(
                    BlockRemoved(
                        tuple(nd.block_hash for nd in run),
                        tuple(nd.block for nd in run),
                        run[0].namespace,
                    )
                )
                start = i

    def cleared(self) -> None:
        """`AllBlocksCleared`: every cached block was dropped."""
        if self.enabled:
            self._events.append(AllBlocksCleared())

    def drain(self) -> list[Event]:
        """Return and forget the events emitted since the last drain."""
        events = self._events
        self._events = []
        replay(events, self._drained_view)
        return events

    def replayed_blocks(self) -> set[int] | None:
        """The block set all events so far replay to (None when events are off)."""
        if not self.enabled:
            return None
        return replay(self._events, set(self._drained_view))
