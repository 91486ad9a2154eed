"""Checkpoint placement policies: where a request saves SSM checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CODES", "DEFAULT_POLICY", "KV", "POLICY_NAMES", "CheckpointPolicy", "abbreviate"]

KV = "kv"
"""The policy name of an attention-only replay (no SSM checkpoints)."""

POLICY_NAMES: tuple[str, ...] = (
    "every-block",
    "every-n",
    "chunk-boundaries",
    "prompt-end",
    "branch-points",
    "decode-end",
    "spare-slots",
)
"""Checkpoint placements; combine them with '+' (e.g. ``branch-points+prompt-end``).
``spare-slots`` is a modifier: the periodic placements (every-block, every-n,
chunk-boundaries) only use free slots and never evict another checkpoint."""

DEFAULT_POLICY = "branch-points+prompt-end+decode-end+every-n"
"""The placement the planner uses unless told otherwise (the best in docs/replay.md)."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where a request saves SSM checkpoints (steps are token counts).

    - ``every-block``: every block boundary the prefill computes.
    - ``every-n``: every multiple of `interval` tokens the prefill computes.
    - ``chunk-boundaries``: the end of every `chunk`-token prefill chunk
      (counted from the cache hit) and the prompt end.
    - ``prompt-end``: the last block boundary of the prompt (where the KV a
      later request can reuse ends).
    - ``branch-points``: ``seq.branch_step``, where the request leaves the
      cached KV path; the next request sharing that prefix hits it.
    - ``decode-end``: the last block boundary decode crossed (the next turn of
      a conversation contains this request's output).
    - ``spare-slots`` (modifier): steps chosen only by the periodic placements
      are saved only while a slot is free, so they never evict a checkpoint.

    Only steps past the cache hit are saved: the state before it was never
    computed by this request.
    """

    parts: tuple[str, ...]
    interval: int = 128
    chunk: int = 2048

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a checkpoint policy needs at least one placement")
        for part in self.parts:
            if part not in POLICY_NAMES:
                raise ValueError(
                    f"unknown checkpoint placement {part!r} (choose from {', '.join(POLICY_NAMES)})"
                )
        if self.interval < 1 or self.chunk < 1:
            raise ValueError("checkpoint interval and chunk size must be >= 1 token")

    @classmethod
    def parse(cls, spec: str, interval: int = 128, chunk: int = 2048) -> CheckpointPolicy:
        """A policy from ``part[+part...]``, e.g. ``branch-points+prompt-end``."""
        pieces = [p.strip() for p in spec.split("+")]
        if any(not p for p in pieces):
            raise ValueError(f"empty placement in checkpoint policy {spec!r}")
        return cls(tuple(dict.fromkeys(pieces)), interval, chunk)

    @property
    def name(self) -> str:
        return "+".join(self.parts)

    @property
    def decode_end(self) -> bool:
        return "decode-end" in self.parts

    @property
    def spare_slots(self) -> bool:
        return "spare-slots" in self.parts

    def prefill_steps(
        self, prompt_len: int, hit: int, branch_step: int, block_size: int
    ) -> list[int]:
        """Sorted steps in ``(hit, prompt_len]`` to checkpoint during prefill."""
        return sorted(self.plan(prompt_len, hit, branch_step, block_size))

    def plan(
        self,
        prompt_len: int,
        hit: int,
        branch_step: int,
        block_size: int,
        known_branches: tuple[int, ...] = (),
    ) -> dict[int, bool]:
        """Steps in ``(hit, prompt_len]`` -> whether the step is essential.

        ``branch-points`` saves at `branch_step` (where the request left the cached
        path) and at each of `known_branches` (forks the workload knows of, e.g. a
        conversation tree's; `Request.branch_steps`).

        A step is essential unless only a periodic placement chose it and the
        policy has ``spare-slots`` (then it is saved only into a free slot).
        """
        b = block_size
        periodic: set[int] = set()
        essential: set[int] = set()
        for part in self.parts:
            if part == "every-block":
                periodic.update(range((hit // b + 1) * b, prompt_len + 1, b))
            elif part == "every-n":
                n = self.interval
                periodic.update(range((hit // n + 1) * n, prompt_len + 1, n))
            elif part == "chunk-boundaries":
                periodic.update(range(hit + self.chunk, prompt_len, self.chunk))
                periodic.add(prompt_len)
            elif part == "prompt-end":
                essential.add(prompt_len // b * b)
            elif part == "branch-points":
                essential.add(branch_step)
                essential.update(known_branches)
        if not self.spare_slots:
            essential |= periodic
        return {s: s in essential for s in essential | periodic if hit < s <= prompt_len}


CODES: dict[str, str] = {
    "every-block": "EB",
    "every-n": "N",
    "chunk-boundaries": "CB",
    "prompt-end": "PE",
    "branch-points": "BP",
    "decode-end": "DE",
    "spare-slots": "SS",
}
"""Short names of the placements, for tables and progress labels."""


def abbreviate(policy: str) -> str:
    """A short, unambiguous name: ``branch-points+prompt-end`` -> ``BP+PE``; kv -> ``KV``."""
    if policy == KV:
        return "KV"
    return "+".join(CODES.get(part, part) for part in policy.split("+"))
