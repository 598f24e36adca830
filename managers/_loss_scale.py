"""Loss scaling for float16 training: ``DynamicLossScale``, jmp's rule.

A float16 gradient underflows to zero below about 6e-8: the step scales the cost up before
differentiating (the gradients with it) and the gradients down after, in their own dtype
(float32 for parameters stored in float32). When a scaled gradient overflows (inf or NaN
anywhere), the step is skipped and the scale halved; after ``period`` steps in a row with
finite gradients it doubles. The scale and the count of good steps live in the train state
(``TrainState.loss_scale``), so a checkpoint holds them and a resumed run scales exactly as
the uninterrupted one. It is not a manager: ``graphmod.optimize(..., loss_scale=)`` runs it,
through the ``graphmod.typing.LossScale`` protocol.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from graphmod.typing import Variables


class DynamicLossScale:
    """Dynamic loss scaling (as ``jmp.DynamicLossScale``): scale the cost by ``initial``,
    halve it (by ``factor``, down to ``min_scale``) and skip the step when a gradient
    overflows, multiply it by ``factor`` after ``period`` finite steps in a row.

    Args:
        initial: the first scale (jmp's default ``2**15``).
        period: finite steps in a row after which the scale grows.
        factor: what the scale is multiplied by when it grows, divided by when it shrinks.
        min_scale: the scale never goes below it.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(), lin,
        ...                      managers=[managers.MixedPrecision("float16", bricks=[lin])])
        >>> step = gm.optimize(program, optax.sgd(0.1),
        ...                    loss_scale=managers.DynamicLossScale(2.0 ** 20))
        >>> variables = program.init(jnp.ones((1, 2)))
        >>> state = step.init(variables, jax.random.key(0))
        >>> state, metrics = step(state, jnp.ones((4, 2)))  # 2**20 overflows float16: skipped
        >>> float(metrics["loss_scale/scale"]), bool((state.variables["model"]["W"]
        ...                                          == variables["model"]["W"]).all())
        (524288.0, True)
        >>> state, metrics = step(state, jnp.ones((4, 2)))  # still too large, halved again
        >>> float(state.loss_scale["scale"])
        262144.0
    """

    def __init__(self, initial: float = 2.0 ** 15, *, period: int = 2000, factor: float = 2.0,
                 min_scale: float = 1.0) -> None:
        def number(name: str, value: object, least: float) -> float:
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value) or value < least or value <= 0):
                raise ValueError(f"DynamicLossScale({name}={value!r}): expected a finite "
                                 f"number >= {least} and > 0")
            return float(value)

        self.min_scale = number("min_scale", min_scale, 0.0)
        self.initial = number("initial", initial, self.min_scale)
        if self.initial > float(jnp.finfo(jnp.float32).max) / 2:
            raise ValueError(f"DynamicLossScale(initial={initial!r}): the scale is a float32; "
                             "start it below 2**127 (jmp's default is 2**15)")
        self.factor = number("factor", factor, 1.0)
        if self.factor == 1.0:
            raise ValueError("DynamicLossScale(factor=1.0): the scale would never change; "
                             "pass a factor > 1 (jmp's is 2)")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"DynamicLossScale(period={period!r}): expected an int >= 1, the "
                             "number of finite steps in a row after which the scale grows")
        self.period = period

    def __repr__(self) -> str:
        return (f"DynamicLossScale({self.initial!r}, period={self.period}, "
                f"factor={self.factor!r}, min_scale={self.min_scale!r})")

    def init(self) -> dict[str, jax.Array]:
        """The first state: the scale (float32) and the finite steps since it last changed."""
        return {"scale": jnp.float32(self.initial), "good_steps": jnp.int32(0)}

    def scale(self, state: Mapping[str, jax.Array], cost: jax.Array) -> jax.Array:
        """``cost * scale``, in the cost's dtype."""
        return cost * state["scale"].astype(cost.dtype)

    def unscale(self, state: Mapping[str, jax.Array], grads: Variables) -> Variables:
        """Each gradient divided by the scale, in its own dtype."""
        inverse = 1.0 / state["scale"]
        return jax.tree.map(lambda g: (g * inverse).astype(g.dtype), grads)

    def adjust(self, state: Mapping[str, jax.Array], finite: jax.Array
               ) -> dict[str, jax.Array]:
        """The next state: halved (and the count reset) after an overflow; grown after
        ``period`` finite steps."""
        scale, good = state["scale"], state["good_steps"]
        grow = good + 1 >= self.period
        grown = jnp.where(grow & jnp.isfinite(scale * self.factor), scale * self.factor, scale)
        shrunk = jnp.maximum(jnp.float32(self.min_scale), scale / self.factor)
        return {"scale": jnp.where(finite, grown, shrunk).astype(jnp.float32),
                "good_steps": jnp.where(finite & ~grow, good + 1, 0).astype(jnp.int32)}
