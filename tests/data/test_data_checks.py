"""Checks against the training data's metadata: evaluate, Validation and the Loop refuse
data the model was not trained for, naming the field, before anything is computed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
from graphmod.data import ArraySource, Standardize, Transforms
from graphmod.plugins import Validation


def _data(seed: int = 0, rows: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(2.0, 3.0, (rows, 3)).astype(np.float32)
    return {"x": x, "y": (x[:, 0] > 2.0).astype(np.int32)}


def _cost(m, x, y):
    logits = m(x)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1).mean()


@pytest.fixture
def trained() -> tuple[gm.Program, gm.TrainState, ArraySource, list[int]]:
    train = ArraySource(_data(), 8, name="train")
    fitted = Transforms({"x": Standardize()}).fit(train)
    program = gm.compile(_cost, gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0)), transforms=fitted)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(*_data(rows=1).values()), jax.random.key(0))
    traces: list[int] = []

    def predict(m, x):  # counts its traces: nothing traced is nothing computed
        traces.append(1)
        return m(x)

    return program.derive(predict), step.init(state.variables, jax.random.key(0)), train, \
        traces


def _eval(predict: gm.Program, state: gm.TrainState, data: dict) -> gm.Evaluation:
    return gm.evaluate(predict, state.variables, data, metrics=["accuracy"], batch_size=8)


def test_evaluate_takes_data_like_the_training_data(trained) -> None:
    predict, state, _, traces = trained
    assert 0.0 <= _eval(predict, state, _data(1))["accuracy"] <= 1.0
    assert traces  # the check let it run


def test_an_unseen_label_is_refused_naming_field_and_value_before_any_batch(trained) -> None:
    predict, state, _, traces = trained
    data = _data(1)
    data["y"][-1] = 7  # in the last batch: refused before the first one runs
    with pytest.raises(ValueError, match=r"evaluate: field 'y' holds labels the training "
                                         r"data never held: \[7\]"):
        _eval(predict, state, data)
    assert traces == []


def test_another_feature_count_or_dtype_is_refused_naming_the_field(trained) -> None:
    predict, state, _, traces = trained
    data = _data(1)
    with pytest.raises(ValueError, match=r"evaluate: field 'x' has per-example shape \(4,\)"):
        _eval(predict, state, {**data, "x": np.ones((32, 4), np.float32)})
    with pytest.raises(ValueError, match=r"evaluate: field 'x' has dtype int32"):
        _eval(predict, state, {**data, "x": data["x"].astype(np.int32)})
    with pytest.raises(ValueError, match=r"evaluate: field 'y' has dtype float32"):
        _eval(predict, state, {**data, "y": data["y"].astype(np.float32)})
    assert traces == []
    # float64 is what jit makes float32 (x64 off): it fits, as the program's own check says
    _eval(predict, state, {**data, "x": data["x"].astype(np.float64)})


def test_the_program_refuses_another_feature_count_when_traced(trained) -> None:
    predict, state, _, traces = trained
    with pytest.raises(ValueError, match=r"program.infer: field 'x' has per-example shape"):
        predict.infer(state.variables, np.ones((2, 5), np.float32))
    assert traces == []


class _Padded:
    """A held-out source without metadata of its own: its labels are checked batch by
    batch, on the host, before the first one runs."""

    def __init__(self, data: dict) -> None:
        self.inner = ArraySource(data, 8, drop_remainder=False)

    def iter_padded(self):
        return self.inner.iter_padded()

    def describe(self):
        return {"name": "padded"}


def test_validation_refuses_an_unseen_label_before_the_run_trains(trained) -> None:
    predict, state, train, traces = trained
    data = _data(2)
    data["y"][5] = -1
    step = gm.optimize(predict.origin, optax.sgd(0.1))
    for source in (ArraySource(data, 8), _Padded(data)):
        valid = Validation(predict, source, metrics=["accuracy"])
        loop = gm.Loop(step, train, epochs=1, plugins=[valid])
        with pytest.raises(gm.PluginError, match=r"validation: field 'y' holds labels the "
                                             r"training data never held: \[-1\]"):
            loop.run(state)
        assert loop.time.step == 0 and traces == []


def test_the_loop_refuses_transforms_fitted_on_other_data(trained) -> None:
    predict, state, _, _ = trained
    step = gm.optimize(predict.origin, optax.sgd(0.1))
    other = ArraySource(_data(3), 8, name="other")
    with pytest.raises(ValueError, match=r"transforms were fitted on other data \('train'\) "
                                         r"than the loop trains on \('other'\): their "
                                         r"descriptions differ in .*sha256.*"
                                         r"Transforms\(spec\)\.fit\(train\)"):
        gm.Loop(step, other, epochs=1)
    state = gm.Loop(step, other, epochs=1, allow_data_change=True).run(state)
    assert int(state.step) == 4
    # the same arrays in another source (other batch size, shuffled) are the same data
    gm.Loop(step, ArraySource(_data(), 4, shuffle=True), epochs=1)


def test_the_loop_refuses_transforms_fitted_on_another_grain_pipeline() -> None:
    grain = pytest.importorskip("grain")
    data = _data()
    rows = [{k: v[i] for k, v in data.items()} for i in range(32)]

    def pipeline(seed: int) -> gm.data.GrainSource:
        return gm.data.GrainSource(grain.MapDataset.source(rows).shuffle(seed=seed).batch(8))

    fitted = Transforms({"x": Standardize()}).fit(pipeline(1))
    program = gm.compile(_cost, gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0)), transforms=fitted)
    step = gm.optimize(program, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"fitted on other data .* differ in .*seeds"):
        gm.Loop(step, pipeline(2), epochs=1)
    gm.Loop(step, pipeline(1), epochs=1)  # the pipeline it was fitted on trains
