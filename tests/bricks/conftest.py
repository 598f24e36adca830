"""Helpers shared by the brick tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

import graphmod as gm


def model_gradients(cost: Callable[..., jax.Array], brick: gm.Brick, x: Any) -> tuple[dict, dict]:
    """``(grads, variables)``: gradients of ``program.train``'s cost with respect to the
    model's variables, for ``graphmod.compile(cost, brick)`` initialised on ``x``."""
    program = gm.compile(cost, brick)
    variables = program.init(x)

    def train_cost(model: dict) -> jax.Array:
        return program.train({**variables, "model": model}, x, rng=jax.random.key(0))[0]

    return jax.grad(train_cost)(variables["model"]), variables
