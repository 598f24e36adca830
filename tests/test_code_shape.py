"""The shape issue 10 set for graphmod's code, read from the source: no module over 400
lines, no function of the compiler core over 40 lines of code (its docstring aside), and
function-local imports only where they are deliberate (optional dependencies, and what
``import graphmod`` and ``graphmod --help`` must not pay for)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "graphmod"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_CORE_FUNCTION_LINES = 40
# (module, imported module) pairs imported inside a function, each for a reason.
LOCAL_IMPORTS = {
    # Optional dependencies, loaded by the plugins that use them.
    ("plugins/_logger.py", "tensorboardX"),
    ("plugins/_live_plot.py", "matplotlib.figure"),
    ("plugins/_live_plot.py", "IPython.display"),
    ("plugins/_progress.py", "tqdm.auto"),
    # `import graphmod` loads no orbax: the reader opens it when it is made.
    ("_train/_checkpoint/_reader.py", "orbax.checkpoint"),
    # `graphmod --help` answers without importing JAX or the training layer.
    ("_cli.py", "graphmod._train._checkpoint"),
    ("_cli.py", "graphmod._records._record"),
    ("distributed.py", "jax"),
}


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the end, less the docstring's."""
    lines = function.end_lineno - function.lineno + 1
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def _local_imports(tree: ast.AST) -> set[str]:
    found = set()
    for function in _functions(tree):
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.add(node.module or "")
    return found


def test_the_module_reading_helpers_count_what_they_say() -> None:
    tree = ast.parse('def f():\n    """Doc\n    string."""\n    import json\n    return 1\n')
    assert _code_lines(_functions(tree)[0]) == 3
    assert _local_imports(tree) == {"json"}


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in SOURCES
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them): {long}"


def test_no_function_of_the_core_is_over_40_lines() -> None:
    long = {f"{p.relative_to(PACKAGE)}:{f.lineno} {f.name}": n
            for p in SOURCES if p.relative_to(PACKAGE).parts[0] == "_core"
            for f in _functions(ast.parse(p.read_text()))
            if (n := _code_lines(f)) > MAX_CORE_FUNCTION_LINES}
    assert not long, f"core functions over {MAX_CORE_FUNCTION_LINES} lines: {long}"


def test_function_local_imports_are_the_deliberate_ones() -> None:
    found = {(p.relative_to(PACKAGE).as_posix(), name) for p in SOURCES
             for name in _local_imports(ast.parse(p.read_text()))}
    assert found <= LOCAL_IMPORTS, f"imports inside functions: {sorted(found - LOCAL_IMPORTS)}"
