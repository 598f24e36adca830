"""Plain-text and HTML tables for records shown in terminals and notebooks."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

WIDTH = 100  # the columns of terminal text


def shorten(text: str, width: int) -> str:
    """``text`` cut from the left to ``width`` characters (``…`` marks the cut)."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1:]


def shorten_middle(text: str, width: int) -> str:
    """``text`` cut in the middle to ``width`` characters (``…`` marks the cut): a path
    keeps where it starts (``model/``, ``managers/``) and the end that names the array."""
    if len(text) <= width:
        return text
    head = (width - 1) // 3  # a third for the start, the rest for the end
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
               width: int = WIDTH) -> str:
    """Rows under aligned headers, one line each, in at most ``width`` columns where the
    widest columns can give way: their cells cut in the middle (a path keeps its start and
    the end that names the array).

    Examples:
        >>> print(text_table(["a", "bb"], [[1, 2], [333, 4]]))
        a    bb
        ---  --
        1    2
        333  4
        >>> print(text_table(["path"], [["/encoder/layers/0/attention/query"]], width=20))
        path
        --------------------
        /encod…tention/query
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
            row[widest] = shorten_middle(row[widest], widths[widest])
    line = lambda parts: "  ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True))
    body = [line(headers), line(["-" * w for w in widths]), *map(line, cells)]
    return "\n".join(b.rstrip() for b in body)


# A number, or a size as size_text writes it ("1.5 KiB", "69.1K"): right-aligned.
_NUMBER = re.compile(r"-?[\d.,]+(e-?\d+)?( ?[KMGT]?i?B|[KMG])?|-")


def _numeric(cell: object) -> bool:
    return isinstance(cell, int | float) or bool(_NUMBER.fullmatch(str(cell)))


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]], caption: str,
               groups: Sequence[tuple[int, str]] = ()) -> str:
    """An HTML table (escaped) for ``_repr_html_``: text left-aligned (Jupyter's own style
    right-aligns every cell), columns of numbers right-aligned; ``groups``: ``(row index,
    title)`` of a full-width row opening each group (a module's arrays).

    Examples:
        >>> page = html_table(["path", "size"], [["model/W", 6]], "variables")
        >>> '<td style="text-align:left">model/W</td>' in page, 'right">6</td>' in page
        (True, True)
    """
    sides = ["right" if rows and all(_numeric(row[i]) for row in rows) else "left"
             for i in range(len(headers))]
    cell = lambda tag, side, text: f'<{tag} style="text-align:{side}">{html.escape(text)}</{tag}>'
    head = "".join(cell("th", side, h) for h, side in zip(headers, sides, strict=True))
    titles = dict(groups)
    body = "".join(
        (f'<tr><th colspan="{len(headers)}" style="text-align:left">'
         f"{html.escape(titles[index])}</th></tr>" if index in titles else "")
        + "<tr>" + "".join(cell("td", side, str(c)) for c, side in zip(row, sides, strict=True))
        + "</tr>"
        for index, row in enumerate(rows)
    )
    return (f'<table><caption style="text-align:left">{html.escape(caption)}</caption>'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
