"""Profile: jax.profiler traces of chosen steps where TensorBoard reads them, brick paths in
them, fused steps cut at the trace's end, bad input refused."""

from __future__ import annotations

import glob
import os

import jax
import pytest

import graphmod as gm
from graphmod import On, at
from graphmod.plugins import Logger, Profile
from tests.loop.conftest import Problem


def _profile_steps(loop: gm.Loop) -> list[int]:
    """The steps at which the loop called the profile plugin."""
    return [d.step for d in loop.trace if d.plugin == "profile"]


def test_a_trace_of_two_steps_is_where_tensorboard_reads_it_and_names_brick_paths(
        problem: Problem, tmp_path) -> None:
    profile = Profile(tmp_path / "prof", every=On("step", step=at(3)), steps=2)
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[profile])
    loop.run(problem.state())
    assert _profile_steps(loop) == [3, 5]  # begun after step 3, ended after step 5
    [run] = profile.traces
    assert os.path.dirname(run) == str(tmp_path / "prof" / "plugins" / "profile")
    [xplane] = glob.glob(os.path.join(run, "*.xplane.pb"))
    with open(xplane, "rb") as f:
        data = f.read()
    # graphmod's named scopes: the MLP's linear layers by path and application
    assert b"linear_layers/0.apply" in data and b"linear_layers/1.apply" in data


def test_fused_steps_stop_where_the_trace_ends(problem: Problem, tmp_path) -> None:
    profile = Profile(tmp_path, every=On("step", step=at(3)), steps=2)
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, steps_per_call=4,
                   plugins=[profile])
    loop.run(problem.state())
    assert _profile_steps(loop) == [3, 5] and len(profile.traces) == 1


def test_without_a_directory_traces_go_beside_the_loggers_log(problem: Problem,
                                                              tmp_path) -> None:
    log = Logger(tmp_path / "run", every=On("epoch_end"))
    profile = Profile(every=On("step", step=at(2)), steps=1)
    gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[log, profile]).run(
        problem.state())
    [run] = profile.traces
    assert run.startswith(str(tmp_path / "run" / "plugins" / "profile") + os.sep)
    assert os.path.exists(tmp_path / "run" / "log.csv")


def test_a_run_ending_inside_a_trace_ends_the_trace(problem: Problem, tmp_path) -> None:
    profile = Profile(tmp_path, every=On("step", step=at(2)), steps=50)
    gm.Loop(problem.step, problem.source(8), steps=4, plugins=[profile]).run(problem.state())
    assert len(profile.traces) == 1
    jax.profiler.start_trace(str(tmp_path / "again"))  # no trace is left running
    jax.profiler.stop_trace()


def test_matches_during_a_trace_are_ignored_and_later_ones_trace_again(
        problem: Problem, tmp_path) -> None:
    profile = Profile(tmp_path, every=On("step", step=at(1, 2, 8)), steps=3)
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[profile])
    loop.run(problem.state())
    assert _profile_steps(loop) == [1, 2, 4, 8, 11]


@pytest.mark.parametrize("steps", [0, -1, True, 2.0])
def test_a_bad_number_of_steps_is_refused(steps: object) -> None:
    with pytest.raises(ValueError, match=r"Profile\(steps=.*positive int"):
        Profile("unused", steps=steps)  # type: ignore[arg-type]


def test_a_directory_that_is_a_file_is_refused(tmp_path) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("x")
    with pytest.raises(NotADirectoryError, match=r"notes\.txt.*is a file"):
        Profile(file)


def test_no_directory_and_no_logger_is_refused_before_the_first_step(problem: Problem) -> None:
    seen: list[int] = []
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[Profile()])
    loop.on("step", lambda e: seen.append(e.time.step))
    with pytest.raises(gm.PluginError, match=r"Profile\(directory=\.\.\.\) or add a Logger"):
        loop.run(problem.state())
    assert seen == []
