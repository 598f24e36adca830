"""Variables are checked against the program's layout (paths, shapes, dtypes) when a
signature is traced: by train, infer, update_model, evaluate and optimize's step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import graphmod._core._program._program_checks
import managers
from graphmod import roles
from graphmod.data import ArraySource

X, Y = jnp.ones((8, 4)), jnp.zeros((8, 2))
KEY = jax.random.key(0)
FIX = r"[\s\S]*made by another program or model[\s\S]*program\.init"


def _cost(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return ((model(x) - y) ** 2).mean()


def _program(hidden: int = 8, **kwargs: Any) -> gm.Program:
    mlp = gm.bricks.MLP([4, hidden, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    return gm.compile(_cost, mlp, **kwargs)


def _snapshot(tree: Any) -> Any:
    return jax.tree.map(np.array, tree)


def _with(variables: dict, path: tuple, value: Any) -> dict:
    """A copy of ``variables`` with the leaf at ``path`` replaced."""
    out = jax.tree.map(lambda a: a, variables)
    node = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


def _uses(program: gm.Program, variables: dict) -> dict[str, Callable[[], Any]]:
    """Every public way to hand variables to a program."""
    step = gm.optimize(program, optax.sgd(0.1))
    return {
        "train": lambda: program.train(variables, X, Y, rng=KEY),
        "infer": lambda: program.infer(variables, X, Y),
        "update_model": lambda: program.update_model(variables),
        "step.init": lambda: step.init(variables, KEY),
        "evaluate": lambda: gm.evaluate(program.derive(lambda m, x: m(x)), variables,
                                        {"x": X, "y": Y}, metrics=["mean_squared_error"]),
    }


USES = ["train", "infer", "update_model", "step.init", "evaluate"]


@pytest.mark.parametrize("use", USES)
def test_variables_of_a_wider_mlp_are_refused_naming_each_path(use: str) -> None:
    program, other = _program(8), _program(16)
    program.init(X, Y)
    foreign = other.init(X, Y)
    before = _snapshot(nnx.state(program.model))
    with pytest.raises(ValueError, match="do not fit this program's layout") as info:
        _uses(program, foreign)[use]()
    message = str(info.value)
    for line in ("/linear_layers/0.W has shape (4, 16) and dtype float32; expected (4, 8)",
                 "/linear_layers/0.b has shape (16,) and dtype float32; expected (8,)",
                 "/linear_layers/1.W has shape (16, 2) and dtype float32; expected (8, 2)"):
        assert line in message
    assert "/linear_layers/1.b" not in message  # (2,) fits: only the differing paths
    assert "another program or model" in message and "program.init" in message
    jax.tree.map(np.testing.assert_array_equal, _snapshot(nnx.state(program.model)), before)


@pytest.mark.parametrize("use", USES)
def test_a_bias_of_shape_1_is_not_broadcast(use: str) -> None:
    program = _program()
    variables = _with(program.init(X, Y), ("model", "linear_layers", 1, "b"), jnp.zeros(1))
    with pytest.raises(ValueError, match=r"/linear_layers/1\.b has shape \(1,\) and dtype "
                                         r"float32; expected \(2,\) and float32" + FIX):
        _uses(program, variables)[use]()


@pytest.mark.parametrize("use", USES)
def test_a_bfloat16_weight_is_refused(use: str) -> None:
    program = _program()
    variables = program.init(X, Y)
    weight = variables["model"]["linear_layers"][0]["W"]
    variables = _with(variables, ("model", "linear_layers", 0, "W"), weight.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"/linear_layers/0\.W has shape \(4, 8\) and dtype "
                                         r"bfloat16; expected \(4, 8\) and float32"):
        _uses(program, variables)[use]()


def test_float64_and_weakly_typed_leaves_fit_their_canonical_dtype() -> None:
    assert not jax.config.jax_enable_x64  # float64 becomes float32 inside jit
    with managers.Dropout(gm.dynamic(0.2), roles=[roles.INPUT]):
        program = _program()
    variables = program.init(X, Y)
    as_numpy = jax.tree.map(lambda a: np.asarray(a, np.float64), variables)
    weak = _with(variables, ("managers", "dropout", "hparams", "rate"), 0.3)
    for fine in (as_numpy, weak):
        out, _ = program.train(fine, X, Y, rng=KEY)
        assert np.isfinite(out)


def test_manager_variables_are_checked_against_init_also_in_derived_programs() -> None:
    mlp = gm.bricks.MLP([4, 8, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    with managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT]):
        program = gm.compile(_cost, mlp)
    variables = program.init(X, Y)
    path = ("managers", "batch_norm", "/linear_layers/0", "apply", "output.mean")
    bad = _with(variables, path, jnp.zeros(5))
    expected = (r"managers\['batch_norm'\]\['/linear_layers/0'\]\['apply'\]\['output\.mean'\] "
                r"has shape \(5,\) and dtype float32; expected \(8,\) and float32")
    with pytest.raises(ValueError, match=expected):
        program.train(bad, X, Y, rng=KEY)
    predict = program.derive(lambda m, x: m(x))  # never initialised: checks against its origin
    with pytest.raises(ValueError, match=expected):
        predict.infer(bad, X)
    assert predict.infer(variables, X).shape == (8, 2)


def test_model_leaves_are_checked_before_any_init() -> None:
    program, other = _program(8), _program(16)
    with pytest.raises(ValueError, match=r"/linear_layers/0\.W has shape \(4, 16\)"):
        program.infer(other.init(X, Y), X, Y)


def test_a_train_step_and_the_loop_refuse_a_foreign_state() -> None:
    program, other = _program(8), _program(16)
    program.init(X, Y)
    foreign_step = gm.optimize(other, optax.sgd(0.1))
    foreign = foreign_step.init(other.init(X, Y), KEY)
    step = gm.optimize(program, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"/linear_layers/0\.W has shape \(4, 16\).*" + FIX):
        step(foreign, X, Y)
    loop = gm.Loop(step, ArraySource((np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32)),
                                     batch_size=4), epochs=1, steps_per_call=2)
    with pytest.raises(ValueError, match=r"/linear_layers/0\.W has shape \(4, 16\)"):
        loop.run(foreign)
    assert loop.time.step == 0


def test_variables_are_checked_when_a_signature_is_traced_not_on_every_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    checks: list[int] = []
    original = graphmod._core._program._program_checks.spec_differences

    def counting(*args: Any) -> list[str]:
        checks.append(1)
        return original(*args)

    monkeypatch.setattr(graphmod._core._program._program_checks, "spec_differences", counting)
    program = _program()
    variables = program.init(X, Y)
    for _ in range(5):
        _, variables = program.train(variables, X, Y, rng=KEY)
    traced = len(checks)
    assert traced > 0
    for _ in range(5):
        _, variables = program.train(variables, X, Y, rng=KEY)
        program.infer(variables, X, Y)
    program.infer(variables, X, Y)
    assert len(checks) == traced + 2  # the first infer traced once (model and managers)
