"""Small bricks and helpers shared by the managers' tests.

Imported as ``tests.managers.helpers`` (the repository root is on ``sys.path`` under
``python -m pytest``, as for ``tests.conftest``).

Speed: on CPU every XLA compilation costs tenths of a second, threefry ones most. Test data
and the weights of these bricks come from NumPy, and assertions compute with NumPy, so that
what is compiled is the programs under test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import graphmod as gm
from graphmod import roles


class Identity(gm.Brick):
    """``output = input_``: a rewrite of its input or output shows as is."""

    @gm.application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        return input_


class Scale(gm.Brick):
    """``output = input_ * W`` (elementwise): with ``input_ = 1`` the output is W as read."""

    def __init__(self, n: int, *, seed: int = 0, dtype: Any = jnp.float32) -> None:
        self.W = gm.Weight(normal(seed, n, dtype=dtype))

    @gm.application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        return input_ * self.W


class ReadTwice(gm.Brick):
    """Reads its weight twice, through two access paths, in one application call."""

    def __init__(self, n: int, *, seed: int = 0) -> None:
        self.W = gm.Weight(normal(seed, n))

    @gm.application(inputs=["input_"], outputs=["first", "second"])
    def apply(self, input_: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.W[...] * input_, self.W.reshape(-1) * input_


class Pair(gm.Brick):
    """Two ``Scale`` children that both see the input; ``apply`` adds their outputs."""

    def __init__(self, n: int) -> None:
        self.a = Scale(n, seed=1)
        self.b = Scale(n, seed=2)

    @gm.application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        return self.a(input_) + self.b(input_)


class Counted:
    """Wraps a model function and counts how often it is traced (called in Python)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.count = 0

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        return self.fn(model, *args, **kwargs)


def apply_model(model: Any, *args: Any) -> Any:
    """The model function of most tests: the root brick's output."""
    return model(*args)


def watch(*role_list: roles.Role, **fields: Any) -> gm.VariableFilter:
    """A monitor filter: the given roles and filter fields."""
    return gm.VariableFilter(roles=list(role_list), **fields)


def key(seed: int = 0) -> jax.Array:
    return jax.random.key(seed)


def ones(*shape: int, dtype: Any = jnp.float32) -> jax.Array:
    return full(1.0, *shape, dtype=dtype)


def full(value: float, *shape: int, dtype: Any = jnp.float32) -> jax.Array:
    """A constant array, made by NumPy (nothing to compile)."""
    return jnp.asarray(np.full(shape, value), dtype)


def normal(seed: int, *shape: int, dtype: Any = jnp.float32, mean: float = 0.0,
           std: float = 1.0) -> jax.Array:
    """Normal test data, drawn by NumPy (nothing to compile)."""
    sample = np.random.default_rng(seed).standard_normal(shape) * std + mean
    return jnp.asarray(sample, dtype)


def linear(in_features: int = 3, out_features: int = 4) -> gm.bricks.Linear:
    """A Linear brick with NumPy-drawn weights and a non-zero bias."""
    return gm.bricks.Linear(
        in_features, out_features, rngs=nnx.Rngs(0),
        kernel_init=lambda _, shape: normal(10, *shape) / np.sqrt(shape[0]),
        bias_init=lambda _, shape: normal(11, *shape) / 10)


def array(value: Any) -> np.ndarray:
    """A NumPy copy (float32 for low-precision floats) to assert on."""
    value = np.asarray(value)
    low = jnp.issubdtype(value.dtype, jnp.floating) and value.dtype.itemsize < 4
    return value.astype(np.float32) if low else value


def rewritten_by(program: gm.Program, mode: str = "train") -> list[tuple[str, str, int, str]]:
    """(manager, path, call_id, variable name) of each rewrite of the latest trace."""
    return [(r.manager, r.path, r.call_id, r.name) for r in program.rewrites[mode]]
