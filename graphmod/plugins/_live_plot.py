"""``LivePlot``: metric curves redrawn during the run, in a notebook or to a PNG file.

The figure is a bare ``matplotlib.figure.Figure`` rendered by the Agg canvas: pyplot and
its global backend are never touched, so it runs headless and never opens a window. In a
Jupyter kernel the image is shown once and then updated in place (``IPython.display`` with
a ``display_id``); elsewhere it is saved to ``path``.
"""

from __future__ import annotations

import io
import os
import sys
import time as _time
from typing import TYPE_CHECKING

import numpy as np

from graphmod._core._number_checks import is_real_number
from graphmod._train._events import Event, On, Template
from graphmod._train._host_metrics import metric_of, scalar_metrics
from graphmod._train._plugin import Plugin
from graphmod._train._schedule import each
from graphmod.plugins._common import event_metrics, metric_names, template_or
from graphmod.typing import LoopLike

if TYPE_CHECKING:  # matplotlib and IPython are optional: imported when drawing
    from IPython.display import DisplayHandle
    from matplotlib.figure import Figure


class LivePlot(Plugin):
    """Collects metric values on due events and redraws their curves against the step.

    Each due event reads the named metrics it carries (a device sync): its own if it was
    fired with some, else the latest step's (``every=On("step", step=each(20)) |
    On("validated")`` plots validation metrics too); ``history`` keeps one value per
    metric and step. The figure, one panel per
    metric, is redrawn at most every ``redraw_seconds`` of wall time and once more when the
    run ends, since drawing costs tens of milliseconds. A one-dimensional metric of at most
    64 values (``ActivationStats`` of a scan over layers or an ensemble: one per layer or
    member) is recorded per index (``history["name[0]"]``, ...) and drawn as one line per
    index in the metric's panel.

    Args:
        *metric_names: metrics to plot (none: every scalar metric seen).
        path: the PNG file written outside notebooks (None: do not write one).
        every: the events whose metrics are recorded (default: every 20 steps).
        redraw_seconds: the least wall time between two redraws.
        notebook: show the figure in the notebook (default: when an IPython kernel runs).
        name: the plugin's name.

    Examples:
        >>> import jax, numpy as np, optax, os, tempfile, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import LivePlot
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> path = os.path.join(tempfile.mkdtemp(), "loss.png")
        >>> plot = LivePlot("loss", path=path, every=gm.On("step", step=gm.each(2)))
        >>> state = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=2,
        ...                 plugins=[plot]).run(state)
        >>> [s for s, _ in plot.history["loss"]], os.path.exists(path)
        ([2, 4, 6, 8], True)
    """

    def __init__(self, *metric_names_: str, path: str | os.PathLike | None = "live_plot.png",
                 every: Template | str | None = None, redraw_seconds: float = 2.0,
                 notebook: bool | None = None, name: str = "live_plot") -> None:
        super().__init__(name=name,
                         every=template_or(every, On("step", step=each(20)), "LivePlot"))
        self.metric_names = metric_names(metric_names_, "LivePlot(*metric_names)")
        if not is_real_number(redraw_seconds) or not redraw_seconds >= 0:
            raise ValueError(f"LivePlot(redraw_seconds={redraw_seconds!r}): must be a "
                             "number >= 0")
        self.path = None if path is None else os.path.abspath(os.fspath(path))
        self.redraw_seconds = float(redraw_seconds)
        self.notebook = notebook
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.draws = 0
        self._drawn_at: float | None = None
        self._handle: DisplayHandle | None = None

    def setup(self, loop: LoopLike) -> None:
        self._drawn_at = None
        self._handle = None

    def __call__(self, event: Event) -> None:
        values = scalar_metrics(event_metrics(event), self.metric_names,  # the one sync
                                per_index=True)
        for key, value in values.items():
            points = self.history.setdefault(key, [])
            if not points or points[-1][0] != event.time.step:  # once a step
                points.append((event.time.step, value))
        now = _time.perf_counter()
        if values and (self._drawn_at is None or now - self._drawn_at >= self.redraw_seconds):
            self.draw()

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        if not self.history:
            return
        try:
            self.draw()
        except Exception:
            if error is None:
                raise  # else the run's own error is the one to see

    def draw(self) -> None:
        """Redraws the figure now: updates the notebook display, or writes ``path``."""
        figure = self.figure()
        if self.notebook if self.notebook is not None else _in_notebook():
            self._display(figure)
        elif self.path is not None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            temporary = f"{self.path}.tmp.png"
            figure.savefig(temporary, format="png")
            os.replace(temporary, self.path)  # a viewer never sees a half-written file
        self.draws += 1
        self._drawn_at = _time.perf_counter()

    def figure(self) -> Figure:
        """A new ``matplotlib.figure.Figure`` of the recorded curves, one panel a metric."""
        from matplotlib.figure import Figure

        panels = self.panels()
        figure = Figure(figsize=(6, 2.2 * max(len(panels), 1)), layout="constrained")
        axes = figure.subplots(max(len(panels), 1), 1, squeeze=False)[:, 0]
        for ax, (name, keys) in zip(axes, panels.items(), strict=False):
            for key in keys:
                steps, values = np.asarray(self.history[key], dtype=np.float64).T
                ax.plot(steps, values, marker="." if len(steps) < 50 else None,
                        label=key[len(name):])
            if len(keys) > 1:
                ax.legend(fontsize="small")
            ax.set_ylabel(name)
            ax.grid(True, alpha=0.3)
        axes[-1].set_xlabel("step")
        return figure

    def panels(self) -> dict[str, list[str]]:
        """The figure's panels: each metric recorded (those named, in order), with its keys
        in :attr:`history` (a one-dimensional metric's ``name[i]``, one line each)."""
        panels: dict[str, list[str]] = {}
        for key in self.history:
            panels.setdefault(metric_of(key), []).append(key)
        return {name: panels[name] for name in (self.metric_names or tuple(panels))
                if name in panels}

    def _display(self, figure: Figure) -> None:
        from IPython.display import Image, display

        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        image = Image(data=buffer.getvalue(), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)


def _in_notebook() -> bool:
    """Whether an IPython kernel (Jupyter) runs this process (never imports IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None
