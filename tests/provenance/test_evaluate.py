"""evaluate: metrics against references, every example once, provenance, clear errors."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sklearn import metrics as reference

import graphmod as gm
import managers
from graphmod import roles
from graphmod.data import ArraySource


class Classifier:
    """A 3-class MLP with dropout; data with 50 examples (not a multiple of the batch)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(1)
        self.x = rng.normal(size=(50, 4)).astype(np.float32)
        self.y = rng.integers(0, 3, size=50).astype(np.int32)
        mlp = gm.bricks.MLP([4, 8, 3], rngs=nnx.Rngs(0))
        self.program = gm.compile(
            lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean(),
            mlp, managers=[managers.Dropout(0.5, bricks=mlp.linear_layers, roles=[roles.INPUT])])
        self.variables = self.program.init(self.x[:2], self.y[:2])
        self.predict = self.program.derive(lambda m, x: m(x))
        self.logits = np.asarray(self.predict.infer(self.variables, self.x))


@pytest.fixture(scope="module")
def task() -> Classifier:
    return Classifier()


def test_classification_metrics_match_references(task: Classifier) -> None:
    source = ArraySource({"x": task.x, "y": task.y}, batch_size=16, name="toy")
    result = gm.evaluate(task.program, task.variables, source, predict=lambda m, x: m(x),
                         metrics=["accuracy", "cross_entropy", "precision", "recall", "f1",
                                  "macro_f1", "confusion_matrix"], predictions=True)
    guess = task.logits.argmax(-1)
    assert result.examples == 50
    np.testing.assert_allclose(result["accuracy"], reference.accuracy_score(task.y, guess))
    expected_ce = optax.softmax_cross_entropy_with_integer_labels(task.logits, task.y).mean()
    np.testing.assert_allclose(result["cross_entropy"], expected_ce, rtol=1e-5)
    for name, fn in (("precision", reference.precision_score),
                     ("recall", reference.recall_score), ("f1", reference.f1_score)):
        np.testing.assert_allclose(result[name], fn(task.y, guess, average=None,
                                                    labels=[0, 1, 2], zero_division=0))
    np.testing.assert_allclose(result["macro_f1"], reference.f1_score(
        task.y, guess, average="macro", zero_division=0))
    np.testing.assert_array_equal(result["confusion_matrix"],
                                  reference.confusion_matrix(task.y, guess, labels=[0, 1, 2]))
    np.testing.assert_allclose(result.predictions, task.logits, rtol=1e-6)
    text = str(result)
    assert "evaluation of 50 examples of 'toy'" in text and "precision" in text


def test_one_hot_targets_and_regression(task: Classifier) -> None:
    one_hot = np.eye(3, dtype=np.float32)[task.y]
    result = gm.evaluate(task.predict, task.variables, {"x": task.x, "targets": one_hot},
                         metrics=["accuracy", "mse"], batch_size=7)
    np.testing.assert_allclose(result["accuracy"], (task.logits.argmax(-1) == task.y).mean())
    np.testing.assert_allclose(result["mse"],  # keyed by the name asked for
                               ((task.logits - one_hot) ** 2).mean(), rtol=1e-5)


