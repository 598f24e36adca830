"""Precision policies: ``MixedPrecision`` (compute, output and kept dtypes for a brick and
everything under it) and ``Precision`` (its one-dtype form).

The region of a policy
    A policy selects application calls (``bricks=``, ``applications=``, ``path=``,
    ``call_id=``: Blocks' rule, a brick's own applications); every application called
    inside a selected call is in its *region* too, however deep: the child ``nnx.Linear``
    of a selected Qwen3 ``MLP``, the attention and MLP of a selected decoder layer, each
    layer under ``nnx.scan``. Inside it, floating-point inputs and the parameters read are
    cast to the compute dtype, so every matrix product and convolution runs in it; stored
    parameters, their gradients and the optimizer state keep their own dtype (the casts are
    part of the differentiated function). The selected call's outputs are cast to
    ``output``. A policy selected inside another's region starts a region of its own (the
    innermost wins).

Kept applications
    Calls matched by ``keep=`` (normalisation layers by default) compute in ``keep_dtype``
    (float32): their inputs cast up, their parameters read as stored, their outputs cast
    back to the compute dtype; what they call is kept too.

Flax layers that fix their dtype
    Flax's layers cast their inputs and parameters to their own ``dtype`` (``nnx.Linear(...,
    dtype=jnp.float32)``, as Flax's examples build them): inside a region such a layer's
    ``dtype`` reads as the compute dtype for the duration of its call, restored when the call
    returns (also after an exception). It is the one attribute a policy touches;
    ``param_dtype`` is left alone.

Sharp edges
    The region is tracked while the program traces, by ``graphmod.Manager.region``: each
    policy's ``wrap`` opens it around the call; a call made outside the selected call's
    Python extent (a function traced earlier and replayed) is not in it. Integer inputs
    (token ids) and ``STATE`` variables (running statistics) are never cast.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeAlias, Unpack, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import graphmod as gm
from graphmod.typing import HookContext, PyTree, WrapContext
from managers._checks import ManagerOptions

if TYPE_CHECKING:  # what a filter's variable test takes, as graphmod.VariableFilter names it
    from graphmod._core._selection._filter import Tag

DTypeLike: TypeAlias = str | type | np.dtype
KeepLike: TypeAlias = "type | str | Iterable[type | str] | gm.VariableFilter | None"
"""What ``keep=`` takes: brick classes, class-name globs, or a filter of calls."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One call in a policy's region: its policy, what its inputs and parameters are cast
    to, what its outputs are cast to (None: left), and whether it is kept."""

    owner: str
    compute: np.dtype
    output: np.dtype | None
    kept: bool


def _innermost(owner: str) -> _Entry | None:
    """The innermost open call of the region of policy ``owner``, if it is the innermost
    of every manager's region (``graphmod.Manager.regions``)."""
    stack = gm.Manager.regions()
    if not stack or stack[-1][0] != owner or not isinstance(stack[-1][1], _Entry):
        return None
    return stack[-1][1]


def floating_dtype(value: DTypeLike, where: str) -> np.dtype:
    """``value`` as a floating-point dtype this backend computes in; ``where`` names the
    manager and argument in the error (``"MixedPrecision(compute=...)"``).

    Examples:
        >>> floating_dtype("bfloat16", "MixedPrecision(compute=...)")
        dtype(bfloat16)
    """
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise TypeError(f"{where}: {value!r} is not a dtype; expected a floating-point dtype "
                        "such as 'bfloat16', 'float16' or 'float32'") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{where}: {dtype.name} is not a floating-point dtype; a precision "
                         "policy casts to one such as 'bfloat16', 'float16' or 'float32'")
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ValueError(
            f"{where}: this JAX computes no {dtype.name} (it makes them "
            f"{jax.dtypes.canonicalize_dtype(dtype).name}: jax_enable_x64 is off); enable it "
            "with jax.config.update('jax_enable_x64', True) or choose 'float32'")
    return dtype


