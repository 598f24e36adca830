"""Manager-owned variables as one trace of a program sees them.

A manager's ``call.variable(...)`` is created at ``init`` and read and written by later
traces. Inside a loop body that JAX traces once (a scan over layers) a variable of an
application whose parameters the loop slices is one per iteration (under an ensemble's
``vmap``, one per member): stored stacked with the loops' lengths as leading axes, created,
read and written as the iteration's slice through the markers of
``graphmod._core._loops._loop_keys``; in a body that sees the whole module (a cell broadcast over
time steps) it is one variable shared by every iteration, which the body cannot update nor
create from a parameter's value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeAlias

import jax
import jax.numpy as jnp
from jax.core import Tracer

from graphmod import roles as _roles
from graphmod._core._loops._loop_keys import Layer, eager, named, read_slice, stacked, write_slice
from graphmod._core._tracing._trace import TraceScope, current_trace
from graphmod.errors import StateEscapesTransform, VariablesMismatch
from graphmod.typing import ArrayLike

# (manager name, brick path, application, call_id or None, variable name)
OwnedKey = tuple[str, str, str, int | None, str]
# A variable's ``init`` as the store calls it: its value, or a function of nothing or of the
# parameter's value (the call passes that value only to a function of one argument).
_Init: TypeAlias = "ArrayLike | Callable[..., ArrayLike]"


class _Check(Protocol):
    """Raises if a value made now could not leave the trace, naming ``what`` makes it and
    ``where`` (default: the application call in progress)."""

    def __call__(self, what: str, where: str | None = None, /) -> None: ...


class OwnedStore:
    """The owned variables of one trace, their roles, and what the trace wrote.

    ``check(what, where)`` raises if a value made now could not leave the trace (the frame's
    check, which names the application call in progress).

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import roles
        >>> from graphmod._core._model._owned import OwnedStore
        >>> from graphmod._core._tracing._trace import TraceScope
        >>> store = OwnedStore({}, "init", TraceScope(), lambda what, where=None: None)
        >>> key = ("bn", "/lin", "apply", None, "mean")
        >>> store.ensure(key, jnp.zeros(3), roles.STATE)
        >>> store.read(key).shape
        (3,)
    """

    def __init__(self, owned: Mapping[OwnedKey, jax.Array], mode: str, scope: TraceScope,
                 check: _Check) -> None:
        self.values = dict(owned)
        self._found = owned  # as the trace began, never written
        self.roles: dict[OwnedKey, _roles.Role] = {}
        self.updated: set[OwnedKey] = set()
        self._mode = mode
        self._scope = scope
        self._check = check
        # Met in inner traces (loop bodies): the shape of one iteration's slice, the slice
        # each trace wrote last (keys created or written there: stacked at the end), the
        # keys met in bodies that broadcast the module.
        self._slices: dict[OwnedKey, tuple[int, ...]] = {}
        self._pending: dict[OwnedKey, tuple[object, jax.Array]] = {}  # (trace, slice)
        self._shared: set[OwnedKey] = set()

    def ensure(self, key: OwnedKey, init: _Init, role: _roles.Role,
               parameter: jax.Array | None = None, stacked: int = 1,
               layer: Layer = tuple) -> None:
        """Makes sure ``key`` exists: created at ``init`` from ``init`` (an array, a
        callable of nothing: shapes only, or given the parameter's value, of it); one per
        iteration of the ``stacked`` loops around it that slice its layer (0: one shared by
        every iteration; see the module docstring)."""
        inner = self._scope.inner()
        if inner and not stacked:
            self._shared.add(key)
        if key not in self.values:
            self.values[key] = self._created(key, init, parameter, inner, stacked, layer)
            self.roles[key] = role
        elif self._mode == "init" and key in self._pending and inner and (
                self._pending[key][0] != current_trace()):  # traced again
            self._write_slice(key, _fresh_slice(init, parameter, self.values[key]), stacked,
                              layer)
        elif inner and key not in self._slices:
            self._slices[key] = tuple(
                jnp.shape(init) if not callable(init)
                else jax.eval_shape(init, parameter).shape if parameter is not None
                else jax.eval_shape(init).shape)

    def _created(self, key: OwnedKey, init: _Init, parameter: jax.Array | None, inner: bool,
                 stacked: int, layer: Layer) -> jax.Array:
        manager, path, application, call_id, name = key
        if self._mode != "init":
            raise VariablesMismatch(
                f"manager {manager!r} has no variable {name!r} for {application!r} of "
                f"{path}" + (f" (call {call_id})" if call_id is not None else "")
                + " in these variables: make them with this program's init (or a program "
                "compiled over the same model and managers)"
            )
        if parameter is not None and not (inner and stacked):
            # From the parameter's value: traced by init's own jit, never in an inner
            # trace whose values could not leave it (a module every iteration shares).
            self._check(f"manager {manager!r} creating {name!r} from "
                        f"parameter {path}.{application}")
            return jnp.asarray(_made(init, parameter))
        if not inner:  # traced by init's own jit: no eager dispatch per variable
            return jnp.asarray(_made(init, None))
        if parameter is not None:  # from a layer's (a member's) slice: that slice's value
            value = jnp.asarray(_made(init, parameter))
            self._write_slice(key, value, stacked, layer)
            with jax.ensure_compile_time_eval():  # only its shape: the stack is written
                return jnp.zeros(value.shape, value.dtype)
        # From shapes only: computed eagerly, so a variable first met inside an inner trace
        # (jax.jit, a scan body) does not leak a tracer; stacked over the loops around it
        # at the end of init's trace.
        with jax.ensure_compile_time_eval(), eager():
            value = jnp.asarray(_made(init, None))
        if isinstance(value, Tracer):
            raise ValueError(
                f"manager {manager!r}: the initial value of {name!r} at {path} "
                "depends on traced values; build it from shapes only (e.g. "
                "jnp.zeros(n)) or, in a rewrite_parameter hook, from the parameter "
                "(init=lambda w: ...)"
            )
        if stacked:
            self._write_slice(key, _fresh_slice(init, parameter, value), stacked, layer)
        return value

    def _depth(self, key: OwnedKey) -> int:
        """How many loops ``key`` is stacked over (0 outside loops, or not stacked)."""
        stored = jnp.shape(self.values[key])
        shape = self._slices.get(key, stored)
        return len(stored) - len(shape) if stored[len(stored) - len(shape):] == shape else 0

    def read(self, key: OwnedKey, layer: Layer = tuple) -> jax.Array:
        """``key`` as the current trace sees it: in a loop body the iteration's slice (its
        last write in this trace, else the stored stack's slice)."""
        if not self._scope.inner():
            if key in self._pending and self._mode != "init":
                raise StateEscapesTransform(
                    f"{named(key)} is read outside the loop body that updated it in this "
                    "step")
            return self.values[key]
        pending = self._pending.get(key)
        if pending is not None and pending[0] == current_trace():
            return pending[1]
        depth = self._depth(key)
        return read_slice(self.values[key], depth, key, layer()) if depth else self.values[key]

    def stored(self, key: OwnedKey, layer: Layer = tuple) -> jax.Array:
        """``key`` as the trace found it, whatever it wrote since (in a loop body: that
        value's slice for the iteration); at ``init``, as created."""
        value = self._found.get(key, self.values[key])
        depth = self._depth(key) if self._scope.inner() else 0
        return read_slice(value, depth, key, layer()) if depth else value

    def write(self, key: OwnedKey, value: ArrayLike, layer: Layer = tuple) -> None:
        """Sets ``key`` (in a loop body: the iteration's slice) to ``value``."""
        old = self.values[key]
        inner = self._scope.inner()
        if inner and key in self._shared:
            self._check(f"updating {key[0]} variable {key[4]!r}, shared by every "
                        "iteration of a loop over one module (every element of a vmap that "
                        "leaves the module whole, both branches of a cond)",
                        f"application {key[2]!r} of {key[1]}")
        shape = old.shape[self._depth(key):] if inner else old.shape
        if jnp.shape(value) != shape:
            raise ValueError(
                f"manager {key[0]!r}: new value of {key[4]!r} at {key[1]} has shape "
                f"{jnp.shape(value)}, expected {shape}"
            )
        array = jnp.asarray(value, old.dtype)
        if inner:
            self._write_slice(key, array, self._depth(key), layer)
        else:
            self.values[key] = array
        self.updated.add(key)

    def _write_slice(self, key: OwnedKey, value: jax.Array, depth: int, layer: Layer) -> None:
        write_slice(value, key, depth, layer())
        self._pending[key] = (current_trace(), value)

    def carried(self, values: Mapping[OwnedKey, jax.Array], *, updated: bool) -> None:
        """Takes the values a ``graphmod.scan`` carried (``updated``: as written)."""
        self.values.update(values)
        if updated:
            self.updated.update(values)

    def out(self) -> dict[OwnedKey, jax.Array]:
        """The variables at the end of the trace: those created or updated in loop bodies
        as the stack of every iteration's slice."""
        fresh = self._mode == "init"
        return {key: stacked(value, key, fresh=fresh) if key in self._pending else value
                for key, value in self.values.items()}


def _made(init: _Init, parameter: jax.Array | None) -> ArrayLike:
    """What ``init`` makes: of the parameter's value where there is one, of nothing if it
    is a function, else ``init`` itself."""
    if not callable(init):
        return init
    return init(parameter) if parameter is not None else init()


def _fresh_slice(init: _Init, parameter: jax.Array | None, value: jax.Array) -> jax.Array:
    """An iteration's initial slice of a variable created as ``value``, traced in the loop
    body: from this iteration's slice of the parameter, or with a key marked in ``init``
    (``call.init_key``) that draws each layer its own."""
    if parameter is None and not callable(init):
        return value
    return jnp.asarray(_made(init, parameter), jnp.result_type(value))
