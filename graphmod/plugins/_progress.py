"""``ProgressBar``: a tqdm bar over the run's steps that never waits on the device."""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from graphmod._core._number_checks import is_whole_number
from graphmod._train._events import Event, On, Template
from graphmod._train._host_metrics import copying, on_host, scalar_metrics, scalars
from graphmod._train._plugin import Plugin
from graphmod.plugins._common import metric_names, per_model, planned_steps, template_or
from graphmod.typing import ArrayLike, LoopLike

if TYPE_CHECKING:  # tqdm.auto chooses a subclass (a notebook's widget, a terminal's line)
    from tqdm import tqdm


class ProgressBar(Plugin):
    """A ``tqdm.auto`` progress bar (a widget in Jupyter) over the steps of a run.

    The bar advances on every ``step`` event by the steps the event covers (a fused
    ``steps_per_call`` dispatch moves it by k at once) and shows the epoch as the loop's
    time counts it, as :class:`graphmod.plugins.Print`, ``graphmod inspect`` and
    ``graphmod resume`` do: ``3/40 epochs`` once three epochs are done, through the fourth
    (``epoch 3`` where the loop has no number of epochs).
    On a terminal or in a notebook, until the first step has run it says
    ``compiling the train step… 12 s`` (the first call traces and compiles; nothing else
    would show for that long). It never waits on the device: on the step events matching
    ``every`` (by default at most every 0.1 s of wall time, as tqdm redraws) the
    ``metrics`` start copying to the host, and they are shown at the first step event that
    finds them there (and when the run ends). The bar closes at the end of the run, also
    on an error or an interrupt, saying why a run stopped early (``loop.terminate(reason)``,
    e.g. early stopping; an interrupt; an error). :class:`graphmod.plugins.Print` writes
    its lines above the bar.

    Args:
        total: the bar's length in steps (default: the loop's ``steps``, or ``epochs``
            times the length of its data; open-ended when neither is known).
        metrics: names of step metrics to show beside the bar (those present are shown);
            in a loop over several models, a name without a model (``"loss"``) is shown
            for each (``"disc/loss"``, ``"gen/loss"``); a one-dimensional one (a
            population's, one value per member) as ``"loss mean"``, ``"loss min"`` and
            ``"loss max"``.
        every: the step events on which the metrics are read and shown (default: at most
            every 0.1 s: a copy started, nothing waited for).
        name: the plugin's name.
        **tqdm_kwargs: passed to ``tqdm`` (``desc``, ``file``, ``leave``, ``disable``, ...).

    Examples:
        >>> import io, jax, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import ProgressBar
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> bar = ProgressBar(every=gm.On("step", step=gm.each(4)), file=io.StringIO())
        >>> state = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=2,
        ...                 plugins=[bar]).run(state)
        >>> bar.position, bar.total, sorted(bar.postfix)
        (8, 8, ['loss'])
    """

    def __init__(self, total: int | None = None, metrics: Iterable[str] | str = ("loss",), *,
                 every: Template | str | None = None, name: str = "progress_bar",
                 **tqdm_kwargs: Any) -> None:  # tqdm's, passed on as they are
        # The bar sees every step event (a catch-all step template never blocks fusing
        # steps); ``every`` only decides when the metrics are read.
        super().__init__(name=name, every=On("step") | On("epoch_end") | On("terminate"))
        if total is not None and not is_whole_number(total, least=1):
            raise ValueError(f"ProgressBar(total={total!r}): must be a positive int or None")
        if isinstance(metrics, str):
            metrics = (metrics,)
        self.metrics = metric_names(metrics, "ProgressBar(metrics=...)")
        # None: at most every 0.1 s, checked with a clock read (cheaper than a template).
        self.show_every = None if every is None else template_or(every, On("step"),
                                                                 "ProgressBar")
        self.tqdm_kwargs = tqdm_kwargs
        self.total = total
        self.position = 0
        self.postfix: dict[str, float] = {}
        self.stopped: str | None = None  # why the run stopped early, once it did
        self._requested_total = total
        self._bar: tqdm | None = None
        self._shown_at = -math.inf
        self._copying: dict[str, ArrayLike] | None = None  # metrics on their way to the host
        self._shown = self.metrics  # the names shown: per model in a loop of several
        self._epochs: int | None = None
        self._compiled = threading.Event()  # set by the first step: the status line ends
        self._status: threading.Thread | None = None

    def setup(self, loop: LoopLike) -> None:
        self.total = self._requested_total or planned_steps(loop)
        self._shown = per_model(loop, self.metrics)
        self._epochs = getattr(loop, "epochs", None)
        self._bar = None
        self._shown_at = -math.inf
        self._copying = None
        self.stopped = None
        if self._interactive():  # the bar at once, saying what the first call waits for
            self._bar = self._open(loop.time.step)
            self._compiled.clear()
            self._status = threading.Thread(target=self._compiling, daemon=True,
                                            name=f"{self.name}: compiling")
            self._status.start()

    def _interactive(self) -> bool:
        """Whether the bar is drawn on a terminal or as a notebook's widget."""
        if self.tqdm_kwargs.get("disable"):
            return False
        from tqdm.auto import tqdm

        file = self.tqdm_kwargs.get("file", sys.stderr)
        return tqdm.__module__ == "tqdm.notebook" or bool(
            getattr(file, "isatty", lambda: False)())

    def _compiling(self) -> None:
        """The status line, with the seconds since it began, until the first step."""
        began, bar = time.monotonic(), self._bar
        while bar is not None:  # opened before this thread starts
            text = f"compiling the train step… {time.monotonic() - began:.0f} s"
            bar.set_description_str(text, refresh=True)
            if self._compiled.wait(STATUS_EVERY_S):
                return

    def _end_status(self) -> None:
        if self._status is not None:
            self._compiled.set()
            self._status.join()
            self._status = None

    def __call__(self, event: Event) -> None:
        if event.type == "terminate":
            who = getattr(event.issuer, "name", type(event.issuer).__name__)
            self.stopped = getattr(event, "reason", None) or f"terminated by {who}"
            return
        bar = self._bar if self._bar is not None else self._open(event.loop.start_time.step)
        self._bar = bar
        self._end_status()
        self._advance(bar, event.time.step, event.time.epoch)
        if event.type != "step":  # epoch_end: the epoch's count only
            return
        if self._copying is not None and on_host(self._copying):
            self._show(bar, self._copying)
            self._copying = None
        if self._shown and self._copying is None and self._due(event):
            self._copying = copying(event.metrics, self._shown, per_index=True)

    def _due(self, event: Event) -> bool:
        if self.show_every is not None:
            return self.show_every.matches(event)
        now = time.perf_counter()
        if now - self._shown_at < 0.1:
            return False
        self._shown_at = now
        return True

    def _open(self, start: int) -> tqdm:
        from tqdm.auto import tqdm

        options = {"unit": "step", "dynamic_ncols": True, **self.tqdm_kwargs}
        self.position = start
        return tqdm(total=self.total, initial=start, **options)

    def _advance(self, bar: tqdm, step: int, epoch: int | None) -> None:
        if step > self.position:
            bar.update(step - self.position)
            self.position = step
        if epoch is not None and "desc" not in self.tqdm_kwargs:
            # The loop's count (epochs done: 0 through the first), as Print, a checkpoint,
            # ``graphmod inspect`` and ``graphmod resume`` say it.
            desc = f"{epoch}/{self._epochs} epochs" if self._epochs else f"epoch {epoch}"
            if bar.desc != desc:
                bar.set_description_str(desc, refresh=False)

    def _show(self, bar: tqdm, metrics: Mapping[str, ArrayLike]) -> None:
        # On the host already (or at the end); a one-dimensional metric (a population's:
        # one value per member) as its mean, min and max.
        values = {**scalar_metrics(metrics, self._shown), **_spread(metrics, self._shown)}
        if values:
            self.postfix = values
            bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()})

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        self._end_status()
        bar = self._bar
        if bar is None:
            return
        try:
            if error is None:  # not when stopping on an error: reading could raise again
                self._advance(bar, loop.time.step, loop.time.epoch)
                if self._shown and loop.metrics:
                    self._show(bar, loop.metrics)  # the run is over: it waits for nothing
            elif isinstance(error, KeyboardInterrupt):
                signal = getattr(error, "signal", None)  # a SignalInterrupt's: SIGTERM
                self.stopped = "interrupted" if signal is None else f"stopped by {signal.name}"
            else:
                self.stopped = f"stopped by {type(error).__name__}"
            if self.stopped is not None:
                self.stopped = f"{self.stopped} (at step {loop.time.step})"
                bar.set_description_str(f"{bar.desc}: {self.stopped}", refresh=True)
        finally:
            bar.close()
            self._bar = None


STATUS_EVERY_S = 1.0  # how often the compile status line counts its seconds


def _spread(metrics: Mapping[str, ArrayLike], names: tuple[str, ...]) -> dict[str, float]:
    """Each one-dimensional metric among ``names`` (a population's, one value per member)
    as ``name mean``, ``name min`` and ``name max``."""
    rows = {name: value for name, value in scalars(metrics, names, per_index=True).items()
            if np.ndim(value) == 1}
    shown: dict[str, float] = {}
    for name, value in zip(rows, jax.device_get(list(rows.values())), strict=True):
        value = np.asarray(value, np.float64)
        shown.update({f"{name} mean": float(value.mean()), f"{name} min": float(value.min()),
                      f"{name} max": float(value.max())})
    return shown
