"""Variable types that carry a role, and the read/write redirection that makes rewrites work.

Inside a compiled program every variable of the model reads the program's value for it (a
tracer), possibly rewritten by the managers of the innermost application call, and writes go
to the program's output instead of the stored array. The redirection lives in
:class:`Tracked`: ``get_value``/``set_value`` consult the current frame, and ``__getattr__``
forwards array attributes (``W.T``, ``W.reshape``, ``W.astype``, ``W.sum()``) to the
redirected value, since Flax forwards them to the raw array otherwise.

graphmod's own types (:class:`Parameter`, :class:`Weight`, :class:`Bias`, :class:`Filter`,
:class:`State`) are tracked by construction. Plain Flax variables inside a model are
*adopted* at compile: their class is switched to a tracked subclass of the same name that
behaves identically outside a program (no array is touched). Each variable also gets a
stable identity in its metadata, which survives the split/merge of ``nnx.remat`` where
Python's ``id()`` does not.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from flax import nnx
from flax.typing import MISSING

from graphmod import roles
from graphmod._context import current_frame

__all__ = ["Bias", "Filter", "Parameter", "State", "Weight"]

IDENTITY_KEY = "graphmod_identity"


class Tracked:
    """Mixin: reads and writes go through the active program's frame, if any."""

    __slots__ = ()

    def get_value(self, *, index: Any = MISSING) -> Any:
        frame = current_frame()
        found, value = (False, None) if frame is None else frame.read(self)
        if not found:
            return super().get_value(index=index)  # type: ignore[misc]
        if index is MISSING or index is ...:
            return value
        return value[index]

    def set_value(self, value: Any, *, index: Any = MISSING) -> None:
        frame = current_frame()
        if frame is None or not frame.holds(self):
            super().set_value(value, index=index)  # type: ignore[misc]
            return
        if index is not MISSING and index is not ...:
            value = frame.stored(self).at[index].set(value)
        frame.write(self, value)

    # NNX transforms (nnx.remat, nnx.jit, ...) write raw values back into the variables
    # they were given. While a program traces, its frame holds the values: drop those
    # writes rather than store a tracer in the model (or trip Flax's trace-level check).
    def set_raw_value(self, value: Any, **kwargs: Any) -> None:
        if not _held(self):
            super().set_raw_value(value, **kwargs)  # type: ignore[misc]

    def update_from_state(self, variable_state: Any) -> None:
        if not _held(self):
            super().update_from_state(variable_state)  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        metadata = object.__getattribute__(self, "_var_metadata")
        if name in metadata:
            return metadata[name]
        return getattr(self.get_value(), name)


def _held(variable: Any) -> bool:
    frame = current_frame()
    return frame is not None and frame.holds(variable)


class Parameter(Tracked, nnx.Param):
    """A trainable parameter with role ``PARAMETER``.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> p = gm.Parameter(jnp.zeros(3))
        >>> p.role, p.shape
        (PARAMETER, (3,))
    """

    role = roles.PARAMETER


class Weight(Parameter):
    """A weight matrix or tensor (role ``WEIGHT``).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> gm.Weight(jnp.ones((2, 3))).T.shape
        (3, 2)
    """

    role = roles.WEIGHT


class Filter(Weight):
    """A convolution filter (role ``FILTER``, a kind of ``WEIGHT``).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> gm.Filter(jnp.ones((3, 3, 1, 4))).role
        FILTER
    """

    role = roles.FILTER


class Bias(Parameter):
    """A bias vector (role ``BIAS``).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> gm.Bias(jnp.zeros(4)).role
        BIAS
    """

    role = roles.BIAS


class State(Tracked, nnx.BatchStat):
    """Non-trainable persistent state, such as running statistics (role ``STATE``).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> gm.State(jnp.zeros(4)).role
        STATE
    """

    role = roles.STATE


def role_of(variable: nnx.Variable, name: str) -> roles.Role:
    """The role of a model variable: its own, else by Flax type and attribute name.

    Other Flax variables (``RngCount``, ``RngKey``, ...) are ``CARRIED``: state that the
    program threads through, never rewritten.
    """
    own = getattr(type(variable), "role", None)
    if isinstance(own, roles.Role):
        return own
    if isinstance(variable, nnx.Param):
        if name in ("kernel", "embedding"):
            return roles.WEIGHT
        if name == "bias":
            return roles.BIAS
        return roles.PARAMETER
    if isinstance(variable, nnx.BatchStat):
        return roles.STATE
    return roles.CARRIED


@functools.cache
def tracked_class(cls: type) -> type:
    """A subclass of Flax variable class ``cls`` whose reads go through the frame.

    Cached so a class is adopted once; it keeps the original's name for display.
    """
    if issubclass(cls, Tracked):
        return cls

    def __reduce__(self: Any) -> tuple[Any, ...]:
        # Pickle and deepcopy as the original class, adopted again on load.
        return _unpickle_adopted, (cls, self.__getstate__())

    return type(
        cls.__name__, (Tracked, cls), {"__module__": cls.__module__, "__reduce__": __reduce__}
    )


def _unpickle_adopted(cls: type, state: dict[str, Any]) -> nnx.Variable:
    variable = cls.__new__(cls)
    variable.__setstate__(state)
    adopt(variable)
    return variable


def adopt(variable: nnx.Variable) -> None:
    """Switches a plain Flax variable to its tracked subclass (no array is touched)."""
    cls = type(variable)
    if not issubclass(cls, Tracked):
        object.__setattr__(variable, "__class__", tracked_class(cls))


def identity_of(variable: nnx.Variable) -> str | None:
    """The identity stored in ``variable``'s metadata, or None before its first compile."""
    metadata = object.__getattribute__(variable, "_var_metadata")
    return metadata.get(IDENTITY_KEY)


def assign_identity(variable: nnx.Variable) -> str:
    """Gives ``variable`` a fresh identity (used once, and for copies that share one)."""
    identity = uuid.uuid4().hex
    object.__getattribute__(variable, "_var_metadata")[IDENTITY_KEY] = identity
    return identity
