"""Validation: masked means over every held-out row (short final batch included), argument
selection, default metrics from a program's outputs, and EarlyStopping wired to it."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod.data import ArraySource
from graphmod.plugins import EarlyStopping, Validation
from tests.loop.conftest import Problem
from tests.loop.plugins.conftest import host, own_metrics


class Classes:
    """Three Gaussian classes in 4-D, an MLP with dropout, 30 held-out rows (batches of 8:
    the last one short)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        centers = rng.normal(size=(3, 4)) * 1.5
        labels = rng.integers(0, 3, size=94)
        features = (centers[labels] + rng.normal(size=(94, 4))).astype(np.float32)
        self.x, self.y = features[:64], labels[:64].astype(np.int32)
        self.xv, self.yv = features[64:], labels[64:].astype(np.int32)
        mlp = gm.bricks.MLP([4, 16, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        dropout = managers.Dropout(0.3, bricks=mlp.linear_layers, roles=[roles.INPUT])

        def loss(m, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        self.program = gm.compile(loss, mlp, managers=[dropout])
        self.predict = self.program.derive(lambda m, x: m(x))
        self.step = gm.optimize(self.program, optax.adam(3e-2))
        self.variables = self.program.init(self.x[:2], self.y[:2])

    def state(self) -> gm.TrainState:
        return self.step.init(self.variables, jax.random.key(0))

    def train(self) -> ArraySource:
        return ArraySource((self.x, self.y), 16, shuffle=True, seed=3)

    def held_out(self) -> ArraySource:
        return ArraySource((self.xv, self.yv), 8)

    def by_hand(self, variables: dict) -> dict[str, float]:
        """Accuracy and mean NLL over all 30 rows in one unpadded batch, in NumPy."""
        logits = np.asarray(self.predict.infer(variables, self.xv), np.float64)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return {"valid/accuracy": float((logits.argmax(-1) == self.yv).mean()),
                "valid/nll": float(-logp[np.arange(30), self.yv].mean())}


@pytest.fixture(scope="module")
def classes() -> Classes:
    return Classes()


def accuracy(logits: jax.Array, batch: tuple) -> jax.Array:
    return logits.argmax(-1) == batch[1]


def nll(logits: jax.Array, batch: tuple) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1])


def test_validated_metrics_match_a_hand_computation_over_every_row(classes: Classes) -> None:
    valid = Validation(classes.predict, classes.held_out(),
                       metrics={"accuracy": accuracy, "nll": nll})
    assert [int(m.sum()) for _, m in classes.held_out().iter_padded()] == [8, 8, 8, 6]
    fired: list[tuple[int, dict, dict]] = []
    loop = gm.Loop(classes.step, classes.train(), epochs=3, plugins=[valid])
    loop.on("validated", lambda e: fired.append(
        (e.time.step, own_metrics(e), classes.by_hand(e.state.variables))))
    loop.run(classes.state())
    assert [step for step, _, _ in fired] == [4, 8, 12]
    for _, got, want in fired:
        assert set(got) == {"valid/accuracy", "valid/nll"}
        np.testing.assert_allclose(got["valid/accuracy"], want["valid/accuracy"], rtol=1e-6)
        np.testing.assert_allclose(got["valid/nll"], want["valid/nll"], rtol=1e-5)
    assert [(s, m) for s, m, _ in fired] == valid.history
    assert fired[0][1] != fired[-1][1]  # the metrics follow training


def test_a_resumed_run_keeps_the_history_of_every_validation(classes: Classes,
                                                              tmp_path) -> None:
    def plugins() -> list:
        return [Validation(classes.predict, classes.held_out(), metrics=["accuracy"]),
                EarlyStopping("valid/accuracy", patience=5, mode="max", restore_best=False),
                gm.plugins.Checkpoint(tmp_path)]

    first = plugins()
    gm.Loop(classes.step, classes.train(), epochs=2, plugins=first).run(classes.state())
    again = plugins()
    gm.Loop.resume(tmp_path, classes.step, classes.train(), epochs=3, plugins=again)
    whole = plugins()[:2]
    gm.Loop(classes.step, classes.train(), epochs=3, plugins=whole).run(classes.state())
    assert [step for step, _ in again[0].history] == [4, 8, 12]  # not only the new epoch
    assert again[1].state_dict() == whole[1].state_dict()  # the best and its step
    assert again[0].history[:2] == first[0].history
    np.testing.assert_allclose([m["valid/accuracy"] for _, m in again[0].history],
                               [m["valid/accuracy"] for _, m in whole[0].history])


def test_default_metrics_come_from_the_programs_outputs(classes: Classes) -> None:
    variables = classes.state().variables
    want = classes.by_hand(variables)
    per_example = classes.program.derive(lambda m, x, y: {
        "nll": optax.softmax_cross_entropy_with_integer_labels(m(x), y),
        "hits": m(x).argmax(-1) == y})
    dict_batches = ArraySource({"y": classes.yv, "x": classes.xv}, 8)
    got = Validation(per_example, dict_batches, prefix="").evaluate(variables)
    np.testing.assert_allclose(got["nll"], want["valid/nll"], rtol=1e-5)
    np.testing.assert_allclose(got["hits"], want["valid/accuracy"], rtol=1e-6)
    # The training program returns the scalar mean loss: batches of 6 divide the 30 rows
    # exactly, so the weighted mean of batch means is the mean over rows.
    got = Validation(classes.program, ArraySource((classes.xv, classes.yv), 6)).evaluate(
        variables)
    np.testing.assert_allclose(got["valid/loss"], want["valid/nll"], rtol=1e-5)


def test_the_inference_call_gets_only_the_arguments_it_takes(classes: Classes) -> None:
    variables = classes.state().variables
    seen: list[tuple] = []

    def shapes(logits: jax.Array, batch: dict) -> jax.Array:
        seen.append((logits.shape, sorted(batch)))
        return jnp.zeros(logits.shape[0])

    source = ArraySource({"x": classes.xv, "y": classes.yv}, 8)
    Validation(classes.predict, source, metrics={"zero": shapes}).evaluate(variables)
    assert seen == [((8, 3), ["x", "y"])]  # traced once: every batch has one shape


def test_early_stopping_on_validation_stops_and_restores_the_best(classes: Classes) -> None:
    kept: dict[int, dict] = {}
    valid = Validation(classes.predict, classes.held_out(), metrics={"accuracy": accuracy})
    # No later evaluation can beat the first by more than 1.0: stops after two more.
    stop = EarlyStopping("valid/accuracy", mode="max", min_delta=1.0, patience=2)
    loop = gm.Loop(classes.step, classes.train(), epochs=10, plugins=[valid, stop])
    loop.on("validated", lambda e: kept.update({e.time.step: host(e.state.variables)}))
    state = loop.run(classes.state())
    assert [s for s, _ in valid.history] == [4, 8, 12] and stop.stopped_step == 12
    assert int(state.step) == 4 and loop.time.step == 12
    jax.tree.map(np.testing.assert_array_equal, host(state.variables), kept[4])
    assert valid.evaluate(state.variables) == valid.history[0][1]


def test_early_stopping_that_never_triggers_restores_the_best(classes: Classes) -> None:
    valid = Validation(classes.predict, classes.held_out(), metrics={"nll": nll})
    stop = EarlyStopping("valid/nll", patience=100)
    loop = gm.Loop(classes.step, classes.train(), epochs=4, plugins=[valid, stop])
    state = loop.run(classes.state())
    best_step, best = min(((s, m["valid/nll"]) for s, m in valid.history),
                          key=lambda pair: pair[1])
    assert stop.stopped_step is None and loop.time.step == 16
    assert (int(state.step), stop.best) == (best_step, best)
    assert valid.evaluate(state.variables)["valid/nll"] == best


def test_bad_input_is_named(classes: Classes, problem: Problem) -> None:
    with pytest.raises(TypeError, match=r"Validation\(program\): expected a graphmod Program"):
        Validation(classes.step, classes.held_out())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Validation\(source\): expected a graphmod.data"):
        Validation(classes.predict, [(classes.xv, classes.yv)])
    with pytest.raises(TypeError, match=r"entry 'acc' must map a name to fn"):
        Validation(classes.predict, classes.held_out(), metrics={"acc": 1})  # type: ignore
    variables = classes.state().variables
    with pytest.raises(TypeError, match=r"returned \(8, 3\), not metrics.*pass metrics="):
        Validation(classes.predict, classes.held_out()).evaluate(variables)
    loop = gm.Loop(problem.step, problem.source(32), epochs=1, plugins=[
        Validation(problem.program.derive(lambda m, x: m(x).T), problem.source(8),
                   metrics={"t": lambda out, batch: out})])
    with pytest.raises(gm.PluginError, match=r"metric 't' has shape \(2, 8\); expected a "
                                             r"scalar or per-example values"):
        loop.run(problem.state())


@pytest.mark.parametrize(("held_out", "message"), [
    (lambda c: ArraySource((np.ones((30, 5), np.float32), c.yv), 8),
     r"the data of source 'arrays' do not fit the program's inputs.*argument 'x': "
     r"expected shape \(batch, 4\)"),
    (lambda c: ArraySource({"inputs": c.xv, "y": c.yv}, 8),
     r"the program's inputs \['x'\] are not all fields of the source"),
])
def test_held_out_data_that_do_not_fit_stop_the_run_before_its_first_step(
        classes: Classes, held_out: Callable[[Classes], ArraySource], message: str) -> None:
    steps: list[int] = []
    loop = gm.Loop(classes.step, classes.train(), epochs=2, plugins=[
        Validation(classes.predict, held_out(classes), metrics=["accuracy"])])
    loop.on(gm.On("step"), lambda event: steps.append(event.time.step))
    with pytest.raises(gm.PluginError, match=r"plugin 'validation' raised in setup: "
                                             r"ValueError: validation: " + message):
        loop.run(classes.state())
    assert steps == []  # before: refused at the end of the first epoch
