"""The loop: events, templates, ordering, termination, speed contracts, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphmod as gm
from graphmod import On, always, at, each
from graphmod.data import ArraySource
from tests.loop.conftest import Problem


class Recorder(gm.Plugin):
    def __init__(self, log: list, name: str, **kwargs: object) -> None:
        super().__init__(name=name, **kwargs)
        self.log = log

    def __call__(self, event: gm.Event) -> None:
        self.log.append((self.name, event.type, event.time.step))


def test_events_in_order_with_lifo_end_events(problem: Problem) -> None:
    log: list = []
    loop = gm.Loop(problem.step, problem.source(32), epochs=2,
                   plugins=[Recorder(log, "a"), Recorder(log, "b")])
    loop.run(problem.state())
    types = [t for name, t, _ in log if name == "a"]
    assert types == ["begin", "epoch_begin", "step", "step", "step", "epoch_end",
                     "epoch_begin", "step", "step", "step", "epoch_end", "end"]
    ends = [name for name, t, _ in log if t == "epoch_end"]
    assert ends == ["b", "a", "b", "a"]
    begins = [name for name, t, _ in log if t == "epoch_begin"]
    assert begins == ["a", "b", "a", "b"]
    trace = [(d.event, d.plugin) for d in loop.trace if d.event == "end"]
    assert trace == [("end", "b"), ("end", "a")]
    assert "epoch_end" in str(loop.trace)


def test_priority_reorders_dispatch(problem: Problem) -> None:
    log: list = []
    loop = gm.Loop(problem.step, problem.source(32), steps=1,
                   plugins=[Recorder(log, "low"), Recorder(log, "high", priority=5)])
    loop.run(problem.state())
    assert [n for n, t, _ in log if t == "begin"] == ["high", "low"]


def test_templates_match_type_issuer_and_fields(problem: Problem) -> None:
    hits: dict[str, list] = {"examples": [], "pred": [], "either": [], "value": []}
    loop = gm.Loop(problem.step, problem.source(8), epochs=1)
    loop.on(On("step", examples=each(20)), lambda e: hits["examples"].append(e.time.examples))
    loop.on(On("step", step=lambda s: s % 5 == 0), lambda e: hits["pred"].append(e.time.step))
    loop.on(On("begin") | On("end"), lambda e: hits["either"].append(e.type))
    loop.on(On("step", step=3), lambda e: hits["value"].append(e.time.step))
    loop.run(problem.state())
    assert hits["examples"] == [24, 40, 64, 80]  # once per multiple of 20 crossed
    assert hits["pred"] == [5, 10]
    assert hits["either"] == ["begin", "end"]
    assert hits["value"] == [3]


def test_plugin_fired_events_come_after_the_current_event(problem: Problem) -> None:
    log: list = []

    def fire(event: gm.Event) -> None:
        log.append(("fire", event.type))
        event.loop.fire("custom", value=event.time.step)

    loop = gm.Loop(problem.step, problem.source(32), steps=1)
    loop.on(On("step"), fire)
    loop.on(On("step"), lambda e: log.append(("second", e.type)))
    loop.on(On("custom", issuer="fire"), lambda e: log.append(("custom", e.value)))
    loop.run(problem.state())
    assert log == [("fire", "step"), ("second", "step"), ("custom", 1)]


def test_terminate_stops_after_the_current_step(problem: Problem) -> None:
    seen: list = []
    loop = gm.Loop(problem.step, problem.source(8), epochs=5)
    loop.on(On("step", step=at(3)), lambda e: e.loop.terminate())
    loop.on(On("step"), lambda e: seen.append(e.time.step))
    state = loop.run(problem.state())
    assert seen == [1, 2, 3] and int(state.step) == 3


class Guarded:
    """A device value that fails loudly when anything fetches it to the host."""

    def __init__(self, value: jax.Array) -> None:
        self.value = value

    def _fetch(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("the loop fetched a metric to the host")

    __float__ = __int__ = __bool__ = __array__ = __index__ = _fetch
    item = tolist = block_until_ready = _fetch


def _guard(step: object) -> object:
    def guarded(state: object, **batch: object) -> tuple[object, dict]:
        state, metrics = step(state, **batch)  # type: ignore[operator]
        return state, {k: Guarded(v) for k, v in metrics.items()}
    return guarded


def test_the_step_path_never_waits_on_the_device(problem: Problem) -> None:
    # transfer_guard catches real device-to-host copies (on accelerators); Guarded metrics
    # catch any fetch on every backend, CPU included.
    quiet = gm.Loop(_guard(problem.step), problem.source(8), epochs=3)
    state = problem.state()
    jax.block_until_ready(state)
    with jax.transfer_guard_device_to_host("disallow"):
        state = quiet.run(state)
    assert int(state.step) == 36
    # The check can fail: a due plugin that reads a metric does fetch it.
    due = gm.Loop(_guard(problem.step), problem.source(8), epochs=3)
    due.on(On("epoch_end", epoch=at(3)), lambda e: float(e.metrics["loss"]))
    with pytest.raises(gm.PluginError, match="the loop fetched a metric"):
        due.run(problem.state())


@pytest.mark.parametrize("k", [4, 7])
def test_steps_per_call_is_bitwise_identical_and_fires_at_the_same_times(k: int) -> None:
    runs = []
    for steps_per_call in (1, k):
        problem = Problem()
        fired: list = []
        loop = gm.Loop(problem.step, problem.source(8), epochs=2, steps_per_call=steps_per_call)
        loop.on(On("step", step=each(5)), lambda e, f=fired: f.append(e.time.step))
        loop.on(On("step", examples=each(36) & ~at(72)),
                lambda e, f=fired: f.append(("ex", e.time.examples)))
        state = loop.run(problem.state())
        runs.append((jax.tree.map(np.asarray, state.variables), fired, int(state.step)))
    (a, fired_a, steps_a), (b, fired_b, steps_b) = runs
    assert steps_a == steps_b == 24 and fired_a == fired_b and fired_a
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_update_state_casts_and_annealing_does_not_retrace() -> None:
    problem = Problem(dropout=gm.dynamic(0.5))
    handle = problem.dropout.hparam("rate")
    rates: list = []

    def anneal(event: gm.Event) -> None:
        rate = 0.5 * (1 - event.time.step / 12)
        event.loop.update_state(lambda s: s._replace(variables=handle.set(s.variables, rate)))
        rates.append(float(handle.get(event.loop.state.variables)))

    loop = gm.Loop(problem.step, problem.source(8), epochs=1)
    loop.on(On("step"), anneal)
    loop.run(problem.state())
    assert problem.step._step._cache_size() == 1
    np.testing.assert_allclose(rates[-1], 0.0, atol=1e-6)
    assert handle.get(loop.state.variables).dtype == jnp.float32


def test_bad_input_gets_clear_errors(problem: Problem) -> None:
    with pytest.raises(ValueError, match="arrays are empty"):
        ArraySource({"x": np.zeros((0, 4))}, 2)
    with pytest.raises(ValueError, match="data source is empty"):
        gm.Loop(problem.step, [], epochs=1)
    with pytest.raises(ValueError, match=r"yielded no batch in epoch 0"):
        gm.Loop(problem.step, iter([]), epochs=1).run(problem.state())
    with pytest.raises(ValueError, match=r"Loop\(steps_per_call=0\)"):
        gm.Loop(problem.step, problem.source(), steps_per_call=0)
    with pytest.raises(TypeError, match=r"loop.on\(template\): expected On\(...\).*each\(10\)"):
        gm.Loop(problem.step, problem.source()).on(each(10), print)
    with pytest.raises(ValueError, match=r"On\('step', loss=...\): a schedule needs a timeline"):
        On("step", loss=each(3))
    with pytest.raises(TypeError, match=r"both sides must be schedules"):
        On("step", step=each(3) | 4)
    wrong = ArraySource({"x": problem.x[:, :3], "y": problem.y}, 8)
    with pytest.raises(ValueError, match=r"argument 'x': expected shape \(batch, 4\)"):
        gm.Loop(problem.step, wrong).run(problem.state())


def test_a_plugin_that_raises_stops_the_loop_and_is_named(problem: Problem) -> None:
    seen: list = []

    class Saver(gm.Plugin):
        def on_interrupt(self, event: gm.Event) -> None:
            seen.append(("interrupt", event.time.step, type(event.error).__name__))

        def teardown(self, loop: gm.Loop, error: BaseException | None) -> None:
            seen.append(("teardown", type(error).__name__))

    def broken(event: gm.Event) -> None:
        raise ZeroDivisionError("boom")

    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[Saver()])
    loop.on(On("step", step=at(2)), broken)
    with pytest.raises(gm.PluginError, match=r"plugin 'broken' raised on the 'step' event at "
                                             r"step 2: ZeroDivisionError: boom"):
        loop.run(problem.state())
    assert seen == [("interrupt", 2, "PluginError"), ("teardown", "PluginError")]


def test_plain_iterables_and_dict_or_tuple_batches(problem: Problem) -> None:
    batches = [(problem.x[i:i + 8], problem.y[i:i + 8]) for i in range(0, 32, 8)]
    state = gm.Loop(problem.step, batches, epochs=2).run(problem.state())
    assert int(state.step) == 8
    assert always(0, 1)


def test_step_middleware_setup_and_teardown_on_keyboard_interrupt(problem: Problem) -> None:
    log: list = []

    class Middleware(gm.Plugin):
        def setup(self, loop: gm.Loop) -> None:
            log.append("setup")

        def teardown(self, loop: gm.Loop, error: BaseException | None) -> None:
            log.append(("teardown", type(error).__name__))

        def wrap_step(self, step: object) -> object:
            def wrapped(state: object, **batch: object) -> object:
                log.append("step")
                return step(state, **batch)  # type: ignore[operator]
            return wrapped

    def interrupt(event: gm.Event) -> None:
        raise KeyboardInterrupt

    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[Middleware()])
    loop.on(On("step", step=at(2)), interrupt)
    with pytest.raises(KeyboardInterrupt):
        loop.run(problem.state())
    assert log == ["setup", "step", "step", ("teardown", "KeyboardInterrupt")]


def test_a_plugin_can_run_a_nested_loop(problem: Problem) -> None:
    inner_steps: list = []

    def nested(event: gm.Event) -> None:
        inner = gm.Loop(problem.step, problem.source(32), steps=2)
        inner.on(On("step"), lambda e: inner_steps.append((e.issuer is inner, e.time.step)))
        inner.run(problem.state())

    loop = gm.Loop(problem.step, problem.source(32), epochs=1)
    loop.on(On("epoch_end"), nested)
    loop.run(problem.state())
    assert inner_steps == [(True, 1), (True, 2)] and loop.time.step == 3
