"""Every internal link and anchor of a built site resolves, and the API reference and the
tutorials show no private names (run by ``.ci/run`` after ``mkdocs build``;
``tests/test_docs_links.py`` tests the crawler itself).

Usage::

    python docs/_hooks/links.py SITE_DIR     # exit 1 and list what is wrong, if anything
"""

from __future__ import annotations

import re
import sys
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path


class _Page(HTMLParser):
    """The ids a page defines and the links it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.text: list[str] = []
        self._hidden = 0  # inside <script> or <style>

    def handle_endtag(self, tag: str) -> None:
        self._hidden -= tag in ("script", "style")

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.text.append(data)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self._hidden += tag in ("script", "style")
        for key in ("id", "name"):
            if found.get(key):
                self.ids.add(str(found[key]))
        if tag == "a" and found.get("href"):
            self.links.append(str(found["href"]))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def _target(site: Path, page: Path, href: str) -> tuple[Path, str] | None:
    """The file and fragment an internal ``href`` of ``page`` points to (None: external)."""
    parts = urllib.parse.urlsplit(href)
    if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
        return None
    path = urllib.parse.unquote(parts.path)
    target = page if not path else (
        site / path.lstrip("/") if path.startswith("/") else page.parent / path)
    if target.is_dir() or path.endswith("/"):
        target = target / "index.html"
    return target.resolve(), urllib.parse.unquote(parts.fragment)


def broken_links(site: Path) -> list[str]:
    """``"page: href"`` for every internal link whose file or anchor does not exist.

    Examples:
        >>> import tempfile
        >>> site = Path(tempfile.mkdtemp())
        >>> _ = (site / "index.html").write_text('<h2 id="a">A</h2><a href="#a">ok</a>'
        ...                                      '<a href="#b">no</a><a href="x/">gone</a>')
        >>> broken_links(site)
        ['index.html: #b', 'index.html: x/']
    """
    site = site.resolve()
    pages = {path.resolve(): _parse(path) for path in sorted(site.rglob("*.html"))}
    broken = []
    for path, page in pages.items():
        for href in page.links:
            target = _target(site, path, href)
            if target is None:
                continue
            file, fragment = target
            known = pages.get(file)
            exists = known is not None or (file.is_file() and not fragment)
            if not exists or (fragment and known is not None and fragment not in known.ids):
                broken.append(f"{path.relative_to(site)}: {href}")
    return broken


# The API reference shows no private module of graphmod or managers (graphmod._core._tracing._frame)
# and no private class (_AdditiveNoise) in signatures and bases; the tutorials import none
# (they may name one as data: a crafted record that rebuild refuses).
_PRIVATE = {
    "api/": re.compile(r"\b(?:graphmod|managers)(?:\.\w+)*\._[a-z]\w*|(?<![\w.])_[A-Z]\w*"),
    "tutorials/": re.compile(r"(?:from|import)\s+(?:graphmod|managers)(?:\.\w+)*\._\w+"),
}


def private_names(site: Path) -> list[str]:
    """``"page: name"`` for each private name an API page shows or a tutorial imports.

    Examples:
        >>> import tempfile
        >>> site = Path(tempfile.mkdtemp())
        >>> (site / "api").mkdir()
        >>> _ = (site / "api" / "index.html").write_text(
        ...     "<p>Bases: _AdditiveNoise</p><p>graphmod._cli.inspect_run()</p>"
        ...     "<script>var _Hidden = 1;</script><p>graphmod.compile</p>")
        >>> private_names(site)
        ['api/index.html: _AdditiveNoise', 'api/index.html: graphmod._cli']
    """
    site = site.resolve()
    found = []
    for path in sorted(site.rglob("*.html")):
        page = path.relative_to(site).as_posix()
        for prefix, pattern in _PRIVATE.items():
            if page.startswith(prefix):
                text = " ".join(_parse(path).text)
                found += [f"{page}: {name}" for name in dict.fromkeys(pattern.findall(text))]
    return found


if __name__ == "__main__":
    site_dir = Path(sys.argv[1])
    broken, private = broken_links(site_dir), private_names(site_dir)
    print("\n".join(broken) or "every internal link and anchor resolves")
    print("\n".join(private) or "no private names in the API reference and tutorials")
    sys.exit(1 if broken or private else 0)
