"""The loop: events, templates, ordering, termination, speed contracts, bad input."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator

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


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_a_step_limit_on_an_epochs_last_batch_still_ends_the_epoch(
        problem: Problem, steps_per_call: int) -> None:
    log: list = []
    loop = gm.Loop(problem.step, problem.source(32), steps=6, steps_per_call=steps_per_call,
                   plugins=[Recorder(log, "a")])  # three batches an epoch: two whole epochs
    loop.run(problem.state())
    assert [(t, step) for _, t, step in log if t != "step"] == [
        ("begin", 0), ("epoch_begin", 0), ("epoch_end", 3), ("epoch_begin", 3),
        ("epoch_end", 6), ("end", 6)]
    assert (loop.time.epoch, loop.position) == (2, 0)

    log.clear()
    loop = gm.Loop(problem.step, problem.source(32), steps=5, steps_per_call=steps_per_call,
                   plugins=[Recorder(log, "a")])  # the second epoch stops before its end
    loop.run(problem.state())
    assert [t for _, t, _ in log if t != "step"] == [
        "begin", "epoch_begin", "epoch_end", "epoch_begin", "end"]
    assert (loop.time.epoch, loop.position) == (1, 2)


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


def test_a_plugin_with_a_settle_method_of_its_own_runs_as_any_other(problem: Problem) -> None:
    class Settling(gm.Plugin):  # a user's plugin that happens to name a method settle
        calls = 0

        def on_step(self, event: gm.Event) -> None:
            self.calls += 1

        def settle(self) -> None:
            raise AssertionError("not the loop's to call: the plugin has no due event")

    plugin = Settling(name="settling")
    gm.Loop(problem.step, problem.source(), epochs=1, plugins=[plugin]).run(problem.state())
    assert plugin.calls > 0


def test_bad_input_gets_clear_errors(problem: Problem) -> None:
    with pytest.raises(ValueError, match="arrays are empty"):
        ArraySource({"x": np.zeros((0, 4))}, 2)
    with pytest.raises(ValueError, match="data source is empty"):
        gm.Loop(problem.step, [], epochs=1)
    with pytest.raises(ValueError, match=r"yielded no batch in epoch 0"):
        gm.Loop(problem.step, iter([]), epochs=1).run(problem.state())
    batches = (batch for batch in problem.source())  # the data loaders guide's generator
    with pytest.raises(ValueError, match=r"Loop\(step, data, epochs=2\): data is a generator, "
                       r"an iterator that its first epoch uses up; .*a list of batches"):
        gm.Loop(problem.step, batches, epochs=2)
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


def test_batches_the_function_cannot_take_are_refused_before_any_plugin_writes(
        problem: Problem, tmp_path: object) -> None:
    directory = tmp_path / "run"  # type: ignore[operator]
    renamed = ArraySource({"x": problem.x, "label": problem.y}, 8)
    with pytest.raises(TypeError, match=r"Loop.run: the data's batches: <lambda>\(m, x, y\) "
                       r"cannot take keyword arguments \['label', 'x'\].*name the data's "
                       r"fields after <lambda>'s arguments"):
        gm.Loop(problem.step, renamed, steps=2,
                plugins=[gm.plugins.Checkpoint(directory)]).run(problem.state())
    assert not directory.exists()  # before: step 0 saved, with "continue with: resume"
    extra = ArraySource({"x": problem.x, "y": problem.y, "index": np.arange(96)}, 8)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'index'"):
        gm.Loop(problem.step, extra, steps=2).run(problem.state())
    plain = [{"x": problem.x[:8], "label": problem.y[:8]}]  # not read ahead: the trace tells
    with pytest.raises(TypeError, match=r"the train step: <lambda>\(m, x, y\) cannot take"):
        gm.Loop(problem.step, plain, steps=1).run(problem.state())


def test_batches_of_another_feature_size_are_refused_before_anything_is_written(
        problem: Problem, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    directory, log = tmp_path / "run", tmp_path / "log.csv"
    wide = ArraySource({"x": np.ones((96, 5), np.float32), "y": problem.y}, 8)
    chosen = [gm.plugins.Checkpoint(directory), gm.plugins.Logger(str(log))]
    with pytest.raises(ValueError, match=r"Loop.run: the data's batches do not fit the "
                       r"program: argument 'x': expected shape \(batch, 4\) and dtype "
                       r"float32 \(as in init's example\), got shape \(8, 5\)"):
        gm.Loop(problem.step, wide, steps=2, plugins=chosen).run(problem.state())
    assert list(tmp_path.iterdir()) == []  # before: step 0 saved, a header logged
    # A plain iterable is not read ahead: its first step's trace refuses it, and the
    # Checkpoint saves nothing, since no step of the run finished.
    plain = [(np.ones((8, 5), np.float32), problem.y[:8])]
    with pytest.raises(ValueError, match=r"argument 'x': expected shape \(batch, 4\)"):
        gm.Loop(problem.step, plain, steps=1,
                plugins=[gm.plugins.Checkpoint(directory)]).run(problem.state())
    assert "at step 0, before this run finished a step: nothing to save; run it again " \
        "from the start" in capsys.readouterr().err
    assert not directory.exists()
    # The same run, with the data mended, starts in the same directory.
    fixed = [(problem.x[:8], problem.y[:8])] * 2
    state = gm.Loop(problem.step, fixed, epochs=1,
                    plugins=[gm.plugins.Checkpoint(directory)]).run(problem.state())
    assert int(state.step) == 2 and sorted(p.name for p in directory.iterdir()) == ["2"]


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


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (a test runner may have set another), restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class Saver(gm.Plugin):
    """Records the interrupt event and teardown; ``save_on_interrupt`` as a Checkpoint's."""

    save_on_interrupt = True

    def __init__(self, log: list, name: str = "saver") -> None:
        super().__init__(name=name)
        self.log = log

    def on_interrupt(self, event: gm.Event) -> None:
        state = None if event.state is None else int(event.state.step)
        self.log.append((self.name, event.time.step, state, type(event.error).__name__))

    def teardown(self, loop: gm.Loop, error: BaseException | None) -> None:
        self.log.append(("teardown", self.name, type(error).__name__))


