"""``bricks.SimpleRecurrent`` and ``bricks.LSTM``: against Flax cells and plain loops."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
from graphmod import roles
from graphmod.bricks import LSTM, SimpleRecurrent
from tests.bricks.conftest import model_gradients

X = jax.random.normal(jax.random.key(0), (2, 7, 3))
TOL = dict(rtol=1e-5, atol=1e-6)


def simple_twin() -> tuple[nnx.SimpleCell, SimpleRecurrent]:
    cell = nnx.SimpleCell(3, 5, rngs=nnx.Rngs(0))
    cell.dense_i.bias[...] = jax.random.normal(jax.random.key(1), (5,))
    rnn = SimpleRecurrent(3, 5, rngs=nnx.Rngs(1))
    rnn.W[...] = cell.dense_i.kernel[...]
    rnn.U[...] = cell.dense_h.kernel[...]
    rnn.b[...] = cell.dense_i.bias[...]
    return cell, rnn


def lstm_twin() -> tuple[nnx.LSTMCell, LSTM]:
    cell = nnx.LSTMCell(3, 4, rngs=nnx.Rngs(0))
    for index, dense in enumerate((cell.hi, cell.hf, cell.hg, cell.ho)):
        dense.bias[...] = jax.random.normal(jax.random.key(index), (4,))
    lstm = LSTM(3, 4, rngs=nnx.Rngs(1))
    lstm.W[...] = jnp.concatenate([d.kernel[...] for d in (cell.ii, cell.if_, cell.ig,
                                                             cell.io)], axis=1)
    lstm.U[...] = jnp.concatenate([d.kernel[...] for d in (cell.hi, cell.hf, cell.hg,
                                                             cell.ho)], axis=1)
    lstm.b[...] = jnp.concatenate([d.bias[...] for d in (cell.hi, cell.hf, cell.hg, cell.ho)])
    return cell, lstm


def simple_loop(params: dict, x: jax.Array, h: jax.Array | None = None) -> jax.Array:
    """The simple recurrence as a Python loop over time, in plain jnp."""
    h = jnp.zeros((x.shape[0], params["U"].shape[0])) if h is None else h
    states = []
    for t in range(x.shape[1]):
        h = jnp.tanh(x[:, t] @ params["W"] + h @ params["U"] + params["b"])
        states.append(h)
    return jnp.stack(states, axis=1)


def params_of(brick: Any) -> dict[str, jax.Array]:
    return {"W": brick.W[...], "U": brick.U[...], "b": brick.b[...]}


# -- SimpleRecurrent ----------------------------------------------------------------------
def test_simple_recurrent_matches_flax_simple_cell_and_a_plain_loop() -> None:
    cell, rnn = simple_twin()
    np.testing.assert_allclose(rnn(X), nnx.RNN(cell)(X), **TOL)
    np.testing.assert_allclose(rnn(X), simple_loop(params_of(rnn), X), **TOL)
    h = jax.random.normal(jax.random.key(5), (2, 5))
    np.testing.assert_allclose(rnn(X, h), nnx.RNN(cell)(X, initial_carry=h), **TOL)
    new_h, _ = cell(h, X[:, 0])
    np.testing.assert_allclose(rnn.step(X[:, 0], h), new_h, **TOL)


def test_simple_recurrent_activation_is_used() -> None:
    _, rnn = simple_twin()
    relu = SimpleRecurrent(3, 5, activation=jax.nn.relu, rngs=nnx.Rngs(1))
    for name in ("W", "U", "b"):
        getattr(relu, name)[...] = getattr(rnn, name)[...]
    h = jnp.ones((2, 5))
    expected = jax.nn.relu(X[:, 0] @ rnn.W[...] + h @ rnn.U[...] + rnn.b[...])
    np.testing.assert_allclose(relu.step(X[:, 0], h), expected, **TOL)
    assert float(relu(X).min()) >= 0.0


# -- LSTM ---------------------------------------------------------------------------------
def test_lstm_matches_flax_lstm_cell() -> None:
    cell, lstm = lstm_twin()
    np.testing.assert_allclose(lstm(X), nnx.RNN(cell)(X), **TOL)
    h = jax.random.normal(jax.random.key(5), (2, 4))
    c = jax.random.normal(jax.random.key(6), (2, 4))
    np.testing.assert_allclose(lstm(X, h, c), nnx.RNN(cell)(X, initial_carry=(c, h)), **TOL)
    (new_c, new_h), _ = cell((c, h), X[:, 0])
    state, cell_state = lstm.step(X[:, 0], h, c)
    np.testing.assert_allclose(state, new_h, **TOL)
    np.testing.assert_allclose(cell_state, new_c, **TOL)


def test_lstm_recurrent_kernel_blocks_are_orthogonal() -> None:
    lstm = LSTM(3, 4, rngs=nnx.Rngs(0))
    for block in jnp.split(lstm.U[...], 4, axis=1):
        np.testing.assert_allclose(block.T @ block, jnp.eye(4), atol=1e-5)


# -- both ---------------------------------------------------------------------------------
BRICKS = {
    "simple": lambda: SimpleRecurrent(3, 5, rngs=nnx.Rngs(0)),
    "lstm": lambda: LSTM(3, 5, rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize("kind", BRICKS)
def test_shapes_and_roles(kind: str) -> None:
    brick = BRICKS[kind]()
    gates = 4 if kind == "lstm" else 1
    assert brick.W.shape == (3, 5 * gates) and brick.U.shape == (5, 5 * gates)
    assert brick.b.shape == (5 * gates,)
    assert brick.W.role is roles.WEIGHT and brick.U.role is roles.WEIGHT
    assert brick.b.role is roles.BIAS
    assert brick(X).shape == (2, 7, 5)
    assert brick(jnp.ones((1, 1, 3))).shape == (1, 1, 5)


@pytest.mark.parametrize("kind", BRICKS)
def test_eager_compiled_and_jitted_agree(kind: str) -> None:
    brick = BRICKS[kind]()
    program = gm.compile(lambda m, x: m(x), brick)
    variables = program.init(X)
    eager = brick(X)
    np.testing.assert_allclose(program.infer(variables, X), eager, **TOL)
    out, new = program.train(variables, X, rng=jax.random.key(0))
    np.testing.assert_allclose(out, eager, **TOL)
    jax.tree.map(np.testing.assert_array_equal, new, variables)
    np.testing.assert_allclose(jax.jit(lambda x: brick(x))(X), eager, **TOL)
    out = jax.vmap(lambda x: program.infer(variables, x))(jnp.stack([X, -X]))
    np.testing.assert_allclose(out[1], brick(-X), **TOL)
    assert program.roles(variables)["model"] == {
        "W": roles.WEIGHT, "U": roles.WEIGHT, "b": roles.BIAS}


@pytest.mark.parametrize("kind", BRICKS)
def test_step_is_an_application_recorded_once_in_the_scanned_body(kind: str) -> None:
    brick = BRICKS[kind]()
    program = gm.compile(lambda m, x: m(x), brick)
    graph = program.graph(X, mode="infer")
    steps = [r for r in graph.outputs if r.tag.application == "step"]
    # One traced body: each output of the step is recorded once, with per-step shapes.
    assert sorted(r.tag.name for r in steps) == (
        ["new_cell", "new_state"] if kind == "lstm" else ["new_state"])
    assert all(r.shape == (2, 5) for r in steps)
    initial = [r.tag.name for r in graph.auxiliary_variables
               if r.tag.role is roles.INITIAL_STATE]
    assert initial == (["initial_state", "initial_cell"] if kind == "lstm"
                       else ["initial_state"])


def test_weight_managers_rewrite_the_recurrent_kernel_at_every_step() -> None:
    _, rnn = simple_twin()

    class Double(gm.Manager):
        def rewrite_parameter(self, call: Any, name: str, value: jax.Array) -> jax.Array:
            return 2.0 * value

    with Double(roles=[roles.WEIGHT], name_regex="U$"):
        program = gm.compile(lambda m, x: m(x), rnn)
    variables = program.init(X)
    expected = simple_loop({**params_of(rnn), "U": 2.0 * rnn.U[...]}, X)
    np.testing.assert_allclose(program.infer(variables, X), expected, **TOL)
    assert [(r.application, r.name) for r in program.rewrites["infer"]] == [("step", "U")]


def test_train_gradients_match_flax() -> None:
    cell, lstm = lstm_twin()
    grads, _ = model_gradients(lambda m, x: (m(x) ** 2).sum(), lstm, X)
    graphdef, params, rest = nnx.split(cell, nnx.Param, ...)
    zeros = (jnp.zeros((2, 4)), jnp.zeros((2, 4)))

    def flax_cost(params: nnx.State) -> jax.Array:
        rnn = nnx.RNN(nnx.merge(graphdef, params, rest))
        return (rnn(X, initial_carry=zeros) ** 2).sum()

    flax_grads = jax.grad(flax_cost)(params)
    names = ("i", "f", "g", "o")
    np.testing.assert_allclose(grads["W"], jnp.concatenate(
        [flax_grads[f"i{n}" if n != "f" else "if_"]["kernel"][...] for n in names], 1), **TOL)
    np.testing.assert_allclose(grads["U"], jnp.concatenate(
        [flax_grads[f"h{n}"]["kernel"][...] for n in names], 1), **TOL)
    np.testing.assert_allclose(grads["b"], jnp.concatenate(
        [flax_grads[f"h{n}"]["bias"][...] for n in names]), **TOL)


def test_simple_recurrent_gradients_match_a_plain_loop() -> None:
    _, rnn = simple_twin()
    program = gm.compile(lambda m, x, h: (m(x, h) ** 2).sum(), rnn)
    h = jax.random.normal(jax.random.key(5), (2, 5))
    variables = program.init(X, h)

    def cost(model: dict, h: jax.Array) -> jax.Array:
        return program.train({**variables, "model": model}, X, h, rng=jax.random.key(0))[0]

    grads = jax.grad(cost, argnums=(0, 1))(variables["model"], h)
    expected = jax.grad(lambda p, h: (simple_loop(p, X, h) ** 2).sum(), argnums=(0, 1))(
        params_of(rnn), h)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), grads, expected)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SimpleRecurrent(0, 5, rngs=nnx.Rngs(0)), r"SimpleRecurrent\(in_features=0\)"),
    (lambda: SimpleRecurrent(3, 2.0, rngs=nnx.Rngs(0)),
     r"SimpleRecurrent\(hidden_features=2.0\)"),
    (lambda: LSTM(3, -4, rngs=nnx.Rngs(0)), r"LSTM\(hidden_features=-4\)"),
])
def test_bad_constructor_arguments_are_named(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_a_non_callable_activation_is_named() -> None:
    with pytest.raises(TypeError, match=r"activation='tanh'"):
        SimpleRecurrent(3, 5, activation="tanh", rngs=nnx.Rngs(0))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", BRICKS)
def test_inputs_of_the_wrong_shape_are_named(kind: str) -> None:
    brick = BRICKS[kind]()
    with pytest.raises(ValueError, match=r"inputs of shape \(7, 3\).*\[batch, time"):
        brick(X[0])
    with pytest.raises(ValueError, match=r"inputs of shape \(2, 7, 4\).*in_features=3"):
        brick(jnp.ones((2, 7, 4)))
    with pytest.raises(ValueError, match=r"initial_state of shape \(2, 4\).*\(2, 5\)"):
        brick(X, jnp.zeros((2, 4)))