@overload
def _cast(value: jax.Array, dtype: np.dtype | None) -> jax.Array: ...
@overload
def _cast(value: object, dtype: np.dtype | None) -> object: ...
def _cast(value: object, dtype: np.dtype | None) -> object:
    """``value`` in ``dtype`` if it is a floating-point array of another dtype."""
    if (dtype is None or not isinstance(value, jax.Array | np.ndarray)
            or not jnp.issubdtype(value.dtype, jnp.floating) or value.dtype == dtype):
        return value
    return value.astype(dtype)


@dataclasses.dataclass(frozen=True, repr=False)
class _Region(gm.VariableFilter):
    """A policy's filter: the calls it selects, and every call inside its region.

    ``by_call``: ``path=`` globs the call's path (``/layers/0.apply``) and every variable of
    a call in the region is selected (``MixedPrecision``); else the fields select variables
    as any manager's do (``Precision``)."""

    owner: str = ""
    by_call: bool = True

    def selects_root(self, brick: object, brick_path: str, application: str, call_id: int,
                     instance_paths: dict[int, str]) -> bool:
        return super().matches_application(brick, brick_path, application, call_id,
                                           instance_paths) and (
            not self.by_call or self.path is None
            or fnmatch.fnmatchcase(f"{brick_path}.{application}", self.path))

    def matches_application(self, brick: object, brick_path: str, application: str,
                            call_id: int, instance_paths: dict[int, str]) -> bool:
        return _innermost(self.owner) is not None or self.selects_root(
            brick, brick_path, application, call_id, instance_paths)

    matches_call = matches_application

    def matches_variable(self, tag: Tag) -> bool:
        return self.by_call or super().matches_variable(tag)

    @property
    def selects_variables(self) -> bool:
        return not self.by_call and super().selects_variables

    def as_text(self, brick_path: Callable[[object], str | None] = lambda brick: None
                ) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(gm.VariableFilter)}
        return gm.VariableFilter(**fields).as_text(brick_path)


@dataclasses.dataclass(frozen=True)
class _Keep:
    """Which calls of a region a policy keeps in ``keep_dtype``: brick classes, class-name
    globs (``"*Norm"``) or a filter of calls without brick instances."""

    classes: tuple[type, ...] = ()
    names: tuple[str, ...] = ()
    filter: gm.VariableFilter | None = None

    def __call__(self, call: HookContext) -> bool:
        assert call.path is not None  # a hook runs inside a program, at a path
        if self.filter is not None:
            return self.filter.matches_application(
                call.brick, call.path, call.application, call.call_id, {}) and (
                self.filter.path is None
                or fnmatch.fnmatchcase(f"{call.path}.{call.application}", self.filter.path))
        return isinstance(call.brick, self.classes) or any(
            fnmatch.fnmatchcase(type(call.brick).__name__, n) for n in self.names)


def _keep(keep: KeepLike, owner: str) -> _Keep:
    """``keep=`` of policy ``owner``, checked."""
    where = f"{owner}(keep=...)"
    if isinstance(keep, gm.VariableFilter):
        if keep.brick_instances() or any(x is not None for x in (
                keep.roles, keep.name, keep.name_regex)):
            raise ValueError(f"{where}: a filter of calls by brick class, application, "
                             "path or call_id, without brick instances or roles; e.g. "
                             "VariableFilter(path='/layers/0/norm.*')")
        return _Keep(filter=keep)
    items = () if keep is None else (keep,) if isinstance(keep, str | type) else tuple(keep)
    wrong = [k for k in items if not isinstance(k, str | type)]
    if wrong:
        raise TypeError(f"{where}: a {type(wrong[0]).__name__} instance is neither a brick "
                        "class nor a class-name glob ('*Norm'); to keep one layer, pass "
                        "VariableFilter(path='/layers/0/norm.*')")
    return _Keep(tuple(k for k in items if isinstance(k, type)),
                 tuple(k for k in items if isinstance(k, str)))


