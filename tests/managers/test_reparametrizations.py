"""WeightNorm, WeightStandardization, SpectralNorm and MaxNorm against their formulas by
hand in NumPy, on a Linear's and a convolution's weights; constructor checks; the stored
weight never overwritten. (flax.nnx's layers at step 0: tests/managers/test_library.py.)"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from tests.managers.helpers import Counted, array, key, linear, normal

X = normal(1, 6, 3)
IMAGES = normal(2, 2, 5, 5, 3)
TOL = {"rtol": 1e-4, "atol": 1e-5}


def conv() -> gm.bricks.Conv:
    """A 3x3 convolution, 3 -> 4 channels, with NumPy-drawn weights (W: (3, 3, 3, 4))."""
    return gm.bricks.Conv(3, 4, (3, 3), padding="VALID", rngs=nnx.Rngs(0),
                          kernel_init=lambda _, shape: normal(12, *shape) / 5,
                          bias_init=lambda _, shape: normal(13, *shape) / 10)


def read_weight(brick: gm.Brick, manager: gm.Manager, x: jax.Array,
                mode: str = "infer", variables: dict | None = None) -> tuple[Any, dict]:
    """The brick's output under ``manager`` and the variables used (init's unless given)."""
    program = gm.compile(lambda m, x: m(x), brick, managers=[manager])
    variables = program.init(x) if variables is None else variables
    if mode == "infer":
        return program.infer(variables, x), variables
    return program.train(variables, x, rng=key(0))


def convolve(x: jax.Array, w: np.ndarray, b: Any) -> np.ndarray:
    """A VALID convolution with weight ``w`` (the reference: XLA's, on NumPy's weight)."""
    out = jax.lax.conv_general_dilated(jnp.asarray(x), jnp.asarray(w, jnp.float32), (1, 1),
                                       "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return array(out) + array(b)


# -- WeightNorm -------------------------------------------------------------------------------

def test_weight_norm_is_g_times_v_over_its_norm_per_output_unit_on_a_conv_kernel() -> None:
    brick = conv()
    manager = managers.WeightNorm(roles=[roles.WEIGHT])
    out, variables = read_weight(brick, manager, IMAGES)
    v = array(brick.W[...]).astype(np.float64)
    norm = np.sqrt((v ** 2).sum((0, 1, 2)))
    g_path = variables["managers"]["weight_norm"]["/"]["W"]
    np.testing.assert_allclose(g_path["g"], norm, rtol=1e-6)
    np.testing.assert_allclose(out, brick(IMAGES), **TOL)  # unchanged at init
    g = np.array([0.5, 1.0, 2.0, 3.0])
    g_path["g"] = jnp.asarray(g, jnp.float32)
    out, _ = read_weight(brick, manager, IMAGES, variables=variables)
    np.testing.assert_allclose(out, convolve(IMAGES, g * v / norm, brick.b[...]), **TOL)


def test_weight_norm_trains_g_and_v_and_never_writes_the_normalized_weight_back() -> None:
    lin = linear()
    program = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), lin,
                         managers=[managers.WeightNorm(roles=[roles.WEIGHT])])
    variables = program.init(X)
    grads = jax.grad(lambda v: program.train(v, X, rng=key(0))[0])(variables)
    assert np.abs(array(grads["managers"]["weight_norm"]["/"]["W"]["g"])).sum() > 0
    # d cost / d V is orthogonal to V per output unit: the norm's scale drops out.
    dv, v = array(grads["model"]["W"]), array(lin.W[...])
    np.testing.assert_allclose((dv * v).sum(0), 0, atol=1e-6)
    _, new = program.train(variables, X, rng=key(0))
    np.testing.assert_array_equal(new["model"]["W"], variables["model"]["W"])


# -- WeightStandardization --------------------------------------------------------------------

@pytest.mark.parametrize("gain", [False, True])
def test_weight_standardization_is_the_hand_formula_on_a_conv_kernel(gain: bool) -> None:
    brick = conv()
    manager = managers.WeightStandardization(epsilon=1e-4, gain=gain, roles=[roles.WEIGHT])
    _, variables = read_weight(brick, manager, IMAGES)
    scale = np.ones(4)
    if gain:
        owned = variables["managers"]["weight_standardization"]["/"]["W"]
        np.testing.assert_array_equal(owned["gain"], np.ones(4))  # starts at 1
        scale = np.array([0.5, 1.0, 2.0, -1.0])
        owned["gain"] = jnp.asarray(scale, jnp.float32)
    out, _ = read_weight(brick, manager, IMAGES, variables=variables)
    w = array(brick.W[...]).astype(np.float64)
    mean, var = w.mean((0, 1, 2)), w.var((0, 1, 2))
    np.testing.assert_allclose(out, convolve(IMAGES, scale * (w - mean) / np.sqrt(var + 1e-4),
                                             brick.b[...]), **TOL)


def test_weight_standardization_owns_nothing_without_gain() -> None:
    _, variables = read_weight(linear(), managers.WeightStandardization(
        roles=[roles.WEIGHT]), X)
    assert variables["managers"]["weight_standardization"] == {"hparams": {}}


# -- SpectralNorm -----------------------------------------------------------------------------

def power_iteration(w: np.ndarray, u: np.ndarray, steps: int) -> tuple[np.ndarray, float]:
    """Miyato et al.'s iteration on ``w`` as (fan_in, out): the new ``u`` and sigma."""
    for _ in range(steps):
        v = u @ w.T
        v /= np.linalg.norm(v)
        u = v @ w
        u /= np.linalg.norm(u)
    return u, (v @ w @ u.T).item()


