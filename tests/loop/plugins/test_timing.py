"""Timing: calls and seconds per plugin and event type, beyond the trace's bounded buffer."""

from __future__ import annotations

import io

import graphmod as gm
from graphmod import On, each
from graphmod._train._loop import DispatchTrace
from graphmod.plugins import Print, Timing
from tests.loop.conftest import Problem


def _run(problem: Problem, trace_size: int | None = None) -> tuple[Timing, gm.Loop]:
    timing = Timing()
    loop = gm.Loop(problem.step, problem.source(8), epochs=2,
                   plugins=[timing, Print("loss", every=On("step", step=each(4)),
                                          file=io.StringIO())])
    loop.on("epoch_end", lambda e: None)
    if trace_size is not None:
        loop.trace = DispatchTrace(maxlen=trace_size)
    loop.run(problem.state())
    return timing, loop


def test_calls_per_plugin_and_event_type_are_counted(problem: Problem) -> None:
    timing, loop = _run(problem)
    counts = {key: tally.calls for key, tally in timing.totals.items()}
    assert counts[("print", "step")] == 6
    assert counts[("<lambda>", "epoch_end")] == 2
    assert counts[("timing", "step")] == 24
    assert counts[("timing", "begin")] == counts[("timing", "end")] == 1
    assert timing.by_plugin()["print"].calls == 6
    assert timing.by_event()["epoch_end"].calls == 4  # the lambda's and Timing's own
    assert timing.steps == 24
    seconds = sum(d.seconds for d in loop.trace)
    assert abs(timing.plugin_seconds - seconds) <= 1e-9 * max(1.0, seconds)


def test_counts_survive_a_trace_buffer_smaller_than_the_run(problem: Problem) -> None:
    small, _ = _run(problem, trace_size=4)
    full, _ = _run(problem)
    assert {k: t.calls for k, t in small.totals.items()} == \
        {k: t.calls for k, t in full.totals.items()}


def test_the_summary_table_lists_every_plugin(problem: Problem, capsys) -> None:
    timing = Timing(show=True)
    gm.Loop(problem.step, problem.source(32), epochs=1, plugins=[timing]).run(problem.state())
    printed = capsys.readouterr().out
    assert printed.strip() == str(timing)
    lines = str(timing).splitlines()
    assert lines[0].startswith("run: 3 steps in ")
    assert lines[1].split() == ["plugin", "event", "calls", "total", "ms", "mean", "ms"]
    assert {tuple(line.split()[:3]) for line in lines[3:]} == {
        ("timing", "begin", "1"), ("timing", "epoch_begin", "1"), ("timing", "step", "3"),
        ("timing", "epoch_end", "1"), ("timing", "end", "1")}
    assert "<table>" in timing._repr_html_()
