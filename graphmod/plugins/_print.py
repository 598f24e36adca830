"""``Print``: prints the times and chosen metrics of the events it is due on."""

from __future__ import annotations

import sys
from typing import TextIO

import numpy as np
from tqdm import tqdm

from graphmod._core._warn import warn
from graphmod._train._events import Event, On, Template
from graphmod._train._host_metrics import host_value
from graphmod._train._plugin import Plugin
from graphmod._train._schedule import each
from graphmod.plugins._common import event_metrics, metric_names, template_or
from graphmod.typing import LoopLike


class Print(Plugin):
    """Prints the step, epoch, examples and the named metrics on each event it is due on.

    This is the plugin that reads metrics, so it waits on the device only when due. It
    prints on whatever event it receives, so it can be registered for any template:
    ``loop.on(On("step", examples=each(10_000)), Print("loss"))``, or
    ``Print("valid/accuracy", every=On("validated"))`` for the metrics a ``validated``
    event carries. A named metric the event lacks is left out of that line; one that no
    event had by the end of the run gets a warning (a misspelt name prints nothing). A line
    is printed once: the same event at the same step saying the same (a validation at the
    last ``epoch_end`` and again at ``end``) is not printed again. The epoch is the loop's
    count (epochs done), as the progress bar, ``graphmod inspect`` and ``graphmod resume``
    say it.

    Args:
        *metric_names: metrics to print, in order (none: every scalar metric).
        every: the events to print on (default: every 100 steps).
        file: where to print (default: ``sys.stdout`` at the time of printing).
        name: the plugin's name.

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import Print
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> loop = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=2)
        >>> _ = loop.on(gm.On("step", examples=gm.each(32)), Print("loss"))
        >>> state = loop.run(state)  # doctest: +ELLIPSIS
        step 4  epoch 0  examples 32  loss ...
        step 8  epoch 1  examples 64  loss ...
    """

    def __init__(self, *metric_names_: str, every: Template | str | None = None,
                 file: TextIO | None = None, name: str = "print") -> None:
        super().__init__(name=name,
                         every=template_or(every, On("step", step=each(100)), "Print"))
        self.metric_names = metric_names(metric_names_, "Print(*metric_names)")
        self.file = file
        self._seen: set[str] = set()
        self._printed = 0
        self._last: tuple[str, int, str] | None = None  # the latest line's event and step

    def setup(self, loop: LoopLike) -> None:
        self._seen = set()
        self._printed = 0
        self._last = None

    def __call__(self, event: Event) -> None:
        line = self.format(event)
        if (event.type, event.time.step, line) == self._last:
            return
        self._last = (event.type, event.time.step, line)
        self._printed += 1
        # Through tqdm: a progress bar on the terminal is cleared, the line written above
        # it, and the bar drawn again (no line glued onto the bar).
        out = self.file or sys.stdout
        tqdm.write(line, file=out)
        out.flush()

    def format(self, event: Event) -> str:
        """The line printed for ``event`` (reads its metrics: a device sync)."""
        t = event.time
        parts = [] if event.type == "step" else [event.type]
        parts += [f"step {t.step}", f"epoch {t.epoch}", f"examples {t.examples}"]
        metrics = event_metrics(event)
        names = self.metric_names or tuple(k for k in metrics if np.ndim(metrics[k]) == 0)
        for name in names:
            if name in metrics:
                self._seen.add(name)
                parts.append(f"{name} {_format(host_value(metrics[name]))}")
        return "  ".join(parts)

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        missing = [n for n in self.metric_names if n not in self._seen]
        if error is None and missing and self._printed:
            warn(f"{self.name}: no event it printed had the metric(s) {missing}; "
                 f"check the names (e.g. {sorted(loop.metrics)[:8]})")


def _format(value: float | np.ndarray) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return np.array2string(np.asarray(value), precision=4, threshold=8)
