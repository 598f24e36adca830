"""What importing graphmod loads: its public names load their modules on first use, and all
of them together (the core, the loop, the plugins) never load orbax (opened on first save or
restore); the command's --help loads no JAX."""

from __future__ import annotations

import subprocess
import sys


def _printed_by(code: str) -> str:
    """What ``code`` prints, run in a fresh interpreter (nothing imported yet)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout


def test_importing_graphmod_loads_no_orbax() -> None:
    out = _printed_by("import sys, graphmod, managers; "
                      "[getattr(graphmod, name) for name in graphmod.__all__]; "
                      "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                      "('orbax', 'tensorstore')))")
    assert out.strip() == "[]", out


def test_a_checkpointer_loads_orbax_when_it_is_made() -> None:
    out = _printed_by("import sys, tempfile; from graphmod._train._checkpoint import Checkpointer; "
                      "before = 'orbax.checkpoint' in sys.modules; "
                      "Checkpointer(tempfile.mkdtemp()); "
                      "print(before, 'orbax.checkpoint' in sys.modules)")
    assert out.split() == ["False", "True"], out


def test_the_command_answers_help_without_loading_jax() -> None:
    """``graphmod --help`` parses its arguments before anything loads JAX (seconds)."""
    out = _printed_by(
        "import contextlib, io, sys\n"
        "from graphmod._cli import main\n"
        "for argv in (['--help'], ['run', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as text, "
        "contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "    assert text.getvalue().startswith('usage: graphmod'), text.getvalue()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'jax', 'jaxlib', 'flax', 'numpy', 'orbax'}))")
    assert out.strip() == "[]", out


def test_the_export_table_is_the_type_checking_imports_and_all() -> None:
    """graphmod's lazy table, the imports type checkers and the API docs read, and
    ``__all__`` name the same things, each from the same module."""
    import ast
    import pathlib

    import graphmod

    tree = ast.parse(pathlib.Path(graphmod.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and getattr(node.test, "id", None) == "TYPE_CHECKING")
    imported = {alias.name: f"graphmod.{alias.name}" if node.module == "graphmod"
                else node.module for node in block.body for alias in node.names}
    assert imported == graphmod._EXPORTS
    assert sorted(graphmod.__all__) == sorted(imported)
    for name in graphmod.__all__:
        assert getattr(graphmod, name) is not None, name