def test_top_k_accuracy_and_mean_absolute_error_match_references(task: Classifier) -> None:
    one_hot = np.eye(3, dtype=np.float32)[task.y]
    result = gm.evaluate(task.predict, task.variables, {"x": task.x, "y": task.y},
                         metrics=["top_2_accuracy", gm.metrics.Accuracy(top_k=1)], batch_size=16)
    np.testing.assert_allclose(result["top_2_accuracy"], reference.top_k_accuracy_score(
        task.y, task.logits, k=2, labels=[0, 1, 2]))
    np.testing.assert_allclose(result["accuracy"], (task.logits.argmax(-1) == task.y).mean())
    assert result["top_2_accuracy"] > result["accuracy"]  # the data tell them apart
    errors = gm.evaluate(task.predict, task.variables, {"x": task.x, "y": one_hot},
                         metrics=["mae", "mean_absolute_error"], batch_size=16)
    expected = reference.mean_absolute_error(one_hot, task.logits)
    np.testing.assert_allclose(errors["mae"], expected, rtol=1e-5)
    np.testing.assert_allclose(errors["mean_absolute_error"], expected, rtol=1e-5)
    with pytest.raises(ValueError, match=r"metric 'top_3_accuracy': top_k=3 needs more than 3 "
                                         r"classes; the predictions have 3 \(shape \(16, 3\)"):
        gm.evaluate(task.predict, task.variables, {"x": task.x, "y": task.y},
                    metrics=["top_3_accuracy"], batch_size=16)
    with pytest.raises(ValueError, match=r"Accuracy\(top_k=0\): must be an int of at least 1"):
        gm.metrics.Accuracy(top_k=0)
    alike, labels = np.zeros((4, 3), np.float32), np.array([0, 1, 2, 0])  # ties: by index
    for k, expected in ((1, 0.5), (2, 0.75)):
        metric = gm.metrics.Accuracy(top_k=k)
        assert metric.result(metric.statistics(alike, labels, np.ones(4))) == expected


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_scores_count_as_wrong(task: Classifier, fill: float) -> None:
    # Every comparison with NaN is False, and inf == inf: the ranking read each example as a
    # hit of its target (accuracy and top-2 1.0), argmax read class 0 as predicted.
    result = gm.evaluate(task.program, task.variables, {"x": task.x, "y": task.y},
                         predict=lambda m, x: m(x) * 0 + fill, batch_size=16,
                         metrics=["accuracy", "top_2_accuracy", "recall", "macro_f1",
                                  "confusion_matrix"])
    assert result["accuracy"] == result["top_2_accuracy"] == result["macro_f1"] == 0.0
    assert result["recall"].tolist() == [0.0, 0.0, 0.0]
    assert result["confusion_matrix"].sum() == 0  # predicting no class


def test_one_non_finite_score_makes_its_example_wrong() -> None:
    scores = jnp.array([[jnp.nan, 5.0, 0.0], [0.0, 5.0, jnp.inf], [0.0, 5.0, 1.0]])
    labels, weights = jnp.array([1, 1, 1]), jnp.ones(3)
    for metric in (gm.metrics.Accuracy(), gm.metrics.Accuracy(top_k=2),
                   gm.metrics.Recall(average="micro")):
        sums = jax.jit(metric.statistics)(scores, labels, weights)
        assert metric.result(sums) == pytest.approx(1 / 3), metric
    precision = gm.metrics.Precision(average="micro")  # of the one example predicted
    assert precision.result(precision.statistics(scores, labels, weights)) == 1.0


def test_labels_outside_the_classes_are_refused_naming_the_first(task: Classifier) -> None:
    y = task.y.copy()
    y[[20, 30]] = 7, -1
    for metric in ("accuracy", "cross_entropy", "f1", "confusion_matrix"):
        with pytest.raises(ValueError, match=rf"metric '{metric}': targets 'y' hold the label "
                                             r"7 at example 20, outside the 3 classes of the "
                                             r"predictions .*\[0, 3\)\)\. Fix the labels, or "
                                             r"give the model 8 outputs"):
            gm.evaluate(task.predict, task.variables, {"x": task.x, "y": y},
                        metrics=[metric], batch_size=16)
    y[20] = 0
    with pytest.raises(ValueError, match=r"label -1 at example 30.*leave out the examples of "
                                         r"a label below 0"):
        gm.evaluate(task.predict, task.variables, {"x": task.x, "y": y},
                    metrics=["cross_entropy"], batch_size=16)
    sequences = np.zeros((50, 2), np.int32)  # a label per position: the position is named
    sequences[3, 1] = 3
    with pytest.raises(ValueError, match=r"label 3 at example 3, position \(1,\)"):
        gm.evaluate(task.program.derive(lambda m, x: m(x)[:, None].repeat(2, 1)),
                    task.variables, {"x": task.x, "y": sequences}, metrics=["accuracy"])


