"""Per-iteration keys and manager-owned variables inside loop bodies that JAX traces once.

A body run by ``lax.scan``/``fori_loop``/``while_loop`` (and so ``nnx.scan``,
``nnx.fori_loop``, ``nnx.RNN``, scan over layers) is traced once: a key made inside it from
what the trace knows is the same in every iteration, and Flax exposes no loop index. So a key
that ``call.rng()`` makes inside an inner trace is marked (:func:`mark`: the ``loop_key``
primitive, the identity under every JAX transform), and ``_loop_resolution.resolving``
wraps the program's traced function: it is traced to a jaxpr, evaluated with each marker
replaced by its key folded (unless ``per_step=False``: one key for every iteration) with
the position of every loop around it, outermost first (``xs``' index for a scan, so a
reverse scan, as a transposed one, counts down from ``length - 1``; the iteration count from
0 for a while loop). The rewrite happens before any differentiation of the program, so a
remat body recomputed in the backward pass draws what the forward pass drew. A program
without markers is traced as before, at no extra cost.

Manager-owned variables met in such a body are one per iteration, marked the same way: a
read is the ``owned_read`` of the variable's stack (:func:`read_slice`), resolved to the
slice of the innermost loops' positions; a write, or the creation at ``init``, is an
``owned_write`` of the iteration's slice (:func:`write_slice`), which the resolved scan
returns as one more stacked output (so a nested scan stacks outermost first; a remat or a
cond passes it on); and the variable's output at the end of the trace is an ``owned_out``
(:func:`stacked`) replaced by that stack (at ``init``: each iteration's initial value, the
same in every slice unless drawn from a marked key: ``call.init_key``). An auxiliary
cost made in such a body leaves it the same way, its stack summed (``Collected.costs_out``).

``vmap`` is no equation of the jaxpr: it is resolved as it traces, by the markers' batching
rules. A marker carries the arrays of the call that makes it (a key: the call's inputs and
its layer's own variables; a slice: the layer's own variables). Where the vmap maps one of
them, a key is folded with the mapped element's index (outer vmaps first), so an ensemble's
members and a vmapped function's elements draw their own numbers; where it maps the layer's
variables (an ensemble made by ``nnx.vmap``, its members' parameters stacked on axis 0), a
slice is the member's: a read is the stack mapped on axis 0, a write every member's slice
at once, so a manager's variable holds one slice per member, a cost is summed over the
members and a measurement is one per member.

Sharp edges
    Markers are resolved through ``jit``/``closed_call``, ``checkpoint`` (``remat``) and
    ``cond`` inside loops; inside another primitive with a body (``custom_jvp``/
    ``custom_vjp`` functions, ``shard_map``) they stay the identity: one draw for every
    iteration (an owned variable there is refused at resolution). An owned variable is
    written in one loop per step (two are refused: the second would read stale slices),
    not in a ``while_loop`` (unknown length), and is not read at the base trace after a
    loop wrote it (refused); its stack fits loops of the lengths at ``init`` only (another
    length is refused). Which variables are stacked is the frame's choice: those of
    applications whose module the loop slices (a scan over layers), not a cell an
    ``nnx.RNN`` broadcasts over time steps. Under ``vmap`` a slice is kept only for a layer
    the vmap alone stacks (an ensemble's member that also loops over stacked layers is
    refused: the order of the axes could not be told), and only where the vmap maps the
    layer (updating a variable of a layer every element shares is refused).
    ``graphmod.scan`` folds its own step index (its body is the frame's base trace, so its
    own draws are not marked): a lifted loop inside its body folds ``graphmod.scan``'s step
    twice (still one key per step), and a lifted loop around a ``graphmod.scan`` is not
    folded into the draws of its body.
    ``program.graph`` traces without resolving: its jaxpr shows the markers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.extend
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.interpreters import ad, batching, mlir

from graphmod.errors import StateEscapesTransform

# ``loop_key(key, *witnesses, loops)``: the witnesses are the arrays of the call that draws
# (its inputs, its layer's parameters), only there for vmap to see (see ``_batch_key``);
# ``loops``: whether the resolution folds the loops' positions in.
loop_key_p = jax.extend.core.Primitive("loop_key")
loop_key_p.def_impl(lambda key, *witnesses, loops: key)
loop_key_p.def_abstract_eval(lambda aval, *witnesses, loops: aval)
ad.primitive_jvps[loop_key_p] = lambda primals, tangents, loops: (
    loop_key_p.bind(*primals, loops=loops), tangents[0])
mlir.register_lowering(loop_key_p, lambda ctx, key, *witnesses, loops: [key])  # unresolved


def _batch_key(args: Sequence[jax.Array], dims: Sequence[int | None], *, loops: bool
               ) -> tuple[jax.Array, int | None]:
    """Under ``vmap``, a key drawn by a call whose arrays are mapped is folded with the
    mapped element's index: each member of an ``nnx.vmap`` ensemble, each element of a
    vmapped function, draws its own numbers (as ``nnx.split_rngs`` gives Flax's streams)."""
    key = loop_key_p.bind(*args, loops=loops)  # outer vmaps fold first: witnesses mapped
    mapped = [(arg, dim) for arg, dim in zip(args[1:], dims[1:], strict=True)
              if dim is not None]
    if not mapped:
        return key, dims[0]
    size = mapped[0][0].shape[mapped[0][1]]
    index = jnp.arange(size, dtype=jnp.uint32)
    if dims[0] is None:
        return jax.vmap(jax.random.fold_in, (None, 0))(key, index), 0
    return jax.vmap(jax.random.fold_in)(jnp.moveaxis(key, dims[0], 0), index), 0


batching.primitive_batchers[loop_key_p] = _batch_key

# Manager-owned variables in loop bodies (no AD or lowering rules: resolved before any
# transform of the program sees them; vmap only over an ensemble's members, see
# ``_members``). ``owned_read``: the iteration's slice of a stack; ``owned_write``: an
# iteration's new slice of variable ``key`` (no output: make_jaxpr keeps it), stacked over
# ``depth`` axes; ``owned_out``: the variable's value after the trace, replaced by the
# stacked writes. Their operands after the first are the layer's own variables' values.
owned_read_p = jax.extend.core.Primitive("owned_read")
owned_read_p.def_abstract_eval(
    lambda aval, *layer, depth, key: ShapedArray(aval.shape[depth:], aval.dtype))
owned_write_p = jax.extend.core.Primitive("owned_write")
owned_write_p.multiple_results = True
owned_write_p.def_abstract_eval(lambda aval, *layer, key, depth: [])
owned_out_p = jax.extend.core.Primitive("owned_out")
owned_out_p.def_abstract_eval(lambda aval, *, key, fresh: aval)
MARKERS = (loop_key_p, owned_read_p, owned_write_p, owned_out_p)

# The values of a calling layer's own variables, asked for where a marker is made: an
# ensemble's vmap maps them (its members' variables stack on their first axis).
Layer = Callable[[], Sequence[jax.Array]]


def named(key: tuple) -> str:
    """What a slice's ``key`` names in an error: an owned variable's key (manager, path,
    application or parameter name, call id, name: ``lora variable 'a' of /mlp.kernel``), or
    a layer's auxiliary cost ``("cost", owner, key)`` or measurement ``("measured", key)``
    (``Collected``)."""
    if len(key) == 5:
        call = "" if key[3] is None else f"#{key[3]}"
        return f"{key[0]} variable {key[4]!r} of {key[1]}.{key[2]}{call}"
    return f"the auxiliary cost {key[2]}" if len(key) == 3 else f"the measurement {key[1]}"


def _members(layer: Sequence[jax.Array], dims: Sequence[int | None], depth: int, key: tuple
             ) -> int:
    """How many members of an ensemble this vmap maps (``nnx.vmap`` over a layer's
    variables, stacked on their first axis): one slice of a variable of ``key`` per member.
    Refused where the vmap leaves the layer whole (a vmapped function over examples) or the
    layer is stacked over loops as well."""
    sizes = [value.shape[dim] for value, dim in zip(layer, dims, strict=True)
             if dim is not None]
    if not sizes:
        raise StateEscapesTransform(
            f"{'updating ' if len(key) == 5 else ''}{named(key)} happens inside a vmap that "
            "does not map the layer's own variables (a vmapped function over examples): one "
            "value per mapped element could not be stored. Compute it outside the vmap, "
            "or narrow the manager's filter to layers called outside it")
    if depth != 1:
        raise StateEscapesTransform(
            f"{named(key)} belongs to a layer that a vmap maps (an ensemble's members) and "
            f"that is stacked over {depth} axes in all (loops over layers as well): one "
            "slice per member is supported for a layer mapped by the vmap alone. Narrow the "
            "manager's filter to other layers")
    return sizes[0]


def _batch_read(args: Sequence[jax.Array], dims: Sequence[int | None], *, depth: int,
                key: tuple) -> tuple[jax.Array, int]:
    """Under an ensemble's vmap a member reads its slice: the stack, mapped on axis 0."""
    stack, *layer = args
    members = _members(layer, dims[1:], depth, key)
    if dims[0] is not None or stack.shape[0] != members:
        raise RuntimeError(
            f"{named(key)} is stored with shape {stack.shape} and read by the {members} "
            "members of a vmap: make the variables with this program's init")
    return stack, 0


def _batch_write(args: Sequence[jax.Array], dims: Sequence[int | None], *, key: tuple,
                 depth: int) -> tuple[list[jax.Array], list[int | None]]:
    """Under an ensemble's vmap each member writes its slice: one write of them all."""
    value, *layer = args
    members = _members(layer, dims[1:], depth, key)
    value = (jnp.broadcast_to(value, (members, *jnp.shape(value))) if dims[0] is None
             else jnp.moveaxis(value, dims[0], 0))
    owned_write_p.bind(value, key=key, depth=0)
    return [], []


batching.primitive_batchers[owned_read_p] = _batch_read
batching.primitive_batchers[owned_write_p] = _batch_write

# Set while ``resolving`` traces a function as it is, assuming it marks no key.
assume_unmarked: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "graphmod_assume_unmarked", default=False)


