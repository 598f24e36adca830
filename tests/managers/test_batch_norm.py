"""BatchNorm: against a hand-written batch norm and flax.nnx.BatchNorm, statistics, gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from tests.managers.helpers import Identity, apply_model, array, key, linear, normal, rewritten_by

MOMENTUM, EPSILON = 0.9, 1e-3
ONES, ZEROS = np.ones(3), np.zeros(3)


def batch_norm(x, mean, var, scale, bias, axis: int) -> np.ndarray:
    """The hand-written reference in NumPy: ``(x - mean) / sqrt(var + eps) * scale + bias``."""
    x = np.asarray(x, np.float64)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    r = lambda v: np.asarray(v, np.float64).reshape(shape)
    return (x - r(mean)) / np.sqrt(r(var) + EPSILON) * r(scale) + r(bias)


def batch_stats(x, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and biased variance over every axis but ``axis`` (NumPy, float64)."""
    x = np.asarray(x, np.float64)
    reduce = tuple(a for a in range(x.ndim) if a != axis % x.ndim)
    return x.mean(reduce), x.var(reduce)


def _owned(variables: dict, path: str = "/", name: str = "output") -> dict:
    entry = variables["managers"]["batch_norm"][path]["apply"]
    return {k.removeprefix(f"{name}."): v for k, v in entry.items()}


def _with_owned(variables: dict, path: str = "/", name: str = "output", **values) -> dict:
    """A copy of ``variables`` with some of batch norm's owned variables replaced."""
    entry = variables["managers"]["batch_norm"][path]["apply"]
    new_entry = {**entry, **{f"{name}.{k}": jnp.asarray(v, jnp.float32)
                             for k, v in values.items()}}
    manager = {**variables["managers"]["batch_norm"], path: {"apply": new_entry}}
    return {**variables, "managers": {**variables["managers"], "batch_norm": manager}}


def _program(fn=apply_model, **kwargs) -> gm.Program:
    kwargs = {"epsilon": EPSILON, "roles": [roles.OUTPUT], **kwargs}
    return gm.compile(fn, Identity(), managers=[managers.BatchNorm(**kwargs)])


def _close(actual, expected, tolerance: float = 1e-5) -> None:
    np.testing.assert_allclose(array(actual), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("shape", "axis"), [((16, 3), -1), ((4, 3, 5), 1)],
                         ids=["2d last axis", "3d axis 1"])
def test_batch_norm_matches_a_hand_written_one_and_flax(shape, axis) -> None:
    program = _program(momentum=MOMENTUM, axis=axis)
    x = normal(1, *shape, mean=1.0, std=3.0)
    variables = program.init(x)
    owned = _owned(variables)
    assert {k: (v.shape, v.dtype) for k, v in owned.items()} == {
        k: ((3,), jnp.float32) for k in ("mean", "var", "scale", "bias")}
    np.testing.assert_array_equal(owned["mean"], ZEROS)
    np.testing.assert_array_equal(owned["var"], ONES)
    scale, bias = np.array([1.0, 2.0, 0.5]), np.array([0.1, -0.2, 0.3])
    mean0, var0 = np.array([0.5, -1.0, 2.0]), np.array([2.0, 0.5, 1.5])
    variables = _with_owned(variables, scale=scale, bias=bias, mean=mean0, var=var0)

    flax_bn = nnx.BatchNorm(3, axis=axis, momentum=MOMENTUM, epsilon=EPSILON, rngs=nnx.Rngs(0))
    flax_bn.scale[...], flax_bn.bias[...] = jnp.asarray(scale), jnp.asarray(bias)
    flax_bn.mean[...], flax_bn.var[...] = jnp.asarray(mean0), jnp.asarray(var0)

    # training: batch statistics; running ones updated as documented
    out, new = program.train(variables, x, rng=key(0))
    mean, var = batch_stats(x, axis)
    _close(out, batch_norm(x, mean, var, scale, bias, axis))
    _close(out, array(flax_bn(x)))
    running = _owned(new)
    _close(running["mean"], MOMENTUM * mean0 + (1 - MOMENTUM) * mean, 1e-6)
    _close(running["var"], MOMENTUM * var0 + (1 - MOMENTUM) * var, 1e-6)
    _close(running["mean"], array(flax_bn.mean[...]), 1e-6)
    _close(running["var"], array(flax_bn.var[...]), 1e-6)
    np.testing.assert_array_equal(running["scale"], scale.astype(np.float32))  # by grads only

    # inference: population statistics; nothing updated
    flax_bn.eval()
    inferred = program.infer(new, x)
    _close(inferred, batch_norm(x, running["mean"], running["var"], scale, bias, axis))
    _close(inferred, array(flax_bn(x)))


