"""ProgressBar: advances by the steps each event covers, reads metrics only when due,
closes on error."""

from __future__ import annotations

import io
import sys

import pytest

import graphmod as gm
from graphmod import On, at, each
from graphmod.plugins import EarlyStopping, Print, ProgressBar, _progress
from tests.loop.conftest import Problem
from tests.loop.plugins.conftest import counting, fire_scores


def test_bar_advances_by_the_steps_of_each_fused_dispatch(problem: Problem) -> None:
    out = io.StringIO()
    bar = ProgressBar(every=On("step", step=each(4)), file=out, mininterval=0)
    positions: list[int] = []
    loop = gm.Loop(problem.step, problem.source(8), epochs=2, steps_per_call=4, plugins=[bar])
    loop.on(On("step"), lambda e: positions.append(bar.position))
    loop.run(problem.state())
    assert positions == [4, 8, 12, 16, 20, 24]  # 12 steps an epoch, fused 4 by 4
    assert (bar.position, bar.total) == (24, 24)
    assert "24/24" in out.getvalue() and "loss=" in out.getvalue()
    assert set(bar.postfix) == {"loss"}


def test_metrics_are_read_only_when_due_and_at_the_end(problem: Problem) -> None:
    step, reads = counting(problem.step)
    bar = ProgressBar(metrics=("loss",), every=On("step", step=each(5)), file=io.StringIO())
    gm.Loop(step, problem.source(8), epochs=1, plugins=[bar]).run(problem.state())
    assert bar.total == 12
    assert reads[0] == 3  # steps 5 and 10, and once when the run ends


def test_bar_closes_when_the_run_stops_on_an_error(problem: Problem) -> None:
    bar = ProgressBar(total=100, file=io.StringIO())
    opened = []
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[bar])
    loop.on(On("step", step=at(2)), lambda e: opened.append(bar._bar))
    loop.on(On("step", step=at(3)), lambda e: 1 / 0)
    with pytest.raises(gm.PluginError, match="ZeroDivisionError"):
        loop.run(problem.state())
    assert opened[0] is not None and opened[0].disable  # tqdm marks a closed bar disabled
    assert bar._bar is None and bar.position == 3 and bar.total == 100


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"ProgressBar\(total=0\)"):
        ProgressBar(total=0)
    with pytest.raises(TypeError, match=r"ProgressBar\(every=...\): expected On"):
        ProgressBar(every=each(3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metric names must be non-empty strings"):
        ProgressBar(metrics=("loss", 3))  # type: ignore[arg-type]


def test_the_bar_never_waits_on_the_device(problem: Problem, monkeypatch) -> None:
    reads: list[int] = []
    real = _progress.scalar_metrics
    monkeypatch.setattr(_progress, "on_host", lambda metrics: False)  # always in transit
    monkeypatch.setattr(_progress, "scalar_metrics",
                        lambda *a: reads.append(loop.time.step) or real(*a))
    bar = ProgressBar(every=On("step", step=each(2)), file=io.StringIO())
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[bar])
    during: list[dict] = []
    loop.on(On("step"), lambda e: during.append(dict(bar.postfix)))
    loop.run(problem.state())
    assert during == [{}] * 12 and reads == [12]  # read once, when the run was over
    assert set(bar.postfix) == {"loss"}


def test_metrics_show_once_they_reached_the_host(problem: Problem, monkeypatch) -> None:
    monkeypatch.setattr(_progress, "on_host", lambda metrics: True)  # copies land at once
    bar = ProgressBar(every=On("step", step=at(1)), file=io.StringIO())
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[bar])
    shown: list[bool] = []
    loop.on(On("step"), lambda e: shown.append(bool(bar.postfix)))
    loop.run(problem.state())
    assert shown[0] is False and shown[-1] is True  # copied at step 1, shown after


def test_the_bar_says_why_a_run_stopped_early_and_counts_epochs_as_the_loop(
        problem: Problem) -> None:
    out = io.StringIO()
    bar = ProgressBar(file=out, mininterval=0)
    stop = EarlyStopping("valid/loss", patience=2)
    loop = gm.Loop(problem.step, problem.source(32), epochs=9, plugins=[bar, stop])
    loop.on("epoch_end", fire_scores([3.0, 2.0, 2.5, 2.4, 1.0]))
    loop.run(problem.state())
    assert bar.stopped == ("early stopping: no better valid/loss in 2 evaluations (best 2 at "
                           "step 6) (at step 12)")
    text = out.getvalue()
    assert "4/9 epochs: early stopping" in text and "12/27" in text  # after 4 epochs of 9
    finished = ProgressBar(file=io.StringIO())
    gm.Loop(problem.step, problem.source(32), epochs=2, plugins=[finished]).run(problem.state())
    assert finished.stopped is None


def test_the_bar_says_a_run_was_interrupted(problem: Problem) -> None:
    bar = ProgressBar(file=io.StringIO())
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[bar])

    def interrupt(event: gm.Event) -> None:
        raise KeyboardInterrupt

    loop.on(On("step", step=at(3)), interrupt)
    with pytest.raises(KeyboardInterrupt):
        loop.run(problem.state())
    assert bar.stopped == "interrupted (at step 3)"


def test_print_writes_above_an_open_bar(problem: Problem, capsys) -> None:
    bar = ProgressBar(file=sys.stdout, mininterval=0)
    gm.Loop(problem.step, problem.source(8), steps=4, plugins=[
        bar, Print("loss", every=On("step", step=at(2)))]).run(problem.state())
    lines = capsys.readouterr().out.replace("\r", "\n").splitlines()
    printed = [line for line in lines if line.startswith("step 2")]
    assert len(printed) == 1 and "%" not in printed[0]  # a line of its own, not on the bar
