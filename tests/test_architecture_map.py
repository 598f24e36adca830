"""The architecture page (docs/concepts/architecture.md) names every module of graphmod, by
the path the code has, and shows one train step as a Mermaid diagram: a module added,
moved or renamed without the map is caught here."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "concepts" / "architecture.md").read_text()


def _named() -> set[str]:
    """Every module path the page names in a table's first column (``_train/_loop``,
    ``_codec/_tag``, ``plugins/_wandb``), and each name of a comma-separated cell."""
    names = set()
    for cell in re.findall(r"^\| ([^|]+) \|", PAGE, flags=re.M):
        names.update(re.findall(r"`([^`]+)`", cell))
    return {name.rstrip("/") for name in names}


def _expected(path: pathlib.Path) -> set[str]:
    """How the page may name a module: its path below its layer's folder (core modules by
    their name, as the core's tables are per folder)."""
    parts = path.relative_to(ROOT / "graphmod").with_suffix("").parts
    if parts[0] == "_core":
        return {parts[-1], "/".join(parts[-2:])}
    return {"/".join(parts), parts[-1]}


def test_the_architecture_page_names_every_module() -> None:
    named = _named()
    modules = [p for p in sorted((ROOT / "graphmod").rglob("*.py"))
               if p.name != "__init__.py" and "__pycache__" not in p.parts]
    missing = [str(p.relative_to(ROOT)) for p in modules if not _expected(p) & named]
    assert not missing, f"modules the architecture page does not name: {missing}"


def test_each_core_folder_has_its_table_and_its_docstring() -> None:
    folders = sorted(p for p in (ROOT / "graphmod" / "_core").iterdir()
                     if p.is_dir() and p.name != "__pycache__")
    for folder in folders:
        assert f"{folder.name}/" in PAGE, folder.name
        doc = (folder / "__init__.py").read_text()
        assert doc.startswith('"""') and len(doc.split('"""')[1].split()) > 5, folder.name


def test_one_train_step_is_drawn() -> None:
    assert "```mermaid" in PAGE and "TrainState" in PAGE.split("```mermaid")[1]
