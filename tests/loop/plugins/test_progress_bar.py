"""ProgressBar: advances by the steps each event covers, reads metrics only when due,
closes on error."""

from __future__ import annotations

import io

import pytest

import graphmod as gm
from graphmod import On, at, each
from graphmod.plugins import ProgressBar
from tests.loop.conftest import Problem
from tests.loop.plugins.conftest import counting


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
