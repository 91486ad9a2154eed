"""Contract details of `cache.events` (mutation survivors): the checkpoint events' fields."""

from __future__ import annotations

from cache.events import (
    CHECKPOINT_GROUP,
    KIND_MAMBA,
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    checkpoint_removed,
    checkpoint_stored,
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
