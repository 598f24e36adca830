"""Declared ordering constraints: the chain sorts the listed managers to satisfy them (a
stable topological sort), shows what moved, and refuses a cycle naming it."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._managers._order import resolve_order


def _linear() -> gm.bricks.Linear:
    return gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0))


def _cost(model: gm.bricks.Linear, x: jax.Array) -> jax.Array:
    return (model(x) ** 2).mean()


X = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)


def test_every_permutation_compiles_to_one_order_and_one_step() -> None:
    # EMA before every parameter rewrite, the cost on the rewritten weight after them.
    make = {"ema": lambda: managers.EMA(0.9),
            "weight_norm": lambda: managers.WeightNorm(),
            "l2": lambda: managers.L2(0.1, on="rewritten")}
    orders, jaxprs = set(), set()
    model = _linear()
    for listed in itertools.permutations(make):
        program = gm.compile(_cost, model, managers=[make[name]() for name in listed])
        step = gm.optimize(program, optax.adam(0.1))
        state = step.init(program.init(X), jax.random.key(0))
        orders.add(tuple(m.name for m in program.managers))
        jaxprs.add(str(jax.make_jaxpr(step._train_step)(state, X)))
    assert orders == {("ema", "weight_norm", "l2")}
    assert len(jaxprs) == 1


def test_what_moved_is_in_the_rewrite_trace_and_the_display() -> None:
    program = gm.compile(_cost, _linear(), managers=[managers.WeightNorm(), managers.EMA(0.9)])
    program.train(program.init(X), X, rng=jax.random.key(0))  # no ManagerConflict any more
    moved = "ema before weight_norm (EMA.runs_before 'parameter_rewrite')"
    trace = str(program.rewrites.train)
    assert f"order: ema, weight_norm (listed: weight_norm, ema)\n  moved: {moved}" in trace
    assert [r.manager for r in program.rewrites.train] == ["weight_norm"]
    text = repr(program)
    assert "0. ema: EMA" in text and "1. weight_norm: WeightNorm" in text
    assert f"order resolved from the listed weight_norm, ema:\n    moved {moved}" in text
    assert "average, runs before 'parameter_rewrite'" in text
    page = program._repr_html_()
    assert "moved by" in page and "EMA.runs_before" in page
    unmoved = gm.compile(_cost, _linear(), managers=[managers.EMA(0.9), managers.WeightNorm()])
    unmoved.init(X)
    assert "order:" not in str(unmoved.rewrites) and "resolved" not in repr(unmoved)


@pytest.mark.parametrize("listed", [("max_norm", "l2"), ("l2", "max_norm")])
def test_l2_penalises_the_weight_it_declares_whatever_the_order(listed) -> None:
    model = _linear()
    w = np.asarray(model.W[...])
    costs = {}
    for on in ("stored", "rewritten"):
        make = {"max_norm": lambda: managers.MaxNorm(0.1, roles=[roles.WEIGHT]),
                "l2": lambda on=on: managers.L2(1.0, on=on)}
        program = gm.compile(_cost, model, managers=[make[name]() for name in listed])
        step = gm.optimize(program, optax.sgd(0.1))
        costs[on] = float(step(step.init(program.init(X), jax.random.key(0)), X)[1]["l2"])
        assert f"cost_on_{on}_parameters" in repr(program)
    np.testing.assert_allclose(costs["stored"], (w ** 2).sum(), rtol=1e-6)
    clipped = w * np.minimum(1, 0.1 / np.linalg.norm(w, axis=0))
    np.testing.assert_allclose(costs["rewritten"], (clipped ** 2).sum(), rtol=1e-5)


class Selection(gm.Manager):
    kinds = ("selection",)
    runs_before = ("augmentation",)


class Augment(gm.Manager):
    kinds = ("augmentation",)
    runs_before = (Selection,)


def test_a_cycle_is_refused_naming_the_managers_and_constraints() -> None:
    chosen = [Selection(roles=[roles.INPUT]), Augment(roles=[roles.INPUT])]
    with pytest.raises(gm.errors.ManagerConflict, match=(
            r"managers selection, augment form a cycle: "
            r"selection before augment \(Selection.runs_before 'augmentation'\); "
            r"augment before selection \(Augment.runs_before Selection\)")):
        gm.compile(_cost, _linear(), managers=chosen)
    chosen[0].priority = 1  # refused before anything was frozen: still settable
    assert chosen[0].priority == 1


def test_the_listed_order_and_priority_win_where_nothing_is_declared() -> None:
    a, b = gm.Manager(manager_name="a"), gm.Manager(manager_name="b")
    first = gm.Manager(manager_name="first", priority=5)
    selection = Selection(manager_name="selection")
    augment = managers.Mixup(0.2, bricks=[gm.bricks.Linear], priority=9)
    order = resolve_order([a, augment, b, first, selection])
    # Mixup's priority 9 would put it first, but selection must run before it: it goes as
    # soon as selection has, which goes in its listed place among the priority-0 ones.
    assert order.names == ("first", "a", "b", "selection", "mixup")
    assert [str(m) for m in order.moves] == [
        "selection before mixup (Selection.runs_before 'augmentation')"]
    assert resolve_order([b, a]).names == ("b", "a")
    with pytest.raises(TypeError, match=r"_Bad.runs_before: 3 is neither a kind"):
        resolve_order([type("_Bad", (gm.Manager,), {"runs_before": (3,)})()])