def test_batch_norm_on_a_linear_input_matches_flax_layers() -> None:
    lin = linear(4, 2)
    program = gm.compile(apply_model, lin, managers=[managers.BatchNorm(
        momentum=MOMENTUM, epsilon=EPSILON, roles=[roles.INPUT])])
    x = normal(2, 8, 4, mean=-1.0, std=2.0)
    out, new = program.train(program.init(x), x, rng=key(0))
    flax_bn = nnx.BatchNorm(4, momentum=MOMENTUM, epsilon=EPSILON, rngs=nnx.Rngs(0))
    flax_lin = nnx.Linear(4, 2, rngs=nnx.Rngs(0), kernel_init=lambda *_: lin.W[...],
                          bias_init=lambda *_: lin.b[...])
    _close(out, array(flax_lin(flax_bn(x))))
    _close(_owned(new, name="input_")["mean"], array(flax_bn.mean[...]), 1e-6)
    flax_bn.eval()
    _close(program.infer(new, x), array(flax_lin(flax_bn(x))))


def test_the_fast_variance_is_flaxs_and_the_two_pass_one_within_rounding() -> None:
    x = normal(3, 16, 3, mean=2.0, std=0.5)
    fast = _program(momentum=MOMENTUM, use_fast_variance=True)
    out, new = fast.train(fast.init(x), x, rng=key(0))
    flax_fast = nnx.BatchNorm(3, momentum=MOMENTUM, epsilon=EPSILON, use_fast_variance=True,
                              rngs=nnx.Rngs(0))
    _close(out, array(flax_fast(x)), 1e-6)
    _close(_owned(new)["var"], array(flax_fast.var[...]), 1e-7)
    # E[x²] - E[x]² against E[(x - E[x])²]: the same statistics to float32 rounding.
    two_pass = _program(momentum=MOMENTUM)
    assert not two_pass.managers[0].use_fast_variance  # the default: two passes
    _close(two_pass.train(two_pass.init(x), x, rng=key(0))[0], out, 1e-4)
    _, var = batch_stats(x, -1)
    _close(_owned(new)["var"], MOMENTUM * ONES + (1 - MOMENTUM) * var, 1e-5)
    # never negative where rounding makes E[x²] - E[x]² so (a constant feature)
    constant = jnp.full((8, 3), 1e3, jnp.float32)
    _, new = fast.train(fast.init(constant), constant, rng=key(0))
    assert bool(jnp.all(_owned(new)["var"] >= MOMENTUM))


def test_the_fast_variance_differentiates_as_the_two_pass_one() -> None:
    # The clip at 0 differentiates as the identity: the gradient is the variance's own,
    # within rounding of the two-pass formula's, and finite where the clip acts.
    def input_grad(program: gm.Program, x: jax.Array) -> jax.Array:
        variables = program.init(x)
        return jax.grad(lambda x: jnp.sum(jnp.sin(program.train(variables, x, rng=key(0))[0])))(x)

    x = normal(4, 16, 3, mean=1.0, std=2.0)
    fast = input_grad(_program(use_fast_variance=True), x)
    _close(fast, input_grad(_program(), x), 1e-4)
    assert np.abs(array(fast)).max() > 1e-2
    # a large mean and a tiny spread: E[x²] - E[x]² rounds below 0 for two features
    spread = 1e3 + 1e-3 * jax.random.normal(key(1), (8, 3))
    assert int(jnp.sum(jnp.mean(spread**2, 0) - jnp.mean(spread, 0) ** 2 < 0)) == 2
    assert bool(jnp.all(jnp.isfinite(input_grad(_program(use_fast_variance=True), spread))))