def test_spectral_norm_runs_steps_iterations_per_training_step_and_stores_them() -> None:
    brick = conv()
    manager = managers.SpectralNorm(steps=2, roles=[roles.WEIGHT])
    program = gm.compile(lambda m, x: m(x), brick, managers=[manager])
    variables = program.init(IMAGES)
    w = array(brick.W[...]).astype(np.float64).reshape(-1, 4)
    u = np.full((1, 4), 0.5)
    for _ in range(3):
        out, variables = program.train(variables, IMAGES, rng=key(0))
        u, sigma = power_iteration(w, u, 2)
        np.testing.assert_allclose(out, convolve(IMAGES, array(brick.W[...]) / sigma,
                                                 brick.b[...]), **TOL)
        owned = variables["managers"]["spectral_norm"]["/"]["W"]
        np.testing.assert_allclose(owned["u"], u, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(owned["sigma"], sigma, rtol=1e-5)
    top = np.linalg.svd(w, compute_uv=False)[0]  # approached from below, step by step
    assert 0.99 * top < sigma <= top


def test_spectral_norm_inference_divides_by_the_stored_estimate_and_updates_nothing() -> None:
    lin = linear()
    program = gm.compile(lambda m, x: m(x), lin, managers=[managers.SpectralNorm(
        roles=[roles.WEIGHT])])
    variables = program.init(X)
    variables["managers"]["spectral_norm"]["/"]["W"]["sigma"] = jnp.float32(4.0)
    np.testing.assert_allclose(program.infer(variables, X),
                               array(X) @ (array(lin.W[...]) / 4.0) + array(lin.b[...]), **TOL)
    # a training step replaces the estimate; inference then divides by the new one
    _, trained = program.train(variables, X, rng=key(0))
    sigma = float(trained["managers"]["spectral_norm"]["/"]["W"]["sigma"])
    assert sigma != 4.0
    np.testing.assert_allclose(program.infer(trained, X),
                               array(X) @ (array(lin.W[...]) / sigma) + array(lin.b[...]), **TOL)


# -- MaxNorm ----------------------------------------------------------------------------------

def keras_max_norm(w: np.ndarray, max_norm: float, axes: tuple[int, ...]) -> np.ndarray:
    """Keras' MaxNorm constraint (without its 1e-7 in the denominator)."""
    norms = np.sqrt((w ** 2).sum(axes, keepdims=True))
    return w * np.clip(norms, 0, max_norm) / norms


@pytest.mark.parametrize("axis", [None, (0, 1, 2), 2, (-1,)])
def test_max_norm_scales_long_units_down_and_leaves_short_ones(axis: Any) -> None:
    brick = conv()
    w = array(brick.W[...]).astype(np.float64)
    axes = {None: (0, 1, 2), 2: (2,)}.get(axis, axis)
    axes = tuple(a % 4 for a in axes)
    limit = float(np.median(np.sqrt((w ** 2).sum(axes))))  # some units above, some below
    out, _ = read_weight(brick, managers.MaxNorm(limit, axis=axis, roles=[roles.WEIGHT]),
                         IMAGES)
    np.testing.assert_allclose(out, convolve(IMAGES, keras_max_norm(w, limit, axes),
                                             brick.b[...]), **TOL)


def test_max_norm_axis_out_of_range_names_the_manager_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"MaxNorm 'max_norm'\(axis=2\).*\[-2, 2\)"):
        read_weight(linear(), managers.MaxNorm(1.0, axis=2, roles=[roles.WEIGHT]), X)


