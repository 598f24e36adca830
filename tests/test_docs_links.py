"""The crawler CI runs over the built documentation site (docs/_hooks/links.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import load_docs_hook

ROOT = Path(__file__).resolve().parents[1]


def test_broken_files_and_anchors_are_found_and_good_ones_pass(tmp_path: Path) -> None:
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "index.html").write_text(
        '<h2 id="fusing-steps">Fusing</h2><a href="../#top">up</a>'
        '<a href="../api/#missing">api</a><a href="https://jax.dev/#x">out</a>')
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "index.html").write_text('<a name="compile"></a>')
    (tmp_path / "index.html").write_text(
        '<p id="top"></p><a href="guide/#fusing-steps">ok</a><a href="guide/#fusing">bad</a>'
        '<a href="api/index.html#compile">ok</a><a href="nowhere.html">bad</a>'
        '<a href="assets/logo.png">ok</a>')
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "logo.png").write_bytes(b"")
    assert load_docs_hook("links").broken_links(tmp_path) == [
        "guide/index.html: ../api/#missing", "index.html: guide/#fusing",
        "index.html: nowhere.html"]


def test_no_notebook_heading_holds_code_the_table_of_contents_would_misspell() -> None:
    # mkdocs-jupyter's table of contents drops code spans from a heading's anchor while
    # the heading's own id keeps them: such a heading gets a broken link.
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                for line in "".join(cell["source"]).splitlines():
                    assert not (line.startswith("#") and "`" in line), (notebook.name, line)


def test_private_names_on_api_and_tutorial_pages_are_found(tmp_path: Path) -> None:
    for folder, text in [("api", "Bases: _AdditiveNoise. Program(fn, shared: Shared)"),
                         ("tutorials/04", "from graphmod._cli import describe_run"),
                         ("tutorials/06", 'rebuild refuses {"function": "graphmod._cli.main"}'),
                         ("concepts", "graphmod/_core/_tracing/_frame.py holds the frame")]:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "index.html").write_text(
            f"<p>{text}</p><script>var _Private = 1;</script>")
    assert load_docs_hook("links").private_names(tmp_path) == [
        "api/index.html: _AdditiveNoise", "tutorials/04/index.html: from graphmod._cli"]
