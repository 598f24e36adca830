"""Calibrated int8 activations of ``managers.Quantized``: the ranges ``managers.quantize``
stores equal NumPy's over the calibration batches (per layer in a scan over layers), and
inference quantizes with them as Qwix does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from managers._quantize import dequantize_matrix, fake_quantize
from tests.managers.test_quantize import MLP, Stack

INPUTS = dict(bricks=[nnx.Linear], roles=[gm.roles.WEIGHT, gm.roles.INPUT])


def _batches(features: int) -> list[np.ndarray]:
    keys = jax.random.split(jax.random.key(5), 3)
    return [np.asarray(jax.random.normal(k, (6, features)) * (i + 1) + i)
            for i, k in enumerate(keys)]


def _numpy(values: np.ndarray, method: str) -> dict[str, float]:
    if method == "absmax":
        return {"absmax": np.max(np.abs(values))}
    if method == "percentile":
        return {"absmax": np.percentile(np.abs(values), 99.0)}
    return {"min": np.min(values), "max": np.max(values)}


@pytest.mark.parametrize("method", ["absmax", "percentile", "minmax"])
def test_calibrated_ranges_equal_numpys_over_the_batches(method: str) -> None:
    program = gm.compile(lambda m, x: m(x), MLP())
    batches = _batches(128)
    variables = program.init(batches[0])
    quantized = managers.Quantized(activations=method, percentile=99.0, **INPUTS)
    _, stored = managers.quantize(program, variables, quantized, data=batches)
    owned = stored["managers"]["quantized"]
    data = np.concatenate(batches)
    for statistic, expected in _numpy(data, method).items():
        np.testing.assert_allclose(owned["/a"]["apply"][f"inputs.{statistic}"], expected,
                                   rtol=1e-6)
    # The second layer sees the first's output, its weight dequantized.
    kernel = dequantize_matrix(owned["/a"]["kernel"]["q"], owned["/a"]["kernel"]["scale"],
                               "int8", 128)
    hidden = np.asarray(jax.nn.relu(data @ kernel + variables["model"]["a"]["bias"]))
    for statistic, expected in _numpy(hidden, method).items():
        np.testing.assert_allclose(owned["/b"]["apply"][f"inputs.{statistic}"], expected,
                                   rtol=1e-5)


def test_each_layer_of_a_scan_gets_its_own_range() -> None:
    program = gm.compile(lambda m, x: m(x), Stack())
    batches = _batches(64)
    variables = program.init(batches[0])
    _, stored = managers.quantize(program, variables, managers.Quantized(
        activations="minmax", **INPUTS), data=batches)
    ranges = stored["managers"]["quantized"]["/blocks/lin"]["apply"]
    assert ranges["inputs.min"].shape == (3,)
    np.testing.assert_allclose(ranges["inputs.min"][0], np.concatenate(batches).min())
    assert bool((ranges["inputs.min"][1:] >= 0).all())  # after a ReLU


def test_inference_quantizes_inputs_with_the_calibrated_ranges() -> None:
    program = gm.compile(lambda m, x: m(x), MLP())
    batches = _batches(128)
    variables = program.init(batches[0])
    served, stored = managers.quantize(program, variables, managers.Quantized(
        activations="absmax", **INPUTS), data=batches)
    owned = stored["managers"]["quantized"]
    x = batches[0] * 3  # beyond the calibrated range: clipped
    absmax = owned["/a"]["apply"]["inputs.absmax"]
    scale = absmax / 127.5
    quantized_x = np.clip(np.round(x / scale), -128, 127) * scale
    kernel = dequantize_matrix(owned["/a"]["kernel"]["q"], owned["/a"]["kernel"]["scale"],
                               "int8", 128)
    hidden = jax.nn.relu(quantized_x @ kernel + variables["model"]["a"]["bias"])
    first = served.derive(lambda m, x: jax.nn.relu(m.a(x)))
    np.testing.assert_allclose(first.infer(stored, x), hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["absmax", "minmax"])
def test_per_tensor_activation_numerics_are_qwixs(method: str) -> None:
    qwix = pytest.importorskip("qwix", reason="qwix is not installed: pip install qwix")
    x = jax.random.normal(jax.random.key(0), (16, 32)) * 2 + 0.5
    ranges = {"absmax": jnp.max(jnp.abs(x))} if method == "absmax" else {
        "min": jnp.min(x), "max": jnp.max(x)}
    theirs = qwix.dequantize(qwix.quantize(x, jnp.int8, calibration_method=method))
    np.testing.assert_allclose(fake_quantize(x, ranges), theirs, rtol=1e-6, atol=1e-6)