def _ctrl_c(log: list) -> Callable[[gm.Event], None]:
    def ctrl_c(event: gm.Event) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # as a user's Ctrl-C: the handler runs right here
        log.append(("ctrl-c", event.time.step))
    return ctrl_c


def test_ctrl_c_stops_after_the_event_and_hands_plugins_the_finished_step(
        problem: Problem, python_sigint: None, capfd: pytest.CaptureFixture) -> None:
    log: list = []
    loop = gm.Loop(problem.step, problem.source(8), epochs=2, plugins=[Saver(log)])
    loop.on(On("step", step=at(3)), _ctrl_c(log))
    loop.on(On("step"), lambda e: log.append(("step", e.time.step)))
    with pytest.raises(KeyboardInterrupt, match=r"^interrupted at step 3$") as info:
        loop.run(problem.state())
    assert log == [("step", 1), ("step", 2), ("ctrl-c", 3), ("step", 3),
                   ("saver", 3, 3, "KeyboardInterrupt"), ("teardown", "saver", "KeyboardInterrupt")]
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(loop.state))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    frames = [frame.name for frame in traceback.extract_tb(info.tb)]
    assert frames[1:] == ["run", "_run_plugins"]  # no traceback through the loop's internals
    err = capfd.readouterr().err
    assert "Ctrl-C: finishing the current step and saving it; press Ctrl-C again" in err
    assert "nothing was saved" not in err  # the saver reports


def test_ctrl_c_without_a_saving_plugin_says_nothing_was_saved(
        problem: Problem, python_sigint: None, capfd: pytest.CaptureFixture) -> None:
    log: list = []
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, steps_per_call=4)
    loop.on(On("step", step=at(2)), _ctrl_c(log))
    with pytest.raises(KeyboardInterrupt, match="interrupted at step 2"):
        loop.run(problem.state())
    assert int(loop.state.step) == 2
    assert ("graphmod: interrupted at step 2; nothing was saved (no plugin saves on an "
            "interrupt: add graphmod.plugins.Checkpoint)") in capfd.readouterr().err


