"""Dropout: inverted scaling, rate, dtypes, reproducible masks, broadcasting, dynamic rate."""

from __future__ import annotations

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
    key,
    normal,
    ones,
    rewritten_by,
    watch,
)


def _identity_program(dropout: managers.Dropout, **kwargs) -> gm.Program:
    return gm.compile(apply_model, Identity(), managers=[dropout], **kwargs)


# -- the rate and the expected value ------------------------------------------------------------

@pytest.mark.parametrize("rate", [0.2, 0.5, 0.8])
def test_dropout_drops_at_the_rate_and_keeps_the_expected_value(rate: float) -> None:
    program = _identity_program(managers.Dropout(rate, roles=[roles.INPUT]))
    x = ones(200, 100)
    out, _ = program.train(program.init(x), x, rng=key(1))
    n = x.size
    sigma = np.sqrt(rate * (1 - rate) / n)  # of the fraction of zeros
    zeros = float(jnp.mean(out == 0))
    assert abs(zeros - rate) < 5 * sigma
    assert abs(float(out.mean()) - 1.0) < 5 * sigma / (1 - rate)
    # inverted scaling: every kept element is scaled by 1 / (1 - rate)
    np.testing.assert_allclose(np.unique(np.asarray(out[out != 0])), [1 / (1 - rate)],
                               rtol=1e-6)


@pytest.mark.parametrize("rate", [0.0, gm.dynamic(0.0)], ids=["static", "dynamic"])
def test_rate_zero_is_the_identity(rate: float | gm.Dynamic) -> None:
    lin = gm.bricks.Linear(5, 3, rngs=nnx.Rngs(0))
    program = gm.compile(apply_model, lin,
                         managers=[managers.Dropout(rate, roles=[roles.INPUT, roles.WEIGHT])])
    x = normal(1, 4, 5)
    out, _ = program.train(program.init(x), x, rng=key(0))
    np.testing.assert_array_equal(out, lin(x))


@pytest.mark.parametrize("rate", [1.0, gm.dynamic(1.0)], ids=["static", "dynamic"])
def test_rate_one_gives_zeros_with_zero_finite_gradients(rate: float | gm.Dynamic) -> None:
    lin = gm.bricks.Linear(5, 3, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x),
                         lin, managers=[managers.Dropout(rate, roles=[roles.OUTPUT])])
    x = normal(1, 4, 5)
    variables = program.init(x)
    out, _ = program.train(variables, x, rng=key(0))
    np.testing.assert_array_equal(out, jnp.zeros_like(out))

    def cost(variables: dict, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sin(program.train(variables, x, rng=key(0))[0]))

    grads = jax.grad(cost, argnums=(0, 1))(variables, x)
    for leaf in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(leaf)))
        np.testing.assert_array_equal(leaf, jnp.zeros_like(leaf))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dropout_keeps_the_input_dtype(dtype) -> None:
    program = _identity_program(managers.Dropout(0.5, roles=[roles.INPUT, roles.OUTPUT]))
    x = ones(8, 16, dtype=dtype)
    out, _ = program.train(program.init(x), x, rng=key(0))
    assert out.dtype == dtype
    assert {(r.dtype_in, r.dtype_out) for r in program.rewrites.train} == {
        (jnp.dtype(dtype).name, jnp.dtype(dtype).name)}
    # two masks of rate 0.5 and scale 2 each: the kept elements are exactly 4
    assert set(np.unique(np.asarray(out, np.float32)).tolist()) <= {0.0, 4.0}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dropout_of_a_parameter_keeps_its_dtype(dtype) -> None:
    model = Scale(16, rngs=nnx.Rngs(0), dtype=dtype)
    program = gm.compile(apply_model, model,
                         managers=[managers.Dropout(0.5, roles=[roles.WEIGHT])])
    x = ones(16, dtype=dtype)
    out, variables = program.train(program.init(x), x, rng=key(0))
    assert out.dtype == dtype
    assert variables["model"]["W"].dtype == dtype
    [rewrite] = program.rewrites.train
    assert (rewrite.name, rewrite.dtype_out) == ("W", jnp.dtype(dtype).name)


# -- what the masks depend on ----------------------------------------------------------------------

def _pair_masks(pair: Pair, managers_: list[gm.Manager], x: jax.Array, rng: jax.Array) -> dict:
    program = gm.compile(apply_model, pair, managers=managers_,
                         monitor=watch(roles.INPUT, bricks=[Scale]))
    _, _, monitored = program.train(program.init(x), x, rng=rng)
    return monitored


def _dropout() -> managers.Dropout:
    return managers.Dropout(0.5, bricks=[Scale], roles=[roles.INPUT])


