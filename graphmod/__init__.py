"""graphmod: a graph-rewriting compiler for JAX models.

Write model code once with bricks; managers rewrite inputs, outputs and parameters of the
applications they select while the function is traced, giving jitted training and inference
functions from the same code.

Examples:
    >>> import graphmod as gm
    >>> gm.roles.WEIGHT.is_a(gm.roles.PARAMETER)
    True
"""

from graphmod import (
    bricks,
    data,
    metrics,
    plugins,
    provenance,
    roles,
)
from graphmod._application import ApplicationCall, OwnedVariable, application
from graphmod._brick import Brick
from graphmod._checkpoint import CheckpointError
from graphmod._evaluate import Evaluation, evaluate
from graphmod._events import Event, On, Template, Time
from graphmod._filter import VariableFilter
from graphmod._graph import ComputationGraph
from graphmod._loop import Loop, PluginError
from graphmod._manager import Dynamic, HParam, Manager, dynamic
from graphmod._optimize import TrainState, TrainStep, optimize
from graphmod._plugin import Plugin
from graphmod._program import Program, compile
from graphmod._scan import scan
from graphmod._schedule import Schedule, after, always, at, before, each, never
from graphmod._variables import Bias, Filter, Parameter, State, Weight
from graphmod.provenance import Provenance, rebuild

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
    "HParam",
    "Loop",
    "Manager",
    "On",
    "OwnedVariable",
    "Parameter",
    "Plugin",
    "PluginError",
    "Program",
    "Provenance",
    "Schedule",
    "State",
    "Template",
    "Time",
    "TrainState",
    "TrainStep",
    "VariableFilter",
    "Weight",
    "after",
    "always",
    "application",
    "at",
    "before",
    "bricks",
    "compile",
    "data",
    "dynamic",
    "each",
    "evaluate",
    "metrics",
    "never",
    "optimize",
    "plugins",
    "provenance",
    "rebuild",
    "roles",
    "scan",
]