def test_a_second_ctrl_c_in_a_session_aborts_the_remaining_interrupt_handlers(
        problem: Problem, python_sigint: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import graphmod._train._interrupt

    # In a script the second Ctrl-C ends the process (test_interrupt.py); in a notebook or
    # REPL it raises KeyboardInterrupt at once, so the session survives.
    monkeypatch.setattr(graphmod._train._interrupt, "_interactive", lambda: True)
    log: list = []

    class Slow(Saver):
        def on_interrupt(self, event: gm.Event) -> None:
            super().on_interrupt(event)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again while this one "saves"
            log.append("slow save finished")

    loop = gm.Loop(problem.step, problem.source(8), epochs=1,
                   plugins=[Saver(log, "first"), Slow(log, "slow")])
    loop.on(On("step", step=at(2)), _ctrl_c(log))
    with pytest.raises(KeyboardInterrupt, match="interrupted at step 2"):
        loop.run(problem.state())
    assert log == [("ctrl-c", 2), ("slow", 2, 2, "KeyboardInterrupt"),
                   ("teardown", "slow", "KeyboardInterrupt"),
                   ("teardown", "first", "KeyboardInterrupt")]


def test_a_nested_loops_ctrl_c_stops_the_outer_loop_too(
        problem: Problem, python_sigint: None) -> None:
    log: list = []

    def nested(event: gm.Event) -> None:
        inner = gm.Loop(problem.step, problem.source(32), steps=3)
        inner.on(On("step", step=at(1)), _ctrl_c(log))
        inner.run(problem.state())

    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[Saver(log)])
    loop.on(On("step", step=at(2)), nested)
    with pytest.raises(KeyboardInterrupt, match="interrupted at step 2"):
        loop.run(problem.state())
    assert log == [("ctrl-c", 1), ("saver", 2, 2, "KeyboardInterrupt"),
                   ("teardown", "saver", "KeyboardInterrupt")]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_the_last_teardown_still_raises(problem: Problem,
                                                      python_sigint: None) -> None:
    class Late(gm.Plugin):
        def teardown(self, loop: gm.Loop, error: BaseException | None) -> None:
            os.kill(os.getpid(), signal.SIGINT)

    loop = gm.Loop(problem.step, problem.source(8), steps=2, plugins=[Late()])
    with pytest.raises(KeyboardInterrupt, match="interrupted after the run ended at step 2"):
        loop.run(problem.state())


def test_outside_the_main_thread_ctrl_c_handling_is_left_as_it_is(problem: Problem,
                                                                  python_sigint: None) -> None:
    handlers: list = []
    loop = gm.Loop(problem.step, problem.source(8), steps=1)
    loop.on(On("step"), lambda e: handlers.append(signal.getsignal(signal.SIGINT)))
    worker = threading.Thread(target=loop.run, args=(problem.state(),))
    worker.start()
    worker.join(timeout=120)
    assert handlers == [signal.default_int_handler]
    loop = gm.Loop(problem.step, problem.source(8), steps=1)
    loop.on(On("step"), lambda e: handlers.append(signal.getsignal(signal.SIGINT)))
    loop.run(problem.state())  # in the main thread: the loop's own handler, while it runs
    assert handlers[-1] is not signal.default_int_handler


def test_an_interrupt_inside_a_donating_step_call_saves_nothing_rather_than_garbage(
        problem: Problem, capsys: pytest.CaptureFixture) -> None:
    log: list = []

    def cut_off(state: gm.TrainState, **batch: object) -> object:
        out = problem.step(state, **batch)  # has donated `state`
        if int(out[0].step) == 3:
            raise KeyboardInterrupt  # before the loop could store the result
        return out

    loop = gm.Loop(cut_off, problem.source(8), epochs=1, plugins=[Saver(log)])
    with pytest.raises(KeyboardInterrupt):
        loop.run(problem.state())
    assert log[0] == ("saver", 2, None, "KeyboardInterrupt")
    assert ("graphmod: interrupted at step 2; nothing was saved (the step call it cut off had "
            "taken the state)") in capsys.readouterr().err


def test_run_refuses_a_missing_or_wrong_state_naming_the_argument(problem: Problem) -> None:
    loop = gm.Loop(problem.step, problem.source(8), steps=1)
    with pytest.raises(TypeError, match=r"Loop.run\(state\): state is None; pass the train "
                                        r"state.*step.init\("):
        loop.run(None)
    with pytest.raises(TypeError, match=r"Loop.run\(state\): a graphmod.optimize step takes a "
                                        r"graphmod.TrainState, got dict; make one with state = "
                                        r"step.init\(variables, jax.random.key\(0\)\)"):
        loop.run(problem.variables)
    assert loop.state is None and loop.time.step == 0


