"""The resolution of the markers of :mod:`graphmod._core._loops._loop_keys` (the mechanism and its
sharp edges are described there): a traced function is evaluated through its jaxpr with
each loop key folded with the positions of the loops around it and each manager-owned
slice read and written per iteration, the loops rebuilt to stack what their bodies wrote.
Uses ``jax._src.source_info_util`` (internal, like ``graphmod._core._tracing._context``) to
keep each equation's name scope.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import jax
import jax.extend
import jax.numpy as jnp
from jax._src import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Primitive

from graphmod._core._loops._jaxpr_interpreter import bind, interpret
from graphmod._core._loops._loop_keys import (
    MARKERS,
    Marked,
    assume_unmarked,
    loop_key_p,
    named,
    owned_out_p,
    owned_read_p,
    owned_write_p,
)
from graphmod.errors import StateEscapesTransform

P = ParamSpec("P")
R = TypeVar("R")
Counters = tuple[jax.Array, ...]  # the positions of the loops around, outermost first
Lengths = tuple[int | None, ...]  # their lengths (None: a while loop's)
Writes = dict[tuple, jax.Array]  # the owned slices a body wrote, by the marker's key


def resolving(f: Callable[P, R]) -> Callable[P, R]:
    """``f`` with the loop keys it marks resolved (see the module docstring).

    ``f`` is traced as it is until a trace marks a key (a program without randomness in
    loops pays nothing): that trace stops there and is redone through a jaxpr, and so is
    every later one."""
    markers = False

    @functools.wraps(f)
    def run(*args: P.args, **static: P.kwargs) -> R:
        nonlocal markers
        if not markers:
            token = assume_unmarked.set(True)
            try:
                return f(*args, **static)
            except Marked:
                markers = True
            finally:
                assume_unmarked.reset(token)
        token = assume_unmarked.set(False)
        try:
            closed, shapes = jax.make_jaxpr(functools.partial(f, **static),
                                            return_shape=True)(*args)
        finally:
            assume_unmarked.reset(token)
        flat, _ = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), ())
        return jax.tree.unflatten(jax.tree.structure(shapes), flat)

    return run


def _has_markers(jaxpr: Jaxpr, markers: tuple[Primitive, ...] = MARKERS) -> bool:
    return any(eqn.primitive in markers
               or any(_has_markers(inner, markers)
                      for inner in jax.extend.core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def _evaluate(jaxpr: Jaxpr, consts: Sequence[jax.Array], args: Sequence[jax.Array],
              counters: Counters, loop_lengths: Lengths = ()) -> tuple[list[jax.Array], Writes]:
    """``jax.core.eval_jaxpr`` with markers resolved with ``counters`` (the loop indices,
    outermost first; ``loop_lengths``: their loops' lengths, None for a while loop); also
    the owned variables' slices written, by key."""
    writes: Writes = {}

    def rule(eqn: JaxprEqn, invals: list[jax.Array]) -> list[jax.Array]:
        names = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (source_info_util.user_context(eqn.source_info.traceback, name_stack=names),
              eqn.ctx.manager):
            return _equation(eqn, invals, counters, loop_lengths, writes)

    return interpret(jaxpr, consts, args, rule), writes


def _equation(eqn: JaxprEqn, invals: list[jax.Array], counters: Counters,
              loop_lengths: Lengths, writes: Writes) -> list[jax.Array]:
    """One equation of :func:`_evaluate`: a marker resolved, a loop rewritten (its owned
    slices written into ``writes``), anything else bound as it is."""
    if eqn.primitive is loop_key_p:
        folded = counters if eqn.params["loops"] else ()
        return [functools.reduce(jax.random.fold_in, folded, invals[0])]
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
                f"{named(key)} is updated in two loops of one step: the second would "
                "read the values from before the first. Run the application in one loop")
        writes.update(inner)
        return outs
    if any(_has_markers(inner, MARKERS[1:]) for inner in inner_jaxprs):
        raise RuntimeError(
            f"a manager-owned variable of a loop body is used inside {eqn.primitive} "
            "(a custom_jvp or custom_vjp function, shard_map...), whose body is not "
            "rewritten: its stack cannot be sliced there. Run the application outside")
    return bind(eqn, invals)


def _index(stack: jax.Array, counters: Counters, loop_lengths: Lengths, *, depth: int,
           key: tuple) -> jax.Array:
    lengths = loop_lengths[len(loop_lengths) - depth:]
    if depth > len(counters) or stack.shape[:depth] != lengths:
        raise RuntimeError(
            f"{named(key)} is stacked over loops of lengths {stack.shape[:depth]} (as at "
            f"init) and read in loops of lengths {lengths}: run its application in loops of "
            "the lengths it was created in (e.g. the sequence length of an nnx.RNN)")
    return stack[tuple(counters[len(counters) - depth:])]


def _collected(writes: Writes, value: jax.Array, *, key: tuple, fresh: bool) -> jax.Array:
    new = writes.get(key)
    if new is None or not (new.shape[new.ndim - value.ndim:] == value.shape if fresh
                           else new.shape == value.shape):
        raise RuntimeError(
            f"{named(key)}: "
            + ("its update inside a loop body could not be found (inside a custom_jvp, "
               "custom_vjp or shard_map body?)" if new is None else
               f"its stack has shape {value.shape}, its slices written in loop bodies stack "
               f"to {new.shape}: the application runs in other loops than at init")
        )
    return new.astype(value.dtype)


