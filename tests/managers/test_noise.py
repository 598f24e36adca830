"""WeightNoise and GaussianNoise: gradients, one perturbation per call, statistics, dtypes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphmod as gm
import managers
from graphmod import roles
from tests.managers.helpers import (
    Counted,
    Identity,
    ReadTwice,
    Scale,
    apply_model,
    array,
    full,
    key,
    ones,
    rewritten_by,
)


def _check_normal(sample: jax.Array, mean: float, std: float) -> None:
    """Mean and standard deviation of an i.i.d. normal sample, within 5 sigma."""
    n = sample.size
    sample = np.asarray(sample, np.float64)
    assert abs(sample.mean() - mean) < 5 * std / np.sqrt(n)
    assert abs(sample.std() - std) < 5 * std / np.sqrt(2 * n)


# -- WeightNoise ----------------------------------------------------------------------------------

def test_weight_noise_gradients_reach_the_stored_parameter() -> None:
    model = Scale(512)
    stored = np.array(model.W[...])

    def cost(model: Scale, x: jax.Array) -> tuple[jax.Array, dict]:
        y = model(x)
        return jnp.sum(jnp.sin(y)), {"y": y}

    program = gm.compile(cost, model, managers=[managers.WeightNoise(0.2, roles=[roles.WEIGHT])])
    x = full(2.0, 512)
    variables = program.init(x)

    def loss(variables: dict) -> tuple[jax.Array, tuple[jax.Array, dict]]:
        (value, metrics), new = program.train(variables, x, rng=key(0))
        return value, (metrics["y"], new)

    grads, (y, new) = jax.grad(loss, has_aux=True)(variables)
    noisy = array(y) / 2  # the weight as the application read it
    _check_normal(noisy - stored, 0.0, 0.2)
    # the hand-written noisy function sum(sin(x * (W + noise))) has gradient x * cos(y)
    np.testing.assert_allclose(grads["model"]["W"], 2 * np.cos(array(y)), rtol=1e-5, atol=1e-6)
    assert np.abs(array(grads["model"]["W"])).min() > 0
    # the stored parameter is never changed: variables in, variables out, the model's array
    np.testing.assert_array_equal(new["model"]["W"], stored)
    np.testing.assert_array_equal(variables["model"]["W"], stored)
    np.testing.assert_array_equal(model.W[...], stored)


@pytest.mark.parametrize("per_call", [False, True])
def test_a_weight_read_twice_in_one_call_is_perturbed_once(per_call: bool) -> None:
    model = ReadTwice(64)
    noise = managers.WeightNoise(0.5, roles=[roles.WEIGHT], per_call=per_call)
    program = gm.compile(lambda m, x: (m(x), m(x)), model, managers=[noise])
    x = ones(64)
    ((first, second), (again, once_more)), _ = program.train(program.init(x), x, rng=key(0))
    np.testing.assert_array_equal(first, second)  # W[...] and W.reshape: one noise
    np.testing.assert_array_equal(again, once_more)
    assert not np.allclose(array(first), array(model.W[...]))
    # By default the next call sees the same noisy copy (one per step, as Blocks);
    # per_call=True draws a new noise for it.
    assert np.allclose(array(first), array(again)) != per_call
    assert rewritten_by(program) == [("weight_noise", "/", 0, "W"), ("weight_noise", "/", 1, "W")]


class TwoNames(gm.Brick):
    """One weight reachable by two attribute names, both read in one call."""

    def __init__(self, n: int) -> None:
        self.W = gm.Weight(jnp.asarray(np.linspace(-1.0, 1.0, n), jnp.float32))
        self.V = self.W

    @gm.application(inputs=["input_"], outputs=["first", "second"])
    def apply(self, input_: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.W * input_, self.V * input_


class Tied(gm.Brick):
    """``b.W = a.W``: two Scale bricks sharing one weight; ``c`` reads one weight twice."""

    def __init__(self, n: int) -> None:
        self.a = Scale(n, seed=1)
        self.b = Scale(n, seed=2)
        self.b.W = self.a.W
        self.c = TwoNames(n)


@pytest.mark.parametrize("per_call", [False, True])
def test_tied_weights_get_one_noisy_copy_per_step_or_one_per_call(per_call: bool) -> None:
    model = Tied(64)
    fn = lambda m, x: (m.a(x), m.b(x), m.a(x), m.c(x))
    noise = managers.WeightNoise(0.5, roles=[roles.WEIGHT], per_call=per_call)
    program = gm.compile(fn, model, managers=[noise])
    x = ones(64)
    variables = program.init(x)
    assert sorted(variables["model"]) == ["a", "c"]  # one variable per tied weight

    def loss(variables: dict) -> tuple[jax.Array, tuple]:
        out, _ = program.train(variables, x, rng=key(0))
        return sum(jnp.sum(o) for o in jax.tree.leaves(out)), out

    grads, (a, b, a_again, (c_first, c_second)) = jax.grad(loss, has_aux=True)(variables)
    shared = array(model.a.W[...])
    for one, other in [(a, b), (a, a_again), (b, a_again)]:
        # Blocks' semantics by default: one noisy copy of the shared weight per step
        assert np.allclose(array(one), array(other)) != per_call
    for noisy in (a, b, a_again):
        assert not np.allclose(array(noisy), shared)
    np.testing.assert_array_equal(c_first, c_second)  # two names, one call, one noise
    assert rewritten_by(program) == [
        ("weight_noise", "/a", 0, "W"), ("weight_noise", "/b", 0, "W"),
        ("weight_noise", "/a", 1, "W"), ("weight_noise", "/c", 0, c_name(program))]
    # three calls read the one stored weight: its gradient is 3 (inputs of ones)
    np.testing.assert_allclose(grads["model"]["a"]["W"], np.full(64, 3.0))
    np.testing.assert_allclose(grads["model"]["c"][c_name(program)], np.full(64, 2.0))


def c_name(program: gm.Program) -> str:
    """The canonical attribute name of ``TwoNames``' weight (first in traversal order)."""
    [info] = [v for v in program.layout.variables if v.path.startswith("/c.")]
    return info.name


