"""The shape of graphmod's code, read from the source: function-local imports only where
they are deliberate (optional dependencies, and what ``import graphmod`` and ``graphmod
--help`` must not pay for).

Modules and functions have no line caps (issue 46): a module is as long as its concept, and
cutting a concept to meet a count scattered it over files."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "graphmod"
SOURCES = sorted(PACKAGE.rglob("*.py"))
# (module, imported module) pairs imported inside a function, each for a reason.
LOCAL_IMPORTS = {
    # Optional dependencies, loaded by the plugins that use them.
    ("plugins/_logger.py", "tensorboardX"),
    ("plugins/_wandb.py", "wandb"),
    ("plugins/_live_plot.py", "matplotlib.figure"),
    ("plugins/_live_plot.py", "IPython.display"),
    ("plugins/_progress.py", "tqdm.auto"),
    # Grain's dependency, for its worker processes' flag (google/grain#1355).
    ("data/_grain.py", "absl"),
    # Grain itself, where a pipeline is known to be Grain's (a run without Grain loads none).
    ("data/_grain.py", "grain"),
    # treescope (Flax's display) renders what it is asked to, where it is installed.
    ("_core/_display/_show.py", "treescope"),
    ("_core/_tracing/_rewrites.py", "treescope"),
    ("_train/_train_state.py", "treescope"),
    # `import graphmod` loads no orbax: the reader opens it when it is made.
    ("_train/_checkpoint/_reader.py", "orbax.checkpoint"),
    # `graphmod --help` answers without importing JAX or the training layer.
    ("_cli.py", "graphmod._train._checkpoint"),
    ("_cli.py", "graphmod._records._record"),
    ("_cli.py", "graphmod.data"),  # inspect's tables of transforms and metadata
    ("distributed.py", "jax"),
    ("distributed.py", "jax._src"),  # JAX's own distributed state, read after it joined
    # `graphmod run` checks the stop signals' settings before it imports JAX.
    ("_train/_interrupt.py", "jax"),
    ("_train/_interrupt.py", "jax.experimental"),
    # Loop.start's background run lives with the Control plugin, which imports the loop.
    ("_train/_loop/_loop.py", "graphmod.plugins._control"),
}


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def _local_imports(tree: ast.AST) -> set[str]:
    found = set()
    for function in _functions(tree):
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.add(node.module or "")
    return found


def test_the_import_reader_finds_imports_inside_functions() -> None:
    tree = ast.parse('def f():\n    """Doc\n    string."""\n    import json\n    return 1\n')
    assert _local_imports(tree) == {"json"}


def test_function_local_imports_are_the_deliberate_ones() -> None:
    found = {(p.relative_to(PACKAGE).as_posix(), name) for p in SOURCES
             for name in _local_imports(ast.parse(p.read_text()))}
    assert found <= LOCAL_IMPORTS, f"imports inside functions: {sorted(found - LOCAL_IMPORTS)}"