def _fixed_dtype(brick: object) -> DTypeLike | None:
    """The floating compute dtype a Flax layer fixes for itself (``nnx.Linear(...,
    dtype=jnp.float32)``), or None."""
    dtype = vars(brick).get("dtype") if isinstance(brick, nnx.Module) else None
    try:
        return dtype if dtype is not None and jnp.issubdtype(dtype, jnp.floating) else None
    except TypeError:
        return None


class _Policy(gm.Manager):
    """The region machinery of ``MixedPrecision`` and ``Precision`` (see the module doc)."""

    kinds = ("parameter_rewrite",)  # a cast: EMA and a cost on the stored weight go first

    def _setup(self, compute: np.dtype, keep: _Keep, keep_dtype: np.dtype, by_call: bool
               ) -> None:
        fields = {f.name: getattr(self.filter, f.name)
                  for f in dataclasses.fields(gm.VariableFilter)}
        self.filter = _Region(**fields, owner=self.name, by_call=by_call)
        self.compute = compute
        self.keep_dtype = keep_dtype
        self._keeps = keep

    def _output(self, call: WrapContext, args: tuple[PyTree, ...], kwargs: dict[str, PyTree]
                ) -> np.dtype | None:
        """What the outputs of a selected call (not inside this policy's region) become."""
        raise NotImplementedError

    def wrap(self, call: WrapContext, next: Callable[..., PyTree], args: tuple[PyTree, ...],
             kwargs: dict[str, PyTree]) -> PyTree:
        outer = _innermost(self.name)
        kept = (outer is not None and outer.kept) or self._keeps(call)
        if outer is None:  # a selected call: its outputs leave the region
            output = self._output(call, args, kwargs)
        else:
            output = self.compute if kept and not outer.kept else None
        entry = _Entry(self.name, self.keep_dtype if kept else self.compute, output, kept)
        fixed = None if kept else _fixed_dtype(call.brick)
        if fixed is not None:
            object.__setattr__(call.brick, "dtype", self.compute)  # restored below
        try:
            with self.region(entry):
                out = next(*args, **kwargs)
        finally:
            if fixed is not None:
                object.__setattr__(call.brick, "dtype", fixed)
        if output is None:
            return out
        # Outputs the filter left unselected (Precision(roles=[INPUT])) are cast too.
        return jax.tree.map(lambda v: _cast(v, output), out)

    def rewrite_input(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        entry = _innermost(self.name)
        return value if entry is None else _cast(value, entry.compute)

    def rewrite_parameter(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        entry = _innermost(self.name)
        return value if entry is None or entry.kept else _cast(value, entry.compute)

    def rewrite_output(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        entry = _innermost(self.name)
        return value if entry is None else _cast(value, entry.output)


class MixedPrecision(_Policy):
    """A mixed-precision policy for the selected bricks and everything under them: every
    matrix product and convolution inside runs in ``compute``, the selected calls' outputs
    come out in ``output``, normalisation layers compute in ``keep_dtype``.

    The policy casts floating-point inputs and the parameters read in the selected calls
    and in every application called inside them (child ``nnx.Linear``s, attention, layers
    under ``nnx.scan``): stored parameters, their gradients and the optimizer state keep the
    dtype the model stores them in (graphmod creates no parameter, so the policy has no
    parameter dtype: build the model with Flax's ``param_dtype``). ``program.rewrites``
    lists every cast. A Flax layer built with a fixed ``dtype=`` computes in ``compute``
    too (see the module doc).

    Args:
        compute: the dtype of the computation (``"bfloat16"``; ``"float16"`` with
            ``managers.DynamicLossScale``).
        output: what the selected calls' floating outputs are cast to; None leaves them
            in ``compute``.
        keep: the calls computed in ``keep_dtype``: brick classes, class-name globs, or a
            ``VariableFilter`` of calls; default ``MixedPrecision.NORMALIZATION`` (Flax's
            and graphmod's norm layers, and any class named ``*Norm``). ``()`` keeps none.
        keep_dtype: the dtype kept calls compute in.
        bricks, applications, path, call_id, filter, ...: the calls the policy starts at,
            as for any manager (``path=`` globs the call's path, ``/layers/0.apply``).

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([2, 4, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: m(x).sum(), mlp,
        ...                      managers=[managers.MixedPrecision(bricks=[mlp])])
        >>> x = jnp.ones((3, 2))
        >>> variables = program.init(x)
        >>> jaxpr = jax.make_jaxpr(lambda v: program.infer(v, x))(variables)
        >>> sorted({str(e.invars[0].aval.dtype) for e in jaxpr.eqns[0].params["jaxpr"].eqns
        ...         if e.primitive.name == "dot_general"})
        ['bfloat16']
        >>> grads = jax.grad(lambda v: program.train(v, x, rng=jax.random.key(0))[0])(
        ...     variables)
        >>> grads["model"]["linear_layers"][0]["W"].dtype
        dtype('float32')
    """

    # Flax's and graphmod's normalisation layers, and any class named like one (Gemma's
    # RMSNorm, bonsai's): their statistics lose too much in bfloat16.
    NORMALIZATION: tuple[type | str, ...] = (
        nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm, gm.bricks.LayerNorm, "*Norm")

    def __init__(self, compute: DTypeLike = "bfloat16", output: DTypeLike | None = "float32",
                 *, keep: KeepLike = NORMALIZATION, keep_dtype: DTypeLike = "float32",
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**kwargs)
        chosen = self.filter
        if chosen.roles is not None or chosen.name is not None or chosen.name_regex is not None:
            raise TypeError(
                "MixedPrecision: a policy selects application calls (bricks=, applications=, "
                "path=, call_id=), not variables (roles=, variable_name=, name_regex=): it "
                "casts every floating input and parameter of those calls and of the calls "
                "inside them; leave some in float32 with keep=, or cast chosen variables "
                "with managers.Precision(roles=...)")
        self.output = None if output is None else floating_dtype(
            output, "MixedPrecision(output=...)")
        self._setup(floating_dtype(compute, "MixedPrecision(compute=...)"),
                    _keep(keep, "MixedPrecision"),
                    floating_dtype(keep_dtype, "MixedPrecision(keep_dtype=...)"), by_call=True)

    def _output(self, call: WrapContext, args: tuple[PyTree, ...], kwargs: dict[str, PyTree]
                ) -> np.dtype | None:
        return self.output


class Precision(_Policy):
    """Mixed precision in one dtype: the selected applications, and every application
    called inside them, compute in ``compute_dtype`` on their selected floating-point
    inputs and parameters, cast down; the selected calls' floating outputs are cast back
    to the widest floating dtype among their inputs. Stored parameters, gradients and the
    optimizer stay in their own dtype. The filter fields select variables as any
    manager's do (``roles=[roles.INPUT]`` casts inputs only), in the selected calls and the
    calls inside them; no layer is kept in float32 (``MixedPrecision`` keeps
    normalisation layers and chooses the outputs' dtype).

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: m(x), lin,
        ...                      managers=[managers.Precision("bfloat16")])
        >>> x = jnp.ones((1, 2))
        >>> variables = program.init(x)
        >>> program.infer(variables, x).dtype, variables["model"]["W"].dtype
        (dtype('float32'), dtype('float32'))
    """

    def __init__(self, compute_dtype: DTypeLike = "bfloat16",
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**kwargs)
        dtype = floating_dtype(compute_dtype, "Precision(compute_dtype=...)")
        self.compute_dtype = dtype.name
        self._setup(dtype, _Keep(), dtype, by_call=False)

    def _output(self, call: WrapContext, args: tuple[PyTree, ...], kwargs: dict[str, PyTree]
                ) -> np.dtype | None:
        floats = [leaf.dtype for leaf in jax.tree.leaves((args, kwargs))
                  if isinstance(leaf, jax.Array | np.ndarray)
                  and jnp.issubdtype(leaf.dtype, jnp.floating)]
        return jnp.result_type(*floats) if floats else None


