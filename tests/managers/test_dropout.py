"""Dropout: inverted scaling, rate, dtypes, reproducible masks, broadcasting, dynamic rate."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from tests.managers.helpers import (
    Counted,
    Identity,
    Pair,
    Scale,
    apply_model,
    array,
    full,
    key,
    linear,
    normal,
    ones,
    rewritten_by,
    watch,
)


def _identity_program(dropout: managers.Dropout, fn=apply_model) -> gm.Program:
    return gm.compile(fn, Identity(), managers=[dropout])


def _check_rate(out: jax.Array, rate: float) -> None:
    """The fraction of zeros is ``rate`` and the mean of dropped ones is 1 (5 sigma)."""
    out = array(out)
    sigma = np.sqrt(rate * (1 - rate) / out.size)  # of the fraction of zeros
    assert abs(np.mean(out == 0) - rate) < 5 * sigma
    assert abs(out.mean() - 1.0) < 5 * sigma / (1 - rate)
    # inverted scaling: every kept element is scaled by 1 / (1 - rate)
    np.testing.assert_allclose(np.unique(out[out != 0]), [1 / (1 - rate)], rtol=1e-5)


# -- the rate and the expected value --------------------------------------------------------------

def test_dropout_drops_at_the_rate_and_keeps_the_expected_value() -> None:
    program = _identity_program(managers.Dropout(0.3, roles=[roles.INPUT]))
    x = ones(100, 100)
    out, _ = program.train(program.init(x), x, rng=key(1))
    _check_rate(out, 0.3)


@pytest.mark.parametrize("rate", [0.0, gm.dynamic(0.0)], ids=["static", "dynamic"])
def test_rate_zero_is_the_identity(rate: float | gm.Dynamic) -> None:
    lin = linear()
    program = gm.compile(apply_model, lin,
                         managers=[managers.Dropout(rate, roles=[roles.INPUT, roles.WEIGHT])])
    x = normal(1, 5, 3)
    out, _ = program.train(program.init(x), x, rng=key(0))
    np.testing.assert_allclose(out, lin(x), rtol=1e-6)


@pytest.mark.parametrize("rate", [1.0, gm.dynamic(1.0)], ids=["static", "dynamic"])
def test_rate_one_gives_zeros_with_zero_finite_gradients(rate: float | gm.Dynamic) -> None:
    program = gm.compile(apply_model, linear(),
                         managers=[managers.Dropout(rate, roles=[roles.OUTPUT])])
    x = normal(1, 5, 3)

    def cost(variables: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        out, _ = program.train(variables, x, rng=key(0))
        return jnp.sum(jnp.sin(out) + out), out

    grads, out = jax.grad(cost, argnums=(0, 1), has_aux=True)(program.init(x), x)
    np.testing.assert_array_equal(out, np.zeros((5, 4)))
    leaves = [array(leaf) for leaf in jax.tree.leaves(grads)]
    assert len(leaves) == 3 + isinstance(rate, gm.Dynamic)  # W, b, x (and the rate)
    for leaf in leaves:
        assert np.all(np.isfinite(leaf))
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dropout_keeps_the_dtype_of_inputs_outputs_and_parameters(dtype) -> None:
    model = Scale(256, dtype=dtype)
    dropout = managers.Dropout(0.5, roles=[roles.INPUT, roles.WEIGHT, roles.OUTPUT])
    program = gm.compile(apply_model, model, managers=[dropout])
    x = ones(256, dtype=dtype)
    out, variables = program.train(program.init(x), x, rng=key(0))
    assert out.dtype == dtype
    assert variables["model"]["W"].dtype == dtype
    name = jnp.dtype(dtype).name
    assert [(r.role, r.dtype_in, r.dtype_out) for r in program.rewrites.train] == [
        ("INPUT", name, name), ("WEIGHT", name, name), ("OUTPUT", name, name)]
    # three masks of rate 0.5, each scaling by exactly 2
    ratio = array(out) / array(model.W[...])
    assert set(np.unique(ratio).tolist()) <= {0.0, 8.0}
    assert 0.8 < np.mean(ratio == 0) < 0.95  # 1 - 1/8 of them dropped


# -- what the masks depend on ---------------------------------------------------------------------

def _pair_masks(pair: Pair, chosen: list[gm.Manager], rng: jax.Array) -> dict:
    """The dropped inputs of both Scale children (inputs of ones: 0 or 2)."""
    program = gm.compile(apply_model, pair, managers=chosen,
                         monitor=watch(roles.INPUT, bricks=[Scale]))
    x = ones(4, 64)
    _, _, monitored = program.train(program.init(x), x, rng=rng)
    return {k: array(v) for k, v in monitored.items()}


def _dropout(**kwargs) -> managers.Dropout:
    return managers.Dropout(0.5, bricks=[Scale], roles=[roles.INPUT], **kwargs)


@pytest.fixture(scope="module")
def pair() -> Pair:
    return Pair(64)


@pytest.fixture(scope="module")
def alone(pair: Pair) -> dict:
    """The masks of a Dropout alone in its program, key 3."""
    return _pair_masks(pair, [_dropout()], key(3))


def _assert_same(masks: dict, expected: dict) -> None:
    assert set(masks) == set(expected) == {"/a.apply.input_", "/b.apply.input_"}
    for name in expected:
        np.testing.assert_array_equal(masks[name], expected[name], err_msg=name)


def test_masks_do_not_change_when_other_managers_are_added(pair, alone) -> None:
    # one manager listed before and one after, both rewriting the same bricks
    chosen = [managers.GaussianNoise(0.3, bricks=[pair.a], roles=[roles.OUTPUT]), _dropout(),
              managers.WeightNoise(0.1, roles=[roles.WEIGHT], priority=2)]
    _assert_same(_pair_masks(pair, chosen, key(3)), alone)


def test_masks_are_the_same_for_a_copy_of_the_model_and_a_new_manager(pair, alone) -> None:
    _assert_same(_pair_masks(nnx.clone(pair), [_dropout()], key(3)), alone)


def test_masks_differ_by_path_and_manager_name(pair, alone) -> None:
    a, b = alone["/a.apply.input_"], alone["/b.apply.input_"]
    assert set(np.unique(a).tolist()) == {0.0, 2.0}
    assert np.any(a != b)  # two paths
    renamed = _pair_masks(pair, [_dropout(manager_name="other")], key(3))
    assert np.any(a != renamed["/a.apply.input_"])  # another manager name


def test_masks_differ_by_call_id() -> None:
    program = _identity_program(managers.Dropout(0.5, roles=[roles.INPUT]),
                                fn=lambda m, x: (m(x), m(x)))
    x = ones(256)
    (first, second), _ = program.train(program.init(x), x, rng=key(0))
    assert [r.call_id for r in program.rewrites.train] == [0, 1]
    assert np.any(array(first) != array(second))


# -- the same masks under every transformation ----------------------------------------------------

INPUT = "/.apply.input_"


@pytest.fixture(scope="module")
def masked() -> tuple[gm.Program, dict, jax.Array]:
    """Dropout on the inputs of a Linear brick, masks monitored."""
    lin = linear()
    program = gm.compile(apply_model, lin, managers=[managers.Dropout(0.5, roles=[roles.INPUT])],
                         monitor=watch(roles.INPUT))
    x = normal(1, 5, 3)
    return program, program.init(x), x


def test_different_keys_give_different_masks_and_the_same_key_the_same(masked) -> None:
    program, variables, x = masked
    one = program.train(variables, x, rng=key(0))[2][INPUT]
    again = program.train(variables, x, rng=key(0))[2][INPUT]
    other = program.train(variables, x, rng=key(1))[2][INPUT]
    np.testing.assert_array_equal(one, again)
    assert np.any(array(one) != array(other))
    kept = array(one) != 0
    np.testing.assert_allclose(array(one)[kept], 2 * array(x)[kept], rtol=1e-6)


def test_same_key_same_masks_in_eager_mode(masked) -> None:
    program, variables, x = masked
    out, _, jitted = program.train(variables, x, rng=key(0))
    with jax.disable_jit():
        eager_out, _, eager = program.train(variables, x, rng=key(0))
    np.testing.assert_array_equal(eager[INPUT], jitted[INPUT])
    np.testing.assert_allclose(eager_out, out, rtol=1e-6, atol=1e-6)


def test_masks_inside_grad_equal_those_of_the_forward_pass(masked) -> None:
    program, variables, x = masked
    _, _, forward = program.train(variables, x, rng=key(0))

    def cost(variables: dict) -> tuple[jax.Array, dict]:
        out, _, monitored = program.train(variables, x, rng=key(0))
        return out.sum(), monitored

    grads, inside = jax.grad(cost, has_aux=True)(variables)
    dropped = array(forward[INPUT])
    np.testing.assert_array_equal(inside[INPUT], dropped)
    # d cost / d W = sum over the batch of the dropped inputs, for every output
    np.testing.assert_allclose(grads["model"]["W"], np.repeat(dropped.sum(0)[:, None], 4, 1),
                               rtol=1e-5)


def test_vmap_over_inputs_with_one_key_gives_the_masks_of_single_calls(masked) -> None:
    program, variables, x = masked
    xs = jnp.stack([x, normal(2, 5, 3), normal(3, 5, 3)])
    outs, _, monitored = jax.vmap(lambda x: program.train(variables, x, rng=key(0)))(xs)
    for i in range(3):
        out, _, single = program.train(variables, xs[i], rng=key(0))
        np.testing.assert_array_equal(monitored[INPUT][i], single[INPUT])
        np.testing.assert_allclose(outs[i], out, rtol=1e-6)


def test_lax_scan_over_steps_gives_the_masks_of_single_calls(masked) -> None:
    program, variables, x = masked
    keys = jax.random.split(key(0), 3)

    def body(carry: None, k: jax.Array) -> tuple[None, jax.Array]:
        return carry, program.train(variables, x, rng=k)[2][INPUT]

    _, scanned = jax.lax.scan(body, None, keys)
    for i in range(3):
        single = program.train(variables, x, rng=keys[i])[2][INPUT]
        np.testing.assert_array_equal(scanned[i], single)
    assert np.any(array(scanned[0]) != array(scanned[1]))


def test_inference_is_the_plain_eager_model(masked) -> None:
    program, variables, x = masked
    trained, _, _ = program.train(variables, x, rng=key(0))
    plain = array(program.model(x))
    assert not np.allclose(array(trained), plain)  # the manager does act in training
    inferred, monitored = program.infer(variables, x)
    np.testing.assert_allclose(inferred, plain, rtol=1e-6)
    np.testing.assert_array_equal(monitored[INPUT], x)
    assert list(program.rewrites.infer) == []


# -- broadcast_dims -------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [(-2,), (0, 2)])
def test_broadcast_dims_share_one_mask_value_along_the_axes(dims: tuple[int, ...]) -> None:
    program = _identity_program(managers.Dropout(0.5, roles=[roles.INPUT], broadcast_dims=dims))
    x = ones(32, 32, 32)
    out, _ = program.train(program.init(x), x, rng=key(0))
    out = array(out)
    axes = tuple(d % 3 for d in dims)
    first = out[tuple(slice(0, 1) if a in axes else slice(None) for a in range(3))]
    np.testing.assert_array_equal(out, np.broadcast_to(first, out.shape))
    assert 0.2 < np.mean(first == 0) < 0.8  # the mask still varies along the other axes


def test_broadcast_dims_out_of_range_raise_naming_the_argument() -> None:
    program = _identity_program(managers.Dropout(0.5, roles=[roles.INPUT], broadcast_dims=(3,)))
    with pytest.raises(ValueError, match="broadcast_dims"):
        program.init(ones(2, 3))


# -- dynamic rate ---------------------------------------------------------------------------------

def test_dynamic_rate_is_a_float32_scalar_changed_without_retrace() -> None:
    dropout = managers.Dropout(gm.dynamic(0.5), roles=[roles.INPUT])
    fn = Counted(apply_model)
    program = _identity_program(dropout, fn)
    x = ones(100, 100)
    variables = program.init(x)
    rate = variables["managers"]["dropout"]["hparams"]["rate"]
    assert (rate.shape, rate.dtype, rate.weak_type) == ((), jnp.float32, False)
    assert float(rate) == 0.5
    out, variables = program.train(variables, x, rng=key(0))
    traces = fn.count
    _check_rate(out, 0.5)

    handle = dropout.hparam("rate")
    for new in (0.1, 0.8):
        changed = handle.set(variables, new)
        stored = changed["managers"]["dropout"]["hparams"]["rate"]
        assert (stored.dtype, stored.weak_type) == (jnp.float32, False)
        out, _ = program.train(changed, x, rng=key(0))
        _check_rate(out, new)
    assert fn.count == traces
    assert program._train._cache_size() == 1


def test_a_constant_rate_is_not_stored_and_has_no_handle() -> None:
    dropout = managers.Dropout(0.5, roles=[roles.INPUT])
    program = _identity_program(dropout)
    variables = program.init(ones(3))
    assert variables["managers"]["dropout"]["hparams"] == {}
    with pytest.raises(ValueError, match="dynamic"):
        dropout.hparam("rate")


def test_rewrites_record_each_dropout() -> None:
    program = gm.compile(apply_model, Pair(4), managers=[_dropout()])
    program.init(full(2.0, 4))
    assert rewritten_by(program, "init") == [("dropout", "/a", 0, "input_"),
                                              ("dropout", "/b", 0, "input_")]


# -- bad arguments --------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [1.5, -0.1, float("nan"), "0.5", True, gm.dynamic(2.0)])
def test_a_bad_rate_raises_naming_the_argument(rate) -> None:
    with pytest.raises(ValueError, match=r"Dropout\(rate="):
        managers.Dropout(rate)


@pytest.mark.parametrize("dims", [1, ("1",)])
def test_bad_broadcast_dims_raise_naming_the_argument(dims) -> None:
    with pytest.raises(TypeError, match=r"Dropout\(broadcast_dims="):
        managers.Dropout(0.5, broadcast_dims=dims)


def test_numpy_scalars_are_accepted_as_rates() -> None:
    assert managers.Dropout(np.float32(0.25)).rate == 0.25


def test_dropout_choosing_no_variables_warns_that_it_drops_all_of_them() -> None:
    with pytest.warns(UserWarning, match=r"Dropout\(0\.1\) without roles= drops every input, "
                      r"output and parameter.*roles=\[gm\.roles\.OUTPUT\]"):
        managers.Dropout(0.1, bricks=[nnx.Linear])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        managers.Dropout(0.1, roles=[gm.roles.OUTPUT])
        managers.Dropout(0.1, variable_name="kernel")
