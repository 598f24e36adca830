"""Models made under ``nnx.var_defaults(hijax=True)`` or ``(ref=True)``, as Flax's own
``examples/nnx_toy_examples/hijax_basic.py`` makes its MLP: compile names the first such
variable and the fix, and the copy the fix makes (``nnx.with_vars``) trains under managers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers

X = np.linspace(-np.pi, np.pi, 100, dtype=np.float32)[:, None]
Y = 0.8 * np.sin(X) + 0.1


class Linear(nnx.Module):  # hijax_basic.py's modules, unmodified
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(rngs.params.uniform((din, dout)))
        self.b = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.b[None]


class Count(nnx.Variable[nnx.A]):
    pass


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs) -> None:
        self.count = Count(jnp.array(0))
        self.linear1 = Linear(din, dhidden, rngs=rngs)
        self.linear2 = Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.count[...] += 1
        return self.linear2(jax.nn.relu(self.linear1(x)) * 0.5)


def mean_square(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((y - model(x)) ** 2)


@pytest.mark.parametrize("kind", ["hijax", "ref"])
def test_compile_names_the_variable_and_the_copy_nnx_with_vars_makes_trains(kind: str) -> None:
    with nnx.var_defaults(**{kind: True}):
        model = MLP(1, 32, 1, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=rf"variable /\.count is a {kind} variable.*"
                       rf"nnx\.with_vars\(model, {kind}=False\)"):
        gm.compile(mean_square, model)
    copy = nnx.with_vars(model, **{kind: False})
    eager = float(mean_square(nnx.clone(copy), X, Y))
    program = gm.compile(mean_square, copy,
                         managers=[managers.WeightNoise(0.01, variable_name="w")])
    variables = program.init(X, Y)
    np.testing.assert_allclose(program.infer(variables, X, Y), eager, rtol=1e-6)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(variables, jax.random.key(0))
    losses = []
    for _ in range(50):
        state, metrics = step(state, X, Y)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert int(state.variables["model"]["count"]) == 50
    assert [(r.path, r.name) for r in program.rewrites.train] == [("/linear1", "w"),
                                                                  ("/linear2", "w")]
