"""Contract details of `cache.event_log` (mutation survivors).

The checkpoint slots that events replay to include the events already drained
(invariant 10 holds after a drain), and a dropped checkpoint's `BlockRemoved`
names its anchor's namespace.
"""

from __future__ import annotations

from cache.events import CHECKPOINT_GROUP, BlockRemoved, BlockStored
from tests.helpers import ssm_trie, state


def test_drained_checkpoint_events_still_count_and_removal_names_the_namespace() -> None:
    trie, copies = ssm_trie(num_blocks=16, slots=2)
    assert copies is not None
    seq = trie.match([1, 2, 3, 4, 5, 6], namespace="tenant")
    trie.allocate(seq, 6)
    trie.commit(seq, 6)
    trie.save(seq, 4, state(1.0))
    stored = [
        e
        for e in trie.drain_events()
        if isinstance(e, BlockStored) and e.group_idx == CHECKPOINT_GROUP
    ]
    assert [e.namespace for e in stored] == ["tenant"]
    (slot,) = stored[0].block_ids
    assert trie._events.replayed_checkpoint_slots() == {slot}
    trie.check()
    copies.complete_all()
    trie.poll()
    trie.release(seq)
    assert trie.evict_checkpoints(1) == 1
    removed = [e for e in trie.drain_events() if isinstance(e, BlockRemoved)]
    assert [(e.namespace, e.group_idx, e.block_ids) for e in removed] == [
        ("tenant", CHECKPOINT_GROUP, (slot,))
    ]
    assert trie._events.replayed_checkpoint_slots() == set()
    trie.check()
