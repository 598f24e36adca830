"""``bricks.LayerNorm``: against ``flax.nnx.LayerNorm`` and plain jnp, eager and compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
from graphmod import roles
from graphmod.bricks import LayerNorm
from tests.bricks.conftest import model_gradients

X = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (4, 5, 6))


def twin(**kwargs: bool | float) -> tuple[nnx.LayerNorm, LayerNorm]:
    """A Flax layer norm with random scale and bias, and a LayerNorm with them copied in."""
    flax_norm = nnx.LayerNorm(6, rngs=nnx.Rngs(0), **kwargs)
    norm = LayerNorm(6, rngs=nnx.Rngs(1), **kwargs)
    if flax_norm.scale is not None:
        flax_norm.scale[...] = jax.random.uniform(jax.random.key(1), (6,), minval=0.5)
        norm.scale[...] = flax_norm.scale[...]
    if flax_norm.bias is not None:
        flax_norm.bias[...] = jax.random.normal(jax.random.key(2), (6,))
        norm.bias[...] = flax_norm.bias[...]
    return flax_norm, norm


@pytest.mark.parametrize("kwargs", [
    {}, {"use_scale": False}, {"use_bias": False},
    {"use_scale": False, "use_bias": False}, {"epsilon": 0.5},
])
def test_matches_flax_layer_norm(kwargs: dict) -> None:
    flax_norm, norm = twin(**kwargs)
    np.testing.assert_allclose(norm(X), flax_norm(X), rtol=1e-5, atol=1e-5)


def test_matches_plain_jnp() -> None:
    _, norm = twin(epsilon=1e-3)
    mean = X.mean(-1, keepdims=True)
    var = X.var(-1, keepdims=True)
    expected = (X - mean) / jnp.sqrt(var + 1e-3) * norm.scale[...] + norm.bias[...]
    np.testing.assert_allclose(norm(X), expected, rtol=1e-5, atol=1e-5)


def test_dtype_follows_flax() -> None:
    flax_norm, norm = twin()
    x = X.astype(jnp.bfloat16)
    assert norm(x).dtype == flax_norm(x).dtype == jnp.float32
    bare_flax, bare = twin(use_scale=False, use_bias=False)
    assert bare(x).dtype == bare_flax(x).dtype == jnp.bfloat16


def test_shapes_and_roles() -> None:
    norm = LayerNorm(6, rngs=nnx.Rngs(0))
    assert isinstance(norm.scale, gm.Parameter) and isinstance(norm.bias, gm.Bias)
    assert norm.scale.role is roles.PARAMETER and norm.bias.role is roles.BIAS
    np.testing.assert_array_equal(norm.scale[...], jnp.ones(6))
    np.testing.assert_array_equal(norm.bias[...], jnp.zeros(6))
    assert norm(X).shape == X.shape
    assert LayerNorm(6, use_scale=False, use_bias=False, rngs=nnx.Rngs(0)).scale is None


def test_eager_compiled_and_jitted_agree() -> None:
    _, norm = twin()
    program = gm.compile(lambda m, x: m(x), norm)
    variables = program.init(X)
    eager = norm(X)
    np.testing.assert_allclose(program.infer(variables, X), eager, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda x: norm(x))(X), eager, rtol=1e-5, atol=1e-6)
    out = jax.vmap(lambda x: program.infer(variables, x))(jnp.stack([X, 2.0 * X]))
    np.testing.assert_allclose(out[1], norm(2.0 * X), rtol=1e-5, atol=1e-5)
    assert program.roles(variables)["model"] == {"scale": roles.PARAMETER, "bias": roles.BIAS}


def test_train_gradients_match_flax() -> None:
    flax_norm, norm = twin()
    grads, _ = model_gradients(lambda m, x: (m(x) ** 3).mean(), norm, X)
    graphdef, state = nnx.split(flax_norm)
    expected = jax.grad(lambda s: (nnx.merge(graphdef, s)(X) ** 3).mean())(state)
    np.testing.assert_allclose(grads["scale"], expected["scale"][...], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads["bias"], expected["bias"][...], rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(grads["scale"]).sum()) > 0


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(num_features=0), r"num_features=0"),
    (dict(num_features=6, epsilon=0.0), r"epsilon=0.0"),
    (dict(num_features=6, epsilon=-1e-5), r"epsilon=-1e-05"),
])
def test_bad_constructor_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LayerNorm(**kwargs, rngs=nnx.Rngs(0))


def test_inputs_of_another_width_are_named() -> None:
    norm = LayerNorm(6, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"input_ of shape \(4, 5\).*num_features=6"):
        norm(jnp.ones((4, 5)))
