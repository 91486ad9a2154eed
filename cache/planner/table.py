"""Plain-text tables that fit a terminal width without ever cutting a cell.

A table wider than the width is split into stacked sections: each repeats
the key columns (the first `keys` columns) and takes as many of the other
columns as fit. A cell is never truncated or wrapped; a single column wider
than the width is printed whole (the terminal wraps it, the number survives).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Column", "render_table"]

_GAP = "  "


class Column:
    """A header, its cells (already formatted) and alignment ('<' or '>')."""

    __slots__ = ("align", "cells", "header")

    def __init__(self, header: str, cells: Sequence[str], align: str = ">") -> None:
        if align not in ("<", ">"):
            raise ValueError(f"align must be '<' or '>', got {align!r}")
        self.header = header
        self.cells = list(cells)
        self.align = align

    @property
    def width(self) -> int:
        return max([len(self.header), *(len(c) for c in self.cells)])


def _section(columns: Sequence[Column]) -> list[str]:
    widths = [c.width for c in columns]
    rows = max((len(c.cells) for c in columns), default=0)

    def line(cells: Sequence[str]) -> str:
        parts = [
            f"{cell:{col.align}{w}}" for cell, col, w in zip(cells, columns, widths, strict=True)
        ]
        return _GAP.join(parts).rstrip()

    out = [line([c.header for c in columns]), _GAP.join("-" * w for w in widths)]
    for i in range(rows):
        out.append(line([c.cells[i] if i < len(c.cells) else "" for c in columns]))
    return out


def render_table(columns: Sequence[Column], width: int, keys: int = 1) -> list[str]:
    """The table's lines, split into sections of at most `width` characters where possible."""
    if not columns:
        return []
    key_cols = list(columns[:keys])
    rest = list(columns[keys:])
    key_width = sum(c.width for c in key_cols) + len(_GAP) * max(0, len(key_cols) - 1)
    sections: list[list[Column]] = []
    current: list[Column] = []
    used = key_width
    for col in rest:
        extra = len(_GAP) + col.width
        if current and used + extra > width:
            sections.append(current)
            current, used = [], key_width
        current.append(col)
        used += extra
    if current or not sections:
        sections.append(current)
    lines: list[str] = []
    for i, section in enumerate(sections):
        if i:
            lines.append("")
        lines.extend(_section(key_cols + section))
    return lines
