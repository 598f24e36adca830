"""Additive Gaussian noise: ``WeightNoise`` on parameters, ``GaussianNoise`` on activations."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

import graphmod as gm
from managers._checks import require_floating


def _check_std(cls: str, std: Any) -> None:
    value = std.value if isinstance(std, gm.Dynamic) else std
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"{cls}(std={std!r}): std must be a finite float >= 0")


class _AdditiveNoise(gm.Manager):
    """Adds ``std * N(0, 1)`` noise in training; identity in inference; keeps dtypes."""

    hparams = ("std",)

    def __init__(self, std: float | gm.Dynamic, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _check_std(type(self).__name__, std)
        self.std = std

    def _noise(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        require_floating(self, call, name, value)
        if not call.training or (not isinstance(self.std, gm.Dynamic) and self.std == 0):
            return value
        dtype = jnp.result_type(value)
        noise = jax.random.normal(call.rng(), jnp.shape(value), dtype)
        return value + (jnp.asarray(self.hp("std"), dtype) * noise).astype(dtype)


class WeightNoise(_AdditiveNoise):
    """Additive Gaussian noise on parameters while training (Graves, 2011).

    Each application call perturbs a parameter once, however often it reads it; gradients
    reach the stored parameter, which is never changed.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
        >>> with managers.WeightNoise(0.1, roles=[gm.roles.WEIGHT]):
        ...     program = gm.compile(lambda m, x: m(x), lin)
        >>> variables = program.init(jnp.ones((1, 2)))
        >>> [r.name for r in program.rewrites["init"]]
        ['W']
    """

    def rewrite_parameter(self, call: gm.ApplicationCall, name: str,
                          value: jax.Array) -> jax.Array:
        return self._noise(call, name, value)


class GaussianNoise(_AdditiveNoise):
    """Additive Gaussian noise on inputs or outputs while training.

    Examples:
        >>> import graphmod as gm, managers
        >>> managers.GaussianNoise(0.1, roles=[gm.roles.INPUT]).name
        'gaussian_noise'
    """

    def rewrite_input(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        return self._noise(call, name, value)

    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        return self._noise(call, name, value)
