"""``StochasticDepth``: drops whole residual branches per example (Huang et al., 2016)."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod import roles
from managers._checks import default_filter, require_floating


class StochasticDepth(gm.Manager):
    """In training, each example's residual branch is kept with probability ``1 - rate``
    and scaled by ``1 / (1 - rate)`` (so its expected value is unchanged), or dropped;
    inference is the identity. Acts on the output of ``graphmod.bricks.Residual``'s
    ``residual`` application by default (every residual block: a ``TransformerBlock`` has
    two), one draw per example along axis 0. ``rate`` may be :func:`graphmod.dynamic`.

    On a Flax model, select the modules whose outputs a block adds to its residual stream,
    not the block: ``bricks=[modules.Attention, modules.FeedForward]`` for Flax's Gemma,
    whose ``Block`` returns the stream itself (dropping that would drop every earlier
    layer's work for the example).

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> block = gm.bricks.Residual(gm.bricks.Linear(4, 4, rngs=nnx.Rngs(0)))
        >>> program = gm.compile(lambda m, x: m(x), block,
        ...                      managers=[managers.StochasticDepth(0.5)])
        >>> x = jnp.ones((6, 4))
        >>> out, _ = program.train(program.init(x), x, rng=jax.random.key(0))
        >>> sorted({bool(jnp.allclose(row, 1.0)) for row in out})  # some rows dropped
        [False, True]
    """

    hparams = ("rate",)

    def __init__(self, rate: float | gm.Dynamic, **kwargs: Any) -> None:
        super().__init__(**default_filter(kwargs, bricks=[gm.bricks.Residual],
                                          applications=["residual"], roles=[roles.OUTPUT]))
        value = rate.value if isinstance(rate, gm.Dynamic) else rate
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not 0.0 <= value < 1.0:
            raise ValueError(f"StochasticDepth(rate={rate!r}): must be a float in [0, 1)")
        self.rate = rate

    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        require_floating(self, call, name, value)
        if not call.training or (not isinstance(self.rate, gm.Dynamic) and self.rate == 0):
            return value
        if jnp.ndim(value) < 1:
            raise ValueError(f"StochasticDepth {self.name!r}: {name!r} of {call.path} is a "
                             "scalar; it drops examples along axis 0 (the batch)")
        keep = 1.0 - jnp.asarray(self.hp("rate"), jnp.float32)
        kept = jax.random.bernoulli(call.rng(), keep, (value.shape[0],) + (1,) * (
            value.ndim - 1))
        return jnp.where(kept, value / keep.astype(value.dtype), jnp.zeros((), value.dtype))
