"""Managers inside ``graphmod.scan`` bodies: the recurrent bricks' per-step application.

DESIGN: "Managers apply inside graphmod.scan bodies (recurrent brick) with per-step or
shared masks; batch-norm statistics and monitored values come out of the scan."
"""

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
from graphmod.bricks import LSTM, SimpleRecurrent
from tests.conftest import has_random, primitives

BATCH, TIME, FEATURES, HIDDEN = 4, 6, 16, 5
TOL = dict(rtol=1e-5, atol=1e-5)


def make(kind: str) -> SimpleRecurrent | LSTM:
    brick = SimpleRecurrent if kind == "simple" else LSTM
    return brick(FEATURES, HIDDEN, rngs=nnx.Rngs(0))


def step_inputs(monitored: dict[str, jax.Array]) -> jax.Array:
    """The one monitored value: the step's ``input_`` as the step saw it, stacked in time."""
    (key,) = monitored
    assert key.endswith("step.input_"), key
    return monitored[key]


def step_input(brick: SimpleRecurrent | LSTM) -> gm.VariableFilter:
    return gm.VariableFilter(bricks=[brick], applications=["step"], roles=[roles.INPUT],
                             name="input_")


def dropout_program(kind: str, **dropout: Any) -> tuple[gm.Program, dict]:
    brick = make(kind)
    with managers.Dropout(0.5, filter=step_input(brick), **dropout):
        program = gm.compile(lambda m, x: m(x), brick, monitor=step_input(brick))
    variables = program.init(jnp.ones((BATCH, TIME, FEATURES)))
    assert [r.name for r in program.rewrites["init"]] == ["input_"]  # not the state
    return program, variables


# -- dropout: per-step and shared masks ------------------------------------------------------
@pytest.mark.parametrize("kind", ["simple", "lstm"])
def test_dropout_draws_a_new_mask_at_every_step(kind: str) -> None:
    program, variables = dropout_program(kind)
    x = jnp.ones((BATCH, TIME, FEATURES))
    _, _, monitored = program.train(variables, x, rng=jax.random.key(0))
    seen = step_inputs(monitored)
    assert seen.shape == (TIME, BATCH, FEATURES)
    assert set(np.unique(np.asarray(seen)).tolist()) == {0.0, 2.0}  # inverted scaling
    masks = np.asarray(seen) != 0
    for t in range(1, TIME):
        assert not np.array_equal(masks[t], masks[0]), f"step {t} reused step 0's mask"


@pytest.mark.parametrize("kind", ["simple", "lstm"])
def test_dropout_per_step_false_shares_one_mask_across_steps(kind: str) -> None:
    program, variables = dropout_program(kind, per_step=False)
    x = jnp.ones((BATCH, TIME, FEATURES))
    _, _, monitored = program.train(variables, x, rng=jax.random.key(0))
    masks = np.asarray(step_inputs(monitored)) != 0
    assert 0 < masks[0].sum() < masks[0].size  # something was dropped, something kept
    for t in range(1, TIME):
        np.testing.assert_array_equal(masks[t], masks[0])
    # Another step key, another (shared) mask; the same key, the same mask.
    _, _, again = program.train(variables, x, rng=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(step_inputs(again)) != 0, masks)
    _, _, other = program.train(variables, x, rng=jax.random.key(1))
    assert not np.array_equal(np.asarray(step_inputs(other))[0] != 0, masks[0])


def test_the_dropped_inputs_are_what_the_recurrence_computes_with() -> None:
    # An identity recurrence (W = I, U = 0, b = 0, no activation) outputs its inputs, so
    # the train output is the dropped input of each step.
    rnn = SimpleRecurrent(FEATURES, FEATURES, activation=lambda h: h, rngs=nnx.Rngs(0))
    rnn.W[...] = jnp.eye(FEATURES)
    rnn.U[...] = jnp.zeros((FEATURES, FEATURES))
    with managers.Dropout(0.5, filter=step_input(rnn)):
        program = gm.compile(lambda m, x: m(x), rnn)
    x = jax.random.uniform(jax.random.key(3), (BATCH, TIME, FEATURES), minval=1.0, maxval=2.0)
    variables = program.init(x)
    out, _ = program.train(variables, x, rng=jax.random.key(0))
    kept = np.asarray(out) != 0
    np.testing.assert_allclose(np.asarray(out)[kept], 2.0 * np.asarray(x)[kept], rtol=1e-6)
    assert not np.array_equal(kept[:, 0], kept[:, 1])  # batch-major output, per-step masks
    np.testing.assert_allclose(program.infer(variables, x), x, rtol=1e-6)  # no dropout


