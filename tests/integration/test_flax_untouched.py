"""A compiled model stays the user's own outside programs (Linen modules brought into NNX
with Flax's bridge: ``test_flax_bridge.py``).

graphmod marks a model's variables (a tracked class, an identity) and modules (a token, an
intercepting class) only while a program traces it. Before, the marks stayed: the graph
definition, the variables' metadata and their classes changed for good, so Flax's exact-type
lookups (``Variable.copy_from``, the Linen bridge's collection names) failed on the user's
model after ``graphmod.compile``, also eagerly.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles

TOL = {"rtol": 1e-5, "atol": 1e-5}
X = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
KEY = jax.random.key(3)


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(4, 5, rngs=rngs)
        self.norm = nnx.BatchNorm(5, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.drop(nnx.relu(self.norm(self.linear(x)))))


def loss(model: Any, x: jax.Array) -> jax.Array:
    return (model(x) ** 2).mean()


def looks(model: nnx.Module) -> dict[str, Any]:
    """What the user can see of a model, arrays aside."""
    nodes = list(nnx.iter_graph(model))
    return {
        "graphdef": nnx.graphdef(model),
        "classes": [(path, type(node)) for path, node in nodes],
        "metadata": [(path, node.get_metadata()) for path, node in nodes
                     if isinstance(node, nnx.Variable)],
        "attributes": [(path, sorted(vars(node))) for path, node in nodes
                       if isinstance(node, nnx.Module)],
        "repr": repr(model),
    }


def test_a_compiled_trained_model_is_the_users_own_outside_programs() -> None:
    model = Model(nnx.Rngs(0, dropout=1))
    before = looks(model)
    with managers.Dropout(0.3, bricks=[nnx.Linear], roles=[roles.INPUT]), \
            managers.WeightNoise(0.1, roles=[roles.WEIGHT]):
        program = gm.compile(loss, model)
    variables = program.init(X)
    step = gm.optimize(program, optax.adam(1e-2))
    state = step.init(variables, KEY)
    for _ in range(2):
        state, _ = step(state, X)
    program.derive(lambda m, x: m(x)).infer(state.variables, X)
    program.graph(X)
    program.update_model(state.variables)
    # Its Dropout's stream advanced once per training step, as in Flax: its count is an
    # array the repr shows.
    assert int(model.drop.rngs.count[...]) == 2
    model.drop.rngs.count[...] = 0

    after = looks(model)
    for name, value in before.items():
        assert after[name] == value, name
    assert type(model.linear.kernel) is nnx.Param
    assert nnx.variable_name_from_type(type(model.norm.mean)) == "batch_stats"
    fresh = Model(nnx.Rngs(5, dropout=6))
    model.linear.kernel.copy_from(fresh.linear.kernel)  # Flax checks the class with `is`
    np.testing.assert_array_equal(model.linear.kernel[...], fresh.linear.kernel[...])
    assert nnx.graphdef(model) == nnx.graphdef(fresh)


def test_a_trace_that_raises_leaves_no_mark() -> None:
    model = Model(nnx.Rngs(0, dropout=1))
    before = looks(model)

    def broken(m: Any, x: jax.Array) -> jax.Array:
        m(x)
        raise RuntimeError("in the user's function")

    program = gm.compile(broken, model, managers=[managers.WeightNoise(0.1)])
    with pytest.raises(RuntimeError, match="user's function"):
        program.init(X)
    assert looks(model) == before


def test_marks_are_held_while_any_trace_over_the_model_runs() -> None:
    model = Model(nnx.Rngs(0, dropout=1))
    before = looks(model)
    inner = gm.compile(loss, model)
    inner_variables = inner.init(X)
    seen: list[Any] = []

    def outer_loss(m: Any, x: jax.Array) -> jax.Array:
        value = inner.infer(inner_variables, x)  # another program's trace, over this model
        seen.append(type(m.linear.kernel))
        return value + loss(m, x)

    outer = gm.compile(outer_loss, model)
    out = outer.infer(outer.init(X), X)
    np.testing.assert_allclose(out, 2 * inner.infer(inner_variables, X), **TOL)
    assert seen[0] is not nnx.Param and seen[0] == nnx.Param  # marked, and equal to it
    assert looks(model) == before
