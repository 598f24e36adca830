"""mkdocs hook: drops Sphinx role markers left in docstring prose.

Docstrings write cross-references the Sphinx way (``:class:`Program```); mkdocstrings
renders the name as inline code and leaves the marker as text (``:class:Program``). This
removes the markers in front of inline code in the rendered pages.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):(?=<code)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub("", html)
