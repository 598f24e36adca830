"""``bricks.Conv``: against ``flax.nnx.Conv`` and a plain loop, eager and compiled."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
from graphmod import roles
from graphmod.bricks import Conv
from tests.bricks.conftest import model_gradients


def twin(config: dict[str, Any]) -> tuple[nnx.Conv, Conv]:
    """A Flax conv with a nonzero bias, and a Conv with its parameters copied in."""
    flax_conv = nnx.Conv(rngs=nnx.Rngs(0), **config)
    flax_conv.bias[...] = jax.random.normal(jax.random.key(9), flax_conv.bias.shape)
    conv = Conv(rngs=nnx.Rngs(1), **config)
    conv.W[...] = flax_conv.kernel[...]
    conv.b[...] = flax_conv.bias[...]
    return flax_conv, conv


CONFIGS = [
    (dict(kernel_size=(3, 3)), (2, 9, 9, 4)),
    (dict(kernel_size=(3,), strides=2, padding="VALID", feature_group_count=2), (3, 10, 4)),
    (dict(kernel_size=3, padding="CAUSAL", kernel_dilation=2), (2, 10, 4)),
    (dict(kernel_size=(3, 2), padding="CIRCULAR"), (2, 7, 6, 4)),
    (dict(kernel_size=(3, 3), strides=(1, 2), padding="REFLECT"), (2, 7, 6, 4)),
    (dict(kernel_size=(2, 3), padding=[(1, 0), 2], kernel_dilation=(2, 1),
          feature_group_count=4), (2, 2, 7, 6, 4)),
    (dict(kernel_size=(3, 3, 3), padding=1), (5, 5, 5, 4)),
    (dict(kernel_size=(3, 3), strides=2, padding="SAME_LOWER"), (1, 8, 8, 4)),
    (dict(kernel_size=(3, 3), padding=((1, 2), 1), input_dilation=2), (1, 5, 5, 4)),
    (dict(kernel_size=(3, 3)), (9, 9, 4)),  # no batch axis
]


@pytest.mark.parametrize(("config", "shape"), CONFIGS)
def test_matches_flax_conv_with_the_same_kernel_and_bias(config: dict, shape: tuple) -> None:
    flax_conv, conv = twin(dict(in_features=4, out_features=8, **config))
    x = jax.random.normal(jax.random.key(2), shape)
    expected = flax_conv(x)
    out = conv(x)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def loop_conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int,
                pad: tuple[int, int]) -> np.ndarray:
    """A direct 2-D convolution (cross-correlation) with plain loops."""
    x = np.pad(x, [(0, 0), pad, pad, (0, 0)])
    kh, kw, _, out_features = w.shape
    rows = (x.shape[1] - kh) // stride + 1
    cols = (x.shape[2] - kw) // stride + 1
    out = np.zeros((x.shape[0], rows, cols, out_features), np.float64)
    for i in range(rows):
        for j in range(cols):
            patch = x[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :]
            out[:, i, j, :] = np.einsum("nhwc,hwco->no", patch, w)
    return out + b


@pytest.mark.parametrize(("padding", "pad", "stride"), [("VALID", (0, 0), 1),
                                                       ("SAME", (1, 1), 1), (2, (2, 2), 2)])
def test_matches_a_plain_loop(padding: Any, pad: tuple[int, int], stride: int) -> None:
    conv = Conv(3, 5, (3, 3), strides=stride, padding=padding, rngs=nnx.Rngs(0))
    conv.b[...] = jnp.arange(5.0)
    x = jax.random.normal(jax.random.key(3), (2, 6, 7, 3))
    expected = loop_conv2d(np.asarray(x, np.float64), np.asarray(conv.W[...], np.float64),
                           np.asarray(conv.b[...], np.float64), stride, pad)
    np.testing.assert_allclose(conv(x), expected, rtol=1e-5, atol=1e-5)


def test_shapes_roles_and_kernel_size_forms() -> None:
    conv = Conv(3, 8, 5, rngs=nnx.Rngs(0))  # an int kernel_size is 1-D, as Flax
    assert conv.kernel_size == (5,) and conv.W.shape == (5, 3, 8)
    assert conv(jnp.ones((2, 11, 3))).shape == (2, 11, 8)
    conv = Conv(4, 6, (3, 3), feature_group_count=2, rngs=nnx.Rngs(0))
    assert conv.W.shape == (3, 3, 2, 6) and conv.b.shape == (6,)
    assert conv.W.role is roles.FILTER and conv.W.role.is_a(roles.WEIGHT)
    assert conv.b.role is roles.BIAS
    assert Conv(3, 8, (3, 3), use_bias=False, rngs=nnx.Rngs(0)).b is None
    assert isinstance(conv.W, gm.Filter) and isinstance(conv.b, gm.Bias)


def test_eager_compiled_and_jitted_agree() -> None:
    conv = Conv(3, 4, (3, 3), strides=2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    program = gm.compile(lambda m, x: m(x), conv)
    variables = program.init(x)
    eager = conv(x)
    np.testing.assert_allclose(program.infer(variables, x), eager, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda x: conv(x))(x), eager, rtol=1e-5, atol=1e-6)
    out = jax.vmap(lambda x: program.infer(variables, x))(jnp.stack([x, -x]))
    np.testing.assert_allclose(out[1], conv(-x), rtol=1e-5, atol=1e-6)
    assert program.roles(variables)["model"] == {"W": roles.FILTER, "b": roles.BIAS}


def test_weight_managers_rewrite_the_filter() -> None:
    conv = Conv(2, 3, (3,), rngs=nnx.Rngs(0))

    class Double(gm.Manager):
        def rewrite_parameter(self, call: Any, name: str, value: jax.Array) -> jax.Array:
            return 2.0 * value

    with Double(roles=[roles.WEIGHT]):
        program = gm.compile(lambda m, x: m(x), conv)
    x = jax.random.normal(jax.random.key(0), (2, 5, 2))
    variables = program.init(x)
    doubled = Conv(2, 3, (3,), rngs=nnx.Rngs(1))
    doubled.W[...] = 2.0 * conv.W[...]
    doubled.b[...] = conv.b[...]
    np.testing.assert_allclose(program.infer(variables, x), doubled(x), rtol=1e-5, atol=1e-6)
    assert [(r.name, r.role) for r in program.rewrites["infer"]] == [("W", "FILTER")]


def test_train_gradients_match_flax() -> None:
    flax_conv, conv = twin(dict(in_features=3, out_features=4, kernel_size=(2, 2), strides=2))
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 3))
    grads, _ = model_gradients(lambda m, x: (m(x) ** 2).mean(), conv, x)
    graphdef, state = nnx.split(flax_conv)
    expected = jax.grad(lambda s: (nnx.merge(graphdef, s)(x) ** 2).mean())(state)
    np.testing.assert_allclose(grads["W"], expected["kernel"][...], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads["b"], expected["bias"][...], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(in_features=0), r"in_features=0"),
    (dict(out_features=2.5), r"out_features=2.5"),
    (dict(kernel_size=()), r"kernel_size=\(\)"),
    (dict(kernel_size=(3, 0)), r"kernel_size=0"),
    (dict(strides=(1, 2, 3)), r"strides=\(1, 2, 3\).*2 ints"),
    (dict(kernel_dilation=0), r"kernel_dilation=0"),
    (dict(padding="FULL"), r"padding='FULL'"),
    (dict(padding=[1, 2, 3]), r"padding=\[1, 2, 3\]"),
    (dict(padding=True), r"padding=True"),
    (dict(padding=[(True, False), 1]), r"padding=\[\(True, False\), 1\]"),
    (dict(padding="CAUSAL"), r"CAUSAL.*1-D"),
    (dict(feature_group_count=3), r"feature_group_count=3.*in_features=4"),
    (dict(input_dilation=2), r"input_dilation=2.*explicit padding"),
])
def test_bad_constructor_arguments_are_named(kwargs: dict, message: str) -> None:
    config = dict(in_features=4, out_features=6, kernel_size=(3, 3)) | kwargs
    with pytest.raises(ValueError, match=message):
        Conv(**config, rngs=nnx.Rngs(0))


def test_inputs_that_do_not_fit_are_named() -> None:
    conv = Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"input_ of shape \(2, 8, 8, 5\).*in_features=3"):
        conv(jnp.ones((2, 8, 8, 5)))
    with pytest.raises(ValueError, match=r"input_ of shape \(8, 3\).*2-D"):
        conv(jnp.ones((8, 3)))
