"""EMA: the average of each step's parameters, read by inference, moved once per step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from examples.flax_nnx.scan_over_layers import ScanMLP
from graphmod import roles


def _linear(dtype: jnp.dtype = jnp.float32) -> nnx.Linear:
    return nnx.Linear(3, 2, param_dtype=dtype, rngs=nnx.Rngs(0))


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)


def _cost(model: nnx.Linear, x: jax.Array, y: jax.Array) -> jax.Array:
    return ((model(x) - y) ** 2).mean()


def test_the_average_follows_each_steps_parameters_and_inference_reads_it() -> None:
    x, y = _data()
    program = gm.compile(_cost, _linear(), managers=[managers.EMA(0.8)])
    step = gm.optimize(program, optax.sgd(0.3))
    state = step.init(program.init(x, y), jax.random.key(0))
    # Before any step inference reads the parameters themselves.
    np.testing.assert_allclose(program.infer(state.variables, x, y),
                               _cost(_updated(state.variables), x, y), rtol=1e-6)
    total, weight = jax.tree.map(np.zeros_like, state.variables["model"]), 0.0
    for _ in range(4):
        read = jax.tree.map(np.asarray, state.variables["model"])  # what the step reads
        state, _ = step(state, x, y)
        total = jax.tree.map(lambda a, w: 0.8 * a + 0.2 * w, total, read)
        weight = 0.8 * weight + 0.2
    expected = jax.tree.map(lambda a: a / weight, total)
    averages = state.variables["managers"]["ema"]["/"]
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(averages[name]["average"], total[name], rtol=1e-6)
        np.testing.assert_allclose(averages[name]["weight"], weight, rtol=1e-6)
        assert not np.allclose(expected[name], state.variables["model"][name])  # it lags
    by_hand = ((x @ expected["kernel"] + expected["bias"] - y) ** 2).mean()
    np.testing.assert_allclose(program.infer(state.variables, x, y), by_hand, rtol=1e-5)
    assert {(r.manager, r.name) for r in program.rewrites["infer"]} == {
        ("ema", "kernel"), ("ema", "bias")}
    trained, _ = program.train(state.variables, x, y, rng=jax.random.key(1))
    np.testing.assert_allclose(trained, _cost(_updated(state.variables), x, y), rtol=1e-6)


def _updated(variables: dict) -> nnx.Linear:
    """The model with the trained (not averaged) parameters."""
    model = _linear()
    nnx.update(model, nnx.State({k: nnx.Param(v) for k, v in variables["model"].items()}))
    return model


def test_merge_gives_a_program_without_it_the_averages_and_the_model_too() -> None:
    x, y = _data()
    model, ema = _linear(), managers.EMA(0.8)
    program = gm.compile(_cost, model, managers=[ema, managers.Dropout(0.2)])
    step = gm.optimize(program, optax.sgd(0.3))
    state = step.init(program.init(x, y), jax.random.key(0))
    before = ema.merge(state.variables)  # no step yet: the parameters themselves
    jax.tree.map(np.testing.assert_array_equal, before["model"], state.variables["model"])
    for _ in range(3):
        state, _ = step(state, x, y)
    merged = ema.merge(state.variables)
    assert sorted(merged["managers"]) == ["dropout"]
    plain = gm.compile(_cost, model, managers=[managers.Dropout(0.2)])
    np.testing.assert_allclose(plain.infer(merged, x, y), program.infer(state.variables, x, y),
                               rtol=1e-6)
    plain.update_model(merged)  # the averages into the nnx model, for eager use
    np.testing.assert_allclose(_cost(model, x, y), program.infer(state.variables, x, y),
                               rtol=1e-5)
    with pytest.raises(gm.errors.VariablesMismatch, match=r"EMA 'ema'\.merge: these "
                                                          r"variables hold no entries of it"):
        ema.merge(merged)


def test_with_lora_it_comes_first_and_inference_keeps_the_adapters() -> None:
    x, y = _data()
    ema, lora = managers.EMA(0.5), managers.LoRA(1, bricks=[nnx.Linear])
    program = gm.compile(_cost, _linear(), managers=[ema, lora])
    step = gm.optimize(program, optax.adam(0.1), trainable=[lora])
    state = step.init(program.init(x, y), jax.random.key(0))
    for _ in range(3):
        state, _ = step(state, x, y)
    merged = lora.merge(ema.merge(state.variables))  # the averages, then the adapters
    assert not np.allclose(merged["model"]["kernel"], state.variables["model"]["kernel"])
    np.testing.assert_allclose(program.infer(state.variables, x, y),
                               gm.compile(_cost, _linear()).infer(merged, x, y), rtol=1e-6)
    # Listed after LoRA, EMA still goes first: it declares runs_before "parameter_rewrite".
    late_lora = managers.LoRA(1, bricks=[nnx.Linear])
    late = gm.compile(_cost, _linear(), managers=[late_lora, managers.EMA(0.5)])
    assert [m.name for m in late.managers] == ["ema", "lora"]
    late_step = gm.optimize(late, optax.adam(0.1), trainable=[late_lora])
    late_state = late_step.init(late.init(x, y), jax.random.key(0))
    for _ in range(3):
        late_state, _ = late_step(late_state, x, y)
    np.testing.assert_array_equal(late.infer(late_state.variables, x, y),
                                  program.infer(state.variables, x, y))
    assert "moved: ema before lora (EMA.runs_before 'parameter_rewrite')" in str(
        late.rewrites.train)

    class Shift(gm.Manager):  # a parameter rewrite that does not declare its kind
        def rewrite_parameter(self, call, name, value):
            return value + 1.0

    undeclared = gm.compile(_cost, _linear(), managers=[Shift(roles=[roles.WEIGHT]),
                                                        managers.EMA(0.5)])
    with pytest.raises(gm.errors.ManagerConflict, match=r"parameter /\.kernel reaches it "
                       r"already rewritten.*declare kinds = \('parameter_rewrite',\)"):
        undeclared.init(x, y)  # else inference would read the average without the shift


def test_a_parameter_read_by_several_calls_or_loop_steps_moves_once_per_step() -> None:
    x, y = _data()

    def twice(model: nnx.Linear, x: jax.Array, y: jax.Array) -> jax.Array:
        return _cost(model, x, y) + _cost(model, 2 * x, y)

    def scanned(model: nnx.Linear, x: jax.Array, y: jax.Array) -> jax.Array:
        return gm.scan(lambda total, xi: (total + _cost(model, xi, y), None), 0.0,
                       jnp.stack([x, 2 * x, 3 * x]))[0]

    for fn in (_cost, twice, scanned):
        program = gm.compile(fn, _linear(), managers=[managers.EMA(0.5)])
        variables = program.init(x, y)
        _, new = program.train(variables, x, y, rng=jax.random.key(0))
        for name in ("kernel", "bias"):  # 0.5 * 0 + 0.5 * w, not 0.75 * w
            ema = new["managers"]["ema"]["/"][name]
            np.testing.assert_allclose(ema["average"], 0.5 * variables["model"][name],
                                       rtol=1e-6, err_msg=fn.__name__)
            np.testing.assert_allclose(ema["weight"], 0.5, err_msg=fn.__name__)


def test_layers_scanned_by_nnx_scan_each_get_their_own_average() -> None:
    model = ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), model, managers=[
        managers.EMA(0.5, bricks=[nnx.Linear], roles=[roles.WEIGHT])])
    variables = program.init(x)
    _, new = program.train(variables, x, rng=jax.random.key(0))
    ema = new["managers"]["ema"]["/layers/linear"]["kernel"]
    np.testing.assert_allclose(ema["average"], 0.5 * variables["model"]["layers"]["linear"][
        "kernel"], rtol=1e-6)  # (3, 4, 4): one average per layer
    np.testing.assert_allclose(ema["weight"], [0.5] * 3)
    # merge puts each layer's average in its place (a weight per layer, not per feature)
    merged = program.managers[0].merge(new)
    np.testing.assert_allclose(merged["model"]["layers"]["linear"]["kernel"],
                               variables["model"]["layers"]["linear"]["kernel"], rtol=1e-6)
    plain = gm.compile(lambda m, x: (m(x) ** 2).mean(), model)
    np.testing.assert_allclose(plain.infer(merged, x), program.infer(new, x), rtol=1e-6)


def test_bfloat16_parameters_are_averaged_in_float32_and_read_in_bfloat16() -> None:
    x, y = _data()
    program = gm.compile(lambda m, x, y: _cost(m, x, y).astype(jnp.float32),
                         _linear(jnp.bfloat16), managers=[managers.EMA(0.99)])
    variables = program.init(x, y)
    assert variables["managers"]["ema"]["/"]["kernel"]["average"].dtype == jnp.float32
    program.infer(variables, x, y)
    assert {r.dtype_out for r in program.rewrites["infer"]} == {"bfloat16"}


def test_a_dynamic_decay_is_a_variable_and_bad_decays_are_refused() -> None:
    x, y = _data()
    program = gm.compile(_cost, _linear(), managers=[managers.EMA(gm.dynamic(0.9))])
    variables = program.init(x, y)
    assert float(variables["managers"]["ema"]["hparams"]["decay"]) == pytest.approx(0.9)
    for decay in (1.0, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match=r"EMA\(decay=.*\): must be a float in \[0, 1\)"):
            managers.EMA(decay)
    assert managers.EMA(manager_name="slow").name == "slow"
