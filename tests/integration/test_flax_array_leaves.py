"""Flax's array leaves in programs: arrays kept as module attributes are model variables.

The model is Flax's ``examples/nnx_toy_examples/07_array_leaves.py`` (Apache-2.0, smaller
sizes): ``self.w = jax.random.normal(...)``, ``self.b = jnp.zeros(...)`` and a counter
``self.count += 1`` in the call. Before, ``graphmod.compile`` died with a bare ``KeyError``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod._core._tracing._frame import crc32

TOL = {"rtol": 1e-5, "atol": 1e-5}
X = np.linspace(0, 1, 16, dtype=np.float32)[:, None]
Y = 0.8 * X**2 + 0.1
KEY = jax.random.key(3)


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs) -> None:
        self.w = jax.random.normal(rngs.params(), (din, dout))
        self.b = jnp.zeros((dout,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.b


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs) -> None:
        self.count = jnp.array(0)
        self.linear1 = Linear(din, dhidden, rngs=rngs)
        self.linear2 = Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.count += 1
        return self.linear2(nnx.relu(self.linear1(x)))


def loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((y - model(x)) ** 2)


def model() -> MLP:
    return MLP(1, 8, 1, rngs=nnx.Rngs(0))


def test_arrays_are_variables_with_roles_by_dtype_and_the_loss_equals_eager_flax() -> None:
    mlp = model()
    program = gm.compile(loss, mlp)
    variables = program.init(X, Y)
    assert jax.tree.map(str, program.roles(variables)["model"]) == {
        "count": "CARRIED", "linear1": {"b": "PARAMETER", "w": "PARAMETER"},
        "linear2": {"b": "PARAMETER", "w": "PARAMETER"}}
    out, new = program.train(variables, X, Y, rng=KEY)
    eager = nnx.clone(mlp)
    np.testing.assert_allclose(out, loss(eager, X, Y), **TOL)
    assert int(new["model"]["count"]) == 1 and int(eager.count) == 1
    assert int(mlp.count) == 0 and isinstance(mlp.linear1.w, jax.Array)  # the model's own

    grads = jax.grad(lambda v: program.train(v, X, Y, rng=KEY)[0], allow_int=True)(
        variables)["model"]
    flax_grads = nnx.grad(loss, argnums=nnx.DiffState(0, lambda path, _: path[-1] in "wb"))(
        nnx.clone(mlp), X, Y)
    for layer in ("linear1", "linear2"):
        for name in ("w", "b"):
            np.testing.assert_allclose(grads[layer][name], flax_grads[layer][name], **TOL)


def test_training_updates_the_arrays_and_the_count_and_writes_them_back() -> None:
    mlp = model()
    program = gm.compile(loss, mlp)
    step = gm.optimize(program, optax.adam(3e-2))
    state = step.init(program.init(X, Y), KEY)
    first = float(program.infer(state.variables, X, Y))
    for _ in range(30):
        state, _ = step(state, X, Y)
    assert int(state.variables["model"]["count"]) == 30
    trained = float(program.infer(state.variables, X, Y))
    assert trained < 0.5 * first
    assert int(state.variables["model"]["count"]) == 30  # infer discards the model's writes
    program.update_model(state.variables)
    assert isinstance(mlp.linear1.w, jax.Array) and int(mlp.count) == 30
    np.testing.assert_allclose(mlp.linear1.w, state.variables["model"]["linear1"]["w"])
    np.testing.assert_allclose(loss(mlp, X, Y), trained, **TOL)  # eager, as Flax runs it


def test_managers_rewrite_array_attributes_like_parameters() -> None:
    mlp = model()
    noise = managers.WeightNoise(0.1, variable_name="w")
    program = gm.compile(loss, mlp, managers=[noise])
    variables = program.init(X, Y)
    out, _ = program.train(variables, X, Y, rng=KEY)
    assert [(r.path, r.name) for r in program.rewrites["train"]] == [
        ("/linear1", "w"), ("/linear2", "w")]
    noisy = nnx.clone(mlp)
    for name in ("linear1", "linear2"):
        layer = getattr(noisy, name)
        key = jax.random.fold_in(KEY, crc32(f"weight_noise|/{name}.w||PARAMETER|w#0"))
        layer.w = layer.w + 0.1 * jax.random.normal(key, layer.w.shape)
    np.testing.assert_allclose(out, loss(noisy, X, Y), **TOL)
    np.testing.assert_allclose(program.infer(variables, X, Y), loss(nnx.clone(mlp), X, Y),
                               **TOL)


def test_the_model_is_unchanged_after_programs_also_when_a_trace_raises() -> None:
    mlp = model()
    before = nnx.graphdef(mlp), [type(leaf) for leaf in jax.tree.leaves(nnx.state(mlp))]

    def broken(m: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        loss(m, x, y)
        raise RuntimeError("in the user's function")

    with pytest.raises(RuntimeError, match="user's function"):
        gm.compile(broken, mlp).init(X, Y)
    gm.compile(loss, mlp).train(gm.compile(loss, mlp).init(X, Y), X, Y, rng=KEY)
    assert (nnx.graphdef(mlp), [type(leaf) for leaf in jax.tree.leaves(nnx.state(mlp))]) \
        == before
    assert int(mlp.count) == 0


class InAList(nnx.Module):
    def __init__(self) -> None:
        self.scales = nnx.data([jnp.ones(2), jnp.ones(2)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * self.scales[0] * self.scales[1]


def test_an_array_inside_a_container_attribute_is_refused_at_compile_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"scales/0 .*wrap it in nnx.Param"):
        gm.compile(lambda m, x: m(x).sum(), InAList())


class Counted(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.w = 0.3 * jax.random.normal(rngs.params(), (1, 1))
        self.calls = jnp.array(0)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls += 1
        return jnp.tanh(x @ self.w)


class Lifted(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = Counted(rngs)
        self.b = Counted(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.remat(lambda m, x: m(x))(self.a, x)
        return nnx.jit(lambda m, x: m(x))(self.b, x)


def test_array_attributes_inside_nnx_transforms_train_and_count_like_eager_flax() -> None:
    lifted = Lifted(nnx.Rngs(0))
    program = gm.compile(lambda m, x: (m(x) ** 2).sum(), lifted)
    variables = program.init(X)

    def train(v: dict) -> tuple[jax.Array, dict]:
        return program.train(v, X, rng=KEY)

    (out, new), grads = jax.value_and_grad(train, has_aux=True, allow_int=True)(variables)
    eager = nnx.clone(lifted)
    flax_grads = nnx.grad(lambda m, x: (m(x) ** 2).sum(),
                          argnums=nnx.DiffState(0, lambda path, _: path[-1] == "w"))(eager, X)
    np.testing.assert_allclose(out, (nnx.clone(lifted)(X) ** 2).sum(), **TOL)
    for name in ("a", "b"):
        assert int(new["model"][name]["calls"]) == int(getattr(eager, name).calls) == 1
        np.testing.assert_allclose(grads["model"][name]["w"], flax_grads[name]["w"], **TOL)
    assert int(lifted.a.calls) == 0


class PytreeLinear(nnx.Pytree):  # Flax's pytree guide (docs_nnx/guides/pytree.md)
    def __init__(self, din: int, dout: int, seed: int) -> None:
        self.din, self.dout = din, dout  # static
        self.w = 0.5 * jax.random.normal(jax.random.key(seed), (din, dout))  # data
        self.b = jnp.zeros((dout,))


class PytreeMLP(nnx.Pytree):
    def __init__(self, num_layers: int = 2, dim: int = 1) -> None:
        self.layers = nnx.List([PytreeLinear(dim, dim, i) for i in range(num_layers)])


class HoldsPytree(nnx.Module):
    def __init__(self) -> None:
        self.net = PytreeMLP()

    def __call__(self, x: jax.Array) -> jax.Array:
        return _through(self.net, x)


def _through(net: PytreeMLP, x: jax.Array) -> jax.Array:
    for layer in net.layers:
        x = jnp.tanh(x @ layer.w + layer.b)
    return x


@pytest.mark.parametrize("root", [PytreeMLP, HoldsPytree])
def test_nnx_pytrees_arrays_are_variables_and_train_as_jax_trains_the_pytree(root: Any) -> None:
    def cost(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        out = _through(model, x) if isinstance(model, PytreeMLP) else model(x)
        return jnp.mean((out - y) ** 2)

    tx = optax.sgd(0.5)
    by_hand, expected = root(), []
    opt_state = tx.init(by_hand)
    for _ in range(3):  # the pytree guide's way: the Pytree itself through jax.grad
        loss, grads = jax.value_and_grad(cost)(by_hand, X, Y)
        updates, opt_state = tx.update(grads, opt_state, by_hand)
        by_hand = optax.apply_updates(by_hand, updates)
        expected.append(float(loss))
    program = gm.compile(cost, root())
    step = gm.optimize(program, tx)
    state, losses = step.init(program.init(X, Y), KEY), []
    for _ in range(3):
        state, metrics = step(state, X, Y)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, **TOL)
    roles = jax.tree.leaves(program.roles(state.variables))
    assert [str(role) for role in roles] == ["PARAMETER"] * 4  # w and b of two layers