def _scan(invals: list[jax.Array], counters: Counters, loop_lengths: Lengths, *,
          jaxpr: ClosedJaxpr, num_consts: int, num_carry: int, length: int, reverse: bool,
          unroll: int | bool, **_: object) -> tuple[list[jax.Array], Writes]:
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


def _while(invals: list[jax.Array], counters: Counters, loop_lengths: Lengths, *,
           cond_jaxpr: ClosedJaxpr, body_jaxpr: ClosedJaxpr, cond_nconsts: int,
           body_nconsts: int, **_: object) -> tuple[list[jax.Array], Writes]:
    cond_consts, body_consts = invals[:cond_nconsts], invals[cond_nconsts:cond_nconsts
                                                             + body_nconsts]

    def run(closed: ClosedJaxpr, consts: list[jax.Array], carry: list[jax.Array],
            count: jax.Array) -> list[jax.Array]:
        outs, writes = _evaluate(closed.jaxpr, closed.consts, [*consts, *carry],
                                 (*counters, count), (*loop_lengths, None))
        if writes:
            raise _refused(next(iter(writes)), "a while loop (lax.while_loop, nnx.while_loop, "
                           "a fori_loop with traced bounds), of unknown length")
        return outs

    def cond(state: tuple[jax.Array, list[jax.Array]]) -> jax.Array:
        return run(cond_jaxpr, cond_consts, state[1], state[0])[0]

    def body(state: tuple) -> tuple:
        return state[0] + 1, run(body_jaxpr, body_consts, state[1], state[0])

    init = (jnp.int32(0), invals[cond_nconsts + body_nconsts:])
    return jax.lax.while_loop(cond, body, init)[1], {}


def _cond(invals: list[jax.Array], counters: Counters, loop_lengths: Lengths, *,
          branches: Sequence[ClosedJaxpr], **_: object) -> tuple[list[jax.Array], Writes]:
    order: list[list[tuple]] = []

    def branch(closed: ClosedJaxpr, operands: list[jax.Array]
               ) -> tuple[list[jax.Array], list[jax.Array]]:
        outs, writes = _evaluate(closed.jaxpr, closed.consts, operands, counters,
                                 loop_lengths)
        if not order:
            order.append(list(writes))
        elif set(order[0]) != set(writes):
            key = next(iter(set(order[0]) ^ set(writes)))
            raise RuntimeError(f"{named(key)} is updated in some branches of a cond only: "
                               "run its application in every branch, or outside the cond")
        return outs, [writes[k] for k in order[0]]

    outs, slices = jax.lax.switch(invals[0], [functools.partial(branch, b) for b in branches],
                                  invals[1:])
    return outs, dict(zip(order[0] if order else (), slices, strict=True))


def _remat(invals: list[jax.Array], counters: Counters, loop_lengths: Lengths, *,
           jaxpr: Jaxpr, prevent_cse: bool, policy: Callable[..., bool] | None,
           **_: object) -> tuple[list[jax.Array], Writes]:
    order: list[tuple] = []

    def evaluate(counters: tuple, args: list) -> tuple[list, list]:
        outs, writes = _evaluate(jaxpr, (), args, counters, loop_lengths)
        order[:] = writes
        return outs, list(writes.values())

    # The counters go in as arguments: the recomputation reads the forward pass's.
    run = jax.checkpoint(evaluate, prevent_cse=prevent_cse, policy=policy)
    outs, slices = run(counters, invals)
    return outs, dict(zip(order, slices, strict=True))


def _jit(invals: list[jax.Array], counters: Counters, loop_lengths: Lengths, *,
         jaxpr: ClosedJaxpr, **_: object) -> tuple[list[jax.Array], Writes]:
    return _evaluate(jaxpr.jaxpr, jaxpr.consts, invals, counters, loop_lengths)  # inlined


def _closed_call(invals: list[jax.Array], counters: Counters, loop_lengths: Lengths, *,
                 call_jaxpr: ClosedJaxpr, **_: object) -> tuple[list[jax.Array], Writes]:
    return _jit(invals, counters, loop_lengths, jaxpr=call_jaxpr)


# How each primitive with a body is rebuilt when markers are inside it (by primitive name).
_RULES: dict[str, Callable[..., tuple[list[jax.Array], Writes]]] = {
    "scan": _scan, "while": _while, "cond": _cond, "remat2": _remat,
    "jit": _jit, "closed_call": _closed_call,
}


def _refused(key: tuple, place: str) -> StateEscapesTransform:
    what = f"updating {named(key)}" if len(key) == 5 else named(key)  # a cost is made
    return StateEscapesTransform(
        f"{what} happens inside {place}: one value per iteration could not be stored. Use "
        "graphmod.scan, or a loop of static length (lax.scan, nnx.scan, a fori_loop with "
        "static bounds), where such a variable is stacked, one slice per iteration"
    )
