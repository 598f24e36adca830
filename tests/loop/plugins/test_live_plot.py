"""LivePlot: records due metrics, writes a PNG headless, updates a notebook display in place."""

from __future__ import annotations

import IPython.display
import numpy as np
import pytest

import graphmod as gm
from graphmod import On, each
from graphmod.plugins import LivePlot
from graphmod.plugins._live_plot import _in_notebook
from tests.loop.conftest import Problem
from tests.loop.plugins.conftest import LayerMetric, fire_scores

PNG = b"\x89PNG\r\n\x1a\n"


def test_headless_run_records_the_metrics_and_writes_a_png(problem: Problem, tmp_path) -> None:
    path = tmp_path / "plots" / "curves.png"
    losses: list[tuple[int, float]] = []
    every = On("step", step=each(3))
    plot = LivePlot("loss", "valid/loss", path=path, every=every | On("validated"))
    loop = gm.Loop(problem.step, problem.source(8), epochs=2, plugins=[plot])
    loop.on(every, lambda e: losses.append((e.time.step, float(e.metrics["loss"]))))
    loop.on("epoch_end", fire_scores([0.5, 0.25]))
    loop.run(problem.state())
    assert not _in_notebook()
    assert plot.history["valid/loss"] == [(12, 0.5), (24, 0.25)]
    assert [(s, v) for s, v in plot.history["loss"] if s % 3 == 0] == losses
    assert path.read_bytes().startswith(PNG) and plot.draws >= 2  # once early, once at the end
    assert not list(path.parent.glob("*.tmp*"))


def test_a_metric_per_layer_is_one_line_per_layer_in_its_panel(layer_metric: LayerMetric,
                                                                tmp_path) -> None:
    every = On("step", step=each(2))
    seen: list[np.ndarray] = []
    plot = LivePlot(layer_metric.name, "loss", path=tmp_path / "plot.png", every=every)
    layer_metric.loop([plot], seen, every).run(layer_metric.state())
    name = layer_metric.name
    assert plot.panels() == {name: [f"{name}[{i}]" for i in range(3)], "loss": ["loss"]}
    for i in range(3):
        assert [v for _, v in plot.history[f"{name}[{i}]"]] == [float(m[i]) for m in seen]
    layers, loss = plot.figure().axes
    assert [line.get_label() for line in layers.get_lines()] == ["[0]", "[1]", "[2]"]
    assert len(loss.get_lines()) == 1


class _Handle:
    def __init__(self, shown: list) -> None:
        self.shown = shown

    def update(self, image: object) -> None:
        self.shown.append(("update", image))


def test_in_a_notebook_the_figure_is_updated_in_place(problem: Problem, tmp_path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list = []

    def display(image: object, display_id: bool = False) -> _Handle:
        assert display_id is True
        shown.append(("display", image))
        return _Handle(shown)

    monkeypatch.setattr(IPython.display, "display", display)
    plot = LivePlot("loss", path=tmp_path / "unused.png", every=On("step", step=each(6)),
                    redraw_seconds=0, notebook=True)
    gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[plot]).run(problem.state())
    assert [kind for kind, _ in shown] == ["display", "update", "update"]  # 6, 12, the end
    assert all(image.data.startswith(PNG) for _, image in shown)
    assert not (tmp_path / "unused.png").exists()


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"LivePlot\(redraw_seconds=-1\)"):
        LivePlot("loss", redraw_seconds=-1)
    with pytest.raises(TypeError, match=r"LivePlot\(\*metric_names\)"):
        LivePlot(["loss"])  # type: ignore[arg-type]
