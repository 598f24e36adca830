"""A small regression problem and train step shared by the loop tests."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod.data import ArraySource


class Problem:
    def __init__(self, dropout: float | gm.Dynamic = 0.1) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(96, 4)).astype(np.float32)
        self.y = (self.x @ rng.normal(size=(4, 2))).astype(np.float32)
        mlp = gm.bricks.MLP([4, 16, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        self.dropout = managers.Dropout(dropout, bricks=mlp.linear_layers, roles=[roles.INPUT])
        self.program = gm.compile(
            lambda m, x, y: ((m(x) - y) ** 2).mean(), mlp, managers=[self.dropout])
        self.step = gm.optimize(self.program, optax.adam(1e-2))
        self.variables = self.program.init(self.x[:2], self.y[:2])

    def source(self, batch_size: int = 8, **kwargs: object) -> ArraySource:
        return ArraySource({"x": self.x, "y": self.y}, batch_size, shuffle=True, seed=1,
                           **kwargs)

    def state(self) -> gm.TrainState:
        return self.step.init(self.variables, jax.random.key(0))


@pytest.fixture(scope="module")
def problem() -> Problem:
    return Problem()