def test_annealing_max_norm_changes_the_output_without_retracing() -> None:
    lin = linear()
    manager = managers.MaxNorm(gm.dynamic(10.0), roles=[roles.WEIGHT])
    fn = Counted(lambda m, x: m(x))
    program = gm.compile(fn, lin, managers=[manager])
    variables = program.init(X)
    loose = program.infer(variables, X)
    count = fn.count
    tight = program.infer(manager.hparam("max_norm").set(variables, 0.1), X)
    assert fn.count == count
    np.testing.assert_allclose(loose, lin(X), **TOL)
    w = array(lin.W[...]).astype(np.float64)
    np.testing.assert_allclose(tight, array(X) @ keras_max_norm(w, 0.1, (0,))
                               + array(lin.b[...]), **TOL)


# -- constructor checks and biases ------------------------------------------------------------

@pytest.mark.parametrize(("make", "message"), [
    (lambda: managers.WeightNorm(epsilon=0), r"WeightNorm\(epsilon=0\): must be a float > 0"),
    (lambda: managers.WeightStandardization(epsilon=-1.0), r"epsilon=-1.0\)"),
    (lambda: managers.WeightStandardization(gain=1), r"gain=1\): expected True or False"),
    (lambda: managers.SpectralNorm(steps=0), r"SpectralNorm\(steps=0\): must be a positive"),
    (lambda: managers.SpectralNorm(steps=True), r"steps=True"),
    (lambda: managers.MaxNorm(0.0), r"MaxNorm\(max_norm=0.0\): must be a float > 0"),
    (lambda: managers.MaxNorm(gm.dynamic(-1.0)), r"max_norm="),
    (lambda: managers.MaxNorm(1.0, axis="0"), r"MaxNorm\(axis='0'\): expected None, an int"),
    (lambda: managers.MaxNorm(1.0, axis=()), r"axis=\(\)"),
])
def test_bad_arguments_name_the_argument(make: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        make()


REPARAMETRIZATIONS = [
    lambda **f: managers.WeightNorm(**f), lambda **f: managers.WeightStandardization(**f),
    lambda **f: managers.SpectralNorm(**f), lambda **f: managers.MaxNorm(1.0, **f),
    lambda **f: managers.LoRA(2, **f),
]


@pytest.mark.parametrize("make", REPARAMETRIZATIONS)
def test_a_bias_is_refused_with_the_fix(make: Any) -> None:
    with pytest.raises(ValueError, match=r"'b' of shape \(4,\).*roles=\[graphmod.roles.WEIGHT"):
        read_weight(linear(), make(roles=[roles.PARAMETER]), X)


@pytest.mark.parametrize("make", REPARAMETRIZATIONS)
def test_without_roles_the_weights_of_the_selected_applications_are_rewritten(make: Any
                                                                              ) -> None:
    class Net(nnx.Module):
        def __init__(self) -> None:
            self.conv = nnx.Conv(2, 3, (3, 3), rngs=nnx.Rngs(0))
            self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(1))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.linear(self.conv(x).mean((1, 2)))

    images = np.ones((2, 5, 5, 2), np.float32)
    for manager, expected in [(make(bricks=[nnx.Conv]), [("/conv", "kernel")]),
                              (make(), [("/conv", "kernel"), ("/linear", "kernel")])]:
        assert manager.filter.roles == (roles.WEIGHT,)
        program = gm.compile(lambda m, x: m(x).sum(), Net(), managers=[manager])
        program.init(images)
        assert [(r.path, r.name) for r in program.rewrites["init"]] == expected
    assert make(path="*").filter.roles is None  # a filter that chooses variables is kept


@pytest.mark.parametrize(("make", "attribute", "value"), [
    (lambda: managers.MaxNorm(0.3, axis=(0,), roles=[roles.WEIGHT]), "axis", (0,)),
    (lambda: managers.WeightStandardization(gain=True, roles=[roles.WEIGHT]), "gain", True),
])
def test_the_optional_arguments_rebuild_from_provenance(make: Any, attribute: str,
                                                        value: Any) -> None:
    model = gm.bricks.Linear(3, 4, rngs=nnx.Rngs(3))
    program = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), model, managers=[make()])
    again = gm.rebuild(program.provenance)
    [rebuilt] = again.managers
    assert getattr(rebuilt, attribute) == value
    other = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), again.model, managers=[rebuilt])
    np.testing.assert_allclose(other.train(other.init(X), X, rng=key(0))[0],
                               program.train(program.init(X), X, rng=key(0))[0], **TOL)
