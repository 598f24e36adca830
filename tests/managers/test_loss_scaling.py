"""``managers.DynamicLossScale`` through ``graphmod.optimize(..., loss_scale=)``: float16
training of the digits MLP as good as float32, an overflow skipped and the scale halved,
growth after ``period`` finite steps, the scale in checkpoints, bad arguments named."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sklearn.datasets import load_digits

import graphmod as gm
import managers
from graphmod import On
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint

_DIGITS = load_digits()
_ORDER = np.random.default_rng(0).permutation(len(_DIGITS.target))  # a shuffled split
X = (_DIGITS.data[_ORDER] / 16.0).astype(np.float32)
Y = _DIGITS.target[_ORDER].astype(np.int32)
TRAIN, TEST = slice(0, 1437), slice(1437, None)


def cost(model: gm.bricks.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def trained(policy: list[gm.Manager], loss_scale: managers.DynamicLossScale | None,
            steps: int = 150) -> tuple[float, gm.TrainState]:
    """Test accuracy (percent) of the digits MLP after ``steps`` Adam steps on batches of
    128, all in one ``lax.scan`` dispatch."""
    mlp = gm.bricks.MLP([64, 64, 10], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    policy = [p(mlp) for p in policy]
    program = gm.compile(cost, mlp, managers=policy)
    step = gm.optimize(program, optax.adam(1e-2), loss_scale=loss_scale)
    state = step.init(program.init(X[:2], Y[:2]), jax.random.key(0))
    order = np.random.default_rng(0).permutation(1437)
    rows = np.resize(order, steps * 128).reshape(steps, 128)
    state, _ = step.steps(state, (X[TRAIN][rows], Y[TRAIN][rows]))
    logits = program.derive(lambda m, x: m(x)).infer(state.variables, X[TEST])
    return 100.0 * float(np.mean(np.argmax(logits, -1) == Y[TEST])), state


def test_float16_with_loss_scaling_trains_the_digits_mlp_as_well_as_float32() -> None:
    f32, _ = trained([], None)
    f16, state = trained(
        [lambda mlp: managers.MixedPrecision("float16", bricks=[mlp])],
        managers.DynamicLossScale())
    print(f"digits test accuracy: float32 {f32:.2f}%, float16 + loss scaling {f16:.2f}%, "
          f"final scale {float(state.loss_scale['scale'])}")
    assert f32 > 90.0
    assert abs(f16 - f32) <= 1.0
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(state.variables)} == {"float32"}
    assert state.loss_scale["scale"].dtype == jnp.float32


def small_step(scale: managers.DynamicLossScale, **kwargs: object
               ) -> tuple[gm.TrainStep, gm.TrainState]:
    lin = gm.bricks.Linear(64, 10, rngs=nnx.Rngs(0))
    program = gm.compile(cost, lin, managers=[managers.MixedPrecision("float16", bricks=[lin])])
    step = gm.optimize(program, optax.adam(1e-2), loss_scale=scale, **kwargs)
    return step, step.init(program.init(X[:2], Y[:2]), jax.random.key(0))


def test_an_overflowing_step_is_skipped_and_the_scale_halves_then_grows_back() -> None:
    step, state = small_step(managers.DynamicLossScale(2.0 ** 40, period=2),
                             skip_nonfinite=True)
    before = jax.tree.map(np.asarray, (state.variables, state.opt_state))
    state, metrics = step(state, X[:32], Y[:32])  # 2**40 overflows float16's 65504
    assert float(metrics["loss_scale/scale"]) == 2.0 ** 39
    assert int(metrics["loss_scale/good_steps"]) == 0
    assert int(state.step) == 1 and int(metrics["skipped_steps"]) == 0  # the scale's skip
    jax.tree.map(np.testing.assert_array_equal, (state.variables, state.opt_state), before)
    scales = [float(state.loss_scale["scale"])]
    for _ in range(40):  # halved at each overflow until a step is finite
        state, metrics = step(state, X[:32], Y[:32])
        scales.append(float(state.loss_scale["scale"]))
        if int(state.loss_scale["good_steps"]):
            break
    assert scales[:-1] == [2.0 ** (39 - k) for k in range(len(scales) - 1)]
    assert scales[-1] == scales[-2] and 1.0 <= scales[-1] < 2.0 ** 39  # a step applied
    assert np.isfinite(float(metrics["loss"]))
    assert not np.array_equal(state.variables["model"]["W"], before[0]["model"]["W"])
    state, metrics = step(state, X[:32], Y[:32])  # the second good step in a row: doubled
    assert float(state.loss_scale["scale"]) in (2 * scales[-1], scales[-1] / 2)
    if float(state.loss_scale["scale"]) == 2 * scales[-1]:
        assert int(state.loss_scale["good_steps"]) == 0


def test_the_scale_survives_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one(
        tmp_path: pathlib.Path) -> None:
    def data() -> ArraySource:
        return ArraySource({"x": X[:96], "y": Y[:96]}, 16, shuffle=True, seed=1)

    step, state = small_step(managers.DynamicLossScale(2.0 ** 18, period=3))
    whole = gm.Loop(step, data(), steps=6).run(state)
    step, state = small_step(managers.DynamicLossScale(2.0 ** 18, period=3))
    loop = gm.Loop(step, data(), steps=6,
                   plugins=[Checkpoint(tmp_path, every=On("step"), keep=None)])
    loop.on(On("step", step=gm.at(3)), lambda e: e.loop.terminate())
    stopped = loop.run(state)
    assert int(stopped.step) == 3 and float(stopped.loss_scale["scale"]) < 2.0 ** 18
    step, _ = small_step(managers.DynamicLossScale(2.0 ** 18, period=3))
    resumed = gm.Loop.resume(tmp_path, step, data(), steps=6,
                             plugins=[Checkpoint(tmp_path, every=On("step"), keep=None)])
    assert int(resumed.step) == 6
    jax.tree.map(np.testing.assert_array_equal, resumed.loss_scale, whole.loss_scale)
    jax.tree.map(np.testing.assert_array_equal, resumed.variables, whole.variables)


def test_a_state_without_a_loss_scale_has_no_leaf_for_it() -> None:
    lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), lin)
    state = gm.optimize(program, optax.adam(0.1)).init(program.init(jnp.ones((1, 2))),
                                                       jax.random.key(0))
    fields = {jax.tree_util.keystr(path[:1]) for path, _ in
              jax.tree_util.tree_flatten_with_path(state)[0]}
    assert state.loss_scale is None and state.skipped is None  # nor a skipped count
    assert fields == {".opt_state", ".variables", ".step", ".rng"}


def test_bad_loss_scales_name_the_argument() -> None:
    for kwargs, match in [({"period": 0}, r"DynamicLossScale\(period=0\)"),
                          ({"initial": -1.0}, r"DynamicLossScale\(initial=-1.0\)"),
                          ({"initial": 2.0 ** 130}, r"below 2\*\*127"),
                          ({"factor": 1.0}, r"DynamicLossScale\(factor=1.0\)")]:
        with pytest.raises(ValueError, match=match):
            managers.DynamicLossScale(**kwargs)
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
                         gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"optimize\(loss_scale=\.\.\.\): expected a loss scale"):
        gm.optimize(program, optax.sgd(0.1), loss_scale=2.0 ** 15)
    x = jnp.ones((2, 2))
    plain = gm.optimize(program, optax.sgd(0.1)).init(program.init(x), jax.random.key(0))
    scaled = gm.optimize(program, optax.sgd(0.1), loss_scale=managers.DynamicLossScale())
    with pytest.raises(ValueError, match=r"this train state has no loss scale"):
        scaled(plain, x)
