"""How managers compose: chain order, priority, use_manager=, managers=[...], wrap."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import graphmod as gm
import managers
from graphmod import roles
from tests.managers.helpers import (
    Identity,
    Pair,
    Scale,
    apply_model,
    array,
    full,
    key,
    normal,
    ones,
    rewritten_by,
)


class AddOne(gm.Manager):
    """Adds 1 to every selected input, output and parameter."""

    def rewrite_input(self, call: gm.ApplicationCall, name: str, value: Any) -> Any:
        return value + 1

    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: Any) -> Any:
        return value + 1

    def rewrite_parameter(self, call: gm.ApplicationCall, name: str, value: Any) -> Any:
        return value + 1


class Double(gm.Manager):
    """Multiplies every selected input, output and parameter by 2."""

    def rewrite_input(self, call: gm.ApplicationCall, name: str, value: Any) -> Any:
        return value * 2

    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: Any) -> Any:
        return value * 2

    def rewrite_parameter(self, call: gm.ApplicationCall, name: str, value: Any) -> Any:
        return value * 2


class Times(gm.Manager):
    """Middleware: multiplies the call's positional arguments by ``factor`` (or its result)."""

    def __init__(self, factor: float, *, where: str = "args", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factor = factor
        self.where = where

    def wrap(self, call: gm.ApplicationCall, next: Callable[..., Any], args: tuple,
             kwargs: dict) -> Any:
        if self.where == "args":
            return next(*(a * self.factor for a in args), **kwargs)
        return self.factor * next(*args, **kwargs)


def _infer(model: Any, chosen: list[gm.Manager] | None, x: Any, fn=apply_model) -> tuple[Any,
                                                                                          Any]:
    program = gm.compile(fn, model, managers=chosen)
    variables = program.init(x)
    return program.infer(variables, x), program


# -- chain order ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("role", "first", "expected", "order"), [
    # inputs: the outer (first) manager's rewrite runs first, the inner one sees its output
    (roles.INPUT, "add", 2 * (3 + 1), ["add_one", "double"]),
    (roles.INPUT, "double", 2 * 3 + 1, ["double", "add_one"]),
    # outputs: the inner manager's rewrite runs first, the outer one returns last
    (roles.OUTPUT, "add", 2 * 3 + 1, ["double", "add_one"]),
    (roles.OUTPUT, "double", 2 * (3 + 1), ["add_one", "double"]),
])
def test_the_first_manager_entered_is_outermost(role, first, expected, order) -> None:
    add, double = AddOne(roles=[role]), Double(roles=[role])
    outer, inner = (add, double) if first == "add" else (double, add)
    with outer, inner:
        program = gm.compile(apply_model, Identity())
    x = full(3.0, 2)
    out = program.infer(program.init(x), x)
    np.testing.assert_array_equal(out, np.full(2, expected))
    assert [r.manager for r in program.rewrites.infer] == order


def test_parameters_pass_outermost_to_innermost() -> None:
    model = Scale(2)
    w = array(model.W[...])
    out, program = _infer(model, [AddOne(roles=[roles.WEIGHT]), Double(roles=[roles.WEIGHT])],
                          ones(2))
    np.testing.assert_allclose(out, 2 * (w + 1))
    assert [r.manager for r in program.rewrites.infer] == ["add_one", "double"]


def test_inputs_and_outputs_nest_like_with_blocks() -> None:
    roles_ = [roles.INPUT, roles.OUTPUT]
    out, program = _infer(Identity(), [AddOne(roles=roles_), Double(roles=roles_)], full(3.0, 2))
    # in: (3 + 1) * 2 = 8; the method returns 8; out: 8 * 2 + 1 = 17
    np.testing.assert_array_equal(out, np.full(2, 17.0))
    assert [(r.manager, r.role) for r in program.rewrites.infer] == [
        ("add_one", "INPUT"), ("double", "INPUT"), ("double", "OUTPUT"), ("add_one", "OUTPUT")]


