"""``Timing``: where a run's wall time went, per plugin and per event type."""

from __future__ import annotations

import dataclasses
import time as _time
from collections.abc import Iterable, Reversible

from graphmod._core._display._table import html_table, text_table
from graphmod._train._events import Event
from graphmod._train._loop._dispatch import Dispatch
from graphmod._train._plugin import Plugin
from graphmod.typing import LoopLike


@dataclasses.dataclass
class Tally:
    """Calls and seconds summed over dispatches.

    Examples:
        >>> from graphmod.plugins import Tally
        >>> tally = Tally()
        >>> tally.add(0.5); tally.add(0.25)
        >>> tally.calls, tally.seconds
        (2, 0.75)
    """

    calls: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.calls += 1
        self.seconds += seconds


class Timing(Plugin):
    """Sums the time every plugin spent on every event type, from the loop's dispatch trace.

    It receives every event and folds the new records of ``loop.trace`` (a bounded buffer)
    into running totals, so long runs are counted whole; its own small cost is listed too.
    At the end it adds the run's wall and training seconds (``train_seconds`` leaves out
    plugins and evaluation). ``str(timing)`` is the summary table; ``by_plugin()`` and
    ``by_event()`` give the totals as :class:`Tally` records.

    Args:
        show: print the table when the run ends.
        name: the plugin's name.

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import Timing
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> timing = Timing()
        >>> loop = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=2, plugins=[timing])
        >>> _ = loop.on(gm.On("epoch_end"), lambda e: None)
        >>> state = loop.run(state)
        >>> timing.by_plugin()["<lambda>"].calls, timing.steps
        (2, 8)
        >>> print(str(timing).splitlines()[0])  # doctest: +ELLIPSIS
        run: 8 steps in ... s wall, ... s training, ... s in plugins
    """

    def __init__(self, *, show: bool = False, name: str = "timing") -> None:
        super().__init__(name=name)
        self.show = show
        self.totals: dict[tuple[str, str], Tally] = {}
        self.steps = 0
        self.wall_seconds = 0.0
        self.train_seconds = 0.0
        self._last: object = None  # the newest trace record seen
        self._start: tuple[float, float, int] | None = None

    def setup(self, loop: LoopLike) -> None:
        self.totals = {}
        self._last = _newest(loop.trace)
        self._start = (_time.perf_counter(), loop.time.train_seconds, loop.time.step)

    def __call__(self, event: Event) -> None:
        self._collect(event.loop.trace)

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        self._collect(loop.trace)
        if self._start is not None:
            began, train, step = self._start
            self.wall_seconds = _time.perf_counter() - began
            self.train_seconds = loop.time.train_seconds - train
            self.steps = loop.time.step - step
        if self.show:
            print(self)

    def _collect(self, trace: Iterable[object]) -> None:
        fresh = []
        for record in reversed(_readable(trace)):
            if record is self._last:
                break
            fresh.append(record)
        for record in reversed(fresh):
            if not isinstance(record, Dispatch) or record.kind != "plugin":
                continue  # a model's step (several models): training, not a plugin's time
            self.totals.setdefault((record.plugin, record.event), Tally()).add(record.seconds)
        if fresh:
            self._last = fresh[0]

    def by_plugin(self) -> dict[str, Tally]:
        """Calls and seconds per plugin name, over every event type."""
        return _group(self.totals, 0)

    def by_event(self) -> dict[str, Tally]:
        """Calls and seconds spent in plugins per event type."""
        return _group(self.totals, 1)

    @property
    def plugin_seconds(self) -> float:
        return sum(t.seconds for t in self.totals.values())

    def _rows(self) -> list[tuple[str, str, int, str, str]]:
        ordered = sorted(self.totals.items(), key=lambda kv: -kv[1].seconds)
        return [(plugin, event, t.calls, f"{t.seconds * 1e3:.3f}",
                 f"{t.seconds * 1e3 / t.calls:.3f}") for (plugin, event), t in ordered]

    def summary(self) -> str:
        """One line: steps, wall seconds, training seconds, seconds in plugins."""
        return (f"run: {self.steps} steps in {self.wall_seconds:.3f} s wall, "
                f"{self.train_seconds:.3f} s training, {self.plugin_seconds:.3f} s in plugins")

    def __str__(self) -> str:
        table = text_table(("plugin", "event", "calls", "total ms", "mean ms"), self._rows())
        return f"{self.summary()}\n{table}"

    def _repr_html_(self) -> str:
        return html_table(("plugin", "event", "calls", "total ms", "mean ms"), self._rows(),
                          self.summary())


def _newest(trace: Iterable[object]) -> object:
    return next(reversed(_readable(trace)), None)


def _readable(trace: Iterable[object]) -> Reversible[object]:
    """The loop's trace, read newest first (a graphmod.Loop's ``DispatchTrace``)."""
    if not isinstance(trace, Reversible):
        raise TypeError(f"Timing: the loop's trace ({type(trace).__name__}) cannot be read "
                        "newest first, as a graphmod.Loop's DispatchTrace is")
    return trace


def _group(totals: dict[tuple[str, str], Tally], index: int) -> dict[str, Tally]:
    grouped: dict[str, Tally] = {}
    for key, tally in totals.items():
        into = grouped.setdefault(key[index], Tally())
        into.calls += tally.calls
        into.seconds += tally.seconds
    return grouped
