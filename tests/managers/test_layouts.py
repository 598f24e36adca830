"""The per-unit managers read Flax's multi-axis kernels by their layers' layouts.

An ``nnx.LinearGeneral`` kernel ends with its output axes and an ``nnx.Einsum`` kernel's
inputs are the axes its equation contracts (Gemma's query ``BTD,NDH->BTNH`` and key-value
``BTD,CKDH->CBTKH``). Before, every manager took all axes but the last as a weight's inputs:
WeightNorm normalized over the heads too, and LoRA's update was low-rank over ``(N*D, H)``
instead of the layer's map from ``D`` to ``(N, H)``. Each manager is checked here against its
formula by hand on the kernel read as that matrix, ``(fan_in, units)``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from managers._layout import WeightLayout, _contracted
from tests.managers.helpers import key

TOL = {"rtol": 1e-5, "atol": 1e-6}
D = 8
EYE = jnp.eye(D)[None]  # (B=1, T=D, D): an einsum over it gives back the kernel's D rows


def query() -> nnx.Einsum:
    return nnx.Einsum("BTD,NDH->BTNH", (2, D, 4), rngs=nnx.Rngs(0))


def key_value() -> nnx.Einsum:
    return nnx.Einsum("BTD,CKDH->CBTKH", (2, 1, D, 4), rngs=nnx.Rngs(1))


def general() -> nnx.LinearGeneral:
    return nnx.LinearGeneral(D, (2, 4), use_bias=False, rngs=nnx.Rngs(2))


# Each layer, the kernel its output over EYE shows (by its equation), and its inputs' axes.
LAYERS: dict[str, tuple[Callable[[], nnx.Module], Callable[[jax.Array], jax.Array],
                        tuple[int, ...]]] = {
    "query": (query, lambda out: out[0].transpose(1, 0, 2), (1,)),
    "key_value": (key_value, lambda out: out[:, 0].transpose(0, 2, 1, 3), (2,)),
    "general": (general, lambda out: out[0], (0,)),
}


def seen(layer: str, manager: gm.Manager, mode: str = "infer") -> tuple[jax.Array, dict, dict]:
    """The kernel as the layer's call reads it under ``manager``, the variables before the
    call and those the call wrote."""
    build, kernel_of, _ = LAYERS[layer]
    program = gm.compile(lambda m, x: m(x), build(), managers=[manager])
    variables = program.init(EYE)
    if mode == "infer":
        return kernel_of(program.infer(variables, EYE)), variables, variables
    out, written = program.train(variables, EYE, rng=key(0))
    return kernel_of(out), variables, written


def as_matrix(layer: str, kernel: jax.Array) -> np.ndarray:
    """``kernel`` as ``(fan_in, units)``, written out for each layer."""
    fan_in = LAYERS[layer][2]
    units = tuple(a for a in range(kernel.ndim) if a not in fan_in)
    return np.asarray(kernel).transpose(fan_in + units).reshape(
        np.prod([kernel.shape[a] for a in fan_in]), -1)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_weight_norm_keeps_one_scale_per_unit_over_the_contracted_axes(layer: str) -> None:
    kernel, variables, _ = seen(layer, managers.WeightNorm(roles=[roles.WEIGHT]))
    stored = variables["model"]["kernel"]
    np.testing.assert_allclose(kernel, stored, **TOL)  # g starts at the norms: unchanged
    g = variables["managers"]["weight_norm"]["/"]["kernel"]["g"]
    np.testing.assert_allclose(np.ravel(g), np.linalg.norm(as_matrix(layer, stored), axis=0),
                               **TOL)
    assert g.shape == tuple(n for a, n in enumerate(stored.shape) if a not in LAYERS[layer][2])


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_weight_standardization_and_max_norm_work_over_the_contracted_axes(layer: str) -> None:
    kernel, _, _ = seen(layer, managers.WeightStandardization(roles=[roles.WEIGHT]))
    matrix = as_matrix(layer, kernel)
    np.testing.assert_allclose(matrix.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(matrix.std(0), 1.0, rtol=1e-3)
    kernel, variables, _ = seen(layer, managers.MaxNorm(0.3, roles=[roles.WEIGHT]))
    stored = as_matrix(layer, variables["model"]["kernel"])
    expected = stored * np.minimum(1, 0.3 / np.linalg.norm(stored, axis=0))
    np.testing.assert_allclose(as_matrix(layer, kernel), expected, **TOL)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_fake_quant_scales_each_unit_and_spectral_norm_divides_by_the_matrix_norm(
        layer: str) -> None:
    kernel, variables, _ = seen(layer, managers.FakeQuant(4, roles=[roles.WEIGHT]))
    stored = as_matrix(layer, variables["model"]["kernel"])
    scale = np.abs(stored).max(0) / 7
    np.testing.assert_allclose(as_matrix(layer, kernel), np.round(stored / scale) * scale,
                               **TOL)
    kernel, variables, written = seen(layer, managers.SpectralNorm(steps=50,
                                                                   roles=[roles.WEIGHT]),
                                      mode="train")
    stored = as_matrix(layer, variables["model"]["kernel"])
    sigma = np.linalg.svd(stored, compute_uv=False)[0]
    state = written["managers"]["spectral_norm"]["/"]["kernel"]
    np.testing.assert_allclose(state["sigma"], sigma, rtol=1e-4)
    assert state["u"].shape == (1, stored.shape[1])
    np.testing.assert_allclose(as_matrix(layer, kernel), stored / sigma, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_lora_adds_a_low_rank_map_from_the_contracted_axes_and_merges_it(layer: str) -> None:
    lora = managers.LoRA(2, alpha=2.0, roles=[roles.WEIGHT])
    kernel, variables, _ = seen(layer, lora)
    stored = variables["model"]["kernel"]
    np.testing.assert_allclose(kernel, stored, **TOL)  # B = 0: the layer unchanged
    adapter = variables["managers"]["lora"]["/"]["kernel"]
    adapter["b"] = jax.random.normal(key(1), adapter["b"].shape)  # as if trained
    build, kernel_of, _ = LAYERS[layer]
    program = gm.compile(lambda m, x: m(x), build(), managers=[lora])
    kernel = kernel_of(program.infer(variables, EYE))
    update = as_matrix(layer, kernel) - as_matrix(layer, stored)
    np.testing.assert_allclose(
        update, np.asarray(adapter["a"]) @ np.asarray(adapter["b"]).reshape(2, -1), **TOL)
    assert np.linalg.matrix_rank(update, tol=1e-4) == 2  # the rank
    merged = lora.merge(variables)
    plain = gm.compile(lambda m, x: m(x), build())
    np.testing.assert_allclose(kernel_of(plain.infer(merged, EYE)), kernel, **TOL)


def test_a_layout_is_read_from_the_equation_or_else_every_axis_but_the_last() -> None:
    assert _contracted("BTD,NDH->BTNH", 3) == (1,)
    assert _contracted("btnh, nhd -> btd", 3) == (0, 1)  # spaces, and leading inputs
    assert _contracted("...D,DH->...H", 2) == (0,)
    for equation in ("BTD,NDH", "BTD,N...H->BTNH", "BTD,NDH->BTNH", "BTD,NH->BTNDH"):
        assert _contracted(equation, 2) is None  # no output, ellipsis, rank, no input
    layout = WeightLayout((2, 1, D, 4), fan_in=(2,))
    weight = jnp.arange(2 * D * 4.0).reshape(layout.shape)
    np.testing.assert_array_equal(layout.from_matrix(layout.matrix(weight)), weight)
    assert not layout.leading and WeightLayout((D, 4), (0,)).leading
