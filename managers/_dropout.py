"""``Dropout``: inverted dropout on inputs, outputs or parameters."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod import roles
from graphmod.typing import HookContext
from managers._checks import ManagerOptions, chooses_variables, require_floating


class Dropout(gm.Manager):
    """Inverted dropout: zeroes each element with probability ``rate`` in training and
    scales the kept ones by ``1 / (1 - rate)``, so the expected value is unchanged.

    Inference is the identity. ``rate=0`` is the identity; ``rate=1`` gives zeros with
    zero (finite) gradients. The output keeps the input's dtype.

    Args:
        rate: drop probability, a float or ``graphmod.dynamic(float)``.
        broadcast_dims: axes along which one mask value is shared (e.g. the time axis).
        per_step: inside ``graphmod.scan`` or a loop JAX traces once (``nnx.scan`` over
            layers, ``nnx.fori_loop``), a new mask each step (default) or one for all.
        **filter: the manager's filter fields (``bricks``, ``roles``, ``variable_name``,
            ...), ``manager_name``, etc. Without one choosing variables (``roles=``,
            ``path=``, ...) it drops every input, output and parameter of the applications
            it selects, and warns.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(100, 100, rngs=nnx.Rngs(0))
        >>> with managers.Dropout(0.5, roles=[gm.roles.INPUT]):
        ...     program = gm.compile(lambda m, x: m(x), lin)
        >>> x = jnp.ones((8, 100))
        >>> variables = program.init(x)
        >>> out, _ = program.train(variables, x, rng=jax.random.key(0))
        >>> bool(jnp.allclose(program.infer(variables, x), lin(x)))
        True
    """

    hparams = ("rate",)
    hparam_ranges = {"rate": (0.0, 1.0)}  # Anneal refuses a rate outside

    def __init__(self, rate: float | gm.Dynamic, *, broadcast_dims: Sequence[int] = (),
                 per_step: bool = True, **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**kwargs)
        value = rate.value if isinstance(rate, gm.Dynamic) else rate
        if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                or not 0.0 <= value <= 1.0):
            raise ValueError(f"Dropout(rate={rate!r}): rate must be a float in [0, 1]")
        if isinstance(broadcast_dims, int) or not all(
                isinstance(d, int) for d in broadcast_dims):
            raise TypeError(f"Dropout(broadcast_dims={broadcast_dims!r}): expected a sequence "
                            "of axis indices (ints)")
        if not chooses_variables(kwargs):
            warnings.warn(
                f"Dropout({rate!r}) without roles= drops every input, output and parameter "
                "of the applications it selects (with no filter, the model's own inputs and "
                "outputs too): choose roles=[gm.roles.OUTPUT] (after each layer, as a dropout "
                "layer does), roles=[gm.roles.INPUT], or roles=[gm.roles.WEIGHT] "
                "(DropConnect)", gm.errors.GraphmodWarning, stacklevel=2)
        self.rate = rate
        self.broadcast_dims = tuple(broadcast_dims)
        self.per_step = per_step
        if self.filter.roles is None or self.filter.names_role(roles.PARAMETER):
            self.kinds = ("parameter_rewrite",)  # DropConnect: EMA and L2 go first

    def _drop(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        require_floating(self, call, name, value)
        if not call.training or (not isinstance(self.rate, gm.Dynamic) and self.rate == 0):
            return value
        shape = list(jnp.shape(value))
        for axis in self.broadcast_dims:
            if not -len(shape) <= axis < len(shape):
                raise ValueError(f"Dropout(broadcast_dims={self.broadcast_dims}): axis {axis} "
                                 f"is out of range for {call.path}.{call.name} of shape "
                                 f"{tuple(jnp.shape(value))}")
            shape[axis] = 1
        key = call.rng(per_step=self.per_step)
        zero = jnp.zeros((), value.dtype)
        if not isinstance(self.rate, gm.Dynamic):  # a constant: the scale is folded now
            if self.rate == 1:
                return jnp.zeros_like(value)
            mask = jax.random.bernoulli(key, 1.0 - self.rate, shape)
            return jnp.where(mask, value * jnp.asarray(1.0 / (1.0 - self.rate), value.dtype),
                             zero)
        keep = 1.0 - jnp.asarray(self.hp("rate"), jnp.float32)
        mask = jax.random.bernoulli(key, keep, shape)
        # The double where keeps the gradient with respect to a dynamic rate finite at 1.
        safe_keep = jnp.where(keep > 0, keep, 1.0)
        scale = jnp.where(keep > 0, 1.0 / safe_keep, 0.0)
        return jnp.where(mask, value * scale.astype(value.dtype), zero)

    def rewrite_input(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._drop(call, name, value)

    def rewrite_output(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._drop(call, name, value)

    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        return self._drop(call, name, value)
