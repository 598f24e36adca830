"""The docs site's tables: none wider than the content column. Every table of a built page
sits in a sideways-scrolling wrapper (docs/_hooks/tables.py, docs/stylesheets/tables.css);
in headless Chromium, where it is installed, no table reaches past the content column
without being scrollable, and table cells wrap only at word boundaries.

The site built here is a small one made with the docs' own hook and stylesheet, from pages
holding what was cut off on the real site: a wide markdown table of signatures, graphmod's
rewrite trace and placement table as a notebook shows them.
"""

from __future__ import annotations

import html.parser
import json
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import graphmod as gm
import managers

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs" / "_hooks" / "tables.py"
CSS = ROOT / "docs" / "stylesheets" / "tables.css"
CHROMIUM = next((found for name in ("chromium", "chromium-headless-shell", "chromium-browser",
                                    "google-chrome") if (found := shutil.which(name))), None)

# What the page reports once loaded: per table, the content column's right edge, the right
# edge of what shows it (its wrapper), whether that scrolls sideways, and the table's width.
MEASURE = """
addEventListener("load", () => {
  const column = document.querySelector(".md-content__inner").getBoundingClientRect();
  const rows = [...document.querySelectorAll(".md-content table")].map(table => {
    const box = table.closest(".gm-scroll") || table.parentElement;
    const cells = [...table.querySelectorAll("td code")].map(code => {
      const range = document.createRange(); range.selectNodeContents(code);
      const lines = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
      const words = code.textContent.split(/\\s+/).length;
      return lines.size <= words;  // mid-word breaks give more lines than words
    });
    return {column: column.right, right: box.getBoundingClientRect().right,
            scrolls: ["auto", "scroll"].includes(getComputedStyle(box).overflowX),
            width: table.scrollWidth, shown: box.clientWidth, words: cells.every(Boolean)};
  });
  const out = document.createElement("pre"); out.id = "measured";
  out.textContent = JSON.stringify(rows); document.body.append(out);
});
"""


class LongNames(nnx.Module):
    def __init__(self) -> None:
        self.positional_embedding_of_the_decoder = nnx.Sequential(
            nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 3, rngs=nnx.Rngs(1)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.positional_embedding_of_the_decoder(x)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    root = tmp_path_factory.mktemp("site")
    docs = root / "docs"
    (docs / "stylesheets").mkdir(parents=True)
    shutil.copy(CSS, docs / "stylesheets" / "tables.css")
    (docs / "measure.js").write_text(MEASURE)
    program = gm.compile(lambda m, x: m(x).sum(), LongNames(), managers=[
        managers.Dropout(0.1, bricks=[nnx.Linear], roles=[gm.roles.INPUT])])
    variables = program.init(jnp.ones((2, 3)))
    signature = "`Dropout(rate, *, bricks=None, roles=None, applications=None, path=None)`"
    wide = "| " + " | ".join(f"column {i}" for i in range(12)) + " |\n" + \
        "|" + "---|" * 12 + "\n" + "| " + " | ".join([signature] * 12) + " |\n"
    (docs / "index.md").write_text(f"# Tables\n\n{wide}\n")
    (docs / "notebook.md").write_text(
        "# Outputs\n\n" + program.rewrites._repr_html_() + "\n\n"
        + program.sharding(variables)._repr_html_() + "\n")
    (root / "mkdocs.yml").write_text(json.dumps({
        "site_name": "tables", "docs_dir": "docs", "site_dir": "site",
        "theme": {"name": "material"}, "hooks": [str(HOOK)],
        "extra_css": ["stylesheets/tables.css"], "extra_javascript": ["measure.js"],
        "markdown_extensions": ["tables", "md_in_html"]}))
    build(load_config(str(root / "mkdocs.yml")))
    return root / "site"


class _Tables(html.parser.HTMLParser):
    """Each outermost table's parent element, as ``(tag, class)``."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, str]] = []
        self.parents: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and all(t != "table" for t, _ in self.stack):
            self.parents.append(self.stack[-1] if self.stack else ("", ""))
        if tag not in ("br", "img", "input", "meta", "link", "hr", "col", "wbr"):
            self.stack.append((tag, dict(attrs).get("class") or ""))

    def handle_endtag(self, tag: str) -> None:
        while self.stack:
            if self.stack.pop()[0] == tag:
                break


def test_every_table_of_a_built_page_sits_in_a_scroll_wrapper(site: pathlib.Path) -> None:
    pages = sorted(site.glob("**/index.html"))
    assert len(pages) == 2
    counts = []
    for page in pages:
        parser = _Tables()
        parser.feed(page.read_text())
        counts.append(len(parser.parents))
        assert parser.parents == [("div", "gm-scroll")] * len(parser.parents), page
    assert sorted(counts) == [1, 2]  # the markdown table; the rewrite trace and placement


def test_the_hook_wraps_each_outermost_table_once() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tables_hook", HOOK)
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = "<table><tr><td><table></table></td></tr></table></table>"
    assert hook.wrap_tables(page) == (
        '<div class="gm-scroll"><table><tr><td><table></table></td></tr></table></div></table>')
    assert hook.wrap_tables(hook.wrap_tables(page)) == hook.wrap_tables(page)  # once


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium or chromium-headless-shell to render "
                    "the built pages (apt-get install chromium)")
@pytest.mark.parametrize("page", ["index.html", "notebook/index.html"])
def test_in_a_browser_no_table_is_clipped_and_cells_break_between_words(
        site: pathlib.Path, page: str, tmp_path: pathlib.Path) -> None:
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
         f"--user-data-dir={tmp_path}", "--virtual-time-budget=5000", "--dump-dom",
         (site / page).as_uri()], capture_output=True, text=True, timeout=120)
    start = done.stdout.find('<pre id="measured">')
    assert start >= 0, done.stderr[-2000:]
    rows = json.loads(html.unescape(done.stdout[start + 19:done.stdout.index("</pre>", start)]))
    assert rows and any(row["width"] > row["shown"] for row in rows)  # wide: they scroll
    for row in rows:
        assert row["right"] <= row["column"] + 1, row  # never past the content column
        assert row["scrolls"] or row["width"] <= row["shown"], row  # nothing cut off
        assert row["words"], row  # signatures wrap at spaces, not inside a word
