"""``graphmod.scan`` and ``graphmod.remat``: ``lax.scan`` and ``jax.checkpoint`` that carry
the program's state through.

A raw ``lax.scan`` body or ``jax.checkpoint`` region cannot leave values aside: a batch-norm
statistic updated or a value monitored inside it would leak a tracer. ``graphmod.scan``
threads the frame's mutable state (manager-owned variables and the model's non-parameter
variables) through the scan carry, stacks monitored values along the scanned axis, and folds
the step index into every ``call.rng()`` (so masks differ per step unless a manager asks for
``per_step=False``). ``graphmod.remat`` returns what the region wrote, monitored and added
to optimize's costs beside its result; inside a loop body JAX traces once (``nnx.scan``
over layers) it is ``jax.checkpoint`` through which the loop's marks pass (per-layer keys and
manager variables, see ``graphmod._core._loops._loop_keys``), and the writes to the loop's
copies of the layer's variables are lifted out (``graphmod._core._tracing._lifted_writes``).
Outside a compiled program they are exactly ``lax.scan`` and ``jax.checkpoint``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar, TypeVarTuple, cast

import jax
import jax.numpy as jnp
from flax import nnx

from graphmod._core._model._owned import OwnedKey
from graphmod._core._tracing import _context
from graphmod._core._tracing._frame import Carry, Frame
from graphmod._core._tracing._lifted_writes import lifting
from graphmod._core._tracing._side_outputs import LoopSnapshot
from graphmod.typing import ArrayLike, PyTree

C = TypeVar("C")  # the scan's carry
X = TypeVar("X")  # one step's slice of xs
Y = TypeVar("Y")  # one step's output, stacked into ys
R = TypeVar("R")  # what a remat region returns
Ts = TypeVarTuple("Ts")  # a remat region's arguments
# The frame's state as a loop carries it across a JAX transform: model variables by path.
ByPath = tuple[dict[str, jax.Array], dict[OwnedKey, jax.Array]]


def scan(
    f: Callable[[C, X], tuple[C, Y]],
    init: C,
    xs: X | None = None,
    length: int | None = None,
    *,
    reverse: bool = False,
    unroll: int | bool = 1,
) -> tuple[C, Y]:
    """Like ``jax.lax.scan(f, init, xs, length)``, carrying manager state and monitors.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> carry, ys = gm.scan(lambda c, x: (c + x, 2 * x), 0.0, jnp.arange(3.0))
        >>> float(carry), ys.tolist()
        (3.0, [0.0, 2.0, 4.0])
    """
    frame = _context.current_frame()
    if frame is None:
        return jax.lax.scan(f, init, xs, length, reverse=reverse, unroll=unroll)
    length = _length(xs, length)
    snapshot = frame.snapshot()
    first = frame.mode == "init" and length > 0
    if first:
        # Create manager-owned variables at the outer level from one step's shapes, so the
        # scan below can carry them; the body then replays the same call ids.
        _step(frame, f, init, jax.tree.map(lambda x: x[0], xs), jnp.int32(0))
    model, owned = frame.carry()

    body = functools.partial(_body, frame, snapshot, f)
    steps = (cast("X", xs), jnp.arange(length))  # xs None: f's x is None, as in lax.scan
    (carry, model_out, owned_out), (ys, monitored) = jax.lax.scan(
        body, (init, _by_path(frame, model), owned), steps, length,
        reverse=reverse, unroll=unroll)
    # init never updates: drop the body's values of the owned variables
    frame.after_loop((_by_identity(frame, model_out), owned if first else owned_out),
                     monitored, owned_written=not first)
    return carry, ys


def _body(frame: Frame, snapshot: LoopSnapshot, f: Callable[[C, X], tuple[C, Y]],
          carry: tuple[C, dict[str, jax.Array], dict[OwnedKey, jax.Array]],
          inputs: tuple[X, jax.Array]
          ) -> tuple[tuple[C, dict[str, jax.Array], dict[OwnedKey, jax.Array]],
                     tuple[Y, dict[str, object]]]:
    """One step of the scan: ``f`` with the frame's state carried in and out."""
    user_carry, model, owned = carry
    x, index = inputs
    step_state = (_by_identity(frame, model), owned)
    with frame.loop_body(snapshot, step_state):
        user_carry, y = _step(frame, f, user_carry, x, index)
        (model, owned), monitored = frame.carried(step_state)
    return (user_carry, _by_path(frame, model), owned), (y, monitored)


def _step(frame: Frame, f: Callable[[C, X], tuple[C, Y]], carry: C, x: X, index: jax.Array
          ) -> tuple[C, Y]:
    with frame.loop_step(index):
        return f(carry, x)


