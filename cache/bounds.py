"""Bounded matches ([R64], [R65]): the arguments that cap where a hit may end.

`match(..., max_hit_tokens=None, atomic_spans=())` lets a scheduler bound the
hit: vLLM asks for no hit at all for a prompt-logprobs request
(`max_hit_tokens=0`), and lmdeploy never splits a multimodal item between
the cached prefix and the computed part (`atomic_spans`). The hit is then the
deepest candidate (a block boundary, or for SSM a matchable checkpoint's
step) that is at most `max_hit_tokens` and ends inside no span. Cutting a hit
back to the start of the span it ends inside, then down to a candidate, and
again while it ends inside one, reaches that same candidate: no candidate
between a span's start and the cut hit can end outside that span.
"""

from __future__ import annotations

from spec.errors import InvalidArgument, InvalidType

Spans = tuple[tuple[int, int], ...]
"""`(start, end)` token ranges, `0 <= start < end`."""

NO_SPANS: Spans = ()
"""`match`'s default: no span (compared by identity, so the default costs no check)."""


def hit_bounds(max_hit_tokens: object, atomic_spans: object) -> tuple[int | None, Spans]:
    """Validate `match`'s bounds ([R1], [R2]: `max_hit_tokens` first, then the spans in
    order); returns them as an int (or None) and a tuple of int pairs.

    `max_hit_tokens`: None or an int (not bool) >= 0. `atomic_spans`: a list or
    tuple of `(start, end)` pairs (lists or tuples) of ints with `0 <= start <
    end`; a span may reach past the tokens. Raises `InvalidType` /
    `InvalidArgument` naming the offending value.
    """
    cap: int | None = None
    if max_hit_tokens is not None:
        if isinstance(max_hit_tokens, bool) or not isinstance(max_hit_tokens, int):
            raise InvalidType(
                f"max_hit_tokens must be None or an int, got {type(max_hit_tokens).__name__}"
            )
        if max_hit_tokens < 0:
            raise InvalidArgument(f"max_hit_tokens must be >= 0, got {max_hit_tokens}")
        cap = max_hit_tokens
    if not isinstance(atomic_spans, (list, tuple)):
        raise InvalidType(
            f"atomic_spans must be a list or tuple of (start, end) pairs, "
            f"got {type(atomic_spans).__name__}"
        )
    spans: list[tuple[int, int]] = []
    for i, span in enumerate(atomic_spans):
        if not isinstance(span, (list, tuple)) or len(span) != 2:
            raise InvalidType(f"atomic_spans[{i}] must be a (start, end) pair, got {span!r}")
        start, end = span
        for value in (start, end):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidType(
                    f"atomic_spans[{i}] must hold ints, got {type(value).__name__} in {span!r}"
                )
        if not 0 <= start < end:
            raise InvalidArgument(f"atomic_spans[{i}] must have 0 <= start < end, got {span!r}")
        spans.append((start, end))
    return cap, tuple(spans)


def span_start(spans: Spans, end: int) -> int:
    """The start of a span that a hit of `end` tokens would end inside (`start < end <
    stop`: part of the span cached, part not); -1 when it ends inside none."""
    for start, stop in spans:
        if start < end < stop:
            return start
    return -1


def bounded_depth(depth: int, block_size: int, cap: int | None, spans: Spans) -> int:
    """The deepest block count `<= depth` whose hit (`blocks * block_size` tokens) is
    at most `cap` (None: no cap) and ends inside no span ([R64], [R65])."""
    if cap is not None and cap // block_size < depth:
        depth = cap // block_size
    while depth > 0:
        start = span_start(spans, depth * block_size)
        if start < 0:
            break
        depth = start // block_size
    return depth
