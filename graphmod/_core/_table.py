"""Plain-text and HTML tables for records shown in terminals and notebooks."""

from __future__ import annotations

import html
from collections.abc import Sequence


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Rows under aligned headers, one line each.

    Examples:
        >>> print(text_table(["a", "bb"], [[1, 2], [333, 4]]))
        a    bb
        ---  --
        1    2
        333  4
    """
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    line = lambda parts: "  ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True))
    body = [line(headers), line(["-" * w for w in widths]), *map(line, cells)]
    return "\n".join(b.rstrip() for b in body)


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]], caption: str) -> str:
    """An HTML table (escaped) for ``_repr_html_``."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
        for row in rows
    )
    return (f"<table><caption>{html.escape(caption)}</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