# Set while an owned variable's initial value is computed eagerly (only its shape is kept
# where it is stacked): keys drawn there are not marked.
_eager: contextvars.ContextVar[bool] = contextvars.ContextVar("graphmod_eager", default=False)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """A block computed eagerly inside a trace: :func:`mark` leaves its keys as they are
    (drawn as outside loops and vmaps), so no value of the trace leaks into it."""
    token = _eager.set(True)
    try:
        yield
    finally:
        _eager.reset(token)


class Marked(BaseException):
    """A key was marked in a trace that assumed none: ``resolving`` redoes it through a
    jaxpr. (Not an ``Exception``: model code catching errors must not swallow it.)"""


def mark(key: jax.Array, witnesses: Sequence[jax.Array] = (), *, loops: bool = True
         ) -> jax.Array:
    """``key``, marked to be folded with the index of every loop around it (``loops``; see
    the module docstring); the identity where no loop is. Under ``vmap``, if any of
    ``witnesses`` is mapped, folded with the mapped element's index as well (as it traces:
    a key not folded with loops never makes the program's trace go through a jaxpr).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from graphmod._core._loops._loop_resolution import resolving
        >>> key = jax.random.key(0)
        >>> draw = resolving(lambda k: jax.lax.scan(
        ...     lambda c, _: (c, jax.random.uniform(mark(k))), 0, length=3)[1])
        >>> bool(draw(key)[0] != draw(key)[1])
        True
        >>> first = jax.random.uniform(jax.random.fold_in(key, 0))
        >>> bool(draw(key)[0] == first)
        True
        >>> members = jax.vmap(lambda w: jax.random.uniform(mark(key, [w])))(jnp.zeros(2))
        >>> bool(members[0] != members[1])
        True
    """
    if _eager.get():
        return key
    if loops:
        _check_unmarked()
    # Without loops nothing is resolved: only a vmap's batching rule folds it, as it traces.
    return loop_key_p.bind(key, *witnesses, loops=loops)


