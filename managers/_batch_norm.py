"""``BatchNorm``: batch normalization of selected inputs or outputs (Ioffe & Szegedy)."""

from __future__ import annotations

import math
import numbers
from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod import roles
from graphmod.typing import HookContext
from managers._checks import ManagerOptions, require_floating


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@jax.custom_jvp
def _nonnegative(variance: jax.Array) -> jax.Array:
    """``max(variance, 0)``, differentiated as the identity: the clip undoes only round-off
    of ``E[x²] - E[x]²`` (a variance is never negative), so its gradient is the formula's.
    ``jnp.maximum``'s own would add a tie-splitting select to the backward pass."""
    return jnp.maximum(variance, 0)


_nonnegative.defjvp(lambda primals, tangents: (_nonnegative(*primals), *tangents))


class BatchNorm(gm.Manager):
    """Normalizes selected variables with batch statistics in training and running
    (population) statistics in inference, then scales and shifts them.

    Follows ``flax.nnx.BatchNorm``: statistics over every axis but the feature ``axis``,
    biased variance, ``running = momentum * running + (1 - momentum) * batch``. The variance
    is ``E[(x - E[x])²]`` (two passes over ``x``) unless ``use_fast_variance=True``:
    ``E[x²] - E[x]²`` in one pass, clipped at 0 (Flax's default; cheaper, less exact where
    the mean is large against the spread), the clip differentiated as the identity (it
    only undoes round-off, so the gradient is the formula's). Owns per
    matched (path, application, variable): ``<var>.scale``, ``<var>.bias`` (trainable) and
    ``<var>.mean``, ``<var>.var`` (state), shared by all call ids (updated in call order).

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(3, 4, rngs=nnx.Rngs(0))
        >>> with managers.BatchNorm(roles=[gm.roles.OUTPUT]):
        ...     program = gm.compile(lambda m, x: m(x), lin)
        >>> variables = program.init(jnp.ones((2, 3)))
        >>> sorted(variables["managers"]["batch_norm"]["/"]["apply"])
        ['output.bias', 'output.mean', 'output.scale', 'output.var']
    """

    exclusive = True

    def __init__(self, *, momentum: float = 0.99, epsilon: float = 1e-5, axis: int = -1,
                 use_scale: bool = True, use_bias: bool = True,
                 use_fast_variance: bool = False,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**kwargs)
        if not _is_real(momentum) or not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm(momentum={momentum!r}): must be a float in [0, 1]")
        if not _is_real(epsilon) or not 0 < epsilon < math.inf:
            raise ValueError(f"BatchNorm(epsilon={epsilon!r}): must be a finite float > 0")
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"BatchNorm(axis={axis!r}): expected an int (the feature axis)")
        self.momentum = momentum
        self.epsilon = epsilon
        self.axis = axis
        self.use_scale = use_scale
        self.use_bias = use_bias
        if not isinstance(use_fast_variance, bool):
            raise TypeError(f"BatchNorm(use_fast_variance={use_fast_variance!r}): expected "
                            "True or False")
        self.use_fast_variance = use_fast_variance

    def _normalize(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        require_floating(self, call, name, value)
        ndim = jnp.ndim(value)
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"BatchNorm(axis={self.axis}) is out of range for {call.path} "
                             f"{call.application}.{name} of shape {jnp.shape(value)}")
        axis = self.axis % ndim
        features = jnp.shape(value)[axis]
        compute = jnp.promote_types(value.dtype, jnp.float32)
        x = value.astype(compute)
        reduce = tuple(a for a in range(ndim) if a != axis)
        # Per-feature vectors broadcast as they are along the last axis; any other axis
        # needs a reshape (each one is an operation JAX stages and differentiates).
        along = (lambda v: v) if axis == ndim - 1 else (
            lambda v: v.reshape([features if a == axis else 1 for a in range(ndim)]))
        mean = call.variable(f"{name}.mean", lambda: jnp.zeros(features, compute))
        var = call.variable(f"{name}.var", lambda: jnp.ones(features, compute))
        if jnp.shape(mean.value) != (features,):  # the statistics of another feature count
            raise ValueError(
                f"BatchNorm(axis={self.axis}) at {call.path} {call.application}.{name}: "
                f"{features} features along axis {axis} of shape {jnp.shape(value)}, but "
                f"statistics of shape {jnp.shape(mean.value)} from init"
                + ("; axis 0 is the batch: pick the feature axis (-1 for dense layers and "
                   "NHWC images, 1 for NCHW)" if axis == 0 else ""))
        if call.training:
            batch_mean = x.mean(reduce)
            batch_var = (_nonnegative(jnp.square(x).mean(reduce) - jnp.square(batch_mean))
                         if self.use_fast_variance
                         else x.var(reduce))  # one jitted jnp.var: traces faster than its ops
            m = self.momentum
            mean.value = m * mean.value + (1 - m) * batch_mean
            var.value = m * var.value + (1 - m) * batch_var
            use_mean, use_var = batch_mean, batch_var
        else:
            use_mean, use_var = mean.value, var.value
        y = (x - along(use_mean)) * along(jax.lax.rsqrt(use_var + self.epsilon))
        if self.use_scale:
            scale = call.variable(f"{name}.scale", lambda: jnp.ones(features, compute),
                                  role=roles.PARAMETER)
            y = y * along(scale.value)
        if self.use_bias:
            bias = call.variable(f"{name}.bias", lambda: jnp.zeros(features, compute),
                                 role=roles.BIAS)
            y = y + along(bias.value)
        return y.astype(value.dtype)

    def rewrite_input(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._normalize(call, name, value)

    def rewrite_output(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._normalize(call, name, value)