def test_masks_do_not_change_when_other_managers_are_added_or_reordered() -> None:
    pair = Pair(64, rngs=nnx.Rngs(0))
    x = ones(4, 64)
    alone = _pair_masks(pair, [_dropout()], x, key(3))
    assert set(alone) == {"/a.apply.input_", "/b.apply.input_"}
    others = lambda: [managers.GaussianNoise(0.3, bricks=[pair.a], roles=[roles.OUTPUT]),
                      managers.WeightNoise(0.1, roles=[roles.WEIGHT])]
    for chosen in ([_dropout(), *others()], [*others(), _dropout()],
                   [managers.GaussianNoise(0.3, roles=[roles.INPUT], priority=1), _dropout()]):
        masks = _pair_masks(pair, chosen, x, key(3))
        if any(isinstance(m, managers.GaussianNoise) and m.priority for m in chosen):
            # outer noise on the input: the mask is where the input became zero
            masks = {k: (v != 0) for k, v in masks.items()}
            expected = {k: (v != 0) for k, v in alone.items()}
        else:
            expected = alone
        assert set(masks) == set(expected)
        for name in expected:
            np.testing.assert_array_equal(masks[name], expected[name], err_msg=name)


def test_masks_are_the_same_for_a_copy_of_the_model_and_a_new_manager() -> None:
    pair = Pair(64, rngs=nnx.Rngs(0))
    x = ones(4, 64)
    first = _pair_masks(pair, [_dropout()], x, key(3))
    second = _pair_masks(nnx.clone(pair), [_dropout()], x, key(3))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), first, second))


def test_masks_differ_by_path_call_and_manager_name() -> None:
    pair = Pair(256, rngs=nnx.Rngs(0))
    x = ones(256)
    masks = _pair_masks(pair, [_dropout()], x, key(0))
    renamed = _pair_masks(
        pair, [managers.Dropout(0.5, bricks=[Scale], roles=[roles.INPUT], name="other")],
        x, key(0))
    a, b = masks["/a.apply.input_"], masks["/b.apply.input_"]
    assert not bool(jnp.all(a == b))  # two paths
    assert not bool(jnp.all(a == renamed["/a.apply.input_"]))  # another manager name

    program = gm.compile(lambda m, x: (m(x), m(x)), Identity(),
                         managers=[managers.Dropout(0.5, roles=[roles.INPUT])])
    (first, second), _ = program.train(program.init(x), x, rng=key(0))
    assert [r.call_id for r in program.rewrites.train] == [0, 1]
    assert not bool(jnp.all(first == second))  # two call ids


def test_different_keys_give_different_masks_and_the_same_key_the_same() -> None:
    program = _identity_program(managers.Dropout(0.5, roles=[roles.INPUT]))
    x = ones(256)
    variables = program.init(x)
    one, _ = program.train(variables, x, rng=key(0))
    again, _ = program.train(variables, x, rng=key(0))
    other, _ = program.train(variables, x, rng=key(1))
    np.testing.assert_array_equal(one, again)
    assert not bool(jnp.all(one == other))


# -- the same masks under every transformation ---------------------------------------------------

@pytest.fixture(scope="module")
def masked() -> tuple[gm.Program, dict, jax.Array]:
    """Dropout on the inputs of a Linear brick, masks monitored."""
    lin = gm.bricks.Linear(6, 3, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), lin,
                         managers=[managers.Dropout(0.5, roles=[roles.INPUT])],
                         monitor=watch(roles.INPUT))
    x = normal(1, 4, 6)
    return program, program.init(x), x


def test_same_key_same_masks_in_eager_mode(masked) -> None:
    program, variables, x = masked
    out, _, jitted = program.train(variables, x, rng=key(0))
    with jax.disable_jit():
        eager_out, _, eager = program.train(variables, x, rng=key(0))
    np.testing.assert_array_equal(eager["/.apply.input_"], jitted["/.apply.input_"])
    np.testing.assert_allclose(eager_out, out, rtol=1e-6, atol=1e-6)


def test_masks_inside_grad_equal_those_of_the_forward_pass(masked) -> None:
    program, variables, x = masked
    _, _, forward = program.train(variables, x, rng=key(0))

    def cost(variables: dict) -> tuple[jax.Array, dict]:
        out, _, monitored = program.train(variables, x, rng=key(0))
        return out.sum(), monitored

    grads, inside = jax.grad(cost, has_aux=True)(variables)
    dropped = forward["/.apply.input_"]
    np.testing.assert_array_equal(inside["/.apply.input_"], dropped)
    # d cost / d W = sum over the batch of the dropped inputs
    np.testing.assert_allclose(grads["model"]["W"],
                               jnp.broadcast_to(dropped.sum(0)[:, None], (6, 3)), rtol=1e-6)


def test_vmap_over_inputs_with_one_key_gives_the_masks_of_single_calls(masked) -> None:
    program, variables, x = masked
    xs = jnp.stack([x, 2 * x, x - 1])
    outs, _, monitored = jax.vmap(lambda x: program.train(variables, x, rng=key(0)))(xs)
    for i in range(3):
        out, _, single = program.train(variables, xs[i], rng=key(0))
        np.testing.assert_array_equal(monitored["/.apply.input_"][i], single["/.apply.input_"])
        np.testing.assert_allclose(outs[i], out, rtol=1e-6)