# -- GaussianNoise --------------------------------------------------------------------------------

class Two(gm.Brick):
    def __init__(self) -> None:
        self.first = Identity()
        self.second = Identity()

    @gm.application(inputs=["input_"], outputs=["first", "second"])
    def apply(self, input_: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.first(input_), self.second(input_)


def test_gaussian_noise_on_inputs_and_outputs_has_the_given_statistics() -> None:
    model = Two()
    on_input = managers.GaussianNoise(gm.dynamic(0.5), bricks=[model.first],
                                      roles=[roles.INPUT])
    on_both = managers.GaussianNoise(0.3, bricks=[model.second],
                                     roles=[roles.INPUT, roles.OUTPUT], manager_name="on_both")
    fn = Counted(apply_model)
    program = gm.compile(fn, model, managers=[on_input, on_both])
    x = full(3.0, 100, 100)
    variables = program.init(x)
    (first, second), _ = program.train(variables, x, rng=key(0))
    _check_normal(first, 3.0, 0.5)
    # two independent draws (input, then output) add their variances
    _check_normal(second, 3.0, 0.3 * np.sqrt(2))
    traces = fn.count
    (first, _), _ = program.train(on_input.hparam("std").set(variables, 0.1), x, rng=key(1))
    _check_normal(first, 3.0, 0.1)
    assert fn.count == traces
    # inference is the identity
    for out in program.infer(variables, x):
        np.testing.assert_array_equal(out, x)
    assert list(program.rewrites.infer) == []


# -- both: dtypes and inference -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_noise_keeps_dtypes_and_inference_is_the_identity(dtype) -> None:
    model = Scale(32, dtype=dtype)
    with managers.WeightNoise(0.1, roles=[roles.WEIGHT]), \
            managers.GaussianNoise(0.1, roles=[roles.INPUT, roles.OUTPUT]):
        program = gm.compile(apply_model, model)
    x = ones(4, 32, dtype=dtype)
    variables = program.init(x)
    out, new = program.train(variables, x, rng=key(0))
    assert out.dtype == dtype
    assert new["model"]["W"].dtype == dtype
    name = jnp.dtype(dtype).name
    assert [(r.manager, r.role, r.dtype_in, r.dtype_out) for r in program.rewrites.train] == [
        ("gaussian_noise", "INPUT", name, name), ("weight_noise", "WEIGHT", name, name),
        ("gaussian_noise", "OUTPUT", name, name)]
    plain = array(model(x))
    assert not np.allclose(array(out), plain)
    inferred = program.infer(variables, x)
    assert inferred.dtype == dtype
    np.testing.assert_array_equal(array(inferred), plain)


# -- bad arguments --------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [managers.WeightNoise, managers.GaussianNoise])
@pytest.mark.parametrize("std", [-0.1, float("nan"), float("inf"), "0.1", gm.dynamic(-1.0)])
def test_a_bad_std_raises_naming_the_argument(cls, std) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}\(std="):
        cls(std)


def test_std_zero_is_the_identity() -> None:
    model = Scale(8)
    program = gm.compile(apply_model, model, managers=[
        managers.WeightNoise(0.0, roles=[roles.WEIGHT]),
        managers.GaussianNoise(0.0, roles=[roles.OUTPUT])])
    x = ones(8)
    out, _ = program.train(program.init(x), x, rng=key(0))
    np.testing.assert_array_equal(out, model(x))