class Part(gm.Plugin):
    def __init__(self, log: list, name: str, fail_in: tuple[str, ...] = ()) -> None:
        super().__init__(name=name)
        self.log, self.fail_in = log, fail_in

    def setup(self, loop: gm.Loop) -> None:
        self.log.append(("setup", self.name))
        if "setup" in self.fail_in:
            raise OSError("no such device")

    def teardown(self, loop: gm.Loop, error: BaseException | None) -> None:
        self.log.append(("teardown", self.name))
        if "teardown" in self.fail_in:
            raise OSError(f"disk full ({self.name})")

    def on_interrupt(self, event: gm.Event) -> None:
        self.log.append(("interrupt", self.name))


def test_a_setup_error_names_the_plugin_and_tears_down_those_set_up(problem: Problem) -> None:
    log: list = []
    loop = gm.Loop(problem.step, problem.source(8), steps=2, plugins=[
        Part(log, "a"), Part(log, "b"), Part(log, "c", ("setup",)), Part(log, "d")])
    with pytest.raises(gm.PluginError, match=r"^plugin 'c' raised in setup: OSError: no such "
                                             r"device$") as info:
        loop.run(problem.state())
    assert isinstance(info.value.__cause__, OSError)
    assert log == [("setup", "a"), ("setup", "b"), ("setup", "c"),
                   ("teardown", "b"), ("teardown", "a")]  # no interrupt event: nothing ran
    assert loop.time.step == 0


def test_a_teardown_error_names_the_plugin_and_every_teardown_runs(problem: Problem) -> None:
    log: list = []
    loop = gm.Loop(problem.step, problem.source(8), steps=2, plugins=[
        Part(log, "a", ("teardown",)), Part(log, "b"), Part(log, "c", ("teardown",))])
    with pytest.raises(gm.PluginError, match=r"^plugin 'c' raised in teardown: OSError: disk "
                                             r"full \(c\)\n") as info:
        loop.run(problem.state())
    assert [entry for entry in log if entry[0] == "teardown"] == [
        ("teardown", "c"), ("teardown", "b"), ("teardown", "a")]
    assert info.value.__notes__ == ["also: plugin 'a' raised in teardown: OSError: disk full (a)"]
    assert loop.time.step == 2
    # When the run itself failed, its error is the one raised; teardown errors are noted.
    log.clear()
    loop = gm.Loop(problem.step, problem.source(8), steps=4,
                   plugins=[Part(log, "a", ("teardown",)), Part(log, "b")])
    loop.on(On("step", step=at(1)), lambda e: 1 / 0)
    with pytest.raises(gm.PluginError, match="raised on the 'step' event at step 1") as info:
        loop.run(problem.state())
    assert info.value.__notes__ == ["also: plugin 'a' raised in teardown: OSError: disk full (a)"]
    assert ("teardown", "b") in log


def test_train_seconds_are_monotone_and_leave_out_every_plugin_call(problem: Problem) -> None:
    seen: list[tuple[str, gm.Time]] = []
    pause = 0.01

    class Slow(gm.Plugin):
        """Sleeps, and fires an event half-way through its own call."""

        fires = ("checked",)

        def on_step(self, event: gm.Event) -> None:
            if event.time.step % 3 == 0:
                time.sleep(pause)
                event.loop.fire("checked")
                time.sleep(pause)

    loop = gm.Loop(problem.step, problem.source(8), steps=12, plugins=[Slow()])
    loop.on(On("step") | On("checked"), lambda e: seen.append((e.type, e.time)))
    loop.run(problem.state())
    train = [t.train_seconds for _, t in seen]
    assert [kind for kind, _ in seen].count("checked") == 4
    assert train == sorted(train), train  # never backwards, fired events included
    last = seen[-1][1]
    # at least the sleeps before the last step's event (steps 3, 6, 9) were spent in
    # plugins, whatever the machine's speed
    assert last.train_seconds <= last.seconds - 6 * pause


def test_the_dispatch_trace_shows_its_latest_calls_in_a_notebook(problem: Problem) -> None:
    loop = gm.Loop(problem.step, problem.source(8), steps=30)
    loop.on(On("step"), lambda e: None)
    loop.run(problem.state())
    text, page = repr(loop.trace), loop.trace._repr_html_()
    assert text.startswith("DispatchTrace: 30 plugin calls, the latest 20\n")
    assert len(text.splitlines()) == 23 and max(map(len, text.splitlines())) <= 100
    assert page.count("<tr>") == 21
    assert re.search(r"<caption[^>]*>DispatchTrace: 30 plugin calls", page)
    assert len(str(loop.trace).splitlines()) == 32  # print() shows them all