def test_lax_scan_over_steps_gives_the_masks_of_single_calls(masked) -> None:
    program, variables, x = masked
    keys = jax.random.split(key(0), 3)

    def body(carry: None, k: jax.Array) -> tuple[None, jax.Array]:
        return carry, program.train(variables, x, rng=k)[2]["/.apply.input_"]

    _, scanned = jax.lax.scan(body, None, keys)
    for i in range(3):
        _, _, single = program.train(variables, x, rng=keys[i])
        np.testing.assert_array_equal(scanned[i], single["/.apply.input_"])
    assert not bool(jnp.all(scanned[0] == scanned[1]))


# -- inference ---------------------------------------------------------------------------------------

def test_inference_is_the_plain_eager_model() -> None:
    mlp = gm.bricks.MLP([5, 8, 3], activation=jax.nn.tanh, rngs=nnx.Rngs(0))
    with managers.Dropout(0.5, bricks=mlp.linear_layers, roles=[roles.INPUT, roles.OUTPUT]), \
            managers.Dropout(0.3, roles=[roles.WEIGHT], name="weight_dropout"):
        program = gm.compile(apply_model, mlp)
    x = normal(1, 4, 5)
    variables = program.init(x)
    trained, _ = program.train(variables, x, rng=key(0))
    assert not bool(jnp.allclose(trained, mlp(x)))  # the managers do act in training
    np.testing.assert_array_equal(program.infer(variables, x), mlp(x))
    assert list(program.rewrites.infer) == []


# -- broadcast_dims -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [(1,), (-2,), (0, 2)])
def test_broadcast_dims_share_one_mask_value_along_the_axes(dims: tuple[int, ...]) -> None:
    program = _identity_program(managers.Dropout(0.5, roles=[roles.INPUT],
                                                 broadcast_dims=dims))
    x = ones(32, 32, 32)
    out, _ = program.train(program.init(x), x, rng=key(0))
    axes = tuple(d % 3 for d in dims)
    first = out[tuple(slice(0, 1) if a in axes else slice(None) for a in range(3))]
    np.testing.assert_array_equal(out, jnp.broadcast_to(first, out.shape))
    assert 0.2 < float(jnp.mean(first == 0)) < 0.8  # the mask still varies elsewhere


def test_broadcast_dims_out_of_range_raise_naming_the_argument() -> None:
    program = _identity_program(managers.Dropout(0.5, roles=[roles.INPUT], broadcast_dims=(3,)))
    with pytest.raises(ValueError, match="broadcast_dims"):
        program.init(ones(2, 3))


# -- dynamic rate --------------------------------------------------------------------------------------

def test_dynamic_rate_is_a_float32_scalar_changed_without_retrace() -> None:
    dropout = managers.Dropout(gm.dynamic(0.5), roles=[roles.INPUT])
    fn = Counted(apply_model)
    program = gm.compile(fn, Identity(), managers=[dropout])
    x = ones(100, 100)
    variables = program.init(x)
    rate = variables["managers"]["dropout"]["hparams"]["rate"]
    assert (rate.shape, rate.dtype, rate.weak_type) == ((), jnp.float32, False)
    assert float(rate) == 0.5
    out, variables = program.train(variables, x, rng=key(0))
    traces = fn.count
    assert abs(float(jnp.mean(out == 0)) - 0.5) < 0.03

    handle = dropout.hparam("rate")
    for new in (0.1, 0.9):
        changed = handle.set(variables, new)
        stored = changed["managers"]["dropout"]["hparams"]["rate"]
        assert (stored.dtype, stored.weak_type) == (jnp.float32, False)
        out, _ = program.train(changed, x, rng=key(0))
        assert abs(float(jnp.mean(out == 0)) - new) < 0.03
        np.testing.assert_allclose(np.unique(np.asarray(out[out != 0])), [1 / (1 - new)],
                                   rtol=1e-5)
    assert fn.count == traces
    assert program._train._cache_size() == 1


def test_a_constant_rate_is_not_stored_and_has_no_handle() -> None:
    dropout = managers.Dropout(0.5, roles=[roles.INPUT])
    program = _identity_program(dropout)
    variables = program.init(ones(3))
    assert variables["managers"]["dropout"]["hparams"] == {}
    with pytest.raises(ValueError, match="dynamic"):
        dropout.hparam("rate")


# -- bad arguments --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", [1.5, -0.1, float("nan"), "0.5", gm.dynamic(2.0)])
def test_a_bad_rate_raises_naming_the_argument(rate) -> None:
    with pytest.raises(ValueError, match=r"Dropout\(rate="):
        managers.Dropout(rate)


def test_rewrites_record_each_dropout() -> None:
    pair = Pair(4, rngs=nnx.Rngs(0))
    program = gm.compile(apply_model, pair, managers=[_dropout()])
    program.init(ones(4))
    assert rewritten_by(program, "init") == [("dropout", "/a", 0, "input_"),
                                              ("dropout", "/b", 0, "input_")]