def read_slice(stack: jax.Array, depth: int, key: tuple, layer: Sequence[jax.Array] = ()
               ) -> jax.Array:
    """The slice of ``stack`` of this iteration of the ``depth`` innermost loops around it
    (a manager-owned variable stacked one slice per iteration; see :func:`write_slice`), or
    of this member of an ensemble that a vmap maps (``layer``: the values of the layer's own
    variables, which that vmap maps).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from graphmod._core._loops._loop_resolution import resolving
        >>> stack = jnp.arange(6.0).reshape(3, 2)
        >>> f = resolving(lambda s: jax.lax.scan(lambda c, _: (c, read_slice(s, 1, ("k",))), 0,
        ...                                      length=3)[1])
        >>> f(stack).tolist() == stack.tolist()
        True
    """
    _check_unmarked()
    return owned_read_p.bind(stack, *layer, depth=depth, key=key)


def write_slice(value: jax.Array, key: tuple, depth: int = 1,
                layer: Sequence[jax.Array] = ()) -> None:
    """Notes ``value`` as this iteration's slice of owned variable ``key`` (stacked over
    ``depth`` axes): :func:`stacked` of ``key`` at the end of the trace is every
    iteration's, stacked with the length of each loop around the write as a leading axis,
    outermost first; under a vmap that maps ``layer`` (an ensemble), each member's.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from graphmod._core._loops._loop_resolution import resolving
        >>> def f(x):
        ...     jax.lax.scan(lambda c, i: (write_slice(c * i, ("k",)), (c, None))[1], x,
        ...                  jnp.arange(3.0))
        ...     return stacked(x, ("k",), fresh=True)
        >>> resolving(f)(jnp.ones(2)).tolist()
        [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    """
    _check_unmarked()
    owned_write_p.bind(value, *layer, key=key, depth=depth)


def stacked(value: jax.Array, key: tuple, *, fresh: bool) -> jax.Array:
    """Owned variable ``key`` after the trace: every iteration's :func:`write_slice`,
    stacked; ``value`` is its stack before (``fresh``: the slice it was created with)."""
    _check_unmarked()
    return owned_out_p.bind(value, key=key, fresh=fresh)


def _check_unmarked() -> None:
    """Raises :class:`Marked` where ``resolving`` traces assuming no marker: it redoes the
    trace through a jaxpr."""
    if assume_unmarked.get():
        raise Marked