def test_scale_and_shift_receive_the_gradients_of_the_hand_written_function() -> None:
    program = _program(lambda m, x: jnp.sum(jnp.sin(m(x))))
    x = normal(1, 16, 3, mean=1.0, std=3.0)
    variables = program.init(x)
    grads = _owned(jax.grad(lambda v: program.train(v, x, rng=key(0))[0])(variables))
    # y = x_hat * scale + bias with scale 1, bias 0: d sum(sin(y)) = sum(cos(y) * (x_hat, 1))
    x_hat = batch_norm(x, *batch_stats(x, -1), ONES, ZEROS, -1)
    _close(grads["scale"], np.sum(np.cos(x_hat) * x_hat, 0), 1e-4)
    _close(grads["bias"], np.sum(np.cos(x_hat), 0), 1e-4)
    assert np.abs(array(grads["scale"])).min() > 1e-3
    assert np.abs(array(grads["bias"])).min() > 1e-3
    assert program.roles(variables)["managers"]["batch_norm"]["/"]["apply"] == {
        "output.scale": roles.PARAMETER, "output.bias": roles.BIAS,
        "output.mean": roles.STATE, "output.var": roles.STATE}


def test_two_calls_of_one_brick_update_the_shared_statistics_in_call_order() -> None:
    program = _program(lambda m, x1, x2: (m(x1), m(x2)), momentum=MOMENTUM)
    x1, x2 = normal(1, 8, 3, mean=1.0, std=2.0), normal(2, 8, 3, mean=-3.0)
    variables = program.init(x1, x2)
    r_mean, r_var = np.array([0.5, 0.0, -0.5]), np.array([2.0, 1.0, 3.0])
    (y1, y2), new = program.train(_with_owned(variables, mean=r_mean, var=r_var), x1, x2,
                                  rng=key(0))
    assert rewritten_by(program) == [("batch_norm", "/", 0, "output"),
                                      ("batch_norm", "/", 1, "output")]
    (m1, v1), (m2, v2) = batch_stats(x1, -1), batch_stats(x2, -1)
    _close(y1, batch_norm(x1, m1, v1, ONES, ZEROS, -1))
    _close(y2, batch_norm(x2, m2, v2, ONES, ZEROS, -1))
    m = MOMENTUM
    running = _owned(new)
    _close(running["mean"], m * (m * r_mean + (1 - m) * m1) + (1 - m) * m2, 1e-6)
    _close(running["var"], m * (m * r_var + (1 - m) * v1) + (1 - m) * v2, 1e-6)


