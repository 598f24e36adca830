"""Anneal: a dynamic hyperparameter follows fn(time), changes training, never retraces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphmod as gm
from graphmod.plugins import Anneal
from tests.loop.conftest import Problem
from tests.loop.plugins.conftest import host


@pytest.fixture(scope="module")
def annealed() -> Problem:
    # Every test of this module feeds batches of 8 only, so the step has one signature.
    return Problem(dropout=gm.dynamic(0.5))


def _rate(problem: Problem, state: gm.TrainState) -> float:
    return float(problem.dropout.hparam("rate").get(state.variables))


def test_the_rate_follows_fn_of_time_and_changes_training_without_retrace(
        annealed: Problem) -> None:
    fn = lambda t: 0.3 * (1 - t.step / 24)
    anneal = Anneal(annealed.dropout.hparam("rate"), fn)
    seen: list[tuple[str, int, float]] = []
    loop = gm.Loop(annealed.step, annealed.source(8), epochs=2, plugins=[anneal])
    loop.on(gm.On("begin") | gm.On("step"),
            lambda e: seen.append((e.type, e.time.step, _rate(annealed, e.loop.state))))
    state = loop.run(annealed.state())
    assert anneal.name == "anneal_dropout_rate"
    assert seen[0] == ("begin", 0, pytest.approx(0.3))  # set before the first step
    np.testing.assert_allclose([r for _, _, r in seen[1:]],
                               np.float32([fn(gm.Time(step=s)) for s in range(1, 25)]))
    assert _rate(annealed, state) == np.float32(fn(loop.time)) == 0.0
    assert annealed.dropout.hparam("rate").get(state.variables).dtype == jnp.float32
    plain = gm.Loop(annealed.step, annealed.source(8), epochs=2).run(annealed.state())
    assert _rate(annealed, plain) == 0.5
    differs = jax.tree.map(lambda a, b: not np.array_equal(a, b), host(state.variables["model"]),
                           host(plain.variables["model"]))
    assert all(jax.tree.leaves(differs))
    assert annealed.step._step._cache_size() == 1


def test_a_constant_anneal_trains_exactly_like_no_anneal(annealed: Problem) -> None:
    rate = annealed.dropout.hparam("rate")
    kept = gm.Loop(annealed.step, annealed.source(8), epochs=1,
                   plugins=[Anneal(rate, lambda t: 0.5)]).run(annealed.state())
    plain = gm.Loop(annealed.step, annealed.source(8), epochs=1).run(annealed.state())
    jax.tree.map(np.testing.assert_array_equal, host(kept.variables), host(plain.variables))


def test_an_unchanged_value_is_not_written_again(annealed: Problem, monkeypatch) -> None:
    writes: list[int] = []
    update_state = gm.Loop.update_state

    def counted(loop: gm.Loop, fn):
        writes.append(loop.time.step)
        return update_state(loop, fn)

    monkeypatch.setattr(gm.Loop, "update_state", counted)
    rate = annealed.dropout.hparam("rate")
    loop = gm.Loop(annealed.step, annealed.source(8), epochs=3,
                   plugins=[Anneal(rate, lambda t: 0.5 - 0.1 * t.epoch)])
    state = loop.run(annealed.state())
    # Before the first step, then at the first step event of epochs 1 and 2 (12 steps each).
    assert len(annealed.source(8)) == 12 and writes == [0, 13, 25]
    assert _rate(annealed, state) == np.float32(0.3)
    constant = Anneal(rate, lambda t: 0.25)
    for _ in range(2):  # each run writes its first value, whatever the last run wrote
        again = gm.Loop(annealed.step, annealed.source(8), steps=2,
                        plugins=[constant]).run(annealed.state())
        assert _rate(annealed, again) == np.float32(0.25)
    assert writes[3:] == [0, 0]


def test_every_chooses_when_the_value_changes(annealed: Problem) -> None:
    fn = lambda t: 0.1 * t.epoch
    seen: list[float] = []
    loop = gm.Loop(annealed.step, annealed.source(8), epochs=3,
                   plugins=[Anneal(annealed.dropout.hparam("rate"), fn, every="epoch_end")])
    loop.on("epoch_begin", lambda e: seen.append(_rate(annealed, e.loop.state)))
    loop.run(annealed.state())
    np.testing.assert_allclose(seen, np.float32([0.0, 0.1, 0.2]))


def test_bad_arguments_are_named(annealed: Problem) -> None:
    rate = annealed.dropout.hparam("rate")
    with pytest.raises(TypeError, match=r"Anneal\(hparam\): expected a graphmod.HParam"):
        Anneal("rate", lambda t: 0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fn must be callable"):
        Anneal(rate, 0.1)  # type: ignore[arg-type]
    loop = gm.Loop(annealed.step, annealed.source(8), epochs=1,
                   plugins=[Anneal(rate, lambda t: None)])
    with pytest.raises(gm.PluginError, match=r"'anneal_dropout_rate' raised in setup.*returned "
                                             r"None") as caught:
        loop.run(annealed.state())
    assert isinstance(caught.value.__cause__, ValueError)
    loop = gm.Loop(annealed.step, annealed.source(8), epochs=1,
                   plugins=[Anneal(gm.HParam("noise", "std"), lambda t: 0.1)])
    with pytest.raises(gm.PluginError, match=r"raised in setup.*noise.std.*compiled into the "
                                             r"program") as caught:
        loop.run(annealed.state())
    assert isinstance(caught.value.__cause__, KeyError)



def test_a_value_outside_the_hparams_range_is_refused_before_it_is_written(
        annealed: Problem) -> None:
    rate = annealed.dropout.hparam("rate")
    assert rate.valid == (0.0, 1.0) and rate == gm.HParam("dropout", "rate")
    written: list[float] = []
    loop = gm.Loop(annealed.step, annealed.source(8), epochs=1,
                   plugins=[Anneal(rate, lambda t: 0.5 + 0.25 * t.step)])
    loop.on("step", lambda e: written.append(_rate(annealed, e.loop.state)))
    with pytest.raises(gm.PluginError, match=r"on the 'step' event at step 3.*returned 1\.25, "
                                             r"outside the valid range \[0\.0, 1\.0\] of "
                                             r"hyperparameter 'rate' of manager 'dropout'; "
                                             r"make fn return values in \[0\.0, 1\.0\]"):
        loop.run(annealed.state())
    assert written == [0.75, 1.0] and _rate(annealed, loop.state) == 1.0  # 1.25 never was
