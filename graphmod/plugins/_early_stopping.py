"""``EarlyStopping``: stops a run whose watched metric stopped improving; restores the best."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from graphmod._core._naming import did_you_mean
from graphmod._core._number_checks import is_real_number, is_whole_number
from graphmod._core._warn import warn
from graphmod._train._events import AnyOf, Event, On, Template
from graphmod._train._host_metrics import host_value
from graphmod._train._plugin import Plugin
from graphmod.plugins._common import event_metrics, saved_field, template_or
from graphmod.typing import JSON, LoopLike, PyTree


class EarlyStopping(Plugin):
    """Watches ``metric``; terminates the run after ``patience`` evaluations without
    improvement, and at the end puts the best train state back.

    On each due event (by default each ``validated`` event that
    :class:`~graphmod.plugins.Validation` fires) it reads ``metric`` from the event's own
    ``metrics`` or else the latest step's. A value better than the best by more than
    ``min_delta`` becomes the best, and a copy of the train state is kept (copied on the
    device: the next step donates the state); NaN never improves. After ``patience``
    evaluations in a row without improvement it calls ``loop.terminate()``. At the ``end``
    event, whether it stopped the run or not, ``restore_best`` swaps the best state in
    through ``loop.update_state`` (plugins that receive ``end`` after it, such as an
    earlier-registered ``Checkpoint``, see the restored state). ``state_dict`` keeps the
    counters and best value; the best state itself is not saved, so a resumed run restores
    only a best reached after it resumed.

    Args:
        metric: the metric's name, e.g. ``"valid/accuracy"``.
        mode: ``"min"`` or ``"max"``: whether smaller or larger values are better.
        patience: evaluations without improvement before stopping.
        min_delta: how much better than the best a value must be to count.
        restore_best: put the best state back at the end of the run.
        every: the events on which ``metric`` is read (default: ``On("validated")``).
        name: the plugin's name.

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import EarlyStopping
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> stop = EarlyStopping("valid/loss", patience=2)
        >>> loop = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=9, plugins=[stop])
        >>> scores = iter([3.0, 2.0, 2.5, 2.4, 1.0])  # stands in for Validation
        >>> _ = loop.on("epoch_end", lambda e: e.loop.fire(
        ...     "validated", metrics={"valid/loss": next(scores)}))
        >>> state = loop.run(state)
        >>> stop.best, stop.best_step, stop.stopped_step, int(state.step)
        (2.0, 8, 16, 8)
    """

    def __init__(self, metric: str, *, mode: str = "min", patience: int = 5,
                 min_delta: float = 0.0, restore_best: bool = True,
                 every: Template | str | None = None, name: str = "early_stopping") -> None:
        if not isinstance(metric, str) or not metric:
            raise TypeError(f"EarlyStopping(metric={metric!r}): expected a metric name")
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}): must be 'min' or 'max'")
        if not is_whole_number(patience, least=1):
            raise ValueError(f"EarlyStopping(patience={patience!r}): must be a positive int")
        if not is_real_number(min_delta) or not min_delta >= 0:
            raise ValueError(f"EarlyStopping(min_delta={min_delta!r}): must be a number >= 0")
        self.watched = template_or(every, On("validated"), "EarlyStopping")
        super().__init__(name=name, every=AnyOf((self.watched, On("end"))))
        self.metric = metric
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.restore_best = restore_best
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0  # evaluations since the last improvement
        self.stopped_step: int | None = None
        self.best_state: PyTree = None
        self._restored = False

    def setup(self, loop: LoopLike) -> None:
        self._restored = False

    def __call__(self, event: Event) -> None:
        if event.type == "end":
            self.restore(event.loop)
        else:
            self.update(event)

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def update(self, event: Event) -> None:
        """Reads the metric from ``event``; keeps the state if best; stops when out of
        patience."""
        value = self._read(event)
        if self.improves(value):
            self.best, self.best_step, self.wait = value, event.time.step, 0
            if self.restore_best:
                self.best_state = jax.tree.map(jnp.copy, event.state)
            return
        self.wait += 1
        if self.wait >= self.patience and self.stopped_step is None:
            self.stopped_step = event.time.step
            best = "none yet" if self.best is None else (
                f"{self.best:.4g} at step {self.best_step}")
            event.loop.terminate(f"early stopping: no better {self.metric} in "
                                 f"{self.patience} evaluations (best {best})")

    def restore(self, loop: LoopLike) -> None:
        """Puts the best state kept back into the loop (when ``restore_best``)."""
        self._restored = True
        if not self.restore_best:
            return
        if self.best_state is not None:
            best = self.best_state
            loop.update_state(lambda state: best)
        elif self.best is not None:
            warn(f"{self.name}: the best state (step {self.best_step}) was reached "
                 "before the run resumed and was not saved; the final state stays")

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        if error is None and not self._restored:
            self.restore(loop)  # registered without the `end` event (loop.on(template, ...))

    def _read(self, event: Event) -> float:
        metrics = event_metrics(event)
        if self.metric in metrics:
            value = metrics[self.metric]
        else:
            have = sorted(metrics)
            raise ValueError(f"{self.name}: the {event.type!r} event has no metric "
                             f"{self.metric!r}{did_you_mean(self.metric, have)}; it has {have}")
        result = host_value(value)
        if not isinstance(result, float):
            raise ValueError(f"{self.name}: metric {self.metric!r} is not a scalar "
                             f"(shape {np.shape(result)})")
        return result

    def state_dict(self) -> dict[str, JSON]:
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait,
                "stopped_step": self.stopped_step}

    def load_state_dict(self, state: dict[str, JSON]) -> None:
        self.best = saved_field(state, "best", float, self.name)
        self.best_step = saved_field(state, "best_step", int, self.name)
        self.wait = saved_field(state, "wait", int, self.name) or 0
        self.stopped_step = saved_field(state, "stopped_step", int, self.name)
        self.best_state = None