@pytest.mark.parametrize(("priorities", "expected", "order"), [
    ((0, 1), 2 * (3 + 1), ["add_one", "double"]),  # double outer: it returns last
    ((1, 0), 2 * 3 + 1, ["double", "add_one"]),  # the listed order
    ((0, 0), 2 * 3 + 1, ["double", "add_one"]),  # ties keep the listed order
    ((-1, 0), 2 * (3 + 1), ["add_one", "double"]),
])
def test_priority_reorders_the_chain(priorities, expected, order) -> None:
    chosen = [AddOne(roles=[roles.OUTPUT], priority=priorities[0]),
              Double(roles=[roles.OUTPUT], priority=priorities[1])]
    out, program = _infer(Identity(), chosen, full(3.0, 2))
    np.testing.assert_array_equal(out, np.full(2, expected))
    assert [r.manager for r in program.rewrites.infer] == order


def test_a_later_built_in_manager_sees_an_earlier_ones_output() -> None:
    # Dropout outer, batch norm inner on one output: bn first, then dropout of its result.
    x = 2 * normal(1, 64, 8) + 1
    dropout = lambda: managers.Dropout(0.5, roles=[roles.OUTPUT])
    norm = lambda: managers.BatchNorm(roles=[roles.OUTPUT], epsilon=1e-3)
    reference = lambda v: (v - v.mean(0)) / np.sqrt(v.var(0) + 1e-3)
    x64 = np.asarray(x, np.float64)

    program = gm.compile(apply_model, Identity(), managers=[dropout(), norm()])
    out, _ = program.train(program.init(x), x, rng=key(0))
    assert rewritten_by(program) == [("batch_norm", "/", 0, "output"),
                                      ("dropout", "/", 0, "output")]
    kept = array(out) != 0
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(out, np.where(kept, 2 * reference(x64), 0), rtol=1e-4,
                               atol=1e-4)

    # the other way round: batch norm of the dropped output (the same mask: same key)
    program = gm.compile(apply_model, Identity(), managers=[norm(), dropout()])
    out, _ = program.train(program.init(x), x, rng=key(0))
    assert rewritten_by(program) == [("dropout", "/", 0, "output"),
                                      ("batch_norm", "/", 0, "output")]
    np.testing.assert_allclose(out, reference(np.where(kept, 2 * x64, 0)), rtol=1e-4,
                               atol=1e-4)


# -- where managers come from ---------------------------------------------------------------------

def test_use_manager_scopes_a_manager_to_one_call() -> None:
    pair = Pair(2)
    fn = lambda m, x: (m.a(x, use_manager=AddOne(roles=[roles.OUTPUT])), m.b(x), m.a(x))
    (a, b, a_again), program = _infer(pair, [], ones(2), fn)
    np.testing.assert_allclose(a, array(pair.a.W[...]) + 1)
    np.testing.assert_allclose(b, array(pair.b.W[...]))
    np.testing.assert_allclose(a_again, array(pair.a.W[...]))
    assert rewritten_by(program, "infer") == [("add_one", "/a", 0, "output")]


def test_use_manager_reaches_the_children_of_the_call() -> None:
    pair = Pair(2)
    fn = lambda m, x: (m(x, use_manager=[Double(roles=[roles.OUTPUT], bricks=[Scale])]),
                       m.a(x))
    (out, a), program = _infer(pair, [], ones(2), fn)
    np.testing.assert_allclose(out, 2 * array(pair.a.W[...]) + 2 * array(pair.b.W[...]))
    np.testing.assert_allclose(a, array(pair.a.W[...]))
    assert rewritten_by(program, "infer") == [("double", "/a", 0, "output"),
                                              ("double", "/b", 0, "output")]


def test_use_manager_composes_with_compiled_managers() -> None:
    pair = Pair(2)
    fn = lambda m, x: m.a(x, use_manager=Double(roles=[roles.OUTPUT]))
    out, program = _infer(pair, [AddOne(roles=[roles.OUTPUT], bricks=[Scale])], ones(2), fn)
    # the compiled manager is entered first: outermost, so it returns last
    np.testing.assert_allclose(out, 2 * array(pair.a.W[...]) + 1)
    assert [r.manager for r in program.rewrites.infer] == ["double", "add_one"]


