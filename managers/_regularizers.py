"""Regularizers as auxiliary costs: ``L2`` and ``WeightDecay`` on selected parameters.

Each adds a cost per selected parameter with ``call.add_auxiliary_variable(cost,
roles=[COST])`` and leaves the parameter as it is; :func:`graphmod.optimize` adds the costs
to the one it differentiates and reports their sum under the manager's name
(``metrics["l2"]``). A parameter read by several applications costs once per step.

Which weight
    A cost penalises the parameter as stored (``on="stored"``, the default: what a
    ``WeightNorm`` reads as ``V``, before a ``WeightNoise`` draw) or as the application
    reads it after every rewrite (``on="rewritten"``: ``g * V / ||V||``). The choice is
    declared for the chain's order (kinds ``"cost_on_stored_parameters"`` /
    ``"cost_on_rewritten_parameters"``, running before / after every
    ``"parameter_rewrite"``), so the listed order no longer decides it, and the program's
    display shows it.

Sharp edges
    The costs are training-mode only (inference and ``program.train``'s outputs do not
    include them: :func:`graphmod.optimize` does). In a loop over stacked layers (Flax's
    ``nnx.scan`` over layers) each layer's cost is summed over the layers. A parameter first
    read inside another raw JAX transform (a cell ``nnx.RNN`` runs at every step) or a
    ``graphmod.scan`` body cannot add a cost there (it would have to leave the inner
    trace): the error names it.
"""

from __future__ import annotations

import math
import numbers
from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod import roles
from graphmod.typing import HookContext
from managers._checks import ManagerOptions, require_floating, roles_by_default


class _ParameterCost(gm.Manager):
    """``factor * strength * sum(W ** 2)`` as an auxiliary cost of each selected parameter."""

    hparams = ("strength",)
    factor = 1.0

    def __init__(self, strength: float | gm.Dynamic, *, on: str = "stored",
                 **kwargs: Unpack[ManagerOptions]) -> None:
        if on not in ("stored", "rewritten"):
            raise ValueError(f"{type(self).__name__}(on={on!r}): must be 'stored' (the "
                             "parameter as stored) or 'rewritten' (as the application reads "
                             "it, after every parameter rewrite: a WeightNorm's g * V / |V|)")
        super().__init__(**roles_by_default(kwargs))
        number = strength.value if isinstance(strength, gm.Dynamic) else strength
        if isinstance(number, bool) or not isinstance(number, numbers.Real) \
                or not math.isfinite(number) or number < 0:
            raise ValueError(f"{type(self).__name__}({number!r}): the strength must be a "
                             "finite float >= 0")
        self.strength = strength
        self.on = on
        self.kinds = (f"cost_on_{on}_parameters",)
        if on == "stored":
            self.runs_before = ("parameter_rewrite",)
        else:
            self.runs_after = ("parameter_rewrite",)

    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        require_floating(self, call, name, value)
        if call.training:
            # The stored value itself, also after a manager that declares no kind.
            read = call.parameter_value if self.on == "stored" else value
            square = jnp.sum(jnp.square(read.astype(jnp.float32)))
            cost = self.factor * jnp.asarray(self.hp("strength"), jnp.float32) * square
            call.add_auxiliary_variable(cost, roles=[roles.COST], name="cost")
        return value


class L2(_ParameterCost):
    """An L2 penalty ``strength * sum(W ** 2)`` per selected parameter (Keras' ``L2``),
    added to the cost by :func:`graphmod.optimize`. Selects ``WEIGHT`` parameters unless
    its filter chooses variables (``roles=``, ``path=``, ``variable_name=``,
    ``name_regex=``, ``filter=``); ``strength`` may be :func:`graphmod.dynamic`. ``on``:
    ``"stored"`` (default) penalises the parameter as stored, ``"rewritten"`` as the
    application reads it after every parameter rewrite (see the module docstring).

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: m(x).mean(), lin, managers=[managers.L2(0.1)])
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(jnp.ones((1, 2))), jax.random.key(0))
        >>> _, metrics = step(state, jnp.ones((4, 2)))
        >>> bool(jnp.isclose(metrics["l2"], 0.1 * (lin.W[...] ** 2).sum()))
        True
        >>> managers.L2(0.1, on="rewritten").kinds
        ('cost_on_rewritten_parameters',)
    """


class WeightDecay(_ParameterCost):
    """Weight decay as a cost, ``rate / 2 * sum(W ** 2)`` per selected parameter: its
    gradient is ``rate * W``, what ``optax.add_decayed_weights(rate)`` adds to the updates
    before the optimizer (coupled decay; for AdamW's decoupled decay use
    ``optax.adamw``). Selects ``WEIGHT`` parameters unless its filter chooses variables
    (``roles=``, ``path=``, ``variable_name=``, ``name_regex=``, ``filter=``); ``on`` as
    for :class:`L2`.

    Examples:
        >>> import graphmod as gm, managers
        >>> managers.WeightDecay(1e-4).name
        'weight_decay'
    """

    factor = 0.5

    def __init__(self, rate: float | gm.Dynamic, *, on: str = "stored",
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(rate, on=on, **kwargs)
