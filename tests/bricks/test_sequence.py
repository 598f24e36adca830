"""``bricks.Sequence``: layers applied in order, eagerly and compiled, with managers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
from graphmod import roles
from graphmod.bricks import Linear, Sequence
from tests.bricks.conftest import model_gradients


def make_sequence() -> Sequence:
    rngs = nnx.Rngs(0)
    return Sequence(Linear(3, 8, rngs=rngs), jax.nn.relu, Linear(8, 2, rngs=rngs))


def reference(seq: Sequence, x: jax.Array) -> jax.Array:
    first, _, last = seq.layers
    hidden = jax.nn.relu(x @ first.W[...] + first.b[...])
    return hidden @ last.W[...] + last.b[...]


X = jax.random.normal(jax.random.key(1), (5, 3))


def test_applies_layers_in_order_like_plain_jnp() -> None:
    seq = make_sequence()
    np.testing.assert_allclose(seq(X), reference(seq, X), rtol=1e-5, atol=1e-6)


def test_a_list_gives_the_same_sequence_as_positional_layers() -> None:
    rngs = nnx.Rngs(0)
    layers = [Linear(3, 4, rngs=rngs), jnp.tanh]
    from_list = Sequence(layers)
    from_args = Sequence(*layers)
    assert len(from_list.layers) == len(from_args.layers) == 2
    np.testing.assert_array_equal(from_list(X), from_args(X))
    assert isinstance(from_list.layers, nnx.List)


def test_order_matters() -> None:
    seq_a = Sequence(lambda x: x + 1.0, lambda x: 2.0 * x)
    seq_b = Sequence(lambda x: 2.0 * x, lambda x: x + 1.0)
    assert float(seq_a(jnp.float32(1.0))) == 4.0
    assert float(seq_b(jnp.float32(1.0))) == 3.0


def test_eager_compiled_and_jitted_agree() -> None:
    seq = make_sequence()
    program = gm.compile(lambda m, x: m(x), seq)
    variables = program.init(X)
    eager = seq(X)
    np.testing.assert_allclose(program.infer(variables, X), eager, rtol=1e-5, atol=1e-6)
    out, _ = program.train(variables, X, rng=jax.random.key(0))
    np.testing.assert_allclose(out, eager, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda x: seq(x))(X), eager, rtol=1e-5, atol=1e-6)


def test_vmap_over_compiled_inference() -> None:
    seq = make_sequence()
    program = gm.compile(lambda m, x: m(x), seq)
    variables = program.init(X)
    stacked = jnp.stack([X, 2.0 * X])
    out = jax.vmap(lambda x: program.infer(variables, x))(stacked)
    np.testing.assert_allclose(out[1], seq(2.0 * X), rtol=1e-5, atol=1e-6)


def test_layer_paths_and_roles() -> None:
    seq = make_sequence()
    program = gm.compile(lambda m, x: m(x), seq)
    variables = program.init(X)
    assert jax.tree.map(jnp.shape, variables["model"]) == {
        "layers": {0: {"W": (3, 8), "b": (8,)}, 2: {"W": (8, 2), "b": (2,)}}
    }
    tree = program.roles(variables)["model"]["layers"]
    assert tree[0]["W"] is roles.WEIGHT and tree[2]["b"] is roles.BIAS
    assert [v.path for v in program.layout.variables] == [
        "/layers/0.W", "/layers/0.b", "/layers/2.W", "/layers/2.b"]


def test_holds_flax_modules_whose_params_get_roles() -> None:
    rngs = nnx.Rngs(0)
    seq = Sequence(nnx.Linear(3, 4, rngs=rngs), jax.nn.relu, Linear(4, 2, rngs=rngs))
    program = gm.compile(lambda m, x: m(x), seq)
    variables = program.init(X)
    tree = program.roles(variables)["model"]["layers"][0]
    assert tree == {"kernel": roles.WEIGHT, "bias": roles.BIAS}
    np.testing.assert_allclose(program.infer(variables, X), seq(X), rtol=1e-5, atol=1e-6)


def test_managers_select_layers_of_the_sequence() -> None:
    seq = make_sequence()

    class Double(gm.Manager):
        def rewrite_output(self, call: Any, name: str, value: jax.Array) -> jax.Array:
            return 2.0 * value

    with Double(bricks=seq.layers[:1], roles=[roles.OUTPUT]):
        program = gm.compile(lambda m, x: m(x), seq)
    variables = program.init(X)
    first, _, last = seq.layers
    expected = jax.nn.relu(2.0 * (X @ first.W[...] + first.b[...])) @ last.W[...] + last.b[...]
    np.testing.assert_allclose(program.infer(variables, X), expected, rtol=1e-5, atol=1e-6)
    assert [(r.path, r.application) for r in program.rewrites["infer"]] == [
        ("/layers/0", "apply")]


def test_train_is_differentiable_and_matches_plain_gradients() -> None:
    seq = make_sequence()
    grads, variables = model_gradients(lambda m, x: (m(x) ** 2).sum(), seq, X)

    def plain(params: dict) -> jax.Array:
        hidden = jax.nn.relu(X @ params[0]["W"] + params[0]["b"])
        return ((hidden @ params[2]["W"] + params[2]["b"]) ** 2).sum()

    expected = jax.grad(plain)(variables["model"]["layers"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 grads["layers"], expected)
    assert float(jnp.abs(grads["layers"][0]["W"]).sum()) > 0


def test_no_layer_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        Sequence()
    with pytest.raises(ValueError, match="at least one layer"):
        Sequence([])


def test_a_layer_that_is_not_callable_is_named() -> None:
    with pytest.raises(TypeError, match=r"layers\[1\] = 3 is not callable"):
        Sequence(jnp.tanh, 3)
