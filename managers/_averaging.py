"""``EMA``: an exponential moving average of the parameters, which inference reads.

Polyak averaging as a manager: the model trains as written, each training step moves an
average of every selected parameter towards the value the step read, and the program's
inference (``program.infer``, ``graphmod.evaluate``, the ``Validation`` plugin) reads the
averages in place of the parameters. Nothing is cloned: the averages are manager-owned
state in the program's variables, saved and restored with them.

Order
    EMA stands for the stored parameter, so it must read it before any other manager
    rewrites it (else inference would drop the earlier rewrite: LoRA's adapters, a cast).
    It declares so (``kinds = ("average",)``, ``runs_before = ("parameter_rewrite",)``):
    ``compile`` puts it before every manager of kind ``"parameter_rewrite"`` (``LoRA``,
    ``WeightNorm``, ``WeightNoise``, ``FakeQuant``, ``Precision``, ...) wherever it is
    listed, and the rewrite trace and the program's display say it moved.

Sharp edges
    A manager of your own that rewrites parameters without declaring
    ``kinds = ("parameter_rewrite",)`` is not moved: listed before EMA, a trace raises
    :class:`graphmod.errors.ManagerConflict`. ``lora.merge(ema.merge(variables))`` merges
    both, the averages first. A step averages the parameters as it read them, before
    its own update (the average after step ``t`` has seen the weights of steps
    ``0 .. t - 1``). A parameter read by several calls in a step (tied weights, a layer
    called twice) moves once per step. The model's own variables keep the trained weights:
    ``program.update_model(variables)`` writes those, with a warning that the averages are
    left out; :meth:`EMA.merge` puts the averages in their place. Other managers'
    parameters (``LoRA``'s adapters) are not the model's and are not averaged. In a loop
    body that sees a whole module (``nnx.RNN``'s cell, ``jax.jit``) an average cannot be
    updated: use ``graphmod.scan``.
"""

from __future__ import annotations

import numbers
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np

import graphmod as gm
from graphmod import roles
from graphmod.typing import Variables
from managers._checks import ManagerOptions, require_floating, roles_by_default
from managers._merge import merged


def _average_dtype(value: jax.Array) -> np.dtype:
    """At least float32: a bfloat16 average would not move by a small step's fraction."""
    return jnp.promote_types(jnp.result_type(value), jnp.float32)


def _averaged(average: jax.Array, weight: jax.Array, parameter: jax.Array) -> jax.Array:
    """The debiased average in the parameter's dtype; the parameter before any step."""
    return jnp.where(weight > 0, average / weight, parameter).astype(jnp.result_type(parameter))


class EMA(gm.Manager):
    """An exponential moving average of each selected parameter, ``decay`` the weight of
    the old average at every training step; inference reads the averages (see the module
    docstring). Unless its filter chooses variables (``roles=``, ``path=``,
    ``variable_name=``, ``name_regex=``, ``filter=``) it averages every ``PARAMETER`` of the
    applications it selects. Named ``"ema"``.

    The average starts at zero and is read divided by the same average of ones (its
    ``weight``), as Adam debiases its moments and ``optax.ema(debias=True)`` does: after
    one step it is that step's parameters, and a changing ``decay`` weights every step as
    it was then. Before any training step inference reads the parameters themselves.

    Args:
        decay: in [0, 1): the weight of the old average (0.999 averages over about the
            last 1000 steps); ``graphmod.dynamic(...)`` to change it while training.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(), lin,
        ...                      managers=[managers.EMA(0.9)])
        >>> variables = program.init(jnp.ones((1, 1)))
        >>> _, trained = program.train(variables, jnp.ones((1, 1)), rng=jax.random.key(0))
        >>> ema = trained["managers"]["ema"]["/"]["W"]
        >>> round(float(ema["weight"]), 6), bool(jnp.allclose(
        ...     ema["average"] / ema["weight"], variables["model"]["W"]))
        (0.1, True)
    """

    hparams = ("decay",)
    kinds = ("average",)
    runs_before = ("parameter_rewrite",)  # it stands for the stored parameter

    def __init__(self, decay: float | gm.Dynamic = 0.999,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        if "manager_name" not in kwargs and "name" not in kwargs:
            kwargs["manager_name"] = "ema"  # not the class name's snake case, e_m_a
        super().__init__(**roles_by_default(kwargs, (roles.PARAMETER,)))
        value = decay.value if isinstance(decay, gm.Dynamic) else decay
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not 0 <= value < 1:
            raise ValueError(f"EMA(decay={decay!r}): must be a float in [0, 1)")
        self.decay = decay

    # A gm.ApplicationCall, whose variables have ``stored`` (HookContext's do not say so).
    def rewrite_parameter(self, call: gm.ApplicationCall, name: str,
                          value: jax.Array) -> jax.Array:
        require_floating(self, call, name, value)
        if value is not call.parameter_value:
            raise gm.errors.ManagerConflict(
                f"{self!r}: parameter {call.parameter} reaches it already rewritten by a "
                "manager before it that declares no kind 'parameter_rewrite'. EMA stands "
                "for the stored parameter (inference reads the average in its place), so "
                "it must rewrite it first, or the earlier rewrite is lost: declare "
                "kinds = ('parameter_rewrite',) on that manager's class (EMA then goes "
                "first wherever it is listed), or list EMA first in managers=[...]")
        dtype = _average_dtype(value)
        # Zeros of the parameter's shape, not its value: also made inside nnx.scan.
        average = call.variable("average", lambda: jnp.zeros(jnp.shape(value), dtype),
                                role=roles.STATE)
        weight = call.variable("weight", lambda: jnp.zeros((), dtype), role=roles.STATE)
        if not call.training:
            return _averaged(average.value, weight.value, value)
        # From the values the step began with: the same update however many calls read it.
        decay = jnp.asarray(self.hp("decay"), dtype)
        read = jax.lax.stop_gradient(value).astype(dtype)  # value is call.parameter_value
        average.value = decay * average.stored + (1 - decay) * read
        weight.value = decay * weight.stored + (1 - decay)
        return value

    def merge(self, variables: Variables) -> Variables:
        """``variables`` with every averaged parameter replaced by its average (as
        inference reads it; a parameter no step has averaged yet stays as it is) and this
        manager's entries removed: a program compiled without it infers what this one
        does, and its ``update_model`` writes the averages into the model. Raises
        :class:`graphmod.errors.VariablesMismatch` if ``variables`` hold none of its entries.

        Examples:
            >>> import jax, jax.numpy as jnp, graphmod as gm, managers
            >>> from flax import nnx
            >>> lin, ema = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)), managers.EMA(0.9)
            >>> program = gm.compile(lambda m, x: m(x), lin, managers=[ema])
            >>> variables = program.init(jnp.ones((1, 2)))
            >>> sorted(ema.merge(variables)["managers"])
            []
        """
        return merged(self, variables, lambda parameter, entries, _: _averaged(
            entries["average"], entries["weight"], parameter), lambda e: e["weight"].ndim)
