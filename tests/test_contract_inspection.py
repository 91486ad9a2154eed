"""Contract details of `cache.inspection` (mutation survivors): the snapshot's event views."""

from __future__ import annotations

import pytest

from tests.helpers import kv_trie, serve, ssm_trie, state

pytest.importorskip("xxhash")  # events on: the block hasher needs the `events` extra


def test_snapshot_carries_the_slots_checkpoint_events_replay_to() -> None:
    trie, _ = ssm_trie(num_blocks=16, slots=2)
    seq = trie.match([1, 2, 3, 4, 5, 6])
    trie.allocate(seq, 6)
    trie.commit(seq, 6)
    trie.save(seq, 6, state(1.0))
    ck = trie._nodes.checkpoint.get(seq.path[0])
    assert ck is not None
    slot = ck.slot
    assert trie.snapshot()["event_checkpoint_slots"] == {slot}
    trie.drain_events()
    assert trie.snapshot()["event_checkpoint_slots"] == {slot}


def test_snapshot_event_views_are_none_with_events_off() -> None:
    trie = kv_trie(enable_events=False)
    serve(trie, [1, 2, 3, 4])
    snap = trie.snapshot()
    assert snap["event_blocks"] is None
    assert snap["event_checkpoint_slots"] is None
