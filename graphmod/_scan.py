"""``graphmod.scan``: ``lax.scan`` that carries the program's state through the loop.

A raw ``lax.scan`` body cannot leave values aside: a batch-norm statistic updated or a value
monitored inside it would leak a tracer. ``graphmod.scan`` threads the frame's mutable state
(manager-owned variables and the model's non-parameter variables) through the scan carry,
stacks monitored values along the scanned axis, and folds the step index into every
``call.rng()`` (so masks differ per step unless a manager asks for ``per_step=False``).
Outside a compiled program it is exactly ``lax.scan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from graphmod import _context
from graphmod import roles as _roles
from graphmod._frame import Frame, current_trace


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
    if length is None:
        leaves = jax.tree.leaves(xs)
        if not leaves:
            raise ValueError("graphmod.scan: give xs or length")
        length = jnp.shape(leaves[0])[0]
    snapshot = (dict(frame.call_counts), len(frame.rewrites),
                len(frame.records) if frame.records is not None else 0)
    if frame.mode == "init" and length > 0:
        # Create manager-owned variables at the outer level from one step's shapes, so the
        # scan below can carry them; the body then replays the same call ids.
        _step(frame, f, init, jax.tree.map(lambda x: x[0], xs), jnp.int32(0))
    mutable = _mutable_model(frame)
    owned = dict(frame.owned)
    saved = (frame.base_trace, frame.monitored)

    def body(carry: Any, inputs: Any) -> tuple[Any, Any]:
        user_carry, model_state, owned_state = carry
        x, index = inputs
        _restore(frame, snapshot)  # JAX may trace a body twice: record its calls once
        frame.values.update(model_state)
        frame.owned.update(owned_state)
        frame.base_trace, frame.monitored = current_trace(), {}
        user_carry, y = _step(frame, f, user_carry, x, index)
        new_model = {i: frame.values[i] for i in model_state}
        new_owned = {k: frame.owned[k] for k in owned_state}
        return (user_carry, new_model, new_owned), (y, frame.monitored)

    try:
        (carry, model_out, owned_out), (ys, monitored) = jax.lax.scan(
            body, (init, mutable, owned), (xs, jnp.arange(length)), length,
            reverse=reverse, unroll=unroll)
    finally:
        frame.base_trace, frame.monitored = saved
    frame.values.update(model_out)
    frame.updated.update(model_out)
    if frame.mode == "init" and length > 0:
        frame.owned.update(owned)  # init never updates: drop the body's values
    else:
        frame.owned.update(owned_out)
        frame.owned_updated.update(owned_out)
    frame.monitored.update(monitored)
    return carry, ys


def _step(frame: Frame, f: Callable, carry: Any, x: Any, index: Any) -> tuple[Any, Any]:
    frame.scan_indices.append(index)
    try:
        return f(carry, x)
    finally:
        frame.scan_indices.pop()


def _mutable_model(frame: Frame) -> dict[str, Any]:
    """The model's variables a step may write: every one but the parameters."""
    return {
        identity: value for identity, value in frame.values.items()
        if not frame.layout.by_identity[identity].role.is_a(_roles.PARAMETER)
    }


def _restore(frame: Frame, snapshot: tuple[dict, int, int]) -> None:
    counts, rewrites, records = snapshot
    frame.call_counts.clear()
    frame.call_counts.update(counts)
    del frame.rewrites[rewrites:]
    if frame.records is not None:
        del frame.records[records:]
