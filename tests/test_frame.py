"""The frame owns its state: read-only views, verbs, and the named errors it raises."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._tracing import _context
from graphmod._core._tracing._trace import TraceScope
from graphmod.errors import ManagerConflict, StateEscapesTransform

X, Y = jnp.ones((8, 4)), jnp.zeros(8, jnp.int32)


def _mlp() -> gm.bricks.MLP:
    return gm.bricks.MLP([4, 5, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))


def _cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def test_two_exclusive_rewrites_of_one_variable_are_a_manager_conflict() -> None:
    mlp = _mlp()
    program = gm.compile(_cost, mlp, managers=[
        managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT]),
        managers.BatchNorm(bricks=[gm.bricks.Linear], roles=[roles.OUTPUT], manager_name="bn2"),
    ])
    with pytest.raises(ManagerConflict, match=r"'bn2' and 'batch_norm'.*/linear_layers/0") as info:
        program.init(X, Y)
    assert isinstance(info.value, ValueError)


def test_use_manager_with_a_name_in_the_chain_is_a_manager_conflict() -> None:
    mlp = _mlp()
    def fn(m: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
        return m(x, use_manager=managers.Dropout(0.5, roles=[roles.OUTPUT])).sum()

    program = gm.compile(fn, mlp, managers=[managers.Dropout(0.1, roles=[roles.INPUT])])
    with pytest.raises(ManagerConflict, match=r"named 'dropout' is already active") as info:
        program.init(X, Y)
    assert isinstance(info.value, ValueError)


class Jitted(gm.Brick):
    """A brick whose linear layer runs inside a raw ``jax.jit``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = gm.bricks.Linear(4, 4, rngs=rngs)

    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x: jax.Array) -> jax.Array:
        return jax.jit(lambda x: self.lin(x))(x)


def test_state_updated_under_a_raw_transform_escapes_it() -> None:
    model = Jitted(nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), model, managers=[
        managers.BatchNorm(bricks=[model.lin], roles=[roles.OUTPUT])])
    variables = program.init(X)
    with pytest.raises(StateEscapesTransform, match=r"/lin.*graphmod\.scan") as info:
        program.train(variables, X, rng=jax.random.key(0))
    assert isinstance(info.value, RuntimeError)


def test_a_trace_scope_refuses_side_outputs_only_in_inner_traces() -> None:
    scope = TraceScope()
    scope.check("writing /.W", "")  # the base trace: fine
    refused: list[str] = []

    def inner(x: jax.Array) -> jax.Array:
        with pytest.raises(StateEscapesTransform, match=r"writing /\.W in here.*graphmod.scan"):
            scope.check("writing /.W", " in here")
        refused.append("yes")
        return x

    jax.jit(inner)(jnp.ones(2))
    assert refused == ["yes"]


def _frame_of(fn: Any, model: Any, *args: Any, **compile_kwargs: Any) -> Any:
    """The frame of the init trace of ``fn`` over ``model``."""
    seen: list[Any] = []

    def traced(m: Any, *a: Any) -> Any:
        seen.append(_context.current_frame())
        return fn(m, *a)

    gm.compile(traced, model, **compile_kwargs).init(*args)
    return seen[0]


def test_the_frame_views_are_read_only() -> None:
    frame = _frame_of(lambda m, x: m(x), _mlp(), X)
    for name in ("values", "monitored", "rewrites", "matches", "records", "owned_roles",
                 "calls", "base_trace"):
        with pytest.raises(AttributeError):
            setattr(frame, name, {})
    assert frame.calls == [] and frame.out is not None


def test_graphmod_scan_restores_the_frame_it_found() -> None:
    linear = gm.bricks.Linear(4, 4, rngs=nnx.Rngs(0))
    found: dict[str, Any] = {}

    def fn(m: Any, x: jax.Array) -> jax.Array:
        frame = _context.current_frame()
        before = (frame.base_trace, frame.monitored)
        carry, _ = gm.scan(lambda c, _: (m(c), None), x, length=3)
        found["same"] = (frame.base_trace == before[0], frame.monitored is before[1])
        found["calls"] = frame.next_call_id("/", "apply")
        return carry

    monitor = {"": gm.VariableFilter(roles=[roles.OUTPUT])}
    program = gm.compile(fn, linear, monitor=monitor)
    _, _, monitored = program.train(program.init(X), X, rng=jax.random.key(0))
    assert found["same"] == (True, True)
    assert found["calls"] == 1  # the body's call is counted once, however often it is traced
    assert monitored["/.apply.output"].shape == (3, 8, 4)  # stacked over the scanned axis
