"""mkdocs hook: every notebook in ``notebooks/`` becomes a page ``tutorials/<name>.ipynb``,
executed top to bottom.

The notebooks stay where CI executes them (``notebooks/``, at the repository root, kept
without outputs). At each build this hook executes them, several at once (one kernel each,
working in ``notebooks/``, as Jupyter would), into a temporary folder, and adds the executed
copies to the site's files as documentation pages, after mkdocs-jupyter's own ``on_files``
(whose wrapper only handles files inside ``docs/``); mkdocs-jupyter then renders them
(``execute: false`` in ``mkdocs.yml``: it would run them one after the other). A cell that
raises fails the build with its traceback, and so does a cell that shows a Python warning
(a tutorial that warns teaches the reader to ignore warnings).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

# A warning as Python's warnings module prints it: "path:line: SomeWarning: message".
_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: .*$", re.MULTILINE)


class NotebookPage(File):
    """A notebook outside ``docs/`` served as a page (mkdocs-jupyter renders it)."""

    def is_documentation_page(self) -> bool:
        return True


def _execute(notebook: Path, into: Path) -> Path:
    """Runs ``notebook`` in a fresh kernel started in ``notebooks/``; writes it, with its
    outputs and widgets' state (the progress bars), to ``into``."""
    executed = nbformat.read(notebook, as_version=4)
    try:
        NotebookClient(executed, resources={"metadata": {"path": str(NOTEBOOKS)}},
                       store_widget_state=True).execute()
    except CellExecutionError as error:
        raise PluginError(f"notebooks/{notebook.name}: a cell raised\n{error}") from error
    for number, cell in enumerate(executed.cells, 1):
        shown = [_WARNING.search(output.get("text", "")) for output in cell.get("outputs", ())
                 if output.get("name") == "stderr"]
        warning = next((match.group(0) for match in shown if match), None)
        if warning:
            raise PluginError(f"notebooks/{notebook.name}: cell {number} shows a warning "
                              f"(avoid its cause, or catch it where the notebook means it):"
                              f"\n{warning}")
    nbformat.write(executed, into / notebook.name)
    return into / notebook.name


@event_priority(-100)  # after mkdocs-jupyter's on_files
def on_files(files: Files, config: MkDocsConfig) -> Files:
    into = Path(tempfile.mkdtemp(prefix="graphmod-notebooks-"))
    atexit.register(shutil.rmtree, into, ignore_errors=True)  # read while pages render
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    with ThreadPoolExecutor(max_workers=min(len(notebooks), os.cpu_count() or 1)) as pool:
        executed = list(pool.map(_execute, notebooks, [into] * len(notebooks)))
    for path in executed:
        files.append(NotebookPage.generated(config, f"tutorials/{path.name}",
                                            abs_src_path=str(path)))
    return files
