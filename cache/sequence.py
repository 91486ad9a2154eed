"""A request's view of the cache, its restore point, and pin receipts."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from spec.errors import InvalidType, PinError
from spec.lifecycle import ReceiptState

if TYPE_CHECKING:
    from cache.copies import Copy
    from cache.node import Checkpoint, Node


class RestorePoint:
    """What a match found to restore from: the checkpoint after `step` tokens."""

    __slots__ = ("checkpoint", "step")

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.step = checkpoint.step

    @property
    def partial(self) -> bool:
        """Whether the step is inside a block (a frozen tail is restored too)."""
        return bool(self.checkpoint.tail)

    def __repr__(self) -> str:
        return f"<RestorePoint step={self.step}>"


class PinReceipt:
    """A single-use receipt for one pin on one checkpoint (`BlockTrie.unpin`).

    `state` follows `spec.lifecycle.RECEIPT`: `issued` while its pin is
    counted, `redeemed` once dropped (terminal).
    """

    __slots__ = ("checkpoint", "owner", "state")

    def __init__(self, owner: object, checkpoint: Checkpoint) -> None:
        self.owner = owner
        self.checkpoint = checkpoint
        self.state: str = ReceiptState.ISSUED.value

    @property
    def used(self) -> bool:
        """Whether the receipt was redeemed (its pin dropped)."""
        return self.state == ReceiptState.REDEEMED.value

    @property
    def step(self) -> int:
        """The pinned checkpoint's step."""
        return self.checkpoint.step

    def __repr__(self) -> str:
        return f"<PinReceipt step={self.checkpoint.step}{' used' if self.used else ''}>"


def check_redeemable(
    receipt: object,
    kind: type,
    owner: object,
    outstanding: dict[int, Any],
    issuer: Callable[..., object],
) -> None:
    """Raise unless `receipt` is a `kind` receipt that `owner`'s `issuer` (its `pin` or
    `pin_blocks`) gave and `outstanding` (by id) still holds: `InvalidType` for another
    type, `PinError` for one already redeemed or not `owner`'s (single use: [R3],
    [R40], [R67]). Errors name the redeeming call, `un` + the issuer's name."""
    operation = f"un{issuer.__name__}"
    if not isinstance(receipt, kind):
        raise InvalidType(f"{operation} takes a {kind.__name__}, got {type(receipt).__name__}")
    mine = getattr(receipt, "owner", None) is owner
    if not mine or outstanding.get(id(receipt)) is not receipt:
        if mine and getattr(receipt, "used", False):
            raise PinError(f"{operation}: {receipt!r} was already used")
        raise PinError(
            f"{operation}: {receipt!r} was not issued by this cache's {issuer.__name__}()"
        )


class Sequence:
    """One request: its tokens, block table, cache hit and what it holds.

    Read-only to users; every change goes through the `BlockTrie` that made it.

    - `tokens`: the token ids so far (prompt, then appended decode tokens);
      the trie keeps them in `token_list`, a uint32 or uint64 `array`.
    - `num_cached_tokens`: how many leading tokens the match served.
    - `block_ids`: the block table; covers the first `len(block_ids) * B` tokens.
    - `restore`: None, or the `RestorePoint` to restore SSM state from.
    - `branch_step`: where the request leaves the cached KV path.
    - `num_committed_tokens`: tokens whose KV is committed.
    - `num_host_tokens`: with a host tier, how much of the hit was not on the
      device when matched: it must be loaded before prefill (`BlockTrie.load`).
    """

    __slots__ = (
        "_tokens_view",
        "blocks",
        "branch_step",
        "extra",
        "host_path",
        "keys",
        "live",
        "load_failed",
        "loads",
        "match_receipt",
        "namespace",
        "num_cached_tokens",
        "num_committed_tokens",
        "num_host_tokens",
        "owner",
        "path",
        "query_tokens",
        "restore",
        "restored",
        "serial",
        "token_list",
    )

    def __init__(
        self,
        owner: object,
        serial: int,
        tokens: array[int],
        namespace: str,
        extra: tuple[Hashable, ...] | None,
    ) -> None:
        self.owner = owner
        self.serial = serial
        self.token_list = tokens
        self._tokens_view: tuple[int, ...] | None = None
        self.namespace = namespace
        self.extra = extra
        self.blocks: list[int] = []
        self.keys: list[Hashable] = []  # block keys built by match, extended by commit
        self.path: list[Node] = []
        self.num_cached_tokens = 0
        self.num_committed_tokens = 0
        self.query_tokens = 0
        self.branch_step = 0
        self.restore: RestorePoint | None = None
        self.match_receipt: PinReceipt | None = None
        self.restored = False
        self.live = True
        self.num_host_tokens = 0
        self.host_path: list[Node] = []  # matched host-only nodes, not yet loaded
        self.loads: list[Copy] = []  # load copies its block table waits on
        self.load_failed = False

    @property
    def tokens(self) -> tuple[int, ...]:
        """The sequence's token ids."""
        view = self._tokens_view
        if view is None or len(view) != len(self.token_list):
            view = self._tokens_view = tuple(self.token_list)
        return view

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The block table: block ids covering the leading tokens (a copy)."""
        return tuple(self.blocks)

    @property
    def num_blocks(self) -> int:
        """Entries in the block table, without copying it."""
        return len(self.blocks)

    def __len__(self) -> int:
        return len(self.token_list)

    def __repr__(self) -> str:
        status = "live" if self.live else "done"
        return (
            f"<Sequence #{self.serial} {status} tokens={len(self.token_list)} "
            f"cached={self.num_cached_tokens} blocks={len(self.blocks)}>"
        )
