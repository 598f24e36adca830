"""Per-iteration keys and manager-owned variables inside loop bodies that JAX traces once.

A body run by ``lax.scan``/``fori_loop``/``while_loop`` (and so ``nnx.scan``,
``nnx.fori_loop``, ``nnx.RNN``, scan over layers) is traced once: a key made inside it from
what the trace knows is the same in every iteration, and Flax exposes no loop index. So a key
that ``call.rng()`` makes inside an inner trace (unless ``per_step=False``: one key for
every iteration) is marked (:func:`mark`: the ``loop_key`` primitive, the identity under
every JAX transform), and :func:`resolving` wraps the program's traced function: it is
traced to a jaxpr, evaluated with each marker replaced by its key folded with the position
of every loop around it, outermost first (``xs``' index for a scan, so a reverse scan, as a
transposed one, counts down from ``length - 1``; the iteration count from 0 for a while
loop). The rewrite happens before any differentiation of the program, so a remat body
recomputed in the backward pass draws what the forward pass drew. A program without
markers is traced as before, at no extra cost (see :func:`resolving`).

Manager-owned variables met in such a body are one per iteration, marked the same way: a
read is the ``owned_read`` of the variable's stack (:func:`read_slice`), resolved to the
slice of the innermost loops' positions; a write, or the creation at ``init``, is an
``owned_write`` of the iteration's slice (:func:`write_slice`), which the resolved scan
returns as one more stacked output (so a nested scan stacks outermost first; a remat or a
cond passes it on); and the variable's output at the end of the trace is an ``owned_out``
(:func:`stacked`) replaced by that stack (at ``init``: each iteration's initial value, the
same in every slice unless drawn from a marked key: ``call.init_key``). An auxiliary
cost made in such a body leaves it the same way, its stack summed (``Collected.costs_out``).

Sharp edges
    Markers are resolved through ``jit``/``closed_call``, ``checkpoint`` (``remat``) and
    ``cond`` inside loops; inside another primitive with a body (``custom_jvp``/
    ``custom_vjp`` functions, ``shard_map``) they stay the identity: one draw for every
    iteration (an owned variable there is refused at resolution). An owned variable is
    written in one loop per step (two are refused: the second would read stale slices),
    not in a ``while_loop`` (unknown length) nor under ``vmap`` (refused), and is not read
    at the base trace after a loop wrote it (refused); its stack fits loops of the lengths
    at ``init`` only (another length is refused). Which variables are stacked is the frame's
    choice: those of applications whose module the loop slices (a scan over layers), not a
    cell an ``nnx.RNN`` broadcasts over time steps. Under ``vmap`` a marked key is not
    split: every mapped element draws the same numbers, as Flax's unsplit ``Rngs`` do; a
    manager's variable made there is one for every mapped element (an ensemble's members
    share LoRA's adapters), and its updates, costs and measurements there are refused.
    ``graphmod.scan`` folds its own step index (its body is the frame's base trace, so its
    own draws are not marked): a lifted loop inside its body folds ``graphmod.scan``'s step
    twice (still one key per step), and a lifted loop around a ``graphmod.scan`` is not
    folded into the draws of its body.
    ``program.graph`` traces without resolving: its jaxpr shows the markers. Uses
    ``jax._src.source_info_util`` (internal, like ``graphmod._core._context``) to keep each
    equation's name scope.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax._src import source_info_util
from jax.interpreters import ad, batching, mlir

from graphmod._core._interpret import bind, interpret
from graphmod.errors import StateEscapesTransform

loop_key_p = jax.extend.core.Primitive("loop_key")
loop_key_p.def_impl(lambda key: key)
loop_key_p.def_abstract_eval(lambda aval: aval)
ad.primitive_jvps[loop_key_p] = lambda primals, tangents: (loop_key_p.bind(*primals), tangents[0])
batching.primitive_batchers[loop_key_p] = lambda args, dims: (loop_key_p.bind(*args), dims[0])
mlir.register_lowering(loop_key_p, lambda ctx, key: [key])  # never resolved: the key itself

# Manager-owned variables in loop bodies (no AD or lowering rules: resolved before any
# transform of the program sees them; owned_write's batching rule refuses vmap).
# ``owned_read``: the iteration's slice of a stack; ``owned_write``: an iteration's new slice
# of variable ``key`` (no output: make_jaxpr keeps it); ``owned_out``: the variable's value
# after the trace, replaced by the stacked writes.
owned_read_p = jax.extend.core.Primitive("owned_read")
owned_read_p.def_abstract_eval(
    lambda aval, *, depth, key: jax.core.ShapedArray(aval.shape[depth:], aval.dtype))
owned_write_p = jax.extend.core.Primitive("owned_write")
owned_write_p.multiple_results = True
owned_write_p.def_abstract_eval(lambda aval, *, key: [])
owned_out_p = jax.extend.core.Primitive("owned_out")
owned_out_p.def_abstract_eval(lambda aval, *, key, fresh: aval)
_MARKERS = (loop_key_p, owned_read_p, owned_write_p, owned_out_p)


def _named(key: tuple) -> str:
    """What a slice's ``key`` names in an error: an owned variable's key (manager, path,
    application, call id, name), or a layer's auxiliary cost ``("cost", owner, key)`` or
    measurement ``("measured", key)`` (``Collected``)."""
    if len(key) == 5:
        return f"{key[0]} variable {key[4]!r} of application {key[2]!r} of {key[1]}"
    return f"the auxiliary cost {key[2]}" if len(key) == 3 else f"the measurement {key[1]}"


def _refused(key: tuple, place: str) -> StateEscapesTransform:
    what = f"updating {_named(key)}" if len(key) == 5 else _named(key)  # a cost is made
    return StateEscapesTransform(
        f"{what} happens inside {place}: one value per iteration could not be stored. Use "
        "graphmod.scan, or a loop of static length (lax.scan, nnx.scan, a fori_loop with "
        "static bounds), where such a variable is stacked, one slice per iteration"
    )


def _batch_write(args: Any, dims: Any, *, key: tuple) -> Any:
    raise _refused(key, "a raw JAX transform or an NNX lifted transform (jax.vmap, nnx.vmap)")


batching.primitive_batchers[owned_write_p] = _batch_write

# Set while ``resolving`` traces a function as it is, assuming it marks no key.
_assume_unmarked: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "graphmod_assume_unmarked", default=False)


class _Marked(BaseException):
    """A key was marked in a trace that assumed none: ``resolving`` redoes it through a
    jaxpr. (Not an ``Exception``: model code catching errors must not swallow it.)"""


def mark(key: jax.Array) -> jax.Array:
    """``key``, marked to be folded with the index of every loop around it (see the module
    docstring); the identity where no loop is.

    Examples:
        >>> import jax
        >>> key = jax.random.key(0)
        >>> draw = resolving(lambda k: jax.lax.scan(
        ...     lambda c, _: (c, jax.random.uniform(mark(k))), 0, length=3)[1])
        >>> bool(draw(key)[0] != draw(key)[1])
        True
        >>> first = jax.random.uniform(jax.random.fold_in(key, 0))
        >>> bool(draw(key)[0] == first)
        True
    """
    return _bind(loop_key_p, key)


def read_slice(stack: jax.Array, depth: int, key: tuple) -> jax.Array:
    """The slice of ``stack`` of this iteration of the ``depth`` innermost loops around it
    (a manager-owned variable stacked one slice per iteration; see :func:`write_slice`).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> stack = jnp.arange(6.0).reshape(3, 2)
        >>> f = resolving(lambda s: jax.lax.scan(lambda c, _: (c, read_slice(s, 1, ("k",))), 0,
        ...                                      length=3)[1])
        >>> f(stack).tolist() == stack.tolist()
        True
    """
    return _bind(owned_read_p, stack, depth=depth, key=key)


def write_slice(value: jax.Array, key: tuple) -> None:
    """Notes ``value`` as this iteration's slice of owned variable ``key``: :func:`stacked`
    of ``key`` at the end of the trace is every iteration's, stacked with the length of each
    loop around the write as a leading axis, outermost first.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def f(x):
        ...     jax.lax.scan(lambda c, i: (write_slice(c * i, ("k",)), (c, None))[1], x,
        ...                  jnp.arange(3.0))
        ...     return stacked(x, ("k",), fresh=True)
        >>> resolving(f)(jnp.ones(2)).tolist()
        [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    """
    _bind(owned_write_p, value, key=key)


def stacked(value: jax.Array, key: tuple, *, fresh: bool) -> jax.Array:
    """Owned variable ``key`` after the trace: every iteration's :func:`write_slice`,
    stacked; ``value`` is its stack before (``fresh``: the slice it was created with)."""
    return _bind(owned_out_p, value, key=key, fresh=fresh)


def _bind(primitive: Any, *args: Any, **params: Any) -> Any:
    if _assume_unmarked.get():
        raise _Marked
    return primitive.bind(*args, **params)


def resolving(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with the loop keys it marks resolved (see the module docstring).

    ``f`` is traced as it is until a trace marks a key (a program without randomness in
    loops pays nothing): that trace stops there and is redone through a jaxpr, and so is
    every later one."""
    markers = False

    @functools.wraps(f)
    def run(*args: Any, **static: Any) -> Any:
        nonlocal markers
        if not markers:
            token = _assume_unmarked.set(True)
            try:
                return f(*args, **static)
            except _Marked:
                markers = True
            finally:
                _assume_unmarked.reset(token)
        token = _assume_unmarked.set(False)
        try:
            closed, shapes = jax.make_jaxpr(functools.partial(f, **static),
                                            return_shape=True)(*args)
        finally:
            _assume_unmarked.reset(token)
        flat, _ = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), ())
        return jax.tree.unflatten(jax.tree.structure(shapes), flat)

    return run


