"""Plain-text tables for the library's reports (explain, einfft plans, communication stats)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]


def text_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "", rule: bool = True, right=()
) -> list[str]:
    """Lines of an aligned table: a header, an optional rule under it, the rows.

    Columns whose index is in ``right`` are right-aligned (numbers).

    >>> text_table(("a", "n"), [("x", "10")], right=(1,))
    ['a   n', '-  --', 'x  10']
    """
    table = [tuple(header)] + [tuple(r) for r in rows]
    widths = [max(len(row[k]) for row in table) for k in range(len(header))]

    def line(row):
        cells = [c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(row, widths))]
        return indent + "  ".join(cells).rstrip()

    lines = [line(table[0])]
    if rule:
        lines.append(indent + "  ".join("-" * w for w in widths))
    lines.extend(line(row) for row in table[1:])
    return lines
