"""Every public name has a docstring with a runnable example (run by --doctest-modules)."""

from __future__ import annotations

import inspect
import types

import pytest

import graphmod
import managers
from graphmod import bricks, data, metrics, plugins, provenance, roles

PACKAGES = [graphmod, bricks, data, metrics, plugins, provenance, roles, managers]


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
