"""optimize: a jitted, donating train step that gives optax exactly the PARAMETER leaves."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles


def _setup(**kwargs: object) -> tuple[gm.Program, dict, jax.Array, jax.Array]:
    mlp = gm.bricks.MLP([4, 6, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    bn = managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT])

    def cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> tuple[jax.Array, dict]:
        loss = ((model(x) - y) ** 2).mean()
        return loss, {"scale": jnp.abs(y).mean()}

    program = gm.compile(cost, mlp, managers=[bn])
    x = jax.random.normal(jax.random.key(0), (8, 4))
    y = jax.random.normal(jax.random.key(1), (8, 2))
    return program, program.init(x, y), x, y


def test_optax_sees_exactly_the_parameter_leaves_in_their_nesting() -> None:
    program, variables, x, y = _setup()
    seen = {}

    def record(updates: dict, state: object, params: dict | None = None) -> tuple:
        seen["tree"] = jax.tree.structure(params)
        return updates, state

    tx = optax.chain(optax.GradientTransformation(lambda p: optax.EmptyState(), record),
                     optax.sgd(0.1))
    step = gm.optimize(program, tx)
    state = step.init(variables, jax.random.key(0))
    state, metrics = step(state, x, y)
    params, _ = program.split(variables, roles.PARAMETER)
    assert seen["tree"] == jax.tree.structure(params)
    assert sorted(metrics) == ["loss", "scale"]
    # Running statistics changed as state, not through the optimizer.
    bn = state.variables["managers"]["batch_norm"]["/linear_layers/0"]["apply"]
    assert not np.allclose(bn["output.mean"], 0.0)


def test_steps_are_deterministic_and_match_a_manual_gradient_step() -> None:
    program, variables, x, y = _setup()
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(variables, jax.random.key(0))
    state, _metrics = step(state, x, y)
    key = jax.random.fold_in(jax.random.key(0), 0)
    params, rest = program.split(variables, roles.PARAMETER)

    def loss(p: dict) -> jax.Array:
        return program.train(program.merge(p, rest), x, y, rng=key)[0][0]

    grads = jax.grad(loss)(params)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    got, _ = program.split(state.variables, roles.PARAMETER)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got,
                 expected)
    assert int(state.step) == 1


def test_a_train_step_written_by_hand_as_the_docs_show_makes_optimizes_steps() -> None:
    mlp = gm.bricks.MLP([4, 6, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(lambda model, x, y: ((model(x) - y) ** 2).mean(), mlp, managers=[
        managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT]),
        managers.Dropout(0.3, roles=[roles.INPUT])])
    x, y = jax.random.normal(jax.random.key(0), (8, 4)), jax.random.normal(jax.random.key(1),
                                                                           (8, 2))
    variables, tx = program.init(x, y), optax.adam(0.01)
    params, rest = program.split(variables)
    opt_state = tx.init(params)

    @jax.jit  # docs/concepts/compile.md, "Your own train step"
    def train_step(params, rest, opt_state, key, x, y):
        def loss(params):
            return program.train(program.merge(params, rest), x, y, rng=key)
        (cost, new), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        _, rest = program.split(new)
        return optax.apply_updates(params, updates), rest, opt_state, cost

    step = gm.optimize(program, tx)
    state = step.init(variables, jax.random.key(7))
    for i in range(3):
        state, metrics = step(state, x, y)
        params, rest, opt_state, cost = train_step(
            params, rest, opt_state, jax.random.fold_in(jax.random.key(7), i), x, y)
        np.testing.assert_allclose(cost, metrics["loss"], rtol=1e-5)
    by_hand = program.merge(params, rest)
    assert jax.tree.structure(by_hand) == jax.tree.structure(state.variables)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 by_hand, state.variables)
    mean = by_hand["managers"]["batch_norm"]["/linear_layers/0"]["apply"]["output.mean"]
    assert not np.allclose(mean, 0.0)  # the running statistics moved, in both


def test_optax_multisteps_accumulates_the_gradients_of_its_steps() -> None:
    program, variables, x, y = _setup()
    one = gm.optimize(program, optax.sgd(0.1))
    expected, _ = one(one.init(variables, jax.random.key(0)), x, y)
    step = gm.optimize(program, optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
    state = step.init(variables, jax.random.key(0))
    first, _ = program.split(variables)
    state, _ = step(state, x, y)
    jax.tree.map(np.testing.assert_array_equal, program.split(state.variables)[0], first)
    state, _ = step(state, x, y)  # the same batch twice: the mean gradient is the gradient
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 program.split(state.variables)[0], program.split(expected.variables)[0])


def test_reduce_on_plateau_reads_each_steps_cost() -> None:
    program, variables, x, y = _setup()
    step = gm.optimize(program, optax.chain(
        optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1, accumulation_size=1)))
    state = step.init(variables, jax.random.key(0))
    state, metrics = step(state, x, y)
    plateau = state.opt_state[1]
    np.testing.assert_allclose(plateau.best_value, metrics["loss"], rtol=1e-6)


def test_lbfgs_with_its_line_search_solves_a_least_squares_problem() -> None:
    lin = gm.bricks.Linear(3, 1, use_bias=False, rngs=nnx.Rngs(0))
    program = gm.compile(lambda model, x, y: ((model(x) - y) ** 2).mean(), lin)
    x = jax.random.normal(jax.random.key(0), (32, 3))
    w = jnp.array([[1.5], [-2.0], [0.5]])
    step = gm.optimize(program, optax.lbfgs())
    state = step.init(program.init(x, x @ w), jax.random.key(0))
    for _ in range(20):
        state, metrics = step(state, x, x @ w)  # the parameters are also in L-BFGS's state
    np.testing.assert_allclose(state.variables["model"]["W"], w, atol=1e-4)
    assert float(metrics["loss"]) < 1e-8


def test_a_schedule_free_optimizer_is_evaluated_at_its_evaluation_point() -> None:
    program, variables, x, y = _setup()
    lora = managers.LoRA(2, roles=[roles.WEIGHT])  # frozen model, trained adapters
    adapted = gm.compile(program.fn, program.model, managers=[*program.managers, lora])
    cases = [(program, variables, None), (adapted, adapted.init(x, y), [lora])]
    for compiled, start, trainable in cases:
        step = gm.optimize(compiled, optax.contrib.schedule_free_adamw(1e-2),
                           trainable=trainable)
        state = step.init(start, jax.random.key(0))
        for _ in range(4):
            state, _ = step(state, x, y)
        trained, rest = step._parameters(state.variables)
        expected = compiled.merge(optax.contrib.schedule_free_eval_params(
            state.opt_state, trained), rest)
        chex.assert_trees_all_close(state.evaluation_variables, expected, rtol=1e-6)
        moved = [not np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(state.evaluation_variables), jax.tree.leaves(state.variables),
            strict=True)]
        assert sum(moved) == len(jax.tree.leaves(trained))  # the trained ones, only
    plain = gm.optimize(program, optax.adam(1e-2)).init(variables, jax.random.key(0))
    assert plain.evaluation_variables is plain.variables
    # Validation evaluates there
    predict = program.derive(lambda m, x: m(x))
    mse = lambda out, batch: ((out - batch[1]) ** 2).mean(-1)
    valid = gm.plugins.Validation(predict, gm.data.ArraySource((x, y), 8),
                                  metrics={"mse": mse})
    step = gm.optimize(program, optax.contrib.schedule_free_adamw(1e-2))
    state = gm.Loop(step, gm.data.ArraySource((x, y), 4), epochs=2, plugins=[valid]).run(
        step.init(variables, jax.random.key(0)))
    at = lambda v: float(((predict.infer(v, x) - y) ** 2).mean())
    assert valid.history[-1][1]["valid/mse"] == pytest.approx(at(
        state.evaluation_variables), rel=1e-5)
    assert at(state.evaluation_variables) != at(state.variables)


def test_skip_nonfinite_leaves_the_state_unchanged_and_counts() -> None:
    program, variables, x, y = _setup()
    step = gm.optimize(program, optax.sgd(0.1), skip_nonfinite=True)
    state = step.init(variables, jax.random.key(0))
    state, metrics = step(state, x, y)
    assert int(metrics["skipped_steps"]) == 0
    before = jax.tree.map(np.asarray, state.variables)
    state, metrics = step(state, x, y.at[0, 0].set(jnp.nan))
    assert int(metrics["skipped_steps"]) == 1 and not np.isfinite(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, state.variables, before)
    assert int(state.step) == 2


def test_optimize_rejects_what_is_not_a_program_or_an_optimizer() -> None:
    program, *_ = _setup()
    with pytest.raises(TypeError, match="expected a graphmod Program"):
        gm.optimize(lambda: None, optax.sgd(0.1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optax GradientTransformation"):
        gm.optimize(program, 0.1)  # type: ignore[arg-type]


def test_the_step_traces_once_per_signature() -> None:
    program, variables, x, y = _setup()
    step = gm.optimize(program, optax.adam(1e-3))
    state = step.init(variables, jax.random.key(0))
    for _ in range(3):
        state, _ = step(state, x, y)
    assert step._step._cache_size() == 1


def test_the_state_passes_its_optimizer_state_first_and_keeps_its_fields() -> None:
    # XLA:CPU schedules small steps by their parameters' order (benchmarks/manager_costs.py):
    # the step's parameters list the optimizer state first; the fields stay as documented.
    program, variables, x, y = _setup()
    step = gm.optimize(program, optax.adam(1e-3))
    state, _ = step(step.init(variables, jax.random.key(0)), x, y)
    tops = [path[0].name for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert tops[0] == "opt_state" and tops[-2:] == ["step", "rng"]  # no skipped count
    assert tops.index("variables") > tops.index("opt_state")
    assert gm.TrainState._fields == ("variables", "opt_state", "step", "rng", "skipped",
                                     "loss_scale")  # None without optimize(loss_scale=)
    assert state[0] is state.variables and int(state.step) == 1
    again = jax.tree.map(lambda v: v, state)
    assert isinstance(again, gm.TrainState)
    assert again._replace(step=jnp.int32(5)).variables is again.variables
    lowered = step._step.lower(state, x, y).as_text()
    assert lowered.index("opt_state") < lowered.index("variables")
