"""The errors graphmod raises where a user can act on them, by what went wrong, and the
category of its warnings (:class:`GraphmodWarning`).

Each subclasses the builtin graphmod raised before it had names for them, so ``except
ValueError`` written against earlier versions still catches them. Every message names the
culprit (manager, variable path, shape, argument) and the fix.

Examples:
    >>> import graphmod as gm
    >>> issubclass(gm.errors.ManagerMatchedNothing, ValueError)
    True
    >>> try:
    ...     raise gm.errors.VariablesMismatch("variables['model'] misses /.W")
    ... except ValueError as error:
    ...     print(type(error).__name__, error)
    VariablesMismatch variables['model'] misses /.W
"""

from __future__ import annotations

from flax.errors import TraceContextError

__all__ = [
    "AttributeOutlivesTrace",
    "GraphmodError",
    "GraphmodWarning",
    "ManagerConflict",
    "ManagerMatchedNothing",
    "ManagerReentered",
    "ModelChanged",
    "StateEscapesTransform",
    "VariablesMismatch",
]


class GraphmodError(Exception):
    """Base of graphmod's named errors: ``except gm.errors.GraphmodError`` catches them all.

    Examples:
        >>> import graphmod as gm
        >>> issubclass(gm.errors.StateEscapesTransform, gm.errors.GraphmodError)
        True
    """


class GraphmodWarning(UserWarning):
    """The category of graphmod's warnings (a ``UserWarning``; a deprecation is a
    ``DeprecationWarning``, ``NaNGuard``'s skipped steps a ``RuntimeWarning``). A warning
    names the line of your code that led to it, not one of graphmod's, so filter graphmod's
    warnings by this category rather than by module.

    Examples:
        >>> import warnings, graphmod as gm
        >>> issubclass(gm.errors.GraphmodWarning, UserWarning)
        True
        >>> with warnings.catch_warnings(record=True) as shown:
        ...     warnings.simplefilter("always")
        ...     warnings.filterwarnings("ignore", category=gm.errors.GraphmodWarning)
        ...     warnings.warn("a batch the mesh cannot split", gm.errors.GraphmodWarning)
        >>> shown
        []
    """


class ManagerMatchedNothing(GraphmodError, ValueError):
    """A strict manager's filter selected no variable of any application call in a trace.

    Fix the filter (``program.graph(...).filter(manager.filter)`` shows what it selects), or
    pass ``strict=False`` to the manager.

    Examples:
        >>> import graphmod as gm
        >>> issubclass(gm.errors.ManagerMatchedNothing, ValueError)
        True
    """


class ManagerConflict(GraphmodError, ValueError):
    """Two managers cannot both act: the same name in one program, or two exclusive
    rewrites of one variable.

    Examples:
        >>> import graphmod as gm
        >>> issubclass(gm.errors.ManagerConflict, ValueError)
        True
    """


class ManagerReentered(GraphmodError, RuntimeError):
    """A manager entered in a ``with`` block while it is already active (a manager applies
    once per chain). Enter it once, or make a second one with its own ``name=``.

    Examples:
        >>> import graphmod as gm, managers
        >>> dropout = managers.Dropout(0.5, roles=[gm.roles.OUTPUT])
        >>> with dropout:
        ...     try:
        ...         with dropout:
        ...             pass
        ...     except RuntimeError as error:
        ...         print(type(error).__name__)
        ManagerReentered
    """


class VariablesMismatch(GraphmodError, ValueError):
    """Variables that do not fit a program: another model's or program's, or a missing or
    unexpected entry, shape or dtype (named by path). Use the variables the program's
    ``init`` returns.

    Examples:
        >>> import graphmod as gm
        >>> issubclass(gm.errors.VariablesMismatch, ValueError)
        True
    """


class ModelChanged(GraphmodError, ValueError):
    """The model's modules or variables were replaced, added or removed after it was
    compiled (parameter surgery: ``model.head = nnx.Linear(...)``). A program holds the
    model it was compiled over, so it refuses to trace, init or write back to a changed one:
    compile again after changing the model, or change values in place
    (``variable[...] = ...``, ``program.update_model(variables)``).

    Examples:
        >>> import graphmod as gm
        >>> issubclass(gm.errors.ModelChanged, ValueError)
        True
    """


class StateEscapesTransform(GraphmodError, RuntimeError):
    """A value that must leave the trace (an updated variable, a monitored value, a new
    manager variable) was made inside a raw JAX transform or an NNX lifted transform
    (``jax.jit``, ``lax.scan``, ``nnx.vmap``, ``nnx.remat``, ...), which cannot return it.

    Use :func:`graphmod.scan` for recurrences and loops over layers, which carries manager
    state step by step, or return the value through the transform.

    Examples:
        >>> import graphmod as gm
        >>> issubclass(gm.errors.StateEscapesTransform, RuntimeError)
        True
    """


class AttributeOutlivesTrace(GraphmodError, TraceContextError):
    """A module of a compiled model was given a new attribute while the program traced (as
    Flax's examples store intermediates: ``self.kl_loss = Loss(...)``) and still had it when
    the traced function returned. A program's variables are fixed when it is compiled, so
    the module is left as it was: take the value off again in the function
    (``nnx.pop(model, Loss)``), or return it with ``self.sow(...)`` to monitor it.

    Examples:
        >>> import flax, graphmod as gm
        >>> issubclass(gm.errors.AttributeOutlivesTrace, flax.errors.TraceContextError)
        True
    """

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)  # not Flax's: its link names Flax's own errors
