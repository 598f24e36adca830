"""Warnings shown at the user's line: the first frame, going out from the caller, of code
that is neither graphmod's, its managers', nor the libraries that run it (JAX, Flax, optax,
orbax, chex, and the standard library's context managers, wrappers and threads).

A warning raised while a program traces (a batch the mesh does not split, a Flax layer held
in eval mode) then names the line of the user's script or notebook cell that called
``program.infer(...)``, or the line of the model that called the layer, instead of a line of
graphmod's own files; Python's once-per-location filter counts that line too. A
``DeprecationWarning``, which Python shows only for ``__main__``'s lines, is seen. Since the
user's module is named, a filter on ``module="graphmod"`` no longer selects these: filter on
the category, :class:`graphmod.errors.GraphmodWarning`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from types import FrameType

from graphmod.errors import GraphmodWarning

# Top-level modules whose frames are never the user's line.
_LIBRARIES = frozenset({"graphmod", "managers", "jax", "jaxlib", "flax", "optax", "orbax",
                        "chex", "contextlib", "functools", "threading", "concurrent"})


def _library(frame: FrameType) -> bool:
    return str(frame.f_globals.get("__name__", "")).partition(".")[0] in _LIBRARIES


def warn(message: str, category: type[Warning] = GraphmodWarning, *,
         past: Callable[[FrameType], bool] | None = None) -> None:
    """``warnings.warn(message, category)`` (by default a
    :class:`graphmod.errors.GraphmodWarning`) at the user's line (see the module docstring),
    also past the frames ``past`` names (a user's subclass's ``__init__`` calling its
    base's); at the caller's line where every frame is a library's (a thread of graphmod's).

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn("careful", RuntimeWarning)
        >>> caught[0].category.__name__, str(caught[0].message)
        ('RuntimeWarning', 'careful')
    """
    frame: FrameType | None = sys._getframe(1)
    level = 2  # warnings.warn's stacklevel of our caller's frame
    while frame is not None and (_library(frame) or (past is not None and past(frame))):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
