"""graphmod.typing: real loops, times and application calls satisfy its Protocols, wrong
objects do not, the hooks are annotated with them, and the aliases' examples run."""

from __future__ import annotations

import ast
import doctest
import inspect
import itertools
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import graphmod as gm
from graphmod.data import ArraySource
from graphmod.typing import (
    HookContext,
    LoopLike,
    OwnedVariableLike,
    TimeLike,
    Variables,
    WrapContext,
)


def _program(*managers: gm.Manager) -> gm.Program:
    lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
    return gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin, managers=list(managers))


class _Record(gm.Manager):
    """Records, per hook, whether the call is a HookContext and what it says."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._seen: list[tuple[str, bool, Any, Any, Any]] = []

    def _note(self, hook: str, call: HookContext) -> None:
        self._seen.append((hook, isinstance(call, HookContext), call.path, call.role,
                           call.parameter))

    def rewrite_input(self, call: HookContext, name: str, value: Any) -> Any:
        self._note("input", call)
        return value

    def rewrite_output(self, call: HookContext, name: str, value: Any) -> Any:
        self._note("output", call)
        owned = call.variable("calls", jnp.zeros(()))
        self._seen.append(("owned", isinstance(owned, OwnedVariableLike), None, None, None))
        return value

    def rewrite_parameter(self, call: HookContext, name: str, value: Any) -> Any:
        self._note("parameter", call)
        return value

    def wrap(self, call: WrapContext, next: Any, args: tuple, kwargs: dict) -> Any:
        self._seen.append(("wrap", isinstance(call, WrapContext), call.path, call.role,
                           call.parameter))
        return super().wrap(call, next, args, kwargs)


def test_application_calls_in_every_hook_of_a_compiled_trace_are_hook_contexts() -> None:
    """Each hook, ``wrap`` included, is handed an object satisfying its Protocol."""
    recorder = _Record(roles=[gm.roles.INPUT, gm.roles.OUTPUT, gm.roles.WEIGHT])
    program = _program(recorder)
    x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
    variables = program.init(x[:1], y[:1])
    recorder._seen.clear()
    program.train(variables, x, y, rng=jax.random.key(0))  # the jitted training trace
    seen = {hook: (ok, path, role, parameter) for hook, ok, path, role, parameter
            in recorder._seen}
    assert seen == {
        "input": (True, "/", gm.roles.INPUT, None),
        "output": (True, "/", gm.roles.OUTPUT, None),
        "parameter": (True, "/", gm.roles.WEIGHT, "/.W"),
        "owned": (True, None, None, None),
        "wrap": (True, "/", None, None),
    }


def test_a_real_loop_is_loop_like_in_setup_in_events_and_in_teardown() -> None:
    program = _program()
    x, y = np.ones((8, 2), np.float32), np.zeros((8, 1), np.float32)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
    checks: list[tuple[str, bool]] = []

    class Check(gm.Plugin):
        def setup(self, loop: LoopLike) -> None:
            checks.append(("setup", isinstance(loop, LoopLike)))

        def on_step(self, event: gm.Event) -> None:
            checks.append(("event", isinstance(event.loop, LoopLike)
                           and isinstance(event.time, TimeLike)))

        def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
            checks.append(("teardown", isinstance(loop, LoopLike)))

    loop = gm.Loop(step, ArraySource((x, y), batch_size=4), epochs=1, plugins=[Check()])
    assert isinstance(loop, LoopLike)
    loop.run(state)
    assert checks == [("setup", True), ("event", True), ("event", True), ("teardown", True)]


def test_wrong_objects_do_not_satisfy_the_protocols() -> None:
    class AlmostLoop:  # everything a plugin uses but terminate()
        step = data = state = trace = start_time = metrics = None
        time = gm.Time()

        def on(self, template: Any, plugin: Any) -> Any: ...
        def fire(self, type: str, **data: Any) -> None: ...
        def update_state(self, fn: Any) -> None: ...
        def state_dict(self) -> dict: ...
        def load_state_dict(self, meta: dict) -> None: ...

    class AlmostCall:  # a hook's call without rng()
        brick = path = application = call_id = training = None
        role = name = parameter = parameter_value = None

        def variable(self, name: str, init: Any) -> Any: ...
        def add_auxiliary_variable(self, value: Any) -> Any: ...

    class HookOnlyCall(AlmostCall):  # a hook's call: also what wrap sees
        def rng(self) -> Any: ...

    loop = gm.Loop(lambda state, x: (state, {}), [1, 2])
    for wrong in (object(), {}, AlmostLoop(), gm.Time()):
        assert not isinstance(wrong, LoopLike), wrong
    for wrong in (object(), AlmostCall(), loop):
        assert not isinstance(wrong, HookContext), wrong
    assert isinstance(HookOnlyCall(), HookContext)
    assert isinstance(HookOnlyCall(), WrapContext)  # no plumbing beyond a hook's call
    assert not isinstance(3, TimeLike)
    assert not isinstance(object(), OwnedVariableLike)
    assert isinstance(loop, LoopLike)  # the same checks do accept the real thing


def test_hooks_plugins_and_events_are_annotated_with_the_protocols() -> None:
    for hook in ("rewrite_input", "rewrite_output", "rewrite_parameter"):
        assert typing.get_type_hints(getattr(gm.Manager, hook))["call"] is HookContext
    assert typing.get_type_hints(gm.Manager.wrap)["call"] is WrapContext
    assert typing.get_type_hints(gm.Plugin.setup)["loop"] is LoopLike
    assert typing.get_type_hints(gm.Plugin.teardown)["loop"] is LoopLike
    assert typing.get_type_hints(gm.Event)["loop"] is LoopLike
    assert typing.get_type_hints(gm.HParam.set)["return"] == Variables


def test_variables_alias_matches_what_init_returns() -> None:
    variables = _program().init(jnp.ones((1, 2)), jnp.zeros((1, 1)))
    outer, inner = typing.get_args(Variables)[0], typing.get_origin(typing.get_args(Variables)[1])
    assert all(isinstance(k, outer) and isinstance(v, inner) for k, v in variables.items())
    assert sorted(variables) == ["managers", "model"]


def test_the_aliases_docstring_examples_run() -> None:
    """Attribute docstrings are invisible to --doctest-modules: run them here."""
    source = inspect.getsource(gm.typing)
    body = ast.parse(source).body
    documented = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            documented[node.target.id] = after.value.value
    aliases = [name for name in gm.typing.__all__  # all but the Protocols
               if not getattr(getattr(gm.typing, name), "_is_protocol", False)]
    assert sorted(documented) == sorted(aliases)
    assert {"ArrayTree", "Batch", "JSON", "KeyLike", "ShardingRule", "Variables"} <= set(aliases)
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(verbose=False)
    for name, text in documented.items():
        assert ">>>" in text, f"graphmod.typing.{name} has no example"
        runner.run(parser.get_doctest(text, {}, f"graphmod.typing.{name}", None, 0))
    assert runner.summarize(verbose=False).failed == 0
