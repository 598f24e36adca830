"""Init's values without compiling the program: trace, keep what the outputs need, run it.

``init`` traces the whole training-mode function to meet every manager-owned variable, but
its outputs (the owned variables and hyperparameters) rarely need more of that trace than a
``jnp.zeros`` or a function of one parameter. ``evaluate_needed`` traces ``fn`` to a jaxpr,
drops every equation its outputs do not need (JAX's dead-code elimination), and evaluates
the remainder eagerly, one primitive at a time, inlining the bodies of ``jax.jit`` calls:
no XLA compile of the program, and the few primitives left hit JAX's per-primitive cache.

Sharp edges
    Uses JAX's dead-code elimination from ``jax._src`` (internal; the JAX minor version is
    pinned in ``pyproject.toml``). Equations with side effects (``jax.debug.print``,
    callbacks) are kept and run, as the compiled ``init`` ran them. Eager evaluation may
    round differently from a fused XLA computation where an owned variable is computed from
    a parameter (last-bit differences).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, TypeVarTuple

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from graphmod import roles as _roles
from graphmod._core._loops._jaxpr_interpreter import bind, interpret
from graphmod._core._loops._loop_resolution import resolving
from graphmod._core._managers._manager import Manager
from graphmod._core._model._layout import Layout
from graphmod._core._model._owned import OwnedKey
from graphmod._core._model._owned_layout import HPARAMS, encode
from graphmod._core._program._arguments import spec_differences
from graphmod._core._program._program_record import abstract
from graphmod._core._tracing._frame import Frame
from graphmod.errors import ModelChanged
from graphmod.typing import ArrayLike, PyTree

__all__ = ["evaluate_needed", "fresh_variables"]

# trace(model values, hyperparameters, key, args, kwargs): the frame of an init trace
InitTrace = Callable[[dict[str, jax.Array], dict[tuple[str, str], jax.Array], jax.Array,
                      tuple[PyTree, ...], dict[str, PyTree]], Frame]
Ts = TypeVarTuple("Ts")
R = TypeVar("R")

# Call primitives whose bodies are evaluated inline, equation by equation.
_INLINED = ("pjit", "jit", "closed_call", "core_call")


def fresh_variables(layout: Layout, managers: Sequence[Manager], trace: InitTrace,
                    args: tuple[PyTree, ...], kwargs: dict[str, PyTree], key: jax.Array, *,
                    probe: bool
                    ) -> tuple[dict, dict[OwnedKey, _roles.Role]]:
    """Init's variables (copies of the model's arrays, the managers' hyperparameters and
    owned variables) and the owned variables' roles, from an init ``trace`` on ``args``;
    ``probe``: shapes only. Pure: nothing is kept.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> variables = program.init(jnp.ones((1, 2)))  # runs fresh_variables
        >>> variables["managers"], variables["model"]["W"].shape
        ({}, (2, 3))
    """
    copy = abstract if probe else (lambda value: jnp.array(value, copy=True))
    model = layout.pure({identity: copy(value) for identity, value in _arrays(layout).items()})
    hparams = {(m.name, h): jnp.float32(v) for m in managers
               for h, v in m.dynamic_hparams().items()}
    roles: dict[OwnedKey, _roles.Role] = {}  # of the last trace
    seen: list[str] = []  # the managers it met

    def owned(model: dict, args: tuple[PyTree, ...], kwargs: dict[str, PyTree],
              key: jax.Array) -> dict:
        frame = trace(layout.model_values(model), hparams, key, args, kwargs)
        roles.clear()
        roles.update(frame.owned_roles)
        seen[:] = [m.name for m in frame.seen_managers.values()]
        return encode(frame.owned_out(), frame.hparams)

    # Owned variables first met in loop bodies are stacked over the loops' lengths.
    run = jax.eval_shape if probe else evaluate_needed
    out = run(resolving(owned), model, args, kwargs, key)
    for name in seen:
        out.setdefault(name, {HPARAMS: {}})
    return {"model": model, "managers": out}, roles


def _arrays(layout: Layout) -> dict[str, ArrayLike]:
    """identity -> the model's array, each of the shape and dtype it was compiled with."""
    arrays = {identity: layout.value(identity) for identity in layout.objects}
    differences = spec_differences(
        arrays, {info.identity: (info.shape, info.dtype) for info in layout.variables},
        lambda identity: layout.by_identity[identity].path)
    if differences:
        raise ModelChanged(
            "program.init: the model's arrays changed since it was compiled:\n  "
            + "\n  ".join(differences) + "\nA program's variables keep the shapes and dtypes "
            "the model had at compile: compile again after changing them "
            "(graphmod.compile(fn, model)), or give the arrays back those shapes and dtypes")
    return arrays


def evaluate_needed(fn: Callable[[*Ts], R], *args: *Ts) -> R:
    """``fn(*args)``, evaluating only the equations its outputs depend on (here not the
    product, which ``fn`` computes and drops).

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod._core._program._abstract_init import evaluate_needed
        >>> evaluate_needed(lambda x: (x @ x.T, {"zeros": jnp.zeros(2)})[1], jnp.ones((3, 3)))
        {'zeros': Array([0., 0.], dtype=float32)}
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr, used_consts, used_args = _pe.dce_jaxpr_consts(
        closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    consts = [c for c, used in zip(closed.consts, used_consts, strict=True) if used]
    flat = [a for a, used in zip(jax.tree.leaves(args), used_args, strict=True) if used]
    # An output the jaxpr holds as a literal comes back as NumPy: made a device array of
    # its own dtype, so the variables jit sees are the same kind as a step's outputs.
    outs = [out if isinstance(out, jax.Array) else jnp.asarray(out, shape.dtype)
            for out, shape in zip(_evaluate(jaxpr, consts, flat), jax.tree.leaves(shapes),
                                  strict=True)]
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def _evaluate(jaxpr: Jaxpr, consts: Sequence[jax.Array], args: Sequence[jax.Array]
              ) -> list[jax.Array]:
    """``jax.core.eval_jaxpr``, with the bodies of jitted calls evaluated inline (a call
    binds as one compiled computation, new for every trace's jaxpr)."""
    return interpret(jaxpr, consts, args, _equation)


def _equation(eqn: JaxprEqn, invals: list[jax.Array]) -> list[jax.Array]:
    if eqn.primitive.name in _INLINED:
        inner = eqn.params["jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"]
        closed = inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())
        return _evaluate(closed.jaxpr, closed.consts, invals)
    with eqn.ctx.manager:
        return bind(eqn, invals)
