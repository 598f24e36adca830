"""Plain-text and HTML tables for records shown in terminals and notebooks."""

from __future__ import annotations

import html
from collections.abc import Sequence

WIDTH = 100  # the columns of terminal text


def shorten(text: str, width: int) -> str:
    """``text`` cut from the left to ``width`` characters (``…`` marks the cut)."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1:]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
               width: int = WIDTH) -> str:
    """Rows under aligned headers, one line each, in at most ``width`` columns where the
    widest columns can give way: their cells cut from the left (the ends of paths say most).

    Examples:
        >>> print(text_table(["a", "bb"], [[1, 2], [333, 4]]))
        a    bb
        ---  --
        1    2
        333  4
        >>> print(text_table(["path"], [["/encoder/layers/0/attention/query"]], width=20))
        path
        --------------------
        …s/0/attention/query
    """
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    while (excess := sum(widths) + 2 * (len(widths) - 1) - width) > 0:
        widest, *rest = sorted(range(len(widths)), key=widths.__getitem__, reverse=True)
        floor = max(12, len(headers[widest]))  # below it nothing is read: let it overflow
        if widths[widest] <= floor:
            break
        # Down to the next widest at most: the widest columns give way in turns.
        next_widest = min(widths[rest[0]] if rest else 0, widths[widest] - 1)
        widths[widest] = max(floor, widths[widest] - excess, next_widest)
        for row in cells:
            row[widest] = shorten(row[widest], widths[widest])
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
