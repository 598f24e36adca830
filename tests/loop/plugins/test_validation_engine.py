"""Validation and evaluate on one engine, one metric protocol and one batch binder: equal
numbers on the same data, a scalar metric refused by name, no retrace on a second pass."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
from graphmod import metrics
from graphmod._train._batch import Binding, bind, target_field
from graphmod.data import ArraySource
from graphmod.plugins import Validation
from tests.loop.plugins.test_validation_plugin import Classes


@pytest.fixture(scope="module")
def classes() -> Classes:
    return Classes()


def nll(logits: jax.Array, batch: Any) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1])


def test_validation_and_evaluate_agree_on_the_same_data_and_metrics(classes: Classes) -> None:
    variables = classes.state().variables
    names = ["accuracy", "cross_entropy", "macro_f1", "mse"]
    one_hot = np.eye(3, dtype=np.float32)[classes.yv]
    source = ArraySource((classes.xv, one_hot), 8)  # 30 rows: the last batch is padded
    validated = Validation(classes.predict, source, metrics=names, prefix="").evaluate(
        variables)
    evaluated = gm.evaluate(classes.predict, variables, source, metrics=names)
    assert sorted(validated) == sorted(evaluated.metrics) == sorted(names)  # as asked for
    for name, value in validated.items():
        assert value == evaluated[name], name
    # A metric function (Validation's form) is metrics.Mean in evaluate: the same number.
    labels = ArraySource((classes.xv, classes.yv), 8)
    by_function = Validation(classes.predict, labels, metrics={"nll": nll}).evaluate(variables)
    mean = gm.evaluate(classes.predict, variables, labels,
                       metrics=[metrics.Mean(nll, name="nll"), "cross_entropy"])
    assert by_function["valid/nll"] == mean["nll"]
    np.testing.assert_allclose(mean["nll"], mean["cross_entropy"], rtol=1e-6)
    np.testing.assert_allclose(mean["nll"], classes.by_hand(variables)["valid/nll"], rtol=1e-5)


def test_a_metric_returning_a_scalar_is_refused_by_name(classes: Classes) -> None:
    variables = classes.state().variables
    mean_nll = {"mean_nll": lambda logits, batch: nll(logits, batch).mean()}
    with pytest.raises(ValueError, match=r"metric 'mean_nll' returned a scalar, not one value "
                                         r"per example.*batch size 8"):
        Validation(classes.predict, classes.held_out(), metrics=mean_nll).evaluate(variables)
    with pytest.raises(ValueError, match=r"metric 'batch_nll' returned a scalar"):
        gm.evaluate(classes.predict, variables, classes.held_out(), metrics=[
            metrics.Mean(lambda logits, batch: nll(logits, batch).sum(), name="batch_nll")])
    with pytest.raises(TypeError, match=r"metrics.Mean\(fn\): fn must be callable"):
        metrics.Mean(3)  # type: ignore[arg-type]


def test_a_second_validation_or_evaluation_does_not_retrace(classes: Classes) -> None:
    variables = classes.state().variables
    traced: list[str] = []

    def hits(logits: jax.Array, batch: Any) -> jax.Array:
        traced.append("validation")  # runs while JAX traces, not per batch
        return logits.argmax(-1) == batch[1]

    valid = Validation(classes.predict, classes.held_out(), metrics={"hits": hits})
    first = valid.evaluate(variables)
    assert traced == ["validation"]
    assert valid.evaluate(variables) == first and traced == ["validation"]

    def counted(logits: jax.Array, batch: Any) -> jax.Array:
        traced.append("evaluate")
        return logits.argmax(-1) == batch[1]

    mean = metrics.Mean(counted, name="hits")
    results = [gm.evaluate(classes.predict, variables, classes.held_out(),
                           metrics=[mean, "accuracy"]) for _ in range(2)]
    assert traced.count("evaluate") == 1
    assert results[0].metrics == results[1].metrics
    assert results[0]["hits"] == results[0]["accuracy"] == first["valid/hits"]


def test_cached_engines_keep_no_program_alive() -> None:
    x, y = np.ones((6, 2), np.float32), np.zeros(6, np.int32)
    program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0)))
    gm.evaluate(program, program.init(x[:1]), (x, y), metrics=["accuracy"])
    alive = weakref.ref(program)
    del program
    gc.collect()
    assert alive() is None


def test_one_binder_for_the_arguments_a_function_takes() -> None:
    def takes(m: Any, x: Any, y: Any = None, *, scale: Any) -> None: ...

    batch = {"y": 1, "scale": 2, "x": 3, "w": 4}
    binding = bind(takes, batch, who="demo", source="toy")
    assert binding == Binding(("x", "y", "scale"), by_name=True)
    assert binding.arguments(batch) == ((), {"x": 3, "y": 1, "scale": 2})
    assert target_field(batch, binding, None, who="demo", source="toy") == "w"
    with pytest.raises(ValueError, match=r"demo: the program's inputs \['x', 'y', 'scale'\] "
                                         r"are not all fields of the source 'toy' \(fields: "
                                         r"'x', 'w'; missing: \['scale'\]\)"):
        bind(takes, {"x": 3, "w": 4}, who="demo", source="toy")
    everything = bind(lambda m, *xs: None, (1, 2, 3), who="demo", source="toy")
    assert everything.fields == (0, 1, 2)  # Validation: *args take the whole tuple
    inputs = bind(lambda m, *xs: None, (1, 2, 3), who="demo", source="toy", spare=1)
    assert inputs.fields == (0, 1)  # evaluate: the last entry stays for the targets
    with pytest.raises(ValueError, match=r"the program takes 2 inputs \(\['x', 'y'\]\) but "
                                         r"the source 'toy' yields 1 arrays"):
        bind(lambda m, x, y: None, (1,), who="demo", source="toy")
