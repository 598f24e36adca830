"""graphmod's layers import one way: core, bricks, records, training, public provenance, the
runner (``graphmod.fit``), CLI.

Read from the source (every import statement, also inside functions and under
``TYPE_CHECKING``), so a violation is named before anything runs. ``from pkg import name``
counts as an import of ``pkg.name`` when that is a module, else of ``pkg``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "graphmod"

# Lowest first; a module may import its own layer and those below it, nothing above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("graphmod.roles", "graphmod.errors", "graphmod.typing", "graphmod._core",
              "graphmod.sharding")),
    ("bricks", ("graphmod.bricks",)),
    ("records", ("graphmod._records",)),
    ("training", ("graphmod._train", "graphmod.plugins", "graphmod.metrics",
                  "graphmod.data", "graphmod.distributed")),
    ("provenance", ("graphmod.provenance",)),
    ("runner", ("graphmod._fit",)),  # graphmod.fit: compile, loop, plugins, provenance
    ("cli", ("graphmod._cli",)),
    ("package", ("graphmod",)),
)
# Third-party packages a layer must not import even lazily: orbax only behind the
# checkpointer, which opens it on first use.
FORBIDDEN = {"core": ("orbax",), "bricks": ("orbax",), "records": ("orbax",)}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """Every module ``name`` imports (absolute names, graphmod's and third parties')."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES
                          else base)
    return found


def _layer(name: str) -> int:
    """The index of the layer holding module ``name`` (the longest prefix that matches)."""
    best = (-1, -1)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                best = max(best, (len(prefix), index))
    assert best[1] >= 0, f"module {name} belongs to no layer: add it to LAYERS"
    return best[1]


GRAPH = {name: {m for m in _imports(name) if m in MODULES} for name in MODULES}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_imports_only_its_layer_and_those_below(name: str) -> None:
    own = _layer(name)
    above = sorted(m for m in GRAPH[name] if _layer(m) > own)
    assert not above, (f"{name} ({LAYERS[own][0]} layer) imports {above} from a layer above "
                       "it; move the shared piece down or invert the dependency")
    banned = FORBIDDEN.get(LAYERS[own][0], ())
    third = sorted(m for m in _imports(name) if m.split(".")[0] in banned)
    assert not third, f"{name} ({LAYERS[own][0]} layer) imports {third}"


def test_no_modules_import_each_other_in_a_circle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in GRAPH[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert not cycles, f"modules importing each other in a circle: {cycles}"


def test_the_contract_sees_a_violation() -> None:
    """The checks above read real imports: the core really imports roles, the training
    layer really imports the core, and a layer above is really above."""
    assert "graphmod.roles" in GRAPH["graphmod._core._program._program_core"]
    assert "graphmod._core._program._program_core" in GRAPH["graphmod._train._program"]
    assert _layer("graphmod._train._loop") > _layer("graphmod._core._tracing._frame")
    assert _layer("graphmod.provenance._rebuild") > _layer("graphmod._train._program")
