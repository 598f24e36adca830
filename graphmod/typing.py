"""Types for code written against graphmod: the data it passes and the objects hooks receive.

Aliases name the plain data graphmod's functions take and return (:data:`Variables`,
:data:`Batch`, :data:`KeyLike`, :data:`ArrayTree`, :data:`Metrics`, :data:`JSON`,
:data:`ShardingRule`, ...); Protocols name what a plugin or a manager may use of the
objects handed to it (:class:`LoopLike` in ``Plugin.setup(loop)`` and ``event.loop``,
:class:`HookContext` in a manager's ``rewrite_input``/``rewrite_output``/
``rewrite_parameter``, :class:`WrapContext` in its ``wrap``), as Haiku's ``typing`` and
optax's ``base`` do. The Protocols are ``runtime_checkable``: ``isinstance`` checks that
the members exist (not their signatures).

This module sits in the core layer and imports only :mod:`graphmod.roles`, so any layer may
annotate with it. The aliases' examples live in attribute docstrings, which
``--doctest-modules`` does not collect: ``tests/test_typing.py`` runs them.

Examples:
    >>> import jax.numpy as jnp, graphmod as gm
    >>> from flax import nnx
    >>> from graphmod.typing import HookContext
    >>> class Halve(gm.Manager):
    ...     def rewrite_output(self, call: HookContext, name: str, value: jnp.ndarray):
    ...         return value / 2
    >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)),
    ...                      managers=[Halve(roles=[gm.roles.OUTPUT])])
    >>> variables: gm.typing.Variables = program.init(jnp.ones((1, 2)))
    >>> sorted(variables)
    ['managers', 'model']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, runtime_checkable

import jax
import numpy as np
from flax import nnx

from graphmod.roles import Role

if TYPE_CHECKING:  # the core's filter and rule, for annotations (they import this module)
    from graphmod._core._selection._filter import VariableFilter
    from graphmod._core._selection._per_layer import PerLayer

__all__ = [
    "JSON",
    "Array",
    "ArrayLike",
    "ArrayTree",
    "AxisName",
    "Batch",
    "HookContext",
    "InputTransforms",
    "KeyLike",
    "LoopLike",
    "LossScale",
    "Metrics",
    "Model",
    "ModelLayout",
    "OwnedVariableLike",
    "PathLike",
    "ProgramContext",
    "PyTree",
    "Shape",
    "ShardingRule",
    "TimeLike",
    "Variables",
    "WrapContext",
]

Variables: TypeAlias = dict[str, dict[str, Any]]
"""What ``program.init`` returns and ``train``/``infer`` take: plain nested dicts of arrays,
``{"model": <the model's NNX state>, "managers": {name: {"hparams": ..., <path>: ...}}}``.

Examples:
    >>> import jax.numpy as jnp, graphmod as gm
    >>> from flax import nnx
    >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
    >>> variables: gm.typing.Variables = program.init(jnp.ones((1, 2)))
    >>> sorted(variables["model"]), variables["managers"]
    (['W', 'b'], {})
"""

Batch: TypeAlias = dict[str, Any] | tuple[Any, ...] | list[Any] | jax.Array | np.ndarray
"""One batch of a loop's data, as the step receives it: a dict is passed by name, a tuple or
a list by position, anything else (an array, another pytree) as the one argument.

Examples:
    >>> import numpy as np, graphmod as gm
    >>> from graphmod.data import ArraySource
    >>> batch: gm.typing.Batch = next(iter(ArraySource((np.ones((4, 2)),), batch_size=2)))
    >>> type(batch).__name__, batch[0].shape
    ('tuple', (2, 2))
"""

KeyLike: TypeAlias = jax.Array | np.ndarray
"""A JAX random key: a typed key (``jax.random.key(0)``) or its raw ``jax.random.key_data``
(uint32), as ``rng=`` arguments take it; a plain int is refused (pass ``jax.random.key(n)``).

Examples:
    >>> import jax, jax.numpy as jnp, graphmod as gm
    >>> from flax import nnx
    >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
    >>> key: gm.typing.KeyLike = jax.random.key_data(jax.random.key(1))
    >>> program.init(jnp.ones((1, 2)), rng=key)["model"]["W"].shape
    (2, 1)
"""


Array: TypeAlias = jax.Array
"""A JAX array (a tracer while a program traces).

Examples:
    >>> import jax.numpy as jnp, graphmod as gm
    >>> x: gm.typing.Array = jnp.ones((2, 3))
    >>> x.shape
    (2, 3)
"""

ArrayLike: TypeAlias = jax.Array | np.ndarray | np.generic | bool | int | float
"""What becomes an array: a JAX or NumPy array, a NumPy scalar or a Python number (what
``jnp.asarray`` takes; a metric's value, a cost).

Examples:
    >>> import numpy as np, graphmod as gm
    >>> values: list[gm.typing.ArrayLike] = [1, 0.5, np.float32(2), np.ones(3)]
    >>> [np.asarray(v).shape for v in values]
    [(), (), (), (3,)]
"""

ArrayTree: TypeAlias = (jax.Array | np.ndarray | np.generic | bool | int | float
                        | Mapping[str, "ArrayTree"] | Sequence["ArrayTree"] | None)
"""Plain nested dicts, lists and tuples of arrays (and numbers): the values that cross
``jax.jit`` in graphmod (variables, batches, outputs, optimizer states of plain data).

Examples:
    >>> import jax, jax.numpy as jnp, graphmod as gm
    >>> tree: gm.typing.ArrayTree = {"W": jnp.ones((2, 2)), "b": [jnp.zeros(2), 0.5]}
    >>> len(jax.tree.leaves(tree))
    3
"""

PyTree: TypeAlias = object
"""Any pytree JAX flattens: an :data:`ArrayTree`, a registered dataclass (a
:class:`graphmod.TrainState`), an ``nnx.State``, an optax state... Annotates what graphmod
only hands to ``jax.tree`` functions, never looks into.

Examples:
    >>> import jax, optax, graphmod as gm
    >>> state: gm.typing.PyTree = optax.sgd(0.1).init({"w": jax.numpy.ones(2)})
    >>> len(jax.tree.leaves(state))
    0
"""

Model: TypeAlias = nnx.Pytree
"""The root a program compiles: any ``flax.nnx.Module`` (graphmod's bricks included) or
other ``nnx.Pytree``.

Examples:
    >>> import graphmod as gm
    >>> from flax import nnx
    >>> model: gm.typing.Model = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> isinstance(model, nnx.Pytree)
    True
"""

Metrics: TypeAlias = dict[str, ArrayLike]
"""A step's or an evaluation's metrics by name (``{"loss": ..., "accuracy": ...}``), each a
scalar (on the device until read).

Examples:
    >>> import graphmod as gm
    >>> metrics: gm.typing.Metrics = {"loss": 0.25, "accuracy": 0.9}
    >>> sorted(metrics)
    ['accuracy', 'loss']
"""

JSON: TypeAlias = bool | int | float | str | list["JSON"] | dict[str, "JSON"] | None
"""A value JSON writes and reads back as it was: what provenance records, checkpoints' meta
and control requests hold (never pickled objects).

Examples:
    >>> import json, graphmod as gm
    >>> record: gm.typing.JSON = {"step": 3, "tags": ["a"], "loss": 0.5, "done": None}
    >>> json.loads(json.dumps(record)) == record
    True
"""

Shape: TypeAlias = tuple[int, ...]
"""An array's shape.

Examples:
    >>> import jax.numpy as jnp, graphmod as gm
    >>> shape: gm.typing.Shape = jnp.ones((2, 3)).shape
    >>> shape
    (2, 3)
"""

PathLike: TypeAlias = str | os.PathLike[str]
"""A directory or file, as a string or a ``pathlib.Path`` (``program.save(directory)``,
``Loop(directory=)``).

Examples:
    >>> import pathlib, graphmod as gm
    >>> where: gm.typing.PathLike = pathlib.Path("runs") / "digits"
    >>> str(where)
    'runs/digits'
"""

AxisName: TypeAlias = str | tuple[str, ...]
"""A mesh axis, or several (``compile(batch_axis=)``, ``axis_name=``).

Examples:
    >>> import graphmod as gm
    >>> axes: list[gm.typing.AxisName] = ["data", ("data", "model")]
    >>> [a if isinstance(a, str) else "+".join(a) for a in axes]
    ['data', 'data+model']
"""

ShardingRule: TypeAlias = "tuple[VariableFilter, jax.sharding.PartitionSpec | PerLayer]"
"""One of ``compile(rules=[...])``: the variables a filter selects, placed by a
``PartitionSpec``, or by one for each layer of a stack (``graphmod.sharding.per_layer``);
the first rule that selects a variable places it.

Examples:
    >>> import graphmod as gm
    >>> from jax.sharding import PartitionSpec
    >>> rule: gm.typing.ShardingRule = (gm.VariableFilter(roles=[gm.roles.WEIGHT]),
    ...                                 PartitionSpec(None, "model"))
    >>> rule[1]
    P(None, 'model')
"""


@runtime_checkable
class TimeLike(Protocol):
    """A point on every timeline of a loop (``loop.time``, ``event.time``): a
    :class:`graphmod.Time`.

    Examples:
        >>> import graphmod as gm
        >>> isinstance(gm.Time(step=3), gm.typing.TimeLike), isinstance(3, gm.typing.TimeLike)
        (True, False)
    """

    @property
    def step(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    @property
    def examples(self) -> int: ...

    @property
    def seconds(self) -> float: ...

    @property
    def train_seconds(self) -> float: ...


PluginT = TypeVar("PluginT")  # what LoopLike.on registers, handed back


@runtime_checkable
class LoopLike(Protocol):
    """The loop as a plugin sees it (``Plugin.setup(loop)``, ``teardown``, ``event.loop``):
    a :class:`graphmod.Loop`.

    Attributes:
        step: the train step the loop calls, ``step(state, *batch) -> (state, metrics)``.
        data: the iterable of batches (one pass per epoch).
        state: the current train state (valid while an event is dispatched).
        time: the current time on every timeline.
        start_time: the time at which the current run started or resumed.
        metrics: the latest step's metrics, on the device until read.
        trace: the bounded record of plugin dispatches (what ``Timing`` reads).

    Examples:
        >>> import graphmod as gm
        >>> loop = gm.Loop(lambda state, x: (state, {}), [1, 2])
        >>> isinstance(loop, gm.typing.LoopLike), isinstance(object(), gm.typing.LoopLike)
        (True, False)
    """

    # Mutable members match the loop's own declarations exactly (a Protocol's attribute is
    # invariant): the step and batches are the user's, as the loop stores them.
    step: Callable[..., Any]
    data: Iterable[Any]
    state: PyTree

    @property  # read-only: a property (the loop's) never matches a mutable attribute
    def trace(self) -> Iterable[Any]: ...

    @property
    def time(self) -> TimeLike: ...

    @property
    def start_time(self) -> TimeLike: ...

    @property
    def metrics(self) -> Mapping[str, ArrayLike]: ...

    def on(self, template: Any, plugin: PluginT, *, priority: int | None = None
           ) -> PluginT:
        """Registers ``plugin`` for the events ``template`` (an ``On(...)`` or a type
        name) matches; returns it."""
        ...

    def fire(self, type: str, **data: object) -> None:
        """Queues an event of ``type`` issued by the plugin being dispatched."""

    def terminate(self, reason: str | None = None) -> None:
        """Stops the run after the current step, saying why."""

    def update_state(self, fn: Callable[[Any], PyTree]) -> None:
        """Replaces the train state by ``fn(state)``, cast to each leaf's dtype."""

    def state_dict(self) -> dict[str, JSON]:
        """The loop's counters and timelines, JSON-serialisable (saved in checkpoints)."""
        ...

    def load_state_dict(self, meta: dict[str, JSON]) -> None:
        """Restores what :meth:`state_dict` returned."""


@runtime_checkable
class OwnedVariableLike(Protocol):
    """A manager-owned variable as ``call.variable(...)`` returns it: read and write
    ``.value`` (writes are kept in training only).

    Examples:
        >>> import graphmod as gm
        >>> class Box:
        ...     value = 0.0
        >>> isinstance(Box(), gm.typing.OwnedVariableLike)
        True
    """

    value: Any


ValueT = TypeVar("ValueT")  # a value a context tags or keeps, handed back as it came
MetricT = TypeVar("MetricT", bound="ArrayLike")  # a metric reported, handed back


@runtime_checkable
class HookContext(Protocol):
    """An application call as a manager's hooks see it (the ``call`` argument of
    ``rewrite_input``, ``rewrite_output`` and ``rewrite_parameter``), read-only like Haiku's
    ``GetterContext``: a :class:`graphmod.ApplicationCall`.

    Attributes:
        brick: the brick (or Flax module) whose application runs.
        path: its path in the model (``"/layers/0"``).
        application: the application's name (``"apply"``).
        call_id: how many earlier calls of this (path, application) the trace saw.
        training: whether the program runs in training mode.
        role: the role of the variable being rewritten (``INPUT``, ``OUTPUT``, ``WEIGHT``...).
        name: the name of the variable being rewritten (``"x"``, ``"W"``).
        parameter: in ``rewrite_parameter``, the parameter's path (``"/.W"``), else None.
        parameter_value: in ``rewrite_parameter``, its stored value before any rewrite.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> seen = []
        >>> class Look(gm.Manager):
        ...     def rewrite_output(self, call: gm.typing.HookContext, name, value):
        ...         count = call.variable("count", jnp.zeros(()))
        ...         seen.append((isinstance(call, gm.typing.HookContext), call.path, name,
        ...                      isinstance(count, gm.typing.OwnedVariableLike)))
        ...         return value
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: m(x), lin, managers=[Look(roles=[gm.roles.OUTPUT])])
        >>> _ = program.init(jnp.ones((1, 2)))
        >>> seen[0]
        (True, '/', 'output', True)
    """

    @property
    def brick(self) -> nnx.Module: ...

    @property
    def path(self) -> str | None: ...

    @property
    def application(self) -> str: ...

    @property
    def call_id(self) -> int: ...

    @property
    def training(self) -> bool: ...

    @property
    def role(self) -> Role | None: ...

    @property
    def name(self) -> str | None: ...

    @property
    def parameter(self) -> str | None: ...

    # as the call stores it: an array, or a slice inside nnx.scan
    @property
    def parameter_value(self) -> Any: ...

    def rng(self, *, per_step: bool = True, per_call: bool = False) -> jax.Array:
        """A key for this call: the step key folded with CRC32 of (manager, path,
        application, role, variable name) and the call id."""
        ...

    def variable(self, name: str, init: ArrayLike | Callable[..., jax.Array], *,
                 role: Role = ..., per_call: bool = False,
                 per_parameter: bool | None = None) -> OwnedVariableLike:
        """A variable owned by the current manager for this call's (path, application), or
        for the parameter in ``rewrite_parameter``; created at ``init``."""
        ...

    def add_auxiliary_variable(self, value: ValueT, *, roles: Sequence[Role] = (),
                               name: str | None = None) -> ValueT:
        """Tags ``value`` as an auxiliary variable of this call (monitorable); returns it."""
        ...


@runtime_checkable
class WrapContext(HookContext, Protocol):
    """An application call as a manager's ``wrap(call, next, args, kwargs)`` sees it: a
    :class:`HookContext`. The ``next`` a ``wrap`` calls applies the manager's own
    ``rewrite_input`` and ``rewrite_output`` around the rest of the chain.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> seen = []
        >>> class Around(gm.Manager):
        ...     def wrap(self, call: gm.typing.WrapContext, next, args, kwargs):
        ...         seen.append(isinstance(call, gm.typing.WrapContext))
        ...         return next(*args, **kwargs)
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: m(x), lin, managers=[Around()])
        >>> _ = program.init(jnp.ones((1, 2)))
        >>> seen
        [True]
    """


@runtime_checkable
class ProgramContext(Protocol):
    """One trace of a program's whole function as a manager's ``wrap_program(call, next,
    args, kwargs)`` sees it: which trace it is, and what a layer around the function may do
    in it (draw a key, own a variable, report a metric, run a function as inference sees
    it, choose between two ways of running on a traced flag).

    Attributes:
        model: the program's root brick (the function's first argument).
        function: the program's function ``fn(model, *args, **kwargs)``.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> seen = []
        >>> class Modes(gm.Manager):
        ...     def wrap_program(self, call: gm.typing.ProgramContext, next, args, kwargs):
        ...         seen.append((isinstance(call, gm.typing.ProgramContext), call.mode))
        ...         return next(*args, **kwargs)
        >>> lin = gm.bricks.Linear(1, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: m(x), lin, managers=[Modes()])
        >>> _ = program.init(jnp.ones((1, 1)))
        >>> seen
        [(True, 'init')]
    """

    @property
    def model(self) -> nnx.Module: ...

    @property
    def function(self) -> Callable[..., Any]: ...  # the user's: what it takes and returns

    @property
    def mode(self) -> str:
        """``"init"`` (the abstract trace that makes the variables), ``"train"`` or
        ``"infer"``."""
        ...

    @property
    def training(self) -> bool:
        """Whether the program runs in training mode (``init`` too)."""
        ...

    @property
    def name(self) -> str:
        """The function's name, as the rewrite trace shows it."""
        ...

    def rng(self, name: str = "") -> jax.Array:
        """The step key folded with CRC32 of (manager, ``name``); training only."""
        ...

    def variable(self, name: str, init: ArrayLike | Callable[[], jax.Array], *,
                 role: Role = ...) -> OwnedVariableLike:
        """A variable the manager owns for the program, created at ``init`` from ``init``."""
        ...

    def report(self, name: str, value: MetricT) -> MetricT:
        """Reports ``value`` in the train step's metrics as ``"<manager>.<name>"``."""
        ...

    def note_input(self, name: str, before: PyTree, after: PyTree) -> None:
        """Notes in the rewrite trace that the layer rewrote the function's argument."""

    def infer(self, fn: Callable[..., ValueT], *args: object, **kwargs: object) -> ValueT:
        """``fn(*args, **kwargs)`` as inference sees the program, without gradient."""
        ...

    def saved(self, value: ValueT) -> ValueT:
        """``value``, kept for the backward pass of a :meth:`switch`, not recomputed."""
        ...

    def switch(self, on: jax.Array | bool, when_on: Callable[[], ValueT],
               when_off: Callable[[], ValueT]) -> ValueT:
        """``when_on()`` where ``on`` holds, else ``when_off()`` (a ``lax.cond`` when
        ``on`` is traced)."""
        ...


@runtime_checkable
class ModelLayout(Protocol):
    """A model's variables as every program compiled over it lays them out
    (``program.layout``): each variable's canonical path and role, and each brick's path.
    What :meth:`graphmod.Manager.frozen_parameters` reads.

    Attributes:
        variables: one record per model variable, with its ``identity``, ``path``
            (``"/linear_layers/0.W"``), ``role``, ``name``, ``shape`` and ``dtype``.
        objects: the model's own ``nnx.Variable`` (or array leaf) of each, by identity.

    Examples:
        >>> import graphmod as gm
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([2, 3, 1], rngs=nnx.Rngs(0))
        >>> layout: gm.typing.ModelLayout = gm.compile(lambda m, x: m(x), mlp).layout
        >>> isinstance(layout, gm.typing.ModelLayout), layout.brick_path(mlp.linear_layers[1])
        (True, '/linear_layers/1')
        >>> [info.path for info in layout.variables][:2]
        ['/linear_layers/0.W', '/linear_layers/0.b']
    """

    @property
    def variables(self) -> Sequence[Any]: ...

    @property
    def objects(self) -> Mapping[str, Any]: ...

    def brick_path(self, brick: object) -> str | None:
        """The path of ``brick`` in the model (None for a module not in it)."""
        ...


@runtime_checkable
class InputTransforms(Protocol):
    """Transformations fitted on the training data that a program applies to its own
    arguments before its function runs, in every mode (``compile(..., transforms=)``);
    :class:`graphmod.data.FittedTransforms` is the one graphmod makes.

    A *field* names one argument of the compiled function after the model: a ``str`` is its
    parameter name (a dict batch's key), an ``int`` its position (a tuple batch's index).
    The program binds its ``(args, kwargs)`` to fields with the function's signature and
    hands over only the fields present in the call.

    Examples:
        >>> from graphmod.typing import InputTransforms
        >>> isinstance(object(), InputTransforms)
        False
    """

    def fields(self) -> tuple[str | int, ...]:
        """The fields these transformations check (every field of the training data)."""
        ...

    def transformed(self) -> tuple[str | int, ...]:
        """The fields they change (a part of :meth:`fields`): each must name an argument of
        the compiled function."""
        ...

    def check(self, arguments: Mapping[str | int, Any], where: str) -> None:
        """Raises ``ValueError`` naming the field, its shape or dtype and the fix when a value
        (an array or an abstract ``jax.ShapeDtypeStruct``, without its leading batch axis
        counted) differs from the training data's metadata; ``where`` names the caller."""
        ...

    def apply(self, arguments: Mapping[str | int, Any]) -> dict[str | int, Any]:
        """The transformed values of the fields given (traceable: jax.numpy only)."""
        ...

    def record(self) -> dict[str, JSON]:
        """A JSON description (kinds, fitted numbers, metadata) for provenance."""
        ...


@runtime_checkable
class LossScale(Protocol):
    """Loss scaling for a step that computes in a low dtype (float16), as
    ``graphmod.optimize(program, tx, loss_scale=...)`` uses it: the step differentiates
    ``scale(state, cost)``, ``unscale``s the gradients, applies the update only where they
    are all finite (a step that overflowed changes no variable and no optimizer state) and
    keeps ``adjust(state, finite)`` in ``TrainState.loss_scale``, so checkpoints hold it and
    a resumed run scales as the uninterrupted one. ``state`` is a dict of scalar arrays
    (what ``init`` returns). ``managers.DynamicLossScale`` is the one graphmod ships (jmp's).

    Examples:
        >>> from graphmod.typing import LossScale
        >>> isinstance(object(), LossScale)
        False
    """

    def init(self) -> dict[str, jax.Array]:
        """The first state (e.g. ``{"scale": 2.0 ** 15, "good_steps": 0}`` as arrays)."""
        ...

    def scale(self, state: Mapping[str, jax.Array], cost: jax.Array) -> jax.Array:
        """The cost the step differentiates (``cost * scale``)."""
        ...

    def unscale(self, state: Mapping[str, jax.Array], grads: Any) -> Any:
        """The gradients of the scaled cost, unscaled (each leaf in its own dtype)."""
        ...

    def adjust(self, state: Mapping[str, jax.Array], finite: jax.Array
               ) -> dict[str, jax.Array]:
        """The next state, from whether this step's gradients were all finite."""
        ...
