"""Where a program's arrays live on a device mesh: JAX's SPMD sharding, chosen by rules.

``compile(..., mesh=, rules=[(VariableFilter, PartitionSpec), ...], batch_axis=)`` makes a
:class:`Placement`. ``init`` puts each model variable with the ``PartitionSpec`` of the
first rule whose filter selects it (replicated when none does); ``train``, ``infer`` and
``optimize``'s step split their batch arguments along ``batch_axis`` inside their jitted
functions, where placing costs no dispatch time (XLA splits a NumPy batch as it is passed,
and one the ``Loop`` placed ahead with :meth:`Placement.put_batch` stays where it is), and
constrain the variables they return to the same placement, so a step's outputs are its
next inputs and nothing retraces. The mesh's axes are used as ``Auto`` axes (whatever
``jax.make_mesh`` made them): XLA's SPMD partitioner propagates the shardings through the
model code, so the program is the one-device program run on the mesh (the same losses,
gradients and random masks, to float rounding).

Sharp edges
    A manager's variable owned per parameter (LoRA's ``a`` and ``b``, WeightNorm's ``g``)
    follows its parameter: each of its dimensions, matched from the right, takes the
    parameter's mesh axis where the two sizes agree, and is whole elsewhere. Variables owned
    per application call (BatchNorm's statistics) and hyperparameters are replicated, except
    the leading axes a layer's variables stack over scanned layers or an ensemble's members:
    placed as all the layer's parameters are there, when they agree (an ensemble split over
    devices keeps each member's statistics on its devices).
    A batch leaf whose leading size the batch axis does not divide (a last, smaller
    evaluation batch) is replicated, not refused: the result is the same, only slower; the
    trace warns, naming the shape and a batch size that divides.
    A batch committed to devices other than the mesh's is refused by JAX ("incompatible
    devices"): NumPy and uncommitted arrays are split as they are passed.
    With several processes, every process must pass the same batch (the loop's data sources,
    seeded alike, do): each cuts its own devices' rows from its copy (:func:`put`). The
    loop compares the first batch of a run across processes; later ones are not compared,
    which would cost an all-gather of every batch.
    A mesh the user set (``jax.set_mesh``, explicit axes as Flax's guides set them) is not
    the program's: every jitted function is traced on the program's own mesh
    (:func:`on_mesh`), and the loop and evaluations run under it (:func:`mesh_context`),
    where JAX checks the arrays' meshes against the context's. The arrays a program
    returns stay on its mesh of ``Auto`` axes: outside graphmod, under an explicit mesh,
    work on them in ``with jax.set_mesh(program.placement.mesh):`` or a ``jax.jit``. A
    program without a mesh traced under the user's puts its arguments that are on no mesh
    on the user's, whole (:func:`batch_on_mesh`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from graphmod._core._model._layout import Layout
from graphmod._core._model._owned_layout import map_leaves
from graphmod._core._selection._rules import (
    axis_names,
    check_rules_select,
    checked_rules,
    first_rule,
)
from graphmod._core._warn import warn
from graphmod.typing import AxisName, PyTree, ShardingRule, Variables

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")  # a tree handed back placed, of the structure it came in

__all__ = ["Placement", "batch_on_mesh", "init_mesh", "mesh_context", "on_mesh", "put"]


class Placement:
    """A mesh, rules that place variables on it, and the axis batches are split along.

    Examples:
        >>> import jax, graphmod as gm
        >>> from flax import nnx
        >>> from jax.sharding import PartitionSpec as P
        >>> from graphmod._core._sharding import Placement
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 4, rngs=nnx.Rngs(0)))
        >>> placement = Placement(mesh, [(gm.VariableFilter(roles=[gm.roles.WEIGHT]),
        ...                               P(None, "data"))], "data", layout=program.layout)
        >>> placement.variables(program.init(jax.numpy.ones((1, 2))), program.layout)[
        ...     "model"]["W"].spec
        P(None, 'data')
    """

    def __init__(self, mesh: Mesh, rules: Sequence[ShardingRule],
                 batch_axis: AxisName | None, *, layout: Layout | None = None) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"compile(mesh=...): expected a jax.sharding.Mesh (e.g. "
                            f"jax.make_mesh((8,), ('data',))), got {type(mesh).__name__}")
        # XLA's sharding propagation (axes of type Auto) runs unmodified model code; explicit
        # axes (jax.make_mesh's default) would ask it to name the sharding of some results.
        self.mesh = Mesh(mesh.devices, mesh.axis_names,
                         axis_types=(AxisType.Auto,) * len(mesh.axis_names))
        self.rules = checked_rules(mesh, rules)
        batch_axis = tuple(batch_axis) if isinstance(batch_axis, list) else batch_axis
        for axis in axis_names(batch_axis):
            if axis not in mesh.axis_names:
                raise ValueError(f"compile(batch_axis={batch_axis!r}): the mesh has no axis "
                                 f"{axis!r}; its axes are {tuple(mesh.axis_names)}")
        self.batch_axis = batch_axis
        # Made once: batches are placed at every call.
        self._whole = NamedSharding(self.mesh, PartitionSpec())
        self._split = [NamedSharding(self.mesh, PartitionSpec(*[None] * dim, batch_axis))
                       for dim in (0, 1)]  # a batch; a stack of batches (fused steps)
        self._batch_size = math.prod(self.mesh.shape[a] for a in axis_names(batch_axis))
        if layout is not None:
            for index, (rule_filter, _) in enumerate(self.rules):
                layout.resolve(rule_filter.brick_instances(), f"compile(rules[{index}])")
            check_rules_select(self.rules, layout)

    def __repr__(self) -> str:
        rules = ", ".join(f"({f!r}, {spec})" for f, spec in self.rules)
        return (f"Placement(mesh={dict(self.mesh.shape)}, rules=[{rules}], "
                f"batch_axis={self.batch_axis!r})")

    # -- variables -----------------------------------------------------------------------
    def variables(self, variables: Mapping, layout: Layout) -> dict:
        """A ``NamedSharding`` for every leaf of ``variables``, in its nesting.

        Raises ``ValueError`` naming the variable, its shape and the rule when a rule's
        spec does not fit the variable (more dimensions, or a size the axes do not divide).
        """
        specs: dict[str, tuple[PartitionSpec, tuple[int, ...]]] = {}
        stacks: dict[str, set[tuple]] = {}  # layer path -> its parameters' stacked axes' specs

        def model(node: object, key: tuple) -> object:
            if isinstance(node, Mapping):
                return {k: model(v, (*key, k)) for k, v in node.items()}
            info, shape = layout.by_key[key], tuple(jax.typeof(node).shape)
            spec = self._model_spec(layout, key, shape)
            specs[info.path] = (spec, shape)
            stacks.setdefault(info.path.rpartition(".")[0], set()).add(
                (*spec, *[None] * len(shape))[:layout.stacked(info.identity)])
            return NamedSharding(self.mesh, spec)

        placed = {"model": model(variables["model"], ())}

        def owned(key: tuple, value: object) -> NamedSharding:
            followed = specs.get(f"{key[1]}.{key[2]}") if len(key) == 5 else None
            if followed is None:  # per application call: as its layer's stacked axes
                stacked = stacks.get(key[1], set()) if len(key) == 5 else set()
                leading = next(iter(stacked)) if len(stacked) == 1 else ()
                fits = len(leading) <= len(jax.typeof(value).shape)  # stacked as its layer
                return NamedSharding(self.mesh, PartitionSpec(*leading if fits else ()))
            return NamedSharding(self.mesh, _follow(*followed, tuple(jax.typeof(value).shape)))

        placed["managers"] = map_leaves(variables["managers"], owned)
        return placed

    def _model_spec(self, layout: Layout, key: tuple, shape: tuple[int, ...]) -> PartitionSpec:
        spec = first_rule(self.rules, "rules", layout, key, shape, self.mesh, "variable")
        return PartitionSpec() if spec is None else spec

    def constrain(self, variables: Variables, layout: Layout) -> Variables:
        """``variables`` (traced) constrained to their placement: a step's outputs are
        placed as its inputs, so the next call neither moves nor retraces anything."""
        return jax.lax.with_sharding_constraint(variables, self.variables(variables, layout))

    # -- batches -------------------------------------------------------------------------
    def _batch_leaf(self, leaf: object, dim: int) -> NamedSharding:
        """Split along the batch axis where the leaf's size divides the batch dimension
        (the leading one; the second for the stacked batches of a fused run), replicated
        otherwise (scalars, small last batches)."""
        shape = getattr(leaf, "shape", ())
        if self.batch_axis is None or len(shape) <= dim or shape[dim] % self._batch_size:
            return self._whole
        return self._split[dim]

    def put_batch(self, tree: T, *, stacked: bool = False, compare: bool = False) -> T:
        """``tree``'s arrays put on the mesh, split along the batch axis; a batch already
        placed so (the loop's, put ahead) is returned as it is, at the cost of a look.
        ``compare``: with several processes, check that each passed the same batch first
        (see :func:`put_leaf`)."""
        split = self._split[int(stacked)]
        # Split by this placement already (device_put keeps the sharding object): the look
        # costs 1 µs instead of 4-6.
        if all(getattr(leaf, "sharding", None) is split for leaf in jax.tree.leaves(tree)):
            return tree

        def place(leaf: object) -> object:  # not the module's put: one batch leaf, looked at
            sharding = self._batch_leaf(leaf, int(stacked))
            if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer) \
                    and leaf.sharding == sharding:
                return leaf
            return put_leaf(leaf, sharding, compare=compare)

        return jax.tree.map(place, tree)

    def constrain_batch(self, tree: T, *, stacked: bool = False) -> T:
        """``tree`` (traced batch arguments) constrained to the placement :meth:`put_batch`
        gives: XLA then splits a NumPy or uncommitted batch over the mesh as it is passed,
        and a batch already placed (the loop's) stays where it is. Warns (once per trace)
        of rows the batch axis does not divide."""
        self._warn_undivided(tree, int(stacked))
        return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(
            leaf, self._batch_leaf(leaf, int(stacked))), tree)

    def _warn_undivided(self, tree: PyTree, dim: int) -> None:
        if self.batch_axis is None:
            return
        # The leaves with rows that _batch_leaf replicates, the batch axis not dividing them
        shapes = sorted({tuple(np.shape(leaf)) for leaf in jax.tree.leaves(tree)
                         if np.ndim(leaf) > dim and self._batch_leaf(leaf, dim) is self._whole})
        if not shapes:
            return
        n, rows = self._batch_size, shapes[0][dim]
        warn(
            f"a batch argument of shape {shapes[0]} is not split over the {n} devices of "
            f"batch axis {self.batch_axis!r}: its {rows} rows are not a multiple of {n}, so "
            "every device computes the whole batch (the same result, without the speed-up). "
            f"Use a batch size that is a multiple of {n} (e.g. {max(n, rows - rows % n)}); "
            "for a last, smaller batch, drop it (ArraySource(drop_remainder=True))")

    def replicated(self) -> NamedSharding:
        """The placement of a leaf no rule names (the step count, the key, the optimizer's
        counters)."""
        return self._whole


def on_mesh(f: Callable[P, R], placement: Placement | None) -> Callable[P, R]:
    """``f`` (a function ``jax.jit`` traces) traced on ``placement``'s mesh, whatever mesh
    the caller set with ``jax.set_mesh``; ``f`` itself without a placement.

    JAX refuses an operation on arrays of one mesh under another context mesh (the
    program's axes are ``Auto``, a mesh set for Flax's explicit sharding is not). Only
    the trace enters the mesh: a compiled call pays nothing.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import AxisType
        >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
        >>> placement = Placement(mesh, [], "data")
        >>> with jax.set_mesh(mesh):
        ...     jax.jit(on_mesh(lambda x: 2 * x, placement))(jnp.ones(2)).tolist()
        [2.0, 2.0]
    """
    if placement is None:
        return f
    mesh = placement.mesh.abstract_mesh

    @functools.wraps(f)
    def traced(*args: P.args, **kwargs: P.kwargs) -> R:
        with jax.sharding.use_abstract_mesh(mesh):
            if any(map(_explicit, jax.tree.leaves((args, kwargs)))):
                args, kwargs = jax.tree.map(
                    lambda leaf: jax.sharding.reshard(leaf, PartitionSpec())
                    if _explicit(leaf) else leaf, (args, kwargs))
            return f(*args, **kwargs)

    return traced


def _explicit(leaf: object) -> bool:
    """Whether ``leaf`` is an array typed on a mesh with explicit axes (made under a
    ``jax.set_mesh`` of the user's): retyped for the program's ``Auto`` axes, as
    ``jax.sharding.auto_axes`` retypes its arguments, XLA then places it."""
    mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None) \
        if isinstance(leaf, jax.Array) else None
    return mesh is not None and AxisType.Explicit in getattr(mesh, "axis_types", ())


def mesh_context(placement: Placement | None) -> contextlib.AbstractContextManager:
    """The program's mesh set as the context mesh (``jax.set_mesh``) for code working on
    its arrays outside a trace (the loop's, an evaluation's): under a mesh the user set
    with explicit axes, JAX refuses even ``a + 1`` on an array of the program's mesh. In a
    trace (``jax.eval_shape`` of an init), where JAX refuses ``set_mesh``, its abstract mesh.

    Examples:
        >>> import jax
        >>> placement = Placement(jax.make_mesh((1,), ("data",)), [], "data")
        >>> with mesh_context(placement):
        ...     jax.sharding.get_abstract_mesh().axis_names
        ('data',)
    """
    if placement is None:
        return contextlib.nullcontext()
    try:
        return jax.set_mesh(placement.mesh)
    except ValueError:  # "set_mesh can only be used outside of jax.jit"
        return jax.sharding.use_abstract_mesh(placement.mesh.abstract_mesh)


def init_mesh(placement: Placement | None) -> contextlib.AbstractContextManager:
    """The context mesh ``init`` evaluates model code under: the program's
    (:func:`mesh_context`), for code that names its axes (``with_sharding_constraint``, as
    Flax's SPMD guide writes it); the user's, if one is set (explicit-sharding code reads it).

    Examples:
        >>> import jax
        >>> with init_mesh(Placement(jax.make_mesh((1,), ("data",)), [], "data")):
        ...     jax.sharding.get_abstract_mesh().axis_names
        ('data',)
    """
    empty = jax.sharding.get_abstract_mesh().empty
    return mesh_context(placement if empty else None)


def batch_on_mesh(tree: T, placement: Placement | None, *, split: bool) -> T:
    """A program's traced arguments ``tree`` on its mesh: split along the batch axis where
    ``split`` (see :meth:`Placement.constrain_batch`); without a placement, those that are
    on no mesh (passed from NumPy) put whole on the mesh the user set with ``jax.set_mesh``,
    if any, where explicit-sharding model code (``reshard``, ``out_sharding=``, as Flax's
    miniGPT writes it) needs them and from which it splits them itself.

    Examples:
        >>> import jax, numpy as np
        >>> seen = []  # the traced argument's mesh, before and after
        >>> def f(x):
        ...     seen.extend(jax.typeof(y).sharding.mesh.axis_names
        ...                 for y in (x, batch_on_mesh(x, None, split=True)))
        ...     return x
        >>> with jax.set_mesh(jax.make_mesh((1,), ("batch",))):
        ...     _ = jax.jit(f)(np.ones(2))
        >>> seen
        [(), ('batch',)]
    """
    if placement is not None:
        return placement.constrain_batch(tree) if split else tree
    if jax.sharding.get_abstract_mesh().empty:
        return tree
    return jax.tree.map(lambda leaf: jax.sharding.reshard(leaf, PartitionSpec()) if isinstance(
        leaf, jax.Array) and jax.typeof(leaf).sharding.mesh.empty else leaf, tree)


def put(tree: T, shardings: PyTree) -> T:
    """``tree`` placed leaf by leaf as ``shardings`` (a tree of its structure) says, by
    :func:`put_leaf`.

    Examples:
        >>> import jax, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> whole = NamedSharding(jax.make_mesh((1,), ("data",)), P())
        >>> put({"x": np.ones(2)}, {"x": whole})["x"].sharding == whole
        True
    """
    return jax.tree.map(put_leaf, tree, shardings)


def put_leaf(leaf: object, sharding: NamedSharding, *, compare: bool = False) -> jax.Array:
    """``jax.device_put(leaf, sharding)``, without an all-gather across processes.

    For a sharding over several processes' devices, ``jax.device_put`` of a host value
    (NumPy, a scalar, an array on this process's devices) first checks that every process
    passed the same value: an all-gather of all of it, which waits for every process, at
    every call. Unless ``compare`` asks for that check, each process here cuts its own
    devices' pieces from its copy, as ``jax.make_array_from_callback`` does, so every
    process must pass the same value. On one process this is ``jax.device_put``.

    Examples:
        >>> import jax, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> split = NamedSharding(jax.make_mesh((1,), ("data",)), P("data"))
        >>> put_leaf(np.arange(4.0), split).sharding == split
        True
    """
    if compare or sharding.is_fully_addressable or not _cuttable(leaf):
        return jax.device_put(leaf, sharding)
    host = np.asarray(leaf)
    return jax.make_array_from_callback(host.shape, sharding, host.__getitem__)


def _cuttable(leaf: object) -> bool:
    """Whether each process can cut its pieces of ``leaf`` from a NumPy copy and get what
    ``jax.device_put`` gives: NumPy arrays and arrays on this process's devices, but not
    keys, tracers, Python scalars (weakly typed in JAX) or arrays already across processes."""
    if isinstance(leaf, np.ndarray | np.generic):
        return True
    return (isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer)
            and leaf.is_fully_addressable and not leaf.weak_type
            and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def _follow(spec: PartitionSpec, parameter: tuple[int, ...], shape: tuple[int, ...]
            ) -> PartitionSpec:
    """The spec of a variable owned for a parameter: dimension by dimension from the right,
    the parameter's axis where the sizes agree, whole elsewhere."""
    entries = tuple(spec) + (None,) * (len(parameter) - len(spec))
    out = []
    for offset in range(1, len(shape) + 1):
        dim = len(parameter) - offset
        same = dim >= 0 and parameter[dim] == shape[-offset]
        out.append(entries[dim] if same else None)
    return PartitionSpec(*reversed(out))
