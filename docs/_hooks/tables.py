"""mkdocs hook: puts every table of a page in a ``div.gm-scroll`` wrapper that scrolls
sideways (docs/stylesheets/tables.css), so no table is wider than the content column.

Material wraps markdown tables only in the browser, with JavaScript, and not the tables of
notebook outputs or mkdocstrings; this wraps each outermost ``<table>`` of the built page
once, in the HTML itself (a page read without JavaScript, or checked by a test, has them).
"""

from __future__ import annotations

import re
from typing import Any

WRAPPER = '<div class="gm-scroll">'
_TAG = re.compile(r"<(/?)table\b[^>]*>", re.IGNORECASE)


def wrap_tables(html: str) -> str:
    """``html`` with each outermost table (nested ones stay inside theirs) in a wrapper,
    unless it is in one already."""
    out, depth, last, opened = [], 0, 0, False
    for tag in _TAG.finditer(html):
        if tag.group(1):  # </table>
            if depth == 0:  # a stray one: left as it is
                continue
            depth -= 1
            if depth == 0:
                out.append(html[last:tag.end()] + ("</div>" if opened else ""))
                last = tag.end()
        else:
            if depth == 0:
                opened = not html[max(0, tag.start() - 200):tag.start()].rstrip().endswith(
                    WRAPPER)
                out.append(html[last:tag.start()] + (WRAPPER if opened else ""))
                last = tag.start()
            depth += 1
    return "".join(out) + html[last:]


def on_post_page(output: str, **kwargs: Any) -> str:
    return wrap_tables(output)