def _has_markers(jaxpr: Any, markers: tuple = _MARKERS) -> bool:
    return any(eqn.primitive in markers
               or any(_has_markers(inner, markers)
                      for inner in jax.extend.core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
              counters: tuple[Any, ...], loop_lengths: tuple[int | None, ...] = ()
              ) -> tuple[list[Any], dict[tuple, Any]]:
    """``jax.core.eval_jaxpr`` with markers resolved with ``counters`` (the loop indices,
    outermost first; ``loop_lengths``: their loops' lengths, None for a while loop); also
    the owned variables' slices written, by key."""
    writes: dict[tuple, Any] = {}

    def rule(eqn: Any, invals: list[Any]) -> list[Any]:
        names = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (source_info_util.user_context(eqn.source_info.traceback, name_stack=names),
              eqn.ctx.manager):
            return _equation(eqn, invals, counters, loop_lengths, writes)

    return interpret(jaxpr, consts, args, rule), writes


def _equation(eqn: Any, invals: list[Any], counters: tuple[Any, ...],
              loop_lengths: tuple[int | None, ...], writes: dict[tuple, Any]) -> list[Any]:
    """One equation of :func:`_evaluate`: a marker resolved, a loop rewritten (its owned
    slices written into ``writes``), anything else bound as it is."""
    if eqn.primitive is loop_key_p:
        return [functools.reduce(jax.random.fold_in, counters, invals[0])]
    if eqn.primitive is owned_read_p:
        return [_index(invals[0], counters, loop_lengths, **eqn.params)]
    if eqn.primitive is owned_write_p:
        writes[eqn.params["key"]] = invals[0]  # the last write wins
        return []
    if eqn.primitive is owned_out_p:
        return [_collected(writes, invals[0], **eqn.params)]
    inner_jaxprs = list(jax.extend.core.jaxprs_in_params(eqn.params))
    if eqn.primitive.name in _RULES and any(map(_has_markers, inner_jaxprs)):
        outs, inner = _RULES[eqn.primitive.name](invals, counters, loop_lengths, **eqn.params)
        if eqn.primitive.name == "scan" and not inner.keys().isdisjoint(writes):
            key = next(iter(inner.keys() & writes.keys()))
            raise RuntimeError(
                f"{_named(key)} is updated in two loops of one step: the second would "
                "read the values from before the first. Run the application in one loop")
        writes.update(inner)
        return outs
    if any(_has_markers(inner, _MARKERS[1:]) for inner in inner_jaxprs):
        raise RuntimeError(
            f"a manager-owned variable of a loop body is used inside {eqn.primitive} "
            "(a custom_jvp or custom_vjp function, shard_map...), whose body is not "
            "rewritten: its stack cannot be sliced there. Run the application outside")
    return bind(eqn, invals)


def _index(stack: Any, counters: tuple, loop_lengths: tuple, *, depth: int, key: tuple
           ) -> Any:
    lengths = loop_lengths[len(loop_lengths) - depth:]
    if depth > len(counters) or stack.shape[:depth] != lengths:
        raise RuntimeError(
            f"{_named(key)} is stacked over loops of lengths {stack.shape[:depth]} (as at "
            f"init) and read in loops of lengths {lengths}: run its application in loops of "
            "the lengths it was created in (e.g. the sequence length of an nnx.RNN)")
    return stack[tuple(counters[len(counters) - depth:])]


def _collected(writes: dict, value: Any, *, key: tuple, fresh: bool) -> Any:
    new = writes.get(key)
    fits = new is not None and (new.shape[new.ndim - value.ndim:] == value.shape if fresh
                                else new.shape == value.shape)
    if not fits:
        raise RuntimeError(
            f"{_named(key)}: "
            + ("its update inside a loop body could not be found (inside a custom_jvp, "
               "custom_vjp or shard_map body?)" if new is None else
               f"its stack has shape {value.shape}, its slices written in loop bodies stack "
               f"to {new.shape}: the application runs in other loops than at init")
        )
    return new.astype(value.dtype)


def _scan(invals: list, counters: tuple, loop_lengths: tuple, *, jaxpr: Any, num_consts: int,
          num_carry: int, length: int, reverse: bool, unroll: Any, **_: Any) -> tuple:
    consts, carry, xs = (invals[:num_consts], invals[num_consts:num_consts + num_carry],
                         invals[num_consts + num_carry:])

    order: list[tuple] = []

    def body(carry: list, inputs: tuple) -> tuple[list, tuple]:
        x, index = inputs
        outs, writes = _evaluate(jaxpr.jaxpr, jaxpr.consts, [*consts, *carry, *x],
                                 (*counters, index), (*loop_lengths, length))
        order[:] = writes
        return outs[:num_carry], (outs[num_carry:], list(writes.values()))

    # The index rides along xs, so a reverse scan sees length-1 first, as its xs; the slices
    # written come out as more ys, stacked in the order of xs.
    carry, (ys, slices) = jax.lax.scan(body, carry, (xs, jnp.arange(length, dtype=jnp.int32)),
                                       length, reverse=reverse, unroll=unroll)
    return [*carry, *ys], dict(zip(order, slices, strict=True))


def _while(invals: list, counters: tuple, loop_lengths: tuple, *, cond_jaxpr: Any, body_jaxpr: Any,
           cond_nconsts: int, body_nconsts: int, **_: Any) -> tuple:
    cond_consts, body_consts = invals[:cond_nconsts], invals[cond_nconsts:cond_nconsts
                                                             + body_nconsts]

    def run(closed: Any, consts: list, carry: list, count: Any) -> list:
        outs, writes = _evaluate(closed.jaxpr, closed.consts, [*consts, *carry],
                                 (*counters, count), (*loop_lengths, None))
        if writes:
            raise _refused(next(iter(writes)), "a while loop (lax.while_loop, nnx.while_loop, "
                           "a fori_loop with traced bounds), of unknown length")
        return outs

    def cond(state: tuple) -> Any:
        return run(cond_jaxpr, cond_consts, state[1], state[0])[0]

    def body(state: tuple) -> tuple:
        return state[0] + 1, run(body_jaxpr, body_consts, state[1], state[0])

    init = (jnp.int32(0), invals[cond_nconsts + body_nconsts:])
    return jax.lax.while_loop(cond, body, init)[1], {}


def _cond(invals: list, counters: tuple, loop_lengths: tuple, *, branches: Sequence[Any],
          **_: Any) -> tuple:
    order: list[tuple] = []

    def branch(closed: Any, operands: list) -> tuple[list, list]:
        outs, writes = _evaluate(closed.jaxpr, closed.consts, operands, counters,
                                 loop_lengths)
        if not order:
            order.append(list(writes))
        elif set(order[0]) != set(writes):
            key = next(iter(set(order[0]) ^ set(writes)))
            raise RuntimeError(f"{_named(key)} is updated in some branches of a cond only: "
                               "run its application in every branch, or outside the cond")
        return outs, [writes[k] for k in order[0]]

    outs, slices = jax.lax.switch(invals[0], [functools.partial(branch, b) for b in branches],
                                  invals[1:])
    return outs, dict(zip(order[0] if order else (), slices, strict=True))


def _remat(invals: list, counters: tuple, loop_lengths: tuple, *, jaxpr: Any, prevent_cse: bool,
           policy: Any, **_: Any) -> tuple:
    order: list[tuple] = []

    def evaluate(counters: tuple, args: list) -> tuple[list, list]:
        outs, writes = _evaluate(jaxpr, (), args, counters, loop_lengths)
        order[:] = writes
        return outs, list(writes.values())

    # The counters go in as arguments: the recomputation reads the forward pass's.
    run = jax.checkpoint(evaluate, prevent_cse=prevent_cse, policy=policy)
    outs, slices = run(counters, invals)
    return outs, dict(zip(order, slices, strict=True))


def _call(invals: list, counters: tuple, loop_lengths: tuple, *, jaxpr: Any = None,
          call_jaxpr: Any = None, **_: Any) -> tuple:
    closed = jaxpr if jaxpr is not None else call_jaxpr
    return _evaluate(closed.jaxpr, closed.consts, invals, counters, loop_lengths)  # inlined


# How each primitive with a body is rebuilt when markers are inside it (by primitive name).
_RULES: dict[str, Callable[..., tuple]] = {
    "scan": _scan, "while": _while, "cond": _cond, "remat2": _remat,
    "jit": _call, "closed_call": _call,
}