def _length(xs: PyTree, length: int | None) -> int:
    if length is not None:
        return length
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise ValueError("graphmod.scan: give xs or length")
    return jnp.shape(leaves[0])[0]


def remat(f: Callable[[*Ts], R], *, policy: Callable[..., bool] | None = None
          ) -> Callable[[*Ts], R]:
    """Like ``jax.checkpoint(f, policy=policy)``: ``f``'s activations are recomputed in the
    backward pass; in a program, the variables ``f`` writes (a batch norm's statistics, an
    RNG stream's count), the values it monitors and the costs and measurements it adds for
    :func:`graphmod.optimize` come out of the region. ``init`` runs ``f`` as it is (it
    computes no gradient). Arguments are passed by position, as to the checkpointed
    function.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> round(float(jax.grad(gm.remat(lambda x: jnp.sin(x) * x))(1.0)), 5)
        1.38177
    """
    checkpointed = jax.checkpoint(f, policy=policy)

    def run(*args: *Ts) -> R:
        frame = _context.current_frame()
        if frame is None:
            return checkpointed(*args)
        if frame.mode == "init":
            return f(*args)
        copies: list[nnx.Variable] = []
        if frame.inner():  # in a loop body: its keys and manager variables cross as marks
            out, lifted = jax.checkpoint(functools.partial(_lifted, copies, f),
                                         policy=policy)(*args)
        else:
            snapshot, state = frame.snapshot(), frame.carry()
            out, written, monitored, costs, measured, lifted = jax.checkpoint(
                functools.partial(_region, frame, snapshot, state, copies, f),
                policy=policy)(*args)
            frame.after_loop((_by_identity(frame, written[0]), written[1]), monitored,
                             owned_written=True)
            for (owner, key), cost in costs.items():  # in place of the region's own tracers
                frame.add_cost(owner, key, cost)
            for key, value in measured.items():
                frame.add_measurement(key, value)
        for variable, value in zip(copies, lifted, strict=True):  # at the copies' own level
            variable.set_raw_value(value)
        return out

    return run


def _region(frame: Frame, snapshot: LoopSnapshot, state: Carry, copies: list[nnx.Variable],
            f: Callable[[*Ts], R], *args: *Ts
            ) -> tuple[R, ByPath, dict[str, object], dict[tuple[str, str], ArrayLike],
                       dict[str, ArrayLike], list[jax.Array]]:
    """``f`` as the base trace of the frame, and what it changed of ``state`` (read from
    outside, as closed-over values), monitored, and added to optimize's costs and
    measurements, and the values it wrote to the ``copies`` it appends (an NNX transform's
    copies of model variables, see ``graphmod._core._tracing._lifted_writes``)."""
    costs = _costs(frame)
    measured = dict(frame.measured)
    with frame.loop_body(snapshot, state):
        out, lifted = _lifted(copies, f, *args)
        new, monitored = frame.carried(state)
    (new_model, new_owned), (old_model, old_owned) = new, state
    model = {k: v for k, v in new_model.items() if v is not old_model[k]}
    owned = {k: v for k, v in new_owned.items() if v is not old_owned[k]}
    return (out, (_by_path(frame, model), owned), monitored,
            {k: v for k, v in _costs(frame).items() if costs.get(k) is not v},
            {k: v for k, v in frame.measured.items() if measured.get(k) is not v}, lifted)


def _lifted(copies: list[nnx.Variable], f: Callable[[*Ts], R], *args: *Ts
            ) -> tuple[R, list[jax.Array]]:
    """``f``'s result, and the values it wrote to the ``copies`` it appends: an NNX
    transform's copies of model variables, written at another trace level (see
    ``graphmod._core._tracing._lifted_writes``)."""
    with lifting() as writes:
        out = f(*args)
    copies.extend(variable for variable, _ in writes.values())
    return out, [value for _, value in writes.values()]


def _by_path(frame: Frame, model: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The model's variables keyed by path where they cross a JAX transform: JAX flattens a
    dict in key order, and identities are spelled from ``id()``, so keyed by identity the
    jaxpr (and the program's fingerprint) changed from one process to the next."""
    return {frame.layout.by_identity[identity].path: value for identity, value in model.items()}


def _by_identity(frame: Frame, model: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """:func:`_by_path` undone."""
    return {frame.layout.identity_at[path]: value for path, value in model.items()}


def _costs(frame: Frame) -> dict[tuple[str, str], ArrayLike]:
    return {(owner, key): value for owner, by_key in frame.costs.items()
            for key, value in by_key.items()}
