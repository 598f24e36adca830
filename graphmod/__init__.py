"""graphmod: a graph-rewriting compiler for JAX models.

Write model code once with bricks; managers rewrite inputs, outputs and parameters of the
applications they select while the function is traced, giving jitted training and inference
functions from the same code.

Examples:
    >>> import graphmod as gm
    >>> gm.roles.WEIGHT.is_a(gm.roles.PARAMETER)
    True

Importing graphmod is cheap: each public name loads its module (and JAX) on first use, so the
``graphmod`` command answers ``--help`` at once. The names are the imports under
``TYPE_CHECKING`` below, which type checkers and the API docs read as they are.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
from typing import TYPE_CHECKING, Any

# Standard library only; imported now because it notes the working directory at import.
from graphmod._train import _command  # noqa: F401

if TYPE_CHECKING:
    from graphmod import (
        bricks,
        data,
        distributed,
        errors,
        metrics,
        plugins,
        provenance,
        roles,
        sharding,
        typing,
    )
    from graphmod._cli import inspect_run
    from graphmod._core._application import application
    from graphmod._core._brick import Brick
    from graphmod._core._call import ApplicationCall, OwnedVariable
    from graphmod._core._filter import VariableFilter
    from graphmod._core._graph import ComputationGraph
    from graphmod._core._manager import Dynamic, HParam, Manager, dynamic
    from graphmod._core._scan import remat, scan
    from graphmod._core._show import VariablesTable
    from graphmod._core._variables import Bias, Filter, Parameter, State, Weight
    from graphmod._fit import FitResult, fit
    from graphmod._train._checkpoint import CheckpointError
    from graphmod._train._evaluate import Evaluation, evaluate
    from graphmod._train._events import Event, On, Template, Time
    from graphmod._train._loop import Loop, PluginError
    from graphmod._train._optimize import TrainStep, optimize
    from graphmod._train._plugin import Plugin
    from graphmod._train._population import PopulationStep, population
    from graphmod._train._program import Program, compile
    from graphmod._train._schedule import Schedule, after, always, at, before, each, never
    from graphmod._train._train_state import TrainState
    from graphmod.provenance import Provenance, rebuild


def _exports() -> dict[str, str]:
    """``{public name: the module it comes from}``, read from the imports above."""
    tree = ast.parse(pathlib.Path(__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and getattr(node.test, "id", None) == "TYPE_CHECKING")
    return {alias.name: f"graphmod.{alias.name}" if node.module == "graphmod" else node.module
            for node in block.body for alias in node.names}


_EXPORTS = _exports()


def __getattr__(name: str) -> Any:
    """Loads a public name's module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'graphmod' has no attribute {name!r}")
    value = importlib.import_module(module)
    if module != f"graphmod.{name}":
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__version__ = "0.1.0"

__all__ = [
    "ApplicationCall",
    "Bias",
    "Brick",
    "CheckpointError",
    "ComputationGraph",
    "Dynamic",
    "Evaluation",
    "Event",
    "Filter",
    "FitResult",
    "HParam",
    "Loop",
    "Manager",
    "On",
    "OwnedVariable",
    "Parameter",
    "Plugin",
    "PluginError",
    "PopulationStep",
    "Program",
    "Provenance",
    "Schedule",
    "State",
    "Template",
    "Time",
    "TrainState",
    "TrainStep",
    "VariableFilter",
    "VariablesTable",
    "Weight",
    "after",
    "always",
    "application",
    "at",
    "before",
    "bricks",
    "compile",
    "data",
    "distributed",
    "dynamic",
    "each",
    "errors",
    "evaluate",
    "fit",
    "inspect_run",
    "metrics",
    "never",
    "optimize",
    "plugins",
    "population",
    "provenance",
    "rebuild",
    "remat",
    "roles",
    "scan",
    "sharding",
    "typing",
]
