"""What a manager hook or an application method knows about one application call.

:class:`ApplicationCall` is read-only, like Haiku's ``GetterContext``: the brick, path,
application, call id and mode, the variable a hook rewrites, and three verbs (``rng()``,
``variable()``, ``add_auxiliary_variable()``). The chain runner that made it
(``graphmod._core._tracing._chain``) does the rest.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from graphmod import roles as _roles
from graphmod._core._loops._loop_keys import Layer, mark
from graphmod._core._tracing._variables import identity_of
from graphmod.typing import ArrayLike

if TYPE_CHECKING:
    from graphmod._core._managers._manager import Manager
    from graphmod._core._model._layout import VariableInfo
    from graphmod._core._tracing._frame import Frame, OwnedInit, OwnedKey

# A value tagged as an auxiliary variable (a measurement: an array), given back as it came.
A = TypeVar("A")
M = TypeVar("M", bound=ArrayLike)


class OwnedVariable:
    """A manager-owned variable of one application: read and write ``.value``.

    ``.stored`` is the value the step began with, whatever the trace wrote since: an update
    computed from it gives the same value however often a step makes it (a parameter read
    by two calls, each running the hook that updates the parameter's variable).

    Examples:
        >>> # inside a manager hook: stats = call.variable("mean", jnp.zeros(4))
        >>> # stats.value = 0.9 * stats.value + 0.1 * batch_mean
        >>> # average.value = 0.9 * average.stored + 0.1 * call.parameter_value
    """

    __slots__ = ("_frame", "_key", "_layer")

    def __init__(self, frame: Frame, key: OwnedKey, layer: Layer = tuple) -> None:
        self._frame = frame
        self._key = key
        self._layer = layer  # an ensemble's member reads and writes its slice

    @property
    def value(self) -> jax.Array:
        return self._frame.read_owned(self._key, layer=self._layer)

    @value.setter
    def value(self, new: jax.Array) -> None:
        if self._frame.training and self._frame.mode != "init":
            self._frame.set_owned(self._key, new, self._layer)
        # inference and init never update state: the update is dropped on purpose

    @property
    def stored(self) -> jax.Array:
        """The value the step began with, whatever the trace wrote since (read-only)."""
        return self._frame.read_owned(self._key, stored=True, layer=self._layer)


class CallRunner(Protocol):
    """What an :class:`ApplicationCall` asks of the chain runner that made it."""

    frame: Frame

    def auxiliary(self, value: object, role: _roles.Role, name: str) -> None: ...

    def arrays(self) -> list[jax.Array]: ...

    def layer_arrays(self) -> list[jax.Array]: ...


@dataclasses.dataclass(frozen=True, eq=False)
class ApplicationCall:
    """One call of an application; what managers and the method know about it.

    Attributes:
        brick: the brick whose application runs.
        application: the application's name.
        path: the brick's path in the model (``"/layers/0"``), None outside a program.
        call_id: how many earlier calls of this (path, application) the trace saw.
        training: whether the program runs in training mode.
        manager: in a manager's hook, that manager, else None.
        role, name: in a ``rewrite_*`` hook, the role and name of the variable rewritten.
        parameter: in a ``rewrite_parameter`` hook, the parameter's path
            (``"/linear1.kernel"``), else None.
        parameter_value: in a ``rewrite_parameter`` hook, the parameter's stored value as
            this call reads it, before any manager's rewrite (a layer's slice inside
            ``nnx.scan``).

    It is read-only: hooks read it and draw keys and variables through it; the plumbing
    of the call (tags, rewrites, monitors) belongs to the chain runner, which hooks never
    see.

    Examples:
        >>> import graphmod as gm
        >>> class Scale(gm.Brick):
        ...     @gm.application(inputs=["x"], outputs=["y"])
        ...     def apply(self, x, application_call):
        ...         return x * (2.0 if application_call.training else 1.0)
        >>> Scale().apply(3.0)  # eagerly: not training
        3.0
    """

    brick: nnx.Module
    application: str
    path: str | None
    call_id: int
    training: bool
    manager: Manager | None = None
    role: _roles.Role | None = None
    name: str | None = None
    parameter: str | None = None
    parameter_value: jax.Array | None = dataclasses.field(default=None, repr=False)
    # The chain runner that made this call (None outside a compiled program).
    _runner: CallRunner | None = dataclasses.field(default=None, repr=False)

    @property
    def _frame(self) -> Frame | None:
        return None if self._runner is None else self._runner.frame

    # -- public API for methods and managers ------------------------------------------
    @property
    def mesh(self) -> jax.sharding.Mesh | None:
        """The program's ``jax.sharding.Mesh`` (``compile(mesh=...)``, its axes ``Auto``),
        None on one device or outside a program: what ``managers.Sharding`` constrains
        activations on."""
        frame = self._frame
        return None if frame is None else frame.mesh

    def rng(self, *, per_step: bool = True, per_call: bool = False,
            per_variable: bool = True) -> jax.Array:
        """A key for this call: the step key folded with CRC32 of (manager, path,
        application, role, variable name) and the call id; inside ``graphmod.scan`` also
        the step index, inside a loop JAX traces once (``nnx.scan`` over layers,
        ``nnx.fori_loop``) the iteration's position (unless ``per_step=False``: one key for
        every step); under ``compile(axis_name=...)`` also the device index. Under ``vmap``
        (an ``nnx.vmap`` ensemble, a vmapped function) where the call's inputs or its
        layer's own parameters are mapped, also the mapped element's index, so each member
        draws its own numbers (with ``per_step=False`` too: one key per member for every
        step).

        In a ``rewrite_parameter`` hook the key is the parameter's, not the call's: folded
        with (manager, parameter path, role, name) only, so every application call that
        reads the parameter in a step (tied weights: an embedding's ``apply`` and
        ``attend``; a layer called twice) sees one draw, as Blocks' one noisy copy of a
        shared variable per graph. ``per_call=True`` keys it by the call instead.

        On a mesh (``compile(mesh=...)``, ``jax.jit`` with shardings) the key holds no
        device index: every device draws its slice of the one-device draw, so masks equal
        the one-device program's. Inside ``shard_map`` or ``pmap`` a function sees one
        device's shard: compile with ``axis_name=`` there, so each device draws its own.
        """
        frame = self._frame
        if frame is None or self.path is None:
            raise RuntimeError(
                f"call.rng() in {type(self.brick).__name__}.{self.application} needs a "
                "compiled program: outside graphmod.compile managers do nothing and there "
                "is no step key"
            )
        parameter = None if per_call else self.parameter  # keyed by the parameter
        parts = (
            self.manager.name if self.manager is not None else "",
            self.path if parameter is None else parameter,
            self.application if parameter is None else "",
            self.role.name if self.role is not None and per_variable else "",
            (self.name or "") if per_variable else "",
        )
        return frame.rng(parts, self.call_id if parameter is None else 0, per_step=per_step,
                         witnesses=self._witnesses)

    def _witnesses(self) -> list[jax.Array]:
        """The arrays of this call (what a draw under ``vmap`` is folded by, when mapped)."""
        arrays = self._runner.arrays() if self._runner is not None else []
        return arrays if self.parameter_value is None else [self.parameter_value, *arrays]

    def init_key(self, seed: int) -> jax.Array:
        """A key for a variable's initial value (:meth:`variable`), from ``seed`` alone: the
        same at every ``init``; in a loop body over stacked layers (``nnx.scan``), folded
        with the layer's position, so layer ``i`` draws from ``fold_in(key, i)`` and no
        two layers start alike (LoRA's ``A``); for a member of an ensemble (``nnx.vmap``),
        folded with the member's index.

        Examples:
            >>> import jax, jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> class Gain(gm.Manager):  # a random gain per output unit
            ...     def rewrite_parameter(self, call, name, value):
            ...         draw = lambda: jax.random.uniform(call.init_key(7), value.shape[-1:])
            ...         return value * call.variable("g", draw, role=gm.roles.PARAMETER).value
            >>> lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
            >>> with Gain(roles=[gm.roles.WEIGHT]):
            ...     program = gm.compile(lambda m, x: m(x), lin)
            >>> g = program.init(jnp.ones((1, 2)))["managers"]["gain"]["/"]["kernel"]["g"]
            >>> bool(jnp.array_equal(g, jax.random.uniform(jax.random.key(7), (3,))))
            True
        """
        key = jax.random.key(seed)
        frame = self._frame
        if frame is None or not frame.inner():
            return key
        assert self._runner is not None
        return mark(key, self._runner.layer_arrays())  # per layer, per ensemble member

    def variable(
        self, name: str, init: OwnedInit, *, role: _roles.Role = _roles.STATE,
        per_call: bool = False,
        per_parameter: bool | None = None,
    ) -> OwnedVariable:
        """A variable owned by the current manager for this (path, application), or in a
        ``rewrite_parameter`` hook for this parameter.

        Created at ``init``. ``init`` is an array, a zero-argument callable computed from
        the shapes it sees, or — in a parameter hook — a callable of one argument, given the
        parameter's initial value (weight norm's ``g = ||W||``). Shared by all call ids
        unless ``per_call=True``. ``per_parameter`` (default: True in parameter hooks) keys
        it by the parameter rather than the application, so two parameters of one
        application get two variables and a tied parameter read by two applications one;
        it lives at ``variables["managers"][manager][owner path][parameter name][name]``.

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> class Norm(gm.Manager):  # weight norm: W * g / ||W||, g starts at ||W||
            ...     def rewrite_parameter(self, call, name, value):
            ...         norm = lambda w: jnp.linalg.norm(w, axis=0)
            ...         g = call.variable("g", norm, role=gm.roles.PARAMETER)
            ...         return value * g.value / norm(value)
            >>> class Two(nnx.Module):
            ...     def __init__(self):
            ...         self.a = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
            ...         self.b = nnx.Linear(3, 1, rngs=nnx.Rngs(1))
            ...     def __call__(self, x):
            ...         return self.b(self.a(x))
            >>> model = Two()
            >>> with Norm(roles=[gm.roles.WEIGHT]):
            ...     program = gm.compile(lambda m, x: m(x), model)
            >>> owned = program.init(jnp.ones((1, 2)))["managers"]["norm"]
            >>> sorted(owned), owned["/a"]["kernel"]["g"].shape
            (['/a', '/b', 'hparams'], (3,))
        """
        frame = self._frame
        if frame is None or self.path is None:
            raise RuntimeError(f"call.variable({name!r}) needs a compiled program")
        if self.manager is None:
            raise RuntimeError(f"call.variable({name!r}) is for managers' hooks")
        _roles.as_role(role, argument="call.variable(role=...)")
        if per_parameter is None:
            per_parameter = self.parameter is not None
        key = self._owned_key(self.manager, self.path, name, per_call, per_parameter)
        given = self.parameter_value if per_parameter and _takes_one_argument(init) else None
        assert self._runner is not None
        layer = self._runner.layer_arrays
        frame.owned_value(key, init, role, given, len(_layers(self.brick, frame)), layer)
        return OwnedVariable(frame, key, layer)

    def _owned_key(self, manager: Manager, path: str, name: str, per_call: bool,
                   per_parameter: bool) -> OwnedKey:
        """The key of this call's (at ``path``; or parameter's) owned variable ``name``."""
        if not per_parameter:
            return (manager.name, path, self.application, self.call_id if per_call else None,
                    name)
        if self.parameter is None or per_call:
            raise ValueError(
                f"manager {manager.name!r}: call.variable({name!r}, per_parameter=True) "
                + ("is for rewrite_parameter hooks; this call rewrites an input or output"
                   if self.parameter is None else
                   "cannot also be per_call: a parameter's variable is shared by its calls")
            )
        owner, _, parameter = self.parameter.rpartition(".")
        return (manager.name, owner, parameter, None, name)

    def add_auxiliary_variable(
        self, value: A, *, roles: Sequence[_roles.Role] = (), name: str | None = None
    ) -> A:
        """Tags ``value`` as an auxiliary variable of this call (monitorable); returns it.

        With ``roles=[graphmod.roles.COST]`` it is also an auxiliary cost: a scalar that
        :func:`graphmod.optimize` adds to the cost it differentiates and reports in its
        metrics, summed by owner (the manager's name, or ``path.application.name``). A
        manager's cost in a ``rewrite_parameter`` hook counts once per parameter and step
        (however many calls read it); one in a loop over stacked layers (``nnx.scan``) is
        each layer's, summed over the layers."""
        role_list = _roles.as_roles(roles, argument="add_auxiliary_variable(roles=...)")
        role = role_list[0] if role_list else _roles.AUXILIARY
        name = name or role.name.lower()
        if self._runner is not None and self.path is not None:
            self._runner.auxiliary(value, role, name)
            if role.is_a(_roles.COST):
                self._add_cost(value, name)
        return value

    def report(self, value: M, name: str) -> M:
        """Tags ``value`` (a scalar measurement of this call, e.g. an activation's mean) as
        an auxiliary variable ``name``, and has :func:`graphmod.optimize` report it in its
        metrics as ``"<manager>:<path>.<application>.<name>"``, fused into the step (no
        host sync); returns it.

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> class Mean(gm.Manager):
            ...     def rewrite_output(self, call, name, value):
            ...         call.report(value.mean(), f"{name}.mean")
            ...         return value
            >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
            >>> program = gm.compile(lambda m, x: m(x).sum(), lin,
            ...                      managers=[Mean(roles=[gm.roles.OUTPUT])])
            >>> step = gm.optimize(program, optax.sgd(0.1))
            >>> state = step.init(program.init(jnp.ones((1, 2))), jax.random.key(0))
            >>> sorted(step(state, jnp.ones((3, 2)))[1])
            ['loss', 'mean:/.apply.output.mean']
        """
        self.add_auxiliary_variable(value, roles=[_roles.AUXILIARY], name=name)
        if self._runner is not None and self.path is not None:
            owner = self.manager.name if self.manager is not None else "report"
            call = f"#{self.call_id}" if self.call_id else ""
            frame = self._runner.frame
            frame.add_measurement(f"{owner}:{self.path}.{self.application}{call}.{name}", value,
                                  layers=_layers(self.brick, frame),
                                  layer=self._runner.layer_arrays)
        return value

    def _add_cost(self, value: object, name: str) -> None:
        refused = (f"add_auxiliary_variable(..., roles=[COST], name={name!r}) in "
                   f"{self.path}.{self.application}: a cost must be a float scalar")
        if not isinstance(value, ArrayLike):
            raise ValueError(f"{refused}, got a {type(value).__name__}")
        if jnp.ndim(value) != 0 or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise ValueError(
                f"{refused}, got shape {jnp.shape(value)} and dtype {jnp.result_type(value)} "
                "(reduce it, e.g. with .sum())")
        where = self.parameter if self.parameter is not None and self.manager is not None \
            else f"{self.path}.{self.application}#{self.call_id}"
        owner = self.manager.name if self.manager is not None \
            else f"{self.path}.{self.application}.{name}"
        assert self._runner is not None
        frame = self._runner.frame
        frame.add_cost(owner, f"{owner}:{where}.{name}", value,
                       layers=_layers(self.brick, frame), layer=self._runner.layer_arrays)


def stacked_slices(brick: nnx.Module, frame: Frame) -> Iterator[tuple[VariableInfo, int]]:
    """``brick``'s own variables the trace in progress sees a slice of (inside a loop over
    stacked layers, an ensemble's vmap), each with how many leading axes the slice lacks."""
    for value in vars(brick).values():
        identity = identity_of(value) if isinstance(value, nnx.Variable) else None
        info = None if identity is None else frame.layout.by_identity.get(identity)
        stacked = 0 if info is None else len(info.shape) - jnp.ndim(value.get_raw_value())
        if info is not None and stacked > 0:  # the stored variable has the loops' axes
            yield info, stacked


def _layers(brick: nnx.Module, frame: Frame) -> tuple[int, ...]:
    """The lengths of the loops over layers stacked on leading axes when the trace in
    progress sees a slice of ``brick``'s own variables; ``()`` when it sees the whole (a
    cell broadcast over steps, or no loop at all)."""
    if not frame.inner():
        return ()
    for info, stacked in stacked_slices(brick, frame):
        return tuple(info.shape[:stacked])
    return ()


def _takes_one_argument(init: object) -> bool:
    """Whether an owned variable's ``init`` is a callable of exactly one required argument
    (given the parameter's value), not of none (computed from shapes) or an array."""
    if not callable(init) or hasattr(init, "shape"):
        return False
    try:
        parameters = inspect.signature(init).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called with nothing
        return False
    required = [p for p in parameters if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1

