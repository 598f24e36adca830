"""The docs build's notebook runner (docs/_hooks/notebooks.py): outputs kept, run in
``notebooks/``, a raising cell failing the build with the notebook's name."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from mkdocs.exceptions import PluginError

from tests.conftest import load_docs_hook

ROOT = Path(__file__).resolve().parents[1]


def _notebook(path: Path, *sources: str) -> Path:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, path)
    return path


def test_an_executed_copy_keeps_its_outputs_and_ran_in_the_notebooks_folder(
        tmp_path: Path) -> None:
    source = _notebook(tmp_path / "good.ipynb", "import os\nprint(os.getcwd())")
    into = tmp_path / "executed"
    into.mkdir()
    executed = nbformat.read(load_docs_hook("notebooks")._execute(source, into), as_version=4)
    assert executed.cells[0].outputs[0]["text"].strip() == str(ROOT / "notebooks")
    assert not nbformat.read(source, as_version=4).cells[0].outputs  # the source untouched


def test_a_raising_cell_fails_the_build_naming_the_notebook(tmp_path: Path) -> None:
    source = _notebook(tmp_path / "bad.ipynb", "x = 1", "raise ValueError('boom')")
    into = tmp_path / "executed"
    into.mkdir()
    with pytest.raises(PluginError, match=r"notebooks/bad\.ipynb: a cell raised(.|\n)*boom"):
        load_docs_hook("notebooks")._execute(source, into)
    assert os.listdir(into) == []  # nothing half-run is rendered


def test_a_cell_showing_a_warning_fails_the_build_naming_the_notebook_and_cell(
        tmp_path: Path) -> None:
    source = _notebook(tmp_path / "noisy.ipynb", "x = 1",
                       "import warnings\nwarnings.warn('rows not split', UserWarning)")
    into = tmp_path / "executed"
    into.mkdir()
    with pytest.raises(PluginError, match=r"notebooks/noisy\.ipynb: cell 2 shows a warning"
                                          r"(.|\n)*UserWarning: rows not split"):
        load_docs_hook("notebooks")._execute(source, into)
    assert os.listdir(into) == []


def test_text_on_stderr_that_is_no_warning_passes(tmp_path: Path) -> None:
    source = _notebook(tmp_path / "quiet.ipynb",
                       "import sys\nprint('Warning: this is a log line', file=sys.stderr)")
    into = tmp_path / "executed"
    into.mkdir()
    assert load_docs_hook("notebooks")._execute(source, into).exists()