def test_inference_uses_the_population_statistics_in_the_variables() -> None:
    program = _program()
    x = normal(1, 8, 3)
    variables = program.init(x)
    shifted = _with_owned(variables, mean=np.full(3, 3.0), var=np.full(3, 4.0))
    _close(program.infer(variables, x), array(x) / np.sqrt(1 + EPSILON), 1e-6)
    _close(program.infer(shifted, x), (array(x) - 3) / np.sqrt(4 + EPSILON), 1e-6)
    assert rewritten_by(program, "infer") == [("batch_norm", "/", 0, "output")]
    # training ignores the running statistics (it uses the batch's)
    np.testing.assert_array_equal(program.train(shifted, x, rng=key(0))[0],
                                  program.train(variables, x, rng=key(0))[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_batch_norm_keeps_the_dtype_and_computes_statistics_in_float32(dtype) -> None:
    program = _program()
    x = normal(1, 16, 3, mean=1.0, std=3.0, dtype=dtype)
    variables = program.init(x)
    assert {v.dtype for v in _owned(variables).values()} == {jnp.dtype(jnp.float32)}
    out, new = program.train(variables, x, rng=key(0))
    assert out.dtype == dtype
    assert {v.dtype for v in _owned(new).values()} == {jnp.dtype(jnp.float32)}
    _close(out, batch_norm(array(x), *batch_stats(array(x), -1), ONES, ZEROS, -1), 2e-2)
    assert program.infer(new, x).dtype == dtype


def test_use_scale_and_use_bias_false_own_no_scale_or_bias() -> None:
    program = _program(use_scale=False, use_bias=False)
    x = normal(1, 8, 3)
    variables = program.init(x)
    assert sorted(_owned(variables)) == ["mean", "var"]
    out, _ = program.train(variables, x, rng=key(0))
    _close(out, batch_norm(x, *batch_stats(x, -1), ONES, ZEROS, -1))


# -- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"momentum": 2.0}, "momentum"), ({"momentum": -0.1}, "momentum"),
    ({"momentum": float("nan")}, "momentum"), ({"epsilon": 0.0}, "epsilon"),
    ({"epsilon": float("nan")}, "epsilon"), ({"epsilon": "1e-5"}, "epsilon"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=rf"BatchNorm\({argument}="):
        managers.BatchNorm(**kwargs)


def test_a_fast_variance_flag_that_is_no_bool_is_refused() -> None:
    with pytest.raises(TypeError, match=r"BatchNorm\(use_fast_variance='yes'\)"):
        managers.BatchNorm(use_fast_variance="yes")  # pyright: ignore[reportArgumentType]


def test_a_bad_axis_raises_naming_it() -> None:
    with pytest.raises(TypeError, match=r"BatchNorm\(axis="):
        managers.BatchNorm(axis=(0, 1))
    program = _program(axis=2)
    with pytest.raises(ValueError, match=r"BatchNorm\(axis=2\)"):
        program.init(normal(0, 4, 3))
    batch_axis = _program(axis=0)  # statistics per example: they fit no other batch size
    variables = batch_axis.init(normal(0, 4, 3))
    with pytest.raises(ValueError, match=r"BatchNorm\(axis=0\) at / apply\.output: 5 features "
                       r"along axis 0 of shape \(5, 3\), but statistics of shape \(4,\) from "
                       r"init; axis 0 is the batch: pick the feature axis"):
        batch_axis.infer(variables, normal(1, 5, 3))


def test_two_batch_norms_of_one_output_raise_naming_both() -> None:
    program = gm.compile(apply_model, Identity(), managers=[
        managers.BatchNorm(roles=[roles.OUTPUT], manager_name="first_norm"),
        managers.BatchNorm(roles=[roles.OUTPUT], manager_name="second_norm")])
    with pytest.raises(ValueError, match="first_norm") as error:
        program.init(normal(0, 4, 3))
    assert "second_norm" in str(error.value)


def test_a_batch_norm_given_with_use_manager_conflicts_with_a_compiled_one() -> None:
    local = managers.BatchNorm(roles=[roles.OUTPUT], manager_name="local")
    fn = lambda m, x: m(x, use_manager=local)
    program = gm.compile(fn, Identity(), managers=[managers.BatchNorm(roles=[roles.OUTPUT])])
    with pytest.raises(ValueError, match="'local'") as error:
        program.init(normal(0, 4, 3))
    assert "'batch_norm'" in str(error.value)


def test_two_batch_norms_of_different_variables_are_allowed() -> None:
    program = gm.compile(apply_model, Identity(), managers=[
        managers.BatchNorm(roles=[roles.INPUT], manager_name="input_norm"),
        managers.BatchNorm(roles=[roles.OUTPUT], manager_name="output_norm")])
    variables = program.init(normal(0, 4, 3))
    assert {"input_norm", "output_norm"} <= set(variables["managers"])
