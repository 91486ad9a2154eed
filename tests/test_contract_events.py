"""Contract details of `cache.events` (mutation survivors): the checkpoint events'
fields, and `replay` / `replay_views` applying events to the sets they are given."""

from __future__ import annotations

from cache.events import (
    CHECKPOINT_GROUP,
    KIND_MAMBA,
    KV_GROUP,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    checkpoint_removed,
    checkpoint_stored,
    replay,
    replay_views,
)


def test_checkpoint_removed_names_its_namespace_medium_and_group() -> None:
    assert checkpoint_removed((7, 8), (1, 2), "tenant") == BlockRemoved(
        (7, 8), (1, 2), "tenant", MEDIUM_GPU, CHECKPOINT_GROUP
    )
    event = checkpoint_removed((7,), (1,), "", medium=MEDIUM_CPU)
    assert (event.namespace, event.medium, event.group_idx) == ("", MEDIUM_CPU, CHECKPOINT_GROUP)


def test_checkpoint_stored_carries_every_field_in_the_checkpoint_group() -> None:
    event = checkpoint_stored(9, 3, 5, (1, 2), 4, "tenant")
    assert event == BlockStored(
        (9,), (3,), 5, (1, 2), 4, "tenant", MEDIUM_GPU, CHECKPOINT_GROUP, KIND_MAMBA, None
    )
    tagged = checkpoint_stored(9, 3, None, (1,), 4, "", extra_keys=("img",), medium=MEDIUM_CPU)
    assert tagged.extra_keys == (("img",),)
    assert (tagged.namespace, tagged.medium, tagged.parent_block_hash) == ("", MEDIUM_CPU, None)


def test_replay_applies_to_the_given_set_and_returns_it() -> None:
    """`replay(events, blocks)` updates `blocks` in place (stores add, removals drop)
    and returns that same set; without one it starts from a new empty set."""
    blocks = {1, 2}
    events = [BlockStored((9,), (3,), None, (5,), 1, ""), BlockRemoved((8,), (1,), "")]
    assert replay(events, blocks) is blocks
    assert blocks == {2, 3}
    assert replay(events) == {3}


def test_replay_views_applies_each_event_to_its_own_group_and_medium() -> None:
    """Each (group_idx, medium) view sees only its own stores and removals; events of a
    pair without a view are skipped; `AllBlocksCleared` empties every view."""
    kv, host, ckpt = {1}, {2}, {3}
    views = {
        (KV_GROUP, MEDIUM_GPU): kv,
        (KV_GROUP, MEDIUM_CPU): host,
        (CHECKPOINT_GROUP, MEDIUM_GPU): ckpt,
    }
    replay_views(
        [
            BlockStored((9,), (4,), None, (5,), 1, "", MEDIUM_CPU),
            BlockStored((9,), (5,), None, (5,), 1, "", MEDIUM_CPU, CHECKPOINT_GROUP),  # no view
            BlockRemoved((8,), (1,), ""),
            BlockRemoved((8,), (2, 4), "", MEDIUM_CPU, CHECKPOINT_GROUP),  # no view
            checkpoint_stored(7, 6, None, (5,), 1, ""),
        ],
        views,
    )
    assert (kv, host, ckpt) == (set(), {2, 4}, {3, 6})
    replay_views([AllBlocksCleared()], views)
    assert (kv, host, ckpt) == (set(), set(), set())
