"""EarlyStopping on scripted validation scores: patience, min_delta, modes, restoring the best."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import graphmod as gm
from graphmod.plugins import EarlyStopping
from tests.loop.conftest import Problem
from tests.loop.plugins.conftest import fire_scores, host


def _run(problem: Problem, scores: list[float], stop: EarlyStopping, epochs: int,
         register: str = "plugins", metric: str = "valid/loss",
         ) -> tuple[gm.TrainState, gm.Loop, dict[int, dict]]:
    kept: dict[int, dict] = {}  # host copies of the variables at each validation, by step
    loop = gm.Loop(problem.step, problem.source(32), epochs=epochs,
                   plugins=[stop] if register == "plugins" else [])
    if register == "on":
        loop.on("validated", stop)
    loop.on("epoch_end", fire_scores(scores, metric))
    loop.on("validated", lambda e: kept.update({e.time.step: host(e.state.variables)}))
    return loop.run(problem.state()), loop, kept


def _assert_same(a: dict, b: dict) -> None:
    jax.tree.map(np.testing.assert_array_equal, host(a), host(b))


def test_stops_after_patience_and_restores_the_best(problem: Problem) -> None:
    stop = EarlyStopping("valid/loss", patience=2)
    state, loop, kept = _run(problem, [3.0, 2.0, 2.5, 2.4, 1.0], stop, epochs=9)
    assert loop.time.step == 12 and (stop.stopped_step, stop.best, stop.best_step) == (12, 2.0, 6)
    assert int(state.step) == 6
    _assert_same(state.variables, kept[6])


def test_restores_the_best_when_it_never_triggered(problem: Problem) -> None:
    stop = EarlyStopping("valid/loss", patience=10)
    state, loop, kept = _run(problem, [3.0, 1.0, 2.0, 2.5], stop, epochs=4)
    assert loop.time.step == 12 and stop.stopped_step is None and stop.best_step == 6
    assert int(state.step) == 6
    _assert_same(state.variables, kept[6])


def test_max_mode_with_min_delta_and_no_restore(problem: Problem) -> None:
    stop = EarlyStopping("valid/accuracy", mode="max", min_delta=0.1, patience=2,
                         restore_best=False)
    state, _, _ = _run(problem, [0.5, 0.55, 0.59, 0.9], stop, epochs=9,
                       metric="valid/accuracy")
    assert (stop.best, stop.best_step, stop.stopped_step) == (0.5, 3, 9)
    assert int(state.step) == 9 and stop.best_state is None  # nothing copied when not needed


def test_registered_for_validated_only_it_restores_when_the_run_ends(problem: Problem) -> None:
    stop = EarlyStopping("valid/loss", patience=10)
    state, _, kept = _run(problem, [3.0, 1.0, 2.0], stop, epochs=3, register="on")
    assert int(state.step) == 6
    _assert_same(state.variables, kept[6])


def test_plugins_that_see_end_after_it_see_the_restored_state(problem: Problem) -> None:
    steps_at_end: list[int] = []
    loop = gm.Loop(problem.step, problem.source(32), epochs=3)
    loop.on("end", lambda e: steps_at_end.append(int(e.loop.state.step)))  # like a Checkpoint
    loop.on(EarlyStopping("valid/loss").every, EarlyStopping("valid/loss"))
    loop.on("epoch_end", fire_scores([2.0, 1.0, 3.0]))
    state = loop.run(problem.state())
    assert steps_at_end == [6] and int(state.step) == 6


def test_state_dict_is_json_and_round_trips() -> None:
    stop = EarlyStopping("valid/loss")
    stop.best, stop.best_step, stop.wait = 0.25, 30, 2
    restored = EarlyStopping("valid/loss")
    restored.load_state_dict(json.loads(json.dumps(stop.state_dict())))
    assert restored.state_dict() == stop.state_dict() == {
        "best": 0.25, "best_step": 30, "wait": 2, "stopped_step": None}
    assert not restored.improves(0.25) and restored.improves(0.2)


def test_a_missing_metric_and_bad_arguments_are_named(problem: Problem) -> None:
    loop = gm.Loop(problem.step, problem.source(32), epochs=1,
                   plugins=[EarlyStopping("valid/acc")])
    loop.on("epoch_end", fire_scores([0.5], metric="valid/accuracy"))
    with pytest.raises(gm.PluginError, match=r"'validated' event has no metric 'valid/acc' "
                                             r"\(did you mean 'valid/accuracy'\?\); it has "
                                             r"\['valid/accuracy'\]"):
        loop.run(problem.state())
    with pytest.raises(ValueError, match=r"EarlyStopping\(mode='median'\)"):
        EarlyStopping("loss", mode="median")
    with pytest.raises(ValueError, match=r"EarlyStopping\(patience=0\)"):
        EarlyStopping("loss", patience=0)
    with pytest.raises(ValueError, match=r"EarlyStopping\(min_delta=-1\)"):
        EarlyStopping("loss", min_delta=-1)
