"""Variable types that carry a role, and the read/write redirection that makes rewrites work.

Inside a compiled program every variable of the model reads the program's value for it (a
tracer), possibly rewritten by the managers of the innermost application call, and writes go
to the program's output instead of the stored array. The redirection lives in
:class:`Tracked`: ``get_value`` is the parameter read
(:func:`~graphmod._core._tracing._parameter_read.read_parameter`), ``set_value`` writes to the
current frame, and ``__getattr__``
forwards array attributes (``W.T``, ``W.reshape``, ``W.astype``, ``W.sum()``) to the
redirected value, since Flax forwards them to the raw array otherwise. ``W.shape``,
``W.ndim`` and ``W.size`` are the stored array's: reading them runs no manager.

graphmod's own types (:class:`Parameter`, :class:`Weight`, :class:`Bias`, :class:`Filter`,
:class:`State`) are tracked by construction. Plain Flax variables of a model are *marked*
while a program traces it, and only then (:func:`mark_variable`, held by
``graphmod._core._tracing._context``): their class is switched to a tracked subclass of the
same name (equal to the original, see :func:`tracked_class`) and their metadata holds an identity,
which survives the split/merge of ``nnx.remat`` where Python's ``id()`` does not. Outside
traces the model is the user's own, unchanged: its classes, metadata and graph definition.

Inside a program, Flax's trace-level checks accept the model's variables and NNX nodes: a
write (``var.value += 1``, an ``nnx.Rngs`` count) goes to the program, and NNX lifted
transforms (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``...) take the program's values and give
back the non-parameter state they update. Their copies of a variable read their own value.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib, tracers
from flax.typing import MISSING

from graphmod import roles
from graphmod._core._tracing import _lifted_writes
from graphmod._core._tracing._context import current_frame
from graphmod._core._tracing._parameter_read import read_parameter
from graphmod.typing import ArrayLike

if TYPE_CHECKING:
    from flax.nnx.pytreelib import PytreeState

__all__ = ["Bias", "Filter", "Parameter", "State", "Weight"]

IDENTITY_KEY = "graphmod_identity"

if TYPE_CHECKING:  # a mixin of Flax variable classes, checked as one
    _VariableMixin = nnx.Variable
else:
    _VariableMixin = object


class Tracked(_VariableMixin):
    """Mixin: reads and writes go through the active program's frame, if any."""

    __slots__ = ()

    def get_value(self, *, index: object = MISSING) -> jax.Array:
        value = read_parameter(self)
        if value is None:
            return super().get_value(index=index)
        if index is MISSING or index is ...:
            return value
        return value[index]

    def set_value(self, value: ArrayLike, *, index: object = MISSING) -> None:
        frame = current_frame()
        if frame is None or not frame.holds(self):
            super().set_value(value, index=index)
            return
        if index is not MISSING and index is not ...:
            value = frame.stored(self).at[index].set(value)
        frame.write(self, value)

    # Flax refuses writes from a trace level other than the variable's creation (the
    # program's trace is one). A variable the frame holds is written to the frame, never to
    # the stored array: ``var.value += 1``, ``var[...] = x`` and an ``nnx.Rngs`` stream's
    # count update are then program state like any other write.
    def _check_can_update(self) -> None:
        if not (_held(self) or _lifted_writes.lifts(self)):
            super()._check_can_update()

    @property
    def _can_update(self) -> bool:
        return _held(self) or _lifted_writes.lifts(self) or super()._can_update

    # NNX lifted transforms (nnx.scan, nnx.vmap, nnx.remat, ...) take the raw values of the
    # variables they are given (as pytree leaves: the ``_raw_value`` slot) and write the
    # results back. While a program traces, the model's own variables yield the program's
    # values and take back non-parameter results (running statistics, RNG counts) into the
    # program, never into the model. The transform's copies hold its values (a layer's
    # slice inside nnx.scan/nnx.vmap): a copy reads its own (``read_parameter``).
    # Inside a graphmod.remat region, a copy's write at another trace level is kept by the
    # region (graphmod._core._tracing._lifted_writes) and read back from it.
    @property
    def _raw_value(self) -> jax.Array:
        frame = current_frame()
        if frame is not None and frame.holds(self):
            return frame.stored(self)
        lifted = _lifted_writes.read(self)
        return _RAW_VALUE.__get__(self) if lifted is None else lifted

    @_raw_value.setter
    def _raw_value(self, value: jax.Array) -> None:  # what NNX transforms write back
        frame = current_frame()
        if frame is not None and frame.holds(self):
            if frame.carries(self):
                frame.write(self, value)
        elif _lifted_writes.lifts(self):
            _lifted_writes.write(self, value)
        else:
            _RAW_VALUE.__set__(self, value)

    def update_from_state(self, variable_state: nnx.Variable) -> None:
        if _held(self):
            self._raw_value = variable_state.get_raw_value()
        else:
            super().update_from_state(variable_state)

    # The shape describes the stored array, which no manager changes: reading it (a parent's
    # ``self.layer.kernel.shape``, as Gemma's attention reads its heads) runs no manager, so
    # SpectralNorm does not iterate once more and nothing is recorded as a read.
    @property
    def shape(self) -> tuple[int, ...]:
        if current_frame() is None:
            return super().shape
        return tuple(np.shape(self._raw_value))

    def __getattr__(self, name: str) -> object:
        metadata = object.__getattribute__(self, "_var_metadata")
        if name in metadata:
            return metadata[name]
        if name in _OF_SHAPE and current_frame() is not None:
            return _OF_SHAPE[name](self.shape)
        return getattr(self.get_value(), name)