def test_use_manager_with_a_name_already_in_the_chain_raises() -> None:
    fn = lambda m, x: m(x, use_manager=AddOne(roles=[roles.OUTPUT]))
    program = gm.compile(fn, Identity(), managers=[AddOne(roles=[roles.INPUT])])
    with pytest.raises(ValueError, match="add_one"):
        program.init(ones(2))
    fn = lambda m, x: m(x, use_manager=AddOne(roles=[roles.OUTPUT], manager_name="local"))
    out, _ = _infer(Identity(), [AddOne(roles=[roles.INPUT])], full(3.0, 2), fn)
    np.testing.assert_array_equal(out, np.full(2, 5.0))


def test_the_managers_argument_overrides_with_blocks() -> None:
    ignored = r"uses exactly the managers listed: \['add_one'\], active in a with block"
    with AddOne(roles=[roles.OUTPUT]):
        with pytest.warns(UserWarning, match=ignored):
            out, program = _infer(Identity(), [Double(roles=[roles.OUTPUT])], full(3.0, 2))
        assert [m.name for m in program.managers] == ["double"]
        np.testing.assert_array_equal(out, np.full(2, 6.0))
        with pytest.warns(UserWarning, match=ignored):
            out, program = _infer(Identity(), [], full(3.0, 2))
        assert program.managers == ()
        np.testing.assert_array_equal(out, np.full(2, 3.0))
        out, program = _infer(Identity(), None, full(3.0, 2))  # None: the with blocks
        np.testing.assert_array_equal(out, np.full(2, 4.0))
    with AddOne(roles=[roles.OUTPUT]) as add_one, warnings.catch_warnings():
        warnings.simplefilter("error")  # listed too: nothing is ignored
        out, _ = _infer(Identity(), [add_one, Double(roles=[roles.OUTPUT])], full(3.0, 2))
    np.testing.assert_array_equal(out, np.full(2, 7.0))  # (3 * 2) + 1


def test_managers_outside_compile_do_nothing() -> None:
    model = Scale(2)
    with AddOne(roles=[roles.OUTPUT]), managers.Dropout(1.0, roles=[roles.INPUT]):
        np.testing.assert_array_equal(model(ones(2)), model.W[...])


# -- wrap middleware ------------------------------------------------------------------------------

def test_a_wrap_manager_without_filter_wraps_every_application() -> None:
    pair = Pair(2)
    out, _ = _infer(pair, [Times(10.0, where="result")], ones(2))
    a, b = array(pair.a.W[...]), array(pair.b.W[...])
    np.testing.assert_allclose(out, 10 * (10 * a + 10 * b), rtol=1e-6)


def test_a_wrap_manager_with_a_filter_wraps_only_the_selected_bricks() -> None:
    pair = Pair(2)
    out, _ = _infer(pair, [Times(10.0, where="result", bricks=[pair.a])], ones(2))
    np.testing.assert_allclose(out, 10 * array(pair.a.W[...]) + array(pair.b.W[...]), rtol=1e-6)


@pytest.mark.parametrize(("wrap_first", "expected"), [(True, 3 * 2 + 1), (False, 3 * (2 + 1))])
def test_a_wrap_manager_takes_its_place_in_the_chain(wrap_first: bool, expected: float) -> None:
    times, add = Times(3.0), AddOne(roles=[roles.INPUT])
    out, _ = _infer(Identity(), [times, add] if wrap_first else [add, times], full(2.0, 2))
    np.testing.assert_array_equal(out, np.full(2, expected))


def test_a_wrap_manager_sees_the_training_flag() -> None:
    class TrainOnly(gm.Manager):
        def wrap(self, call, next, args, kwargs):
            out = next(*args, **kwargs)
            return out + 1 if call.training else out

    program = gm.compile(apply_model, Identity(), managers=[TrainOnly()])
    x = ones(2)
    variables = program.init(x)
    np.testing.assert_array_equal(program.train(variables, x, rng=key(0))[0], np.full(2, 2.0))
    np.testing.assert_array_equal(program.infer(variables, x), x)
