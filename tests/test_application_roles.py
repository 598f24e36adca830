"""Targets and costs of applications: tagged TARGET and COST, selected by role; the cost
bricks against optax; LabelSmoothing against optax.smooth_labels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles

LOGITS = jax.random.normal(jax.random.key(0), (6, 4))
LABELS = jnp.array([0, 1, 2, 3, 1, 0])
ONE_HOT = jax.nn.one_hot(LABELS, 4)


def classify(model: gm.bricks.SoftmaxCrossEntropy, logits: jax.Array, targets: jax.Array):
    return model(logits, targets)


def test_targets_and_costs_are_tagged_by_role() -> None:
    program = gm.compile(classify, gm.bricks.SoftmaxCrossEntropy())
    graph = program.graph(LOGITS, LABELS)
    roles_by_name = {r.tag.name: r.tag.role for r in graph.variables}
    assert roles_by_name == {"logits": roles.INPUT, "targets": roles.TARGET,
                             "cost": roles.COST}
    assert [r.tag.name for r in graph.inputs] == ["logits"]
    assert [r.tag.name for r in graph.targets] == ["targets"]
    assert [r.tag.name for r in graph.auxiliary_variables] == ["cost"]  # a cost, as Blocks
    assert [r.tag.name for r in graph.filter(gm.VariableFilter(roles=[roles.COST]))] == ["cost"]


def test_cost_bricks_equal_optax() -> None:
    cost = gm.bricks.SoftmaxCrossEntropy()
    np.testing.assert_allclose(
        cost(LOGITS, LABELS),
        optax.softmax_cross_entropy_with_integer_labels(LOGITS, LABELS).mean(), rtol=1e-6)
    np.testing.assert_allclose(cost(LOGITS, ONE_HOT),
                               optax.softmax_cross_entropy(LOGITS, ONE_HOT).mean(), rtol=1e-6)
    np.testing.assert_allclose(gm.bricks.SquaredError()(LOGITS, ONE_HOT),
                               optax.l2_loss(LOGITS, ONE_HOT).mean() * 2, rtol=1e-6)
    with pytest.raises(ValueError, match=r"integer targets of shape \(5,\) must match"):
        cost(LOGITS, LABELS[:5])


def test_label_smoothing_is_optax_smooth_labels_in_training_only() -> None:
    smoothing = managers.LabelSmoothing(gm.dynamic(0.2), num_classes=4)
    traces = []
    program = gm.compile(lambda m, x, y: traces.append(1) or classify(m, x, y),
                         gm.bricks.SoftmaxCrossEntropy(), managers=[smoothing])
    variables = program.init(LOGITS, LABELS)
    out, _ = program.train(variables, LOGITS, LABELS, rng=jax.random.key(0))
    smoothed = optax.smooth_labels(ONE_HOT, 0.2)
    np.testing.assert_allclose(out, optax.softmax_cross_entropy(LOGITS, smoothed).mean(),
                               rtol=1e-6)
    np.testing.assert_allclose(program.infer(variables, LOGITS, LABELS),
                               optax.softmax_cross_entropy_with_integer_labels(
                                   LOGITS, LABELS).mean(), rtol=1e-6)
    count = len(traces)
    annealed = smoothing.hparam("alpha").set(variables, 0.0)
    out, _ = program.train(annealed, LOGITS, LABELS, rng=jax.random.key(0))
    np.testing.assert_allclose(out, optax.softmax_cross_entropy(LOGITS, ONE_HOT).mean(),
                               rtol=1e-6)
    assert len(traces) == count  # no retrace
    assert [r.manager for r in program.rewrites.train] == ["label_smoothing"]


def test_label_smoothing_needs_the_class_count_for_integer_labels_and_leaves_inputs() -> None:
    program = gm.compile(classify, gm.bricks.SoftmaxCrossEntropy(),
                         managers=[managers.LabelSmoothing(0.1)])
    with pytest.raises(ValueError, match=r"integer labels; pass num_classes="):
        program.init(LOGITS, LABELS)
    # a filter by INPUT never selects targets; one by TARGET never selects inputs
    dropout = managers.Dropout(0.5, roles=[roles.INPUT])
    program = gm.compile(classify, gm.bricks.SoftmaxCrossEntropy(), managers=[dropout])
    program.train(program.init(LOGITS, ONE_HOT), LOGITS, ONE_HOT, rng=jax.random.key(0))
    assert [(r.role, r.name) for r in program.rewrites.train] == [("INPUT", "logits")]


class Classifier(gm.Brick):
    """A linear layer and its cost in one application, whose ``y`` is a target."""

    def __init__(self) -> None:
        self.linear = gm.bricks.Linear(3, 4, rngs=nnx.Rngs(0))
        self.cost = gm.bricks.SoftmaxCrossEntropy()

    @gm.application(inputs=["x"], targets=["y"], outputs=["cost"], costs=["cost"])
    def apply(self, x: jax.Array, y: jax.Array) -> jax.Array:
        return self.cost(self.linear(x), y)


def test_label_smoothing_rebuilds_from_provenance_and_trains_a_classifier() -> None:
    program = gm.compile(lambda m, x, y: m(x, y), Classifier(),
                         managers=[managers.LabelSmoothing(0.1, num_classes=4,
                                                           bricks=[gm.bricks.SoftmaxCrossEntropy])])
    x = jax.random.normal(jax.random.key(1), (6, 3))
    step = gm.optimize(program, optax.sgd(0.5))
    state = step.init(program.init(x, LABELS), jax.random.key(0))
    losses = []
    for _ in range(5):
        state, metrics = step(state, x, LABELS)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    rebuilt = gm.rebuild(program.provenance, allow=["tests"]).managers[0]
    assert (rebuilt.alpha, rebuilt.num_classes, rebuilt.name) == (0.1, 4, "label_smoothing")


def test_bad_declarations_are_named() -> None:
    with pytest.raises(ValueError, match=r"costs \['loss'\] must be among its outputs"):
        class Bad(gm.Brick):
            @gm.application(inputs=["x"], outputs=["y"], costs=["loss"])
            def apply(self, x: jax.Array) -> jax.Array:
                return x
    with pytest.raises(ValueError, match=r"inputs and targets \['labels'\] are not arguments"):
        class Worse(gm.Brick):
            @gm.application(inputs=["x"], targets=["labels"], outputs=["y"])
            def apply(self, x: jax.Array) -> jax.Array:
                return x


def test_label_smoothing_smooths_labels_tagged_twice_once() -> None:
    # Classifier's y is a TARGET and so is its cost brick's: the default filter selects both
    program = gm.compile(lambda m, x, y: m(x, y), Classifier(),
                         managers=[managers.LabelSmoothing(0.2, num_classes=4)])
    x = jax.random.normal(jax.random.key(1), (6, 3))
    variables = program.init(x, LABELS)
    out, _ = program.train(variables, x, LABELS, rng=jax.random.key(0))
    weights = variables["model"]["linear"]
    logits = x @ weights["W"] + weights["b"]
    np.testing.assert_allclose(
        out, optax.softmax_cross_entropy(logits, optax.smooth_labels(ONE_HOT, 0.2)).mean(),
        rtol=1e-6)
    assert [(r.path, r.name) for r in program.rewrites.train] == [("/", "y")]
    # a value the manager did not make is still its own in a nested call
    twice = gm.compile(lambda m, x, y: m(x, y) + m.cost(m.linear(x), y), Classifier(),
                       managers=[managers.LabelSmoothing(0.2, num_classes=4)])
    twice.train(twice.init(x, LABELS), x, LABELS, rng=jax.random.key(0))
    assert [(r.path, r.name) for r in twice.rewrites.train] == [("/", "y"),
                                                                  ("/cost", "targets")]
    # whatever another manager makes of the labels on the way in, outside or inside it
    for smoothing_first in (True, False):
        chosen = [managers.LabelSmoothing(0.2, num_classes=4),
                  managers.Mixup(0.4, num_classes=4, bricks=[Classifier])]
        mixed = gm.compile(lambda m, x, y: m(x, y), Classifier(),
                           managers=chosen if smoothing_first else chosen[::-1])
        mixed.train(mixed.init(x, LABELS), x, LABELS, rng=jax.random.key(0))
        assert [(r.path, r.name) for r in mixed.rewrites.train
                if r.manager == "label_smoothing"] == [("/", "y")]
