"""Print: prints times and named metrics on whatever events it is registered for."""

from __future__ import annotations

import io

import pytest

import graphmod as gm
from graphmod import On, each
from graphmod.plugins import Print
from tests.loop.conftest import Problem
from tests.loop.plugins.conftest import counting, fire_scores


def test_print_on_any_template_prints_the_due_metrics(problem: Problem, capsys) -> None:
    losses: list[float] = []
    template = On("step", examples=each(40))
    loop = gm.Loop(problem.step, problem.source(8), epochs=1)
    loop.on(template, lambda e: losses.append(float(e.metrics["loss"])))
    loop.on(template, Print("loss"))
    loop.run(problem.state())
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"step 5  epoch 0  examples 40  loss {losses[0]:.4g}",
                     f"step 10  epoch 0  examples 80  loss {losses[1]:.4g}"]


def test_print_reads_metrics_only_when_due(problem: Problem) -> None:
    step, reads = counting(problem.step)
    out = io.StringIO()
    gm.Loop(step, problem.source(8), epochs=2,
            plugins=[Print("loss", every=On("epoch_end"), file=out)]).run(problem.state())
    assert reads[0] == 2 and len(out.getvalue().splitlines()) == 2


def test_print_shows_a_fired_events_own_metrics_and_all_when_unnamed(problem: Problem) -> None:
    out = io.StringIO()
    loop = gm.Loop(problem.step, problem.source(32), epochs=2,
                   plugins=[Print("valid/loss", every="validated", file=out)])
    loop.on("epoch_end", fire_scores([0.5, 0.25]))
    loop.on(On("step", step=each(6)), Print(file=out, name="print_all"))
    loop.run(problem.state())
    lines = out.getvalue().splitlines()
    assert lines[0] == "validated  step 3  epoch 1  examples 96  valid/loss 0.5"
    assert lines[1].startswith("step 6  epoch 1  examples 192  loss ")
    assert lines[2] == "validated  step 6  epoch 2  examples 192  valid/loss 0.25"


def test_a_misspelt_metric_warns_at_the_end(problem: Problem) -> None:
    out = io.StringIO()
    loop = gm.Loop(problem.step, problem.source(32), epochs=1,
                   plugins=[Print("los", every="epoch_end", file=out)])
    with pytest.warns(UserWarning, match=r"no event it printed had the metric\(s\) \['los'\]"):
        loop.run(problem.state())
    assert out.getvalue() == "epoch_end  step 3  epoch 1  examples 96\n"


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match=r"Print\(\*metric_names\): metric names"):
        Print("loss", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Print\(every=...\)"):
        Print("loss", every=each(3))  # type: ignore[arg-type]
