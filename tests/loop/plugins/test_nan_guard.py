"""NaNGuard: stops when skipped steps grow, keeps the last good state, reads only when due."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import graphmod as gm
from graphmod import On, each
from graphmod.data import ArraySource
from graphmod.plugins import NaNGuard
from tests.loop.conftest import Problem
from tests.loop.plugins.conftest import counting, host


@pytest.fixture(scope="module")
def skipping(problem: Problem) -> gm.TrainStep:
    return gm.optimize(problem.program, optax.adam(1e-2), skip_nonfinite=True)


def _source(problem: Problem, bad_rows: slice) -> ArraySource:
    """Batches of 8 in order; the targets of ``bad_rows`` are NaN."""
    y = problem.y.copy()
    y[bad_rows] = np.nan
    return ArraySource({"x": problem.x, "y": y}, 8)


def test_stops_when_steps_are_skipped_and_keeps_the_last_good_state(
        problem: Problem, skipping: gm.TrainStep) -> None:
    guard = NaNGuard(every=On("step", step=each(4)))
    loop = gm.Loop(skipping, _source(problem, slice(40, None)), epochs=1, plugins=[guard])
    with pytest.warns(RuntimeWarning, match=r"3 step\(s\) had a non-finite loss or update "
                                            r"by step 8 .*stopping the run"):
        state = loop.run(problem.state())
    # Steps 6, 7, 8 saw NaN targets: checked at 4 (none yet) and 8 (three), so it stopped.
    assert guard.stopped_step == 8 and loop.time.step == 8
    assert (int(state.step), int(state.skipped), guard.skipped) == (8, 3, 3)
    clean = gm.Loop(skipping, _source(problem, slice(0, 0)), steps=5).run(problem.state())
    jax.tree.map(np.testing.assert_array_equal, host(state.variables), host(clean.variables))


def test_reads_the_count_only_when_due(problem: Problem, skipping: gm.TrainStep) -> None:
    step, reads = counting(skipping)
    gm.Loop(step, _source(problem, slice(0, 0)), epochs=2,
            plugins=[NaNGuard(every=On("step", step=each(5)))]).run(problem.state())
    assert reads[0] == 5  # steps 5, 10, 15, 20, and once at the end (step 24)
    step, reads = counting(skipping)
    gm.Loop(step, _source(problem, slice(0, 0)), epochs=1,
            plugins=[NaNGuard()]).run(problem.state())
    assert reads[0] == 1  # the default, every 100 steps: only the check at the end


def test_the_check_at_the_end_warns(problem: Problem, skipping: gm.TrainStep) -> None:
    guard = NaNGuard()
    loop = gm.Loop(skipping, _source(problem, slice(88, None)), epochs=1, plugins=[guard])
    with pytest.warns(RuntimeWarning, match=r"1 step\(s\) had a non-finite .* by step 12"):
        loop.run(problem.state())
    assert guard.stopped_step is None and guard.skipped == 1


def test_max_skipped_tolerates_a_few_bad_steps(problem: Problem,
                                                skipping: gm.TrainStep) -> None:
    guard = NaNGuard(max_skipped=2, every=On("step", step=each(2)))
    loop = gm.Loop(skipping, _source(problem, slice(16, 32)), epochs=1, plugins=[guard])
    state = loop.run(problem.state())
    assert loop.time.step == 12 and guard.stopped_step is None
    assert int(state.skipped) == guard.skipped == 2


def test_a_step_that_does_not_skip_is_refused(problem: Problem) -> None:
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[NaNGuard()])
    with pytest.raises(gm.PluginError, match=r"'nan_guard' raised in setup.*optimize\(program, "
                                             r"tx, skip_nonfinite=True\)") as caught:
        loop.run(problem.state())
    assert isinstance(caught.value.__cause__, ValueError)
    plain = lambda state, **batch: problem.step(state, **batch)
    loop = gm.Loop(plain, problem.source(8), epochs=1,
                   plugins=[NaNGuard(every=On("step", step=each(2)))])
    with pytest.raises(gm.PluginError, match=r"metrics have no 'skipped_steps'"):
        loop.run(problem.state())
    with pytest.raises(ValueError, match=r"NaNGuard\(max_skipped=-1\)"):
        NaNGuard(max_skipped=-1)