_OF_SHAPE = {"ndim": len, "size": math.prod}  # array attributes the shape alone answers


# The slot a Variable keeps its array in.
_RAW_VALUE: types.MemberDescriptorType = vars(nnx.Variable)["_raw_value"]


def _held(variable: nnx.Variable) -> bool:
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
        return parameter_role(name)
    if isinstance(variable, nnx.BatchStat):
        return roles.STATE
    return roles.CARRIED


def parameter_role(name: str) -> roles.Role:
    """The role of a Flax parameter by its attribute name (Flax's layers' names).

    Examples:
        >>> parameter_role("kernel"), parameter_role("bias"), parameter_role("scale")
        (WEIGHT, BIAS, PARAMETER)
    """
    if name in ("kernel", "embedding"):
        return roles.WEIGHT
    if name == "bias":
        return roles.BIAS
    return roles.PARAMETER


def store_raw(variable: nnx.Variable, value: ArrayLike) -> None:
    """Sets the array ``variable`` keeps, bypassing Flax's trace-level check (for
    graphmod's own stand-ins, filled while a program's trace starts)."""
    _RAW_VALUE.__set__(variable, value)


@functools.cache
def tracked_class(cls: type) -> type:
    """A subclass of Flax variable class ``cls`` whose reads go through the frame.

    Cached so a class is tracked once; it keeps the original's name for display and equals
    it (``==``, not ``is``), since Flax looks some variable types up by equality (the Linen
    bridge's collection names: ``nnx.variable_name_from_type``).
    """
    if issubclass(cls, Tracked):
        return cls

    def __reduce__(self: nnx.Variable) -> tuple[object, ...]:
        # Pickle and deepcopy as the original class, tracked again on load.
        return _unpickle_tracked, (cls, self.__getstate__())

    return _equal_to_original(type(cls))(cls.__name__, (Tracked, cls), {
        "__module__": cls.__module__, "__reduce__": __reduce__, "__slots__": (),
        "__graphmod_original__": cls})


@functools.cache
def _equal_to_original(meta: type) -> type:
    """A metaclass like ``meta`` whose classes equal their ``__graphmod_original__``."""

    def __eq__(cls: type, other: object) -> bool:
        return cls is other or cls.__graphmod_original__ is other  # type: ignore[attr-defined]

    return type(f"Tracked{meta.__name__}", (meta,), {"__eq__": __eq__,
                                                      "__hash__": meta.__hash__})


def _unpickle_tracked(cls: type[nnx.Variable], state: dict[str, object]) -> nnx.Variable:
    variable = cls.__new__(cls)
    variable.__setstate__(state)
    object.__setattr__(variable, "__class__", tracked_class(cls))
    return variable


def mark_variable(variable: nnx.Variable, identity: str) -> Callable[[], None]:
    """Switches a variable of a compiled model to its tracked class and stores ``identity``
    in its metadata, for one trace (copies made by NNX transforms keep both); returns the
    function that puts back what was there. No array is touched."""
    original = type(variable)
    previous = _metadata(variable).get(IDENTITY_KEY, _ABSENT)
    object.__setattr__(variable, "__class__", tracked_class(original))
    _metadata(variable)[IDENTITY_KEY] = identity

    def unmark() -> None:
        object.__setattr__(variable, "__class__", original)
        if previous is _ABSENT:  # Flax may have replaced the dict meanwhile: read it again
            _metadata(variable).pop(IDENTITY_KEY, None)
        else:
            _metadata(variable)[IDENTITY_KEY] = previous

    return unmark


_ABSENT = object()


def _metadata(variable: nnx.Variable) -> dict[str, Any]:  # Flax's type
    return object.__getattribute__(variable, "_var_metadata")


class _ModelTraceState(tracers.TraceState):
    """The trace state of a compiled model's NNX node (module, ``Rngs``...): as Flax's, and
    also valid while a program traces *and* Flax extracts the node for a lifted transform
    (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``, ``nnx.RNN``...). Its variables then yield
    the program's values (``Tracked._raw_value``). Rebinding an attribute of the node inside
    a program stays refused, as Flax refuses it in any trace (a new attribute is allowed
    for the trace: ``graphmod._core._bricks._intercept.assign_in_program``). Reads Flax internals
    (``graphlib.GRAPH_CONTEXT``): the Flax minor version is pinned in ``pyproject.toml``."""

    __slots__ = ()

    def is_valid(self) -> bool:
        return super().is_valid() or (
            current_frame() is not None and bool(graphlib.GRAPH_CONTEXT.ref_index_stack))


def adopt_node(node: object) -> PytreeState | None:
    """Gives an NNX node of a compiled model a :class:`_ModelTraceState` (same trace);
    returns the node's ``PytreeState`` holding it (None for other graph nodes).

    A lifted transform called inside a program replaces the ``PytreeState`` of the nodes it
    writes back (Flax rebuilds it, at the program's trace level): programs put the adopted
    one back around every trace (``Layout.reset_node_states``), so the model stays mutable
    outside programs.
    """
    if not isinstance(node, nnx.Pytree):
        return None
    state = node._pytree__state
    if isinstance(state.trace_state, _ModelTraceState):
        return state
    adopted = object.__new__(_ModelTraceState)
    object.__setattr__(adopted, "_jax_trace", state.trace_state.jax_trace)
    object.__setattr__(state, "_trace_state", adopted)
    return state


def identity_of(variable: nnx.Variable) -> str | None:
    """The identity of a variable of a model a program traces (also of the copies NNX
    transforms make of it), or None."""
    return _metadata(variable).get(IDENTITY_KEY)
