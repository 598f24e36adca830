"""Every public name has a docstring with a runnable example (run by --doctest-modules),
written with public names only: what a user reads in the API docs, a user can type."""

from __future__ import annotations

import inspect
import types

import pytest

import graphmod
import managers
from graphmod import bricks, data, metrics, plugins, provenance, roles

PACKAGES = [graphmod, bricks, data, metrics, plugins, provenance, roles, managers]
# Also read for their docstrings' imports (their names need no example of their own).
MORE = [graphmod.distributed, graphmod.errors, graphmod.sharding, graphmod.typing]


def _public() -> list[tuple[str, object]]:
    names = []
    for package in PACKAGES:
        for name in package.__all__:
            value = getattr(package, name)
            if isinstance(value, types.ModuleType):
                value = value  # a subpackage: its module docstring
            elif not (inspect.isclass(value) or inspect.isfunction(value)
                      or inspect.ismodule(value) or callable(value)):
                continue  # constants such as roles.WEIGHT or always/never schedules
            names.append((f"{package.__name__}.{name}", value))
    return names


@pytest.mark.parametrize(("name", "value"), _public(), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_public_names_have_a_docstring_with_an_example(name: str, value: object) -> None:
    doc = inspect.getdoc(value) or ""
    assert ">>>" in doc, f"{name} has no `>>>` example in its docstring"


def _documented() -> list[tuple[str, str]]:
    """``(name, docstring)`` of every public module, name, method and property."""
    found = []
    for package in [*PACKAGES, *MORE]:
        found.append((package.__name__, inspect.getdoc(package) or ""))
        for name in package.__all__:
            value = getattr(package, name)
            found.append((f"{package.__name__}.{name}", inspect.getdoc(value) or ""))
            if inspect.isclass(value):
                for attribute in dir(value):  # inherited members too (Program.infer)
                    if attribute.startswith("_") and attribute not in ("__init__", "__call__"):
                        continue
                    member = inspect.getattr_static(value, attribute)
                    member = member.fget if isinstance(member, property) else member
                    member = getattr(member, "__func__", member)
                    if callable(member):
                        found.append((f"{package.__name__}.{name}.{attribute}",
                                      inspect.getdoc(member) or ""))
    return found


def test_public_examples_use_public_names_only() -> None:
    private = [name for name, doc in _documented()
               if "from graphmod._" in doc or "import graphmod._" in doc
               or "from managers._" in doc]
    assert not private, f"examples importing private modules: {private}"
