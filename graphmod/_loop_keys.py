"""Per-iteration keys inside loop bodies that JAX traces once.

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

Sharp edges
    Markers are resolved through ``jit``/``closed_call``, ``checkpoint`` (``remat``) and
    ``cond`` inside loops; inside another primitive with a body (``custom_jvp``/
    ``custom_vjp`` functions, ``shard_map``) they stay the identity: one draw for every
    iteration. Under ``vmap`` a marked key is not split: every mapped element draws the same
    numbers, as Flax's unsplit ``Rngs`` do. ``graphmod.scan`` folds its own step index (its
    body is the frame's base trace, so its own draws are not marked): a lifted loop inside
    its body folds ``graphmod.scan``'s step twice (still one key per step), and a lifted
    loop around a ``graphmod.scan`` is not folded into the draws of its body.
    ``program.graph`` traces without resolving: its jaxpr shows the markers. Uses
    ``jax._src.source_info_util`` (internal, like ``graphmod._context``) to keep each
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

loop_key_p = jax.extend.core.Primitive("loop_key")
loop_key_p.def_impl(lambda key: key)
loop_key_p.def_abstract_eval(lambda aval: aval)
ad.primitive_jvps[loop_key_p] = lambda primals, tangents: (loop_key_p.bind(*primals), tangents[0])
batching.primitive_batchers[loop_key_p] = lambda args, dims: (loop_key_p.bind(*args), dims[0])
mlir.register_lowering(loop_key_p, lambda ctx, key: [key])  # never resolved: the key itself

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
    if _assume_unmarked.get():
        raise _Marked
    return loop_key_p.bind(key)


def resolving(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with the loop keys it marks resolved (see the module docstring).

    ``f`` is traced as it is until a trace marks a key (a program without randomness in
    loops pays nothing): that trace stops there and is redone through a jaxpr, and so is
    every later one."""
    markers = False

    @functools.wraps(f)
    def run(*args: Any) -> Any:
        nonlocal markers
        if not markers:
            token = _assume_unmarked.set(True)
            try:
                return f(*args)
            except _Marked:
                markers = True
            finally:
                _assume_unmarked.reset(token)
        token = _assume_unmarked.set(False)
        try:
            closed, shapes = jax.make_jaxpr(f, return_shape=True)(*args)
        finally:
            _assume_unmarked.reset(token)
        flat = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), ())
        return jax.tree.unflatten(jax.tree.structure(shapes), flat)

    return run


def _has_markers(jaxpr: Any) -> bool:
    return any(eqn.primitive is loop_key_p
               or any(map(_has_markers, jax.extend.core.jaxprs_in_params(eqn.params)))
               for eqn in jaxpr.eqns)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
              counters: tuple[Any, ...]) -> list[Any]:
    """``jax.core.eval_jaxpr`` with markers folded with ``counters`` (outermost first)."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, jax.extend.core.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        names = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (source_info_util.user_context(eqn.source_info.traceback, name_stack=names),
              eqn.ctx.manager):
            if eqn.primitive is loop_key_p:
                outs = [functools.reduce(jax.random.fold_in, counters, invals[0])]
            elif eqn.primitive.name in _RULES and any(
                    map(_has_markers, jax.extend.core.jaxprs_in_params(eqn.params))):
                outs = _RULES[eqn.primitive.name](invals, counters, **eqn.params)
            else:
                params = eqn.primitive.get_bind_params(eqn.params)
                outs = eqn.primitive.bind(*invals, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _scan(invals: list, counters: tuple, *, jaxpr: Any, num_consts: int, num_carry: int,
          length: int, reverse: bool, unroll: Any, **_: Any) -> list:
    consts, carry, xs = (invals[:num_consts], invals[num_consts:num_consts + num_carry],
                         invals[num_consts + num_carry:])

    def body(carry: list, inputs: tuple) -> tuple[list, list]:
        x, index = inputs
        outs = _evaluate(jaxpr.jaxpr, jaxpr.consts, [*consts, *carry, *x], (*counters, index))
        return outs[:num_carry], outs[num_carry:]

    # The index rides along xs, so a reverse scan sees length-1 first, as its xs.
    carry, ys = jax.lax.scan(body, carry, (xs, jnp.arange(length, dtype=jnp.int32)), length,
                             reverse=reverse, unroll=unroll)
    return [*carry, *ys]


def _while(invals: list, counters: tuple, *, cond_jaxpr: Any, body_jaxpr: Any,
           cond_nconsts: int, body_nconsts: int, **_: Any) -> list:
    cond_consts, body_consts = invals[:cond_nconsts], invals[cond_nconsts:cond_nconsts
                                                             + body_nconsts]

    def cond(state: tuple) -> Any:
        count, carry = state
        return _evaluate(cond_jaxpr.jaxpr, cond_jaxpr.consts, [*cond_consts, *carry],
                         (*counters, count))[0]

    def body(state: tuple) -> tuple:
        count, carry = state
        return count + 1, _evaluate(body_jaxpr.jaxpr, body_jaxpr.consts,
                                    [*body_consts, *carry], (*counters, count))

    init = (jnp.int32(0), invals[cond_nconsts + body_nconsts:])
    return jax.lax.while_loop(cond, body, init)[1]


def _cond(invals: list, counters: tuple, *, branches: Sequence[Any], **_: Any) -> list:
    def branch(closed: Any, operands: list) -> list:
        return _evaluate(closed.jaxpr, closed.consts, operands, counters)

    return jax.lax.switch(invals[0], [functools.partial(branch, b) for b in branches],
                          invals[1:])


def _remat(invals: list, counters: tuple, *, jaxpr: Any, prevent_cse: bool, policy: Any,
           **_: Any) -> list:
    # The counters go in as arguments: the recomputation reads the forward pass's.
    run = jax.checkpoint(lambda counters, args: _evaluate(jaxpr, (), args, counters),
                         prevent_cse=prevent_cse, policy=policy)
    return run(counters, invals)


def _call(invals: list, counters: tuple, *, jaxpr: Any = None, call_jaxpr: Any = None,
          **_: Any) -> list:
    closed = jaxpr if jaxpr is not None else call_jaxpr
    return _evaluate(closed.jaxpr, closed.consts, invals, counters)  # inlined


# How each primitive with a body is rebuilt when markers are inside it (by primitive name).
_RULES: dict[str, Callable[..., list]] = {
    "scan": _scan, "while": _while, "cond": _cond, "remat2": _remat,
    "jit": _call, "closed_call": _call,
}
