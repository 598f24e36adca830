"""``ActivationStats``: statistics of selected variables as metrics of the train step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from managers._checks import ManagerOptions, require_floating

STATISTICS = ("mean", "std", "zeros", "max_abs")


class ActivationStats(gm.Manager):
    """Reports the mean, standard deviation, fraction of exact zeros and largest absolute
    value of each selected input or output (dead ReLUs, exploding activations) with
    ``call.report``: :func:`graphmod.optimize`'s metrics hold them as
    ``"activation_stats:<path>.<application>.<name>.<statistic>"``, computed inside the
    step (no host sync). Values are never changed; training mode only.

    Args:
        statistics: which of ``"mean"``, ``"std"``, ``"zeros"``, ``"max_abs"`` to report.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0))
        >>> stats = managers.ActivationStats(roles=[gm.roles.OUTPUT], statistics=["zeros"])
        >>> program = gm.compile(lambda m, x: jax.nn.relu(m(x)).sum(), lin, managers=[stats])
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(jnp.ones((1, 2))), jax.random.key(0))
        >>> sorted(step(state, jnp.ones((4, 2)))[1])
        ['activation_stats:/.apply.output.zeros', 'loss']
    """

    def __init__(self, *, statistics: str | Sequence[str] = STATISTICS,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**kwargs)
        chosen = tuple([statistics] if isinstance(statistics, str) else statistics)
        unknown = [s for s in chosen if s not in STATISTICS]
        if unknown or not chosen:
            raise ValueError(f"ActivationStats(statistics={statistics!r}): choose from "
                             f"{list(STATISTICS)}")
        self.statistics = chosen

    # A gm.ApplicationCall: its ``report``, which HookContext does not name.
    def _measure(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        require_floating(self, call, name, value)
        if not call.training:
            return value
        x = jax.lax.stop_gradient(value).astype(jnp.float32)
        compute = {"mean": jnp.mean, "std": jnp.std,
                   "zeros": lambda v: jnp.mean(v == 0), "max_abs": lambda v: jnp.max(jnp.abs(v))}
        for statistic in self.statistics:
            call.report(compute[statistic](x), f"{name}.{statistic}")
        return value

    def rewrite_input(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        return self._measure(call, name, value)

    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        return self._measure(call, name, value)