def test_labels_on_the_device_are_counted_by_the_metrics_and_refused_at_the_end(
        task: Classifier) -> None:
    class OnDevice:  # a source yielding device arrays: evaluate reads no batch early
        def iter_padded(self) -> Any:
            for begin in range(0, 50, 16):
                rows = np.arange(begin, begin + 16) % 50
                y = task.y[rows].copy()
                y[-1] = 7 if begin == 48 else y[-1]  # in the padding only: not counted
                yield {"x": jnp.asarray(task.x[rows]), "y": jnp.asarray(y)}, rows >= begin
        def describe(self) -> dict:
            return {"name": "on device", "size": 50}

    padded = gm.evaluate(task.predict, task.variables, OnDevice(), metrics=["accuracy"])
    assert padded["accuracy"] == (task.logits.argmax(-1) == task.y).mean()

    class Bad(OnDevice):
        def iter_padded(self) -> Any:
            for batch, mask in super().iter_padded():
                yield {"x": batch["x"], "y": batch["y"].at[0].set(-1)}, mask

    with pytest.raises(ValueError, match=r"metric 'cross_entropy': 4 target labels lie "
                                         r"outside the 3 classes .*\(4 below 0, 0 at or above "
                                         r"3\).*Fix the labels"):
        gm.evaluate(task.predict, task.variables, Bad(), metrics=["cross_entropy"])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32])
def test_labels_of_any_integer_dtype_are_counted_inside_jit(dtype: type) -> None:
    metric, scores = gm.metrics.Accuracy(), jnp.eye(3)[jnp.array([0, 1, 2, 0])]
    count = jax.jit(metric.statistics)
    assert metric.result(count(scores, jnp.array([0, 1, 2, 1], dtype), jnp.ones(4))) == 0.75
    with pytest.raises(ValueError, match=r"1 target labels lie outside the 3 classes .*\(0 "
                                         r"below 0, 1 at or above 3\)"):
        metric.result(count(scores, jnp.array([0, 1, 2, 120], dtype), jnp.ones(4)))


def test_the_evaluation_provenance_holds_the_model_and_the_data(task: Classifier) -> None:
    source = ArraySource((task.x, task.y), batch_size=10, name="toy-tuple")
    result = gm.evaluate(task.predict, task.variables, source, metrics=["accuracy"])
    prov = result.provenance
    assert prov.kind == "evaluation"
    assert prov.model.inputs_hash == task.program.provenance.inputs_hash
    assert prov.fingerprint == task.program.provenance.fingerprint
    assert prov["data"] == source.describe() | {"shapes": ((4,), ()), "dtypes": (
        "float32", "int32")}
    assert prov["fields"] == {"inputs": ("0",), "targets": "1"}
    assert prov["metrics"][0]["class"] == "graphmod.metrics.Accuracy"
    assert prov["variables"]["sha256"].startswith("sha256:")
    assert prov.derived["examples"] == 50 and prov.derived["batches"] == 5
    again = gm.Provenance.from_json(prov.to_json())
    assert again == prov and again.model == task.program.provenance
    trained = jax.tree.map(lambda a: a + 1, task.variables)
    other = gm.evaluate(task.predict, trained, source, metrics=["accuracy"]).provenance
    assert gm.provenance.diff(prov, other).fields == ["variables.sha256"]


def test_data_without_targets_is_refused_naming_the_metrics(task: Classifier) -> None:
    with pytest.raises(ValueError, match=r"metrics accuracy, cross_entropy need targets, but "
                                         r"the source 'arrays' has no field.*fields: 'x'"):
        gm.evaluate(task.predict, task.variables, {"x": task.x},
                    metrics=["accuracy", "cross_entropy"])
    only = gm.evaluate(task.predict, task.variables, {"x": task.x}, metrics=[],
                       predictions=True)  # predictions alone need no targets
    assert only.predictions.shape == (50, 3)
    with pytest.raises(ValueError, match=r"inputs: 'x', 'y'\)\. .*takes the targets itself "
                                         r"\(a cost\).*predict=lambda model, x: model\(x\)"):
        gm.evaluate(task.program, task.variables, {"x": task.x, "y": task.y},  # a cost
                    metrics=["accuracy"])
    with pytest.raises(ValueError, match=r"several fields of the source 'arrays' could be "
                       r"them \('boxes', 'y'\): name one with targets="):
        gm.evaluate(task.predict, task.variables,  # DETR's labels and boxes
                    {"x": task.x, "y": task.y, "boxes": task.x}, metrics=["accuracy"])


