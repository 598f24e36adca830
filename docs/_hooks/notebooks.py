"""mkdocs hook: every notebook in ``notebooks/`` becomes a page ``tutorials/<name>.ipynb``.

The notebooks stay where CI executes them (``notebooks/``, at the repository root). This hook
adds them to the site's files as documentation pages backed by the original files, after
mkdocs-jupyter's own ``on_files`` (whose wrapper only handles files inside ``docs/``);
mkdocs-jupyter then executes and renders them like notebooks in ``docs/``.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


class NotebookPage(File):
    """A notebook outside ``docs/`` served as a page (mkdocs-jupyter renders it)."""

    def is_documentation_page(self) -> bool:
        return True


@event_priority(-100)  # after mkdocs-jupyter's on_files
def on_files(files: Files, config: MkDocsConfig) -> Files:
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(NotebookPage.generated(config, f"tutorials/{notebook.name}",
                                            abs_src_path=str(notebook)))
    return files
