"""LayerFreezing: frozen layers keep their parameters and optimizer state bitwise, freezing
more retraces nothing, and the FreezeLayers plugin freezes a resumed run at the same steps."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import plugins
from graphmod.data import ArraySource


def _mlp() -> gm.bricks.MLP:
    return gm.bricks.MLP([3, 6, 6, 1], activation=jnp.tanh, rngs=nnx.Rngs(0))


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 1)).astype(
        np.float32)


def _cost(model: gm.bricks.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return ((model(x) - y) ** 2).mean()


def _layer(tree: dict, i: int) -> dict:
    return tree["model"]["linear_layers"][i]


def test_frozen_layers_keep_parameters_and_adam_state_bitwise_without_retrace() -> None:
    x, y = _data()
    traces = []
    model = _mlp()
    freezing = managers.LayerFreezing(model.linear_layers)
    program = gm.compile(lambda m, x, y: traces.append(1) or _cost(m, x, y), model,
                         managers=[freezing])
    step = gm.optimize(program, optax.adam(0.05))
    state = step.init(program.init(x, y), jax.random.key(0))
    for _ in range(2):
        state, _ = step(state, x, y)
    counted = len(traces)
    state = state._replace(variables=freezing.hparam("frozen").set(state.variables, 2))
    frozen = jax.tree.map(np.array, state)  # host copies: the step donates the state
    for _ in range(3):
        state, _ = step(state, x, y)
    assert len(traces) == counted  # freezing retraced nothing
    adam, adam_then = state.opt_state[0], frozen.opt_state[0]
    for i in (0, 1):  # the first two layers: values and moments as at the freeze
        for tree, then in ((state.variables, frozen.variables), (adam.mu, adam_then.mu),
                           (adam.nu, adam_then.nu)):
            jax.tree.map(np.testing.assert_array_equal, _layer(tree, i), _layer(then, i))
    assert not np.array_equal(_layer(state.variables, 2)["W"], _layer(frozen.variables, 2)["W"])
    assert not np.array_equal(_layer(adam.mu, 2)["W"], _layer(adam_then.mu, 2)["W"])
    # No gradient reaches a frozen layer (the stop_gradient), the last still learns.
    params, rest = program.split(state.variables, gm.roles.PARAMETER)
    grads = jax.grad(lambda p: program.train(program.merge(p, rest), x, y,
                                             rng=jax.random.key(0))[0])(params)
    assert not np.any(_layer(grads, 0)["W"]) and np.any(_layer(grads, 2)["W"])


def _run(directory: pathlib.Path, steps: int, resume: bool = False) -> tuple[object, list]:
    x, y = _data()
    model = _mlp()
    freezing = managers.LayerFreezing(model.linear_layers)
    program = gm.compile(_cost, model, managers=[freezing])
    step = gm.optimize(program, optax.adam(0.05))
    freeze = plugins.FreezeLayers(freezing, every=gm.On("step", step=gm.each(2)))
    chosen = [freeze, plugins.Checkpoint(directory, every=gm.On("step", step=gm.at(3)))]
    source = ArraySource((x, y), batch_size=8)
    if resume:
        state = gm.Loop.resume(str(directory), step, source, plugins=chosen, steps=steps)
    else:
        state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        loop = gm.Loop(step, source, steps=steps, plugins=chosen)
        state = loop.run(state)
        rows = [d.step for d in loop.trace if d.plugin == "freeze_layers.freeze"]
        assert rows == [t for t in (2, 4) if t <= steps]  # what was frozen when: traced
    return state, freeze.history


def test_a_resumed_run_freezes_at_the_same_steps(tmp_path: pathlib.Path) -> None:
    full, history = _run(tmp_path / "full", 5)
    assert history == [{"step": 2, "frozen": 1}, {"step": 4, "frozen": 2}]
    _run(tmp_path / "cut", 3)  # saved at step 3, one layer frozen
    resumed, resumed_history = _run(tmp_path / "cut", 5, resume=True)
    assert resumed_history == history  # the checkpoint's step 2, then its own step 4
    jax.tree.map(np.testing.assert_array_equal, resumed.variables, full.variables)


def test_bad_layers_are_refused_naming_the_fix() -> None:
    model = _mlp()
    with pytest.raises(TypeError, match=r"the layers themselves \(brick instances\)"):
        managers.LayerFreezing([gm.bricks.Linear])
    with pytest.raises(ValueError, match=r"frozen=4\): must be a number of layers from 0 to 3"):
        managers.LayerFreezing(model.linear_layers, frozen=4)
    with pytest.raises(TypeError, match=r"FreezeLayers\(freezing\): expected a "
                       r"managers.LayerFreezing"):
        plugins.FreezeLayers(managers.Dropout(0.1, roles=[gm.roles.INPUT]))