# -- batch norm: running statistics out of the scan -------------------------------------------
MOMENTUM, EPSILON = 0.8, 1e-5


def bn_program(**compile_kwargs: Any) -> tuple[SimpleRecurrent, gm.Program, jax.Array]:
    rnn = SimpleRecurrent(3, HIDDEN, rngs=nnx.Rngs(0))
    rnn.b[...] = jnp.linspace(-1.0, 1.0, HIDDEN)
    with managers.BatchNorm(momentum=MOMENTUM, epsilon=EPSILON, bricks=[rnn],
                            applications=["step"], roles=[roles.OUTPUT]):
        program = gm.compile(lambda m, x: m(x), rnn, **compile_kwargs)
    x = 1.0 + jax.random.normal(jax.random.key(0), (BATCH, TIME, 3))
    return rnn, program, x


def bn_loop(params: dict, x: jax.Array, mean: jax.Array, var: jax.Array, *,
            training: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The recurrence with batch norm on each step's output, by hand: (states, mean, var)."""
    h = jnp.zeros((x.shape[0], HIDDEN))
    states = []
    for t in range(x.shape[1]):
        pre = jnp.tanh(x[:, t] @ params["W"] + h @ params["U"] + params["b"])
        if training:
            use_mean, use_var = pre.mean(0), pre.var(0)  # biased variance
            mean = MOMENTUM * mean + (1 - MOMENTUM) * use_mean
            var = MOMENTUM * var + (1 - MOMENTUM) * use_var
        else:
            use_mean, use_var = mean, var
        h = (pre - use_mean) / jnp.sqrt(use_var + EPSILON)  # scale 1, shift 0 at init
        states.append(h)
    return jnp.stack(states, axis=1), mean, var


def test_batch_norm_updates_running_statistics_once_per_step_in_call_order() -> None:
    _, program, x = bn_program()
    variables = program.init(x)
    stats = variables["managers"]["batch_norm"]["/"]["step"]
    assert sorted(stats) == ["new_state.bias", "new_state.mean", "new_state.scale",
                             "new_state.var"]
    np.testing.assert_array_equal(stats["new_state.mean"], jnp.zeros(HIDDEN))
    np.testing.assert_array_equal(stats["new_state.var"], jnp.ones(HIDDEN))

    out, new = program.train(variables, x, rng=jax.random.key(0))
    states, mean, var = bn_loop(variables["model"], x, jnp.zeros(HIDDEN), jnp.ones(HIDDEN),
                                training=True)
    updated = new["managers"]["batch_norm"]["/"]["step"]
    np.testing.assert_allclose(out, states, **TOL)
    np.testing.assert_allclose(updated["new_state.mean"], mean, **TOL)
    np.testing.assert_allclose(updated["new_state.var"], var, **TOL)
    # Not one update (of the last step), nor TIME updates with one step's statistics.
    _, one_mean, _ = bn_loop(variables["model"], x[:, :1], jnp.zeros(HIDDEN),
                             jnp.ones(HIDDEN), training=True)
    assert not np.allclose(updated["new_state.mean"], one_mean, atol=1e-3)
    # The parameters of the model and of batch norm are not state: unchanged.
    jax.tree.map(np.testing.assert_array_equal, new["model"], variables["model"])
    np.testing.assert_array_equal(updated["new_state.scale"], stats["new_state.scale"])
    # A second step continues from the first step's statistics.
    _, newer = program.train(new, x, rng=jax.random.key(1))
    _, mean2, var2 = bn_loop(variables["model"], x, mean, var, training=True)
    np.testing.assert_allclose(newer["managers"]["batch_norm"]["/"]["step"]["new_state.mean"],
                               mean2, **TOL)
    np.testing.assert_allclose(newer["managers"]["batch_norm"]["/"]["step"]["new_state.var"],
                               var2, **TOL)


def test_batch_norm_infers_with_the_running_statistics() -> None:
    _, program, x = bn_program()
    variables = program.init(x)
    _, trained = program.train(variables, x, rng=jax.random.key(0))
    stats = trained["managers"]["batch_norm"]["/"]["step"]
    expected, _, _ = bn_loop(variables["model"], x, stats["new_state.mean"],
                             stats["new_state.var"], training=False)
    np.testing.assert_allclose(program.infer(trained, x), expected, **TOL)


def test_gradients_flow_through_the_scan_to_model_and_batch_norm_parameters() -> None:
    _, program, x = bn_program()
    variables = program.init(x)

    def cost(variables: dict) -> jax.Array:
        out, _ = program.train(variables, x, rng=jax.random.key(0))
        return (out[:, -1] ** 2 * jnp.arange(1.0, HIDDEN + 1)).sum()

    grads = jax.grad(cost)(variables)
    expected = jax.grad(lambda p: (bn_loop(p, x, jnp.zeros(HIDDEN), jnp.ones(HIDDEN),
                                           training=True)[0][:, -1] ** 2
                                   * jnp.arange(1.0, HIDDEN + 1)).sum())(variables["model"])
    for name in ("W", "U", "b"):
        np.testing.assert_allclose(grads["model"][name], expected[name], rtol=1e-4, atol=1e-5)
    bn_grads = grads["managers"]["batch_norm"]["/"]["step"]
    assert float(jnp.abs(bn_grads["new_state.scale"]).sum()) > 0
    assert float(jnp.abs(bn_grads["new_state.bias"]).sum()) > 0


# -- monitored values: stacked along the scan ------------------------------------------------
def test_monitored_step_outputs_come_out_stacked_along_time() -> None:
    _, program, x = bn_program(monitor=gm.VariableFilter(applications=["step"],
                                                          roles=[roles.OUTPUT]))
    variables = program.init(x)
    out, _, monitored = program.train(variables, x, rng=jax.random.key(0))
    (key,) = monitored
    assert key.endswith("step.new_state")
    assert monitored[key].shape == (TIME, BATCH, HIDDEN)  # leading time axis
    # Outputs as the caller sees them: after batch norm, i.e. the states apply returns.
    np.testing.assert_allclose(monitored[key], jnp.swapaxes(out, 0, 1), rtol=1e-6)
    inferred, monitored_infer = program.infer(variables, x)
    np.testing.assert_allclose(monitored_infer[key], jnp.swapaxes(inferred, 0, 1), rtol=1e-6)


def test_lstm_monitors_both_step_outputs_and_the_initial_state_outside_the_scan() -> None:
    lstm = make("lstm")
    program = gm.compile(lambda m, x: m(x), lstm, monitor={
        "steps": gm.VariableFilter(applications=["step"], roles=[roles.OUTPUT]),
        "initial": gm.VariableFilter(roles=[roles.INITIAL_STATE]),
    })
    x = jax.random.normal(jax.random.key(0), (BATCH, TIME, FEATURES))
    variables = program.init(x)
    out, monitored = program.infer(variables, x)
    shapes = {key: value.shape for key, value in monitored.items()}
    steps = {k: s for k, s in shapes.items() if k.startswith("steps")}
    initial = {k: s for k, s in shapes.items() if k.startswith("initial")}
    assert sorted(k.rsplit(".", 1)[1] for k in steps) == ["new_cell", "new_state"]
    assert set(steps.values()) == {(TIME, BATCH, HIDDEN)}
    assert sorted(k.rsplit(".", 1)[1] for k in initial) == ["initial_cell", "initial_state"]
    assert set(initial.values()) == {(BATCH, HIDDEN)}  # outside the scan: no time axis
    (state_key,) = [k for k in steps if k.endswith("new_state")]
    np.testing.assert_allclose(monitored[state_key], jnp.swapaxes(out, 0, 1), rtol=1e-6)


# -- inference has no randomness ------------------------------------------------------------
def test_the_inference_trace_of_a_regularized_recurrent_model_has_no_random_ops() -> None:
    rnn = SimpleRecurrent(3, HIDDEN, rngs=nnx.Rngs(0))
    with managers.Dropout(0.5, filter=step_input(rnn)), \
            managers.WeightNoise(0.1, bricks=[rnn], roles=[roles.WEIGHT]), \
            managers.BatchNorm(bricks=[rnn], applications=["step"], roles=[roles.OUTPUT]):
        program = gm.compile(lambda m, x: m(x), rnn)
    x = jax.random.normal(jax.random.key(0), (BATCH, TIME, 3))
    variables = program.init(x)
    train = jax.make_jaxpr(lambda v, x: program.train(v, x, rng=jax.random.key(0)))(
        variables, x)
    infer = jax.make_jaxpr(lambda v, x: program.infer(v, x))(variables, x)
    assert "scan" in primitives(train) and "scan" in primitives(infer)
    assert has_random(train)  # the check can see random ops inside the scan body
    assert not has_random(infer), sorted(set(primitives(infer)))
