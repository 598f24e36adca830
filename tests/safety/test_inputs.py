"""Bad input, second round: metrics that do not lie, and inputs once taken without a word.

Labels outside the classes (refused by ``evaluate`` naming the first, and by the metrics'
own sums inside ``jax.jit``), bools and fractions where a count belongs (data, loop,
schedules), an annealed hyperparameter outside its range, a sharding rule that selects no
variable, a regularizer with nothing to regularize. The models are built when a case runs,
so that counting the cases (``test_catalogue_size.py``) builds none.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import graphmod as gm
import managers
from graphmod.data import ArraySource
from graphmod.plugins import Anneal
from tests.loop.conftest import Problem
from tests.safety.catalogue import Case, check_refused

X = np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32)


@functools.cache
def _classifier() -> tuple[gm.Program, dict]:
    """A 3-class linear classifier and its variables."""
    program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
    return program, program.init(X[:1])


def _evaluate(labels: list[int], metric: str) -> Any:
    program, variables = _classifier()
    return gm.evaluate(program, variables, {"x": X, "y": np.array(labels, np.int32)},
                       metrics=[metric], batch_size=4)


def _counted_in_jit(labels: list[int]) -> Any:
    """Accuracy's sums made in a jitted function, where no label can raise, then read."""
    metric = gm.metrics.Accuracy()
    sums = jax.jit(metric.statistics)(jnp.zeros((len(labels), 3)), jnp.array(labels),
                                      jnp.ones(len(labels)))
    return metric.result(jax.device_get(sums))


@functools.cache
def _annealed() -> Problem:
    return Problem(dropout=gm.dynamic(0.5))


def _anneal_to(value: float) -> Any:
    problem = _annealed()
    anneal = Anneal(problem.dropout.hparam("rate"), lambda t: value)
    return gm.Loop(problem.step, problem.source(8), steps=2, plugins=[anneal]).run(
        problem.state())


def _loop(**settings: Any) -> Any:
    problem = _annealed()
    return gm.Loop(problem.step, problem.source(8), **settings)


def _rules(*rules: Any) -> Any:
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    return gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 4, rngs=nnx.Rngs(0)), mesh=mesh,
                      rules=list(rules))


class _Doubling(gm.Brick):
    """A brick without parameters."""

    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x: jax.Array) -> jax.Array:
        return 2 * x


def _l2_without_parameters() -> Any:
    program = gm.compile(lambda m, x: m(x).mean(), _Doubling(), managers=[managers.L2(0.1)])
    step = gm.optimize(program, optax.sgd(0.1))
    return step.init(program.init(X), jax.random.key(0))


CASES: list[Case] = [
    # -- metrics: labels outside the classes ---------------------------------------------
    Case("a label of 7 for 3 classes", lambda root: _evaluate([0, 1, 2, 0, 1, 7, 0, 1],
                                                              "accuracy"), ValueError,
         r"metric 'accuracy': targets 'y' hold the label 7 at example 5, outside the 3 "
         r"classes.*Fix the labels, or give the model 8 outputs"),
    Case("a label of -1", lambda root: _evaluate([0, 1, -1, 0, 1, 2, 0, 1], "cross_entropy"),
         ValueError, r"metric 'cross_entropy': targets 'y' hold the label -1 at example 2, "
         r"outside the 3 classes.*leave out the examples of a label below 0"),
    Case("a label equal to the number of classes", lambda root: _evaluate(
        [0, 1, 2, 0, 1, 2, 0, 3], "macro_f1"), ValueError,
        r"metric 'macro_f1': .* label 3 at example 7, outside the 3 classes .*\[0, 3\)"),
    Case("labels outside the classes counted inside jit", lambda root: _counted_in_jit(
        [0, -1, 2, 7]), ValueError, r"metric 'accuracy': 2 target labels lie outside the 3 "
        r"classes .*\(1 below 0, 1 at or above 3\).*Fix the labels"),
    # -- counts: bools and fractions ------------------------------------------------------
    Case("a batch size of True", lambda root: ArraySource(X, batch_size=True), ValueError,
         r"ArraySource\(batch_size=True\): must be a positive int.*e\.g\. batch_size=32"),
    Case("a batch size of 0", lambda root: ArraySource(X, batch_size=0), ValueError,
         r"ArraySource\(batch_size=0\): must be a positive int.*e\.g\. batch_size=32"),
    Case("a batch size of 2.5", lambda root: ArraySource(X, batch_size=2.5), ValueError,
         r"ArraySource\(batch_size=2\.5\): must be a positive int"),
    Case("a loop of True epochs", lambda root: _loop(epochs=True), ValueError,
         r"Loop\(epochs=True\): must be a positive int, e\.g\. epochs=10"),
    Case("a loop of True steps", lambda root: _loop(steps=True), ValueError,
         r"Loop\(steps=True\): must be a positive int, e\.g\. steps=10"),
    Case("True steps per call", lambda root: _loop(steps_per_call=True), ValueError,
         r"Loop\(steps_per_call=True\): must be a positive int"),
    Case("each(2.5) on a range of ints", lambda root: gm.each(2.5)(0, 3), ValueError,
         r"each\(2\.5\)\(0, 3\): each\(2\.5\) places points between the integers.*Use "
         r"integers there.*or pass float times \(seconds\)"),
    Case("at(1.5) on a range of ints", lambda root: (gm.each(10) | gm.at(1.5))(1, 2),
         ValueError, r"\(each\(10\) \| at\(1\.5\)\)\(1, 2\): at\(1\.5\) places points between"),
    Case("each(True)", lambda root: gm.each(True), TypeError,
         r"each\(n\) must be a number, got True: pass an int or a float \(a bool is no time"),
    Case("a schedule called on a bool", lambda root: gm.each(2)(True, 3), TypeError,
         r"each\(2\)\(True, 3\): times must be numbers, not bools.*pass the step"),
    # -- an annealed hyperparameter outside its range --------------------------------------
    Case("a dropout rate annealed to 5.0", lambda root: _anneal_to(5.0), gm.PluginError,
         r"anneal_dropout_rate.*returned 5\.0, outside the valid range \[0\.0, 1\.0\] of "
         r"hyperparameter 'rate' of manager 'dropout'; make fn return values in \[0\.0, 1\.0\]"),
    Case("a dropout rate annealed to -1", lambda root: _anneal_to(-1), gm.PluginError,
         r"returned -1, outside the valid range \[0\.0, 1\.0\] of hyperparameter 'rate'"),
    # -- sharding rules and regularizers that select nothing -------------------------------
    Case("a sharding rule that selects nothing", lambda root: _rules(
        (gm.VariableFilter(path="/W"), P(None, "data"))), ValueError,
        r"compile\(rules=\.\.\.\): rules\[0\] \(VariableFilter\(path='/W'\), P\(None, 'data'\)"
        r"\) selects no variable of the model.*such as /\.W, /\.b\. Fix its filter, or drop"),
    Case("one of two sharding rules selects nothing", lambda root: _rules(
        (gm.VariableFilter(name="W"), P(None, "data")), (gm.VariableFilter(name="kernel"), P())),
        ValueError, r"rules\[1\] \(VariableFilter\(name='kernel'\), P\(\)\) selects no variable"),
    Case("L2 on a model without parameters", lambda root: _l2_without_parameters(),
         gm.errors.ManagerMatchedNothing,
         r"manager 'l2' \(L2\) matched nothing.*The model holds no parameters at all.*leave it "
         r"out of this program"),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_refused_naming_the_culprit(case: Case, tmp_path: pathlib.Path) -> None:
    check_refused(case, tmp_path)
