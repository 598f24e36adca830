"""Additive Gaussian noise: ``WeightNoise`` on parameters, ``GaussianNoise`` on activations."""

from __future__ import annotations

import math
import numbers
from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod.typing import HookContext
from managers._checks import ManagerOptions, require_floating


def _check_std(cls: str, std: float | gm.Dynamic) -> None:
    value = std.value if isinstance(std, gm.Dynamic) else std
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"{cls}(std={std!r}): std must be a finite float >= 0")


class _AdditiveNoise(gm.Manager):
    """Adds ``std * N(0, 1)`` noise in training; identity in inference; keeps dtypes."""

    hparams = ("std",)

    def __init__(self, std: float | gm.Dynamic, **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**kwargs)
        _check_std(type(self).__name__, std)
        self.std = std

    def _noise(self, call: HookContext, name: str, value: jax.Array,
               key: jax.Array | None = None) -> jax.Array:
        require_floating(self, call, name, value)
        if not call.training or (not isinstance(self.std, gm.Dynamic) and self.std == 0):
            return value
        dtype = jnp.result_type(value)
        noise = jax.random.normal(call.rng() if key is None else key, jnp.shape(value), dtype)
        return value + (jnp.asarray(self.hp("std"), dtype) * noise).astype(dtype)


class WeightNoise(_AdditiveNoise):
    """Additive Gaussian noise on parameters while training (Graves, 2011).

    One noisy copy of each parameter per step, as Blocks: every application call that reads
    it in a step sees the same draw (tied weights, e.g. an embedding's ``apply`` and
    ``attend``, or a layer called twice). ``per_call=True`` draws anew for each application
    call instead (a call reading the parameter twice still sees one draw). Gradients reach
    the stored parameter, which is never changed.

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

    kinds = ("parameter_rewrite",)  # EMA and a cost on the stored weight go first

    def __init__(self, std: float | gm.Dynamic, *, per_call: bool = False,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(std, **kwargs)
        if not isinstance(per_call, bool):
            raise TypeError(f"WeightNoise(per_call={per_call!r}): expected True or False")
        self.per_call = per_call

    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        key = call.rng(per_call=True) if self.per_call and call.training else None
        return self._noise(call, name, value, key)


class GaussianNoise(_AdditiveNoise):
    """Additive Gaussian noise on inputs or outputs while training.

    Examples:
        >>> import graphmod as gm, managers
        >>> managers.GaussianNoise(0.1, roles=[gm.roles.INPUT]).name
        'gaussian_noise'
    """

    def rewrite_input(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._noise(call, name, value)

    def rewrite_output(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._noise(call, name, value)