def test_predictions_and_targets_of_other_shapes_are_refused(task: Classifier) -> None:
    with pytest.raises(ValueError, match=r"metric 'accuracy': predictions of shape \(16, 3\) "
                                         r"and targets 'y' of shape \(16, 2\).*disagree in "
                                         r"shape.*labels of shape \(16,\)"):
        gm.evaluate(task.predict, task.variables,
                    {"x": task.x, "y": np.zeros((50, 2), np.int32)},
                    metrics=["accuracy"], batch_size=16)
    with pytest.raises(ValueError, match=r"'mse': predictions of shape "
                                         r"\(50, 3\) and targets 'y' of shape \(50,\)"):
        gm.evaluate(task.predict, task.variables, {"x": task.x, "y": task.y.astype("f4")},
                    metrics=["mse"])


def test_features_that_do_not_fit_the_inputs_are_refused(task: Classifier) -> None:
    with pytest.raises(ValueError, match=r"the data of source 'arrays' do not fit the "
                                         r"program's inputs.*argument 'x'.*expected shape "
                                         r"\(batch, 4\).*got shape \(50, 5\)"):
        gm.evaluate(task.predict, task.variables,
                    {"x": np.zeros((50, 5), np.float32), "y": task.y}, metrics=["accuracy"])
    with pytest.raises(ValueError, match=r"program's inputs \['x'\] are not all fields of the "
                                         r"source 'arrays' \(fields: 'features', 'y'"):
        gm.evaluate(task.predict, task.variables, {"features": task.x, "y": task.y},
                    metrics=["accuracy"])


def test_an_empty_source_is_refused(task: Classifier) -> None:
    with pytest.raises(ValueError, match=r"the source is empty \(0 examples\)"):
        gm.evaluate(task.predict, task.variables,
                    {"x": np.zeros((0, 4), np.float32), "y": np.zeros(0, np.int32)},
                    metrics=["accuracy"])

    class Nothing:
        def iter_padded(self) -> Any:
            return iter(())

        def describe(self) -> dict:
            return {"name": "nothing", "size": 0}

    with pytest.raises(ValueError, match=r"the source 'nothing' is empty"):
        gm.evaluate(task.predict, task.variables, Nothing(), metrics=["accuracy"])


def test_a_cost_program_needs_predict(task: Classifier) -> None:
    with pytest.raises(ValueError, match=r"predictions have shape \(\).*pass predict="):
        gm.evaluate(task.program, task.variables, {"x": task.x, "y": task.y},
                    metrics=["accuracy"], targets="y", inputs=["x", "y"])
    with pytest.raises(ValueError, match=r"unknown metric 'auc'"):
        gm.evaluate(task.predict, task.variables, {"x": task.x, "y": task.y}, metrics=["auc"])


def test_evaluating_again_with_the_same_predict_traces_it_once(task: Classifier) -> None:
    traces = []

    def predict(model: Any, x: Any) -> Any:
        traces.append(None)  # runs while JAX traces, not per batch
        return model(x)

    first = gm.evaluate(task.program, task.variables, {"x": task.x, "y": task.y},
                        metrics=["accuracy"], predict=predict, batch_size=16)
    traced = len(traces)
    again = gm.evaluate(task.program, task.variables, {"x": task.x, "y": task.y},
                        metrics=["accuracy"], predict=predict, batch_size=16)
    assert traced > 0 and len(traces) == traced  # the derived program is reused
    assert again["accuracy"] == first["accuracy"]
    assert task.program.derive(predict) is task.program.derive(predict)
