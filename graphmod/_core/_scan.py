"""``graphmod.scan``: ``lax.scan`` that carries the program's state through the loop.

A raw ``lax.scan`` body cannot leave values aside: a batch-norm statistic updated or a value
monitored inside it would leak a tracer. ``graphmod.scan`` threads the frame's mutable state
(manager-owned variables and the model's non-parameter variables) through the scan carry,
stacks monitored values along the scanned axis, and folds the step index into every
``call.rng()`` (so masks differ per step unless a manager asks for ``per_step=False``).
Outside a compiled program it is exactly ``lax.scan``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from graphmod._core import _context
from graphmod._core._collected import LoopSnapshot
from graphmod._core._frame import Frame


def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    *,
    reverse: bool = False,
    unroll: int | bool = 1,
) -> tuple[Any, Any]:
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
    state = frame.carry()

    body = functools.partial(_body, frame, snapshot, f)
    (carry, model_out, owned_out), (ys, monitored) = jax.lax.scan(
        body, (init, *state), (xs, jnp.arange(length)), length, reverse=reverse, unroll=unroll)
    # init never updates: drop the body's values of the owned variables
    frame.after_loop((model_out, state[1] if first else owned_out), monitored,
                     owned_written=not first)
    return carry, ys


def _body(frame: Frame, snapshot: LoopSnapshot, f: Callable, carry: Any, inputs: Any
          ) -> tuple[Any, Any]:
    """One step of the scan: ``f`` with the frame's state carried in and out."""
    user_carry, *step_state = carry
    x, index = inputs
    with frame.loop_body(snapshot, tuple(step_state)):
        user_carry, y = _step(frame, f, user_carry, x, index)
        new_state, monitored = frame.carried(tuple(step_state))
    return (user_carry, *new_state), (y, monitored)


def _step(frame: Frame, f: Callable, carry: Any, x: Any, index: Any) -> tuple[Any, Any]:
    with frame.loop_step(index):
        return f(carry, x)


def _length(xs: Any, length: int | None) -> int:
    if length is not None:
        return length
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise ValueError("graphmod.scan: give xs or length")
    return jnp.shape(leaves[0])[0]
