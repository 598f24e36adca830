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
``TYPE_CHECKING`` below, which type checkers and the API docs read as they are (a literal
table beside them loads each at run time).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    from graphmod._core._bricks._application import application
    from graphmod._core._bricks._brick import Brick
    from graphmod._core._display._show import VariablesTable
    from graphmod._core._loops._scan import remat, scan
    from graphmod._core._managers._manager import Dynamic, HParam, Manager, dynamic
    from graphmod._core._program._graph import ComputationGraph
    from graphmod._core._selection._filter import VariableFilter
    from graphmod._core._tracing._call import ApplicationCall, OwnedVariable
    from graphmod._core._tracing._variables import Bias, Filter, Parameter, State, Weight
    from graphmod._fit import FitResult, fit
    from graphmod._train._checkpoint import CheckpointError
    from graphmod._train._evaluate import Evaluation, evaluate
    from graphmod._train._events import Event, On, Template, Time
    from graphmod._train._export import ExportedProgram, export
    from graphmod._train._loop import Loop, PluginError
    from graphmod._train._optimize import TrainStep, optimize
    from graphmod._train._plugin import Plugin
    from graphmod._train._population import PopulationStep, population
    from graphmod._train._program import Program, compile
    from graphmod._train._schedule import Schedule, after, always, at, before, each, never
    from graphmod._train._train_state import TrainState
    from graphmod.provenance import Provenance, rebuild


# {public name: the module it comes from}: the imports above, as a table read at run time
# (a test checks that the two agree with each other and with __all__).
_EXPORTS = {
    "inspect_run": "graphmod._cli",
    "application": "graphmod._core._bricks._application",
    "Brick": "graphmod._core._bricks._brick",
    "ApplicationCall": "graphmod._core._tracing._call",
    "OwnedVariable": "graphmod._core._tracing._call",
    "VariableFilter": "graphmod._core._selection._filter",
    "ComputationGraph": "graphmod._core._program._graph",
    "Dynamic": "graphmod._core._managers._manager",
    "HParam": "graphmod._core._managers._manager",
    "Manager": "graphmod._core._managers._manager",
    "dynamic": "graphmod._core._managers._manager",
    "remat": "graphmod._core._loops._scan",
    "scan": "graphmod._core._loops._scan",
    "VariablesTable": "graphmod._core._display._show",
    "Bias": "graphmod._core._tracing._variables",
    "Filter": "graphmod._core._tracing._variables",
    "Parameter": "graphmod._core._tracing._variables",
    "State": "graphmod._core._tracing._variables",
    "Weight": "graphmod._core._tracing._variables",
    "FitResult": "graphmod._fit",
    "fit": "graphmod._fit",
    "CheckpointError": "graphmod._train._checkpoint",
    "Evaluation": "graphmod._train._evaluate",
    "evaluate": "graphmod._train._evaluate",
    "Event": "graphmod._train._events",
    "On": "graphmod._train._events",
    "Template": "graphmod._train._events",
    "Time": "graphmod._train._events",
    "ExportedProgram": "graphmod._train._export",
    "export": "graphmod._train._export",
    "Loop": "graphmod._train._loop",
    "PluginError": "graphmod._train._loop",
    "TrainStep": "graphmod._train._optimize",
    "optimize": "graphmod._train._optimize",
    "Plugin": "graphmod._train._plugin",
    "PopulationStep": "graphmod._train._population",
    "population": "graphmod._train._population",
    "Program": "graphmod._train._program",
    "compile": "graphmod._train._program",
    "Schedule": "graphmod._train._schedule",
    "after": "graphmod._train._schedule",
    "always": "graphmod._train._schedule",
    "at": "graphmod._train._schedule",
    "before": "graphmod._train._schedule",
    "each": "graphmod._train._schedule",
    "never": "graphmod._train._schedule",
    "TrainState": "graphmod._train._train_state",
    "bricks": "graphmod.bricks",
    "data": "graphmod.data",
    "distributed": "graphmod.distributed",
    "errors": "graphmod.errors",
    "metrics": "graphmod.metrics",
    "plugins": "graphmod.plugins",
    "Provenance": "graphmod.provenance",
    "provenance": "graphmod.provenance",
    "rebuild": "graphmod.provenance",
    "roles": "graphmod.roles",
    "sharding": "graphmod.sharding",
    "typing": "graphmod.typing",
}


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
    "ExportedProgram",
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
    "export",
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
