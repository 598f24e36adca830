"""A loop's plugins and the delivery of events to them: order, queue, timing, errors.

Plugins receive an event in registration order, ``*_end`` and ``end`` in reverse (LIFO),
higher ``priority`` first. Events a plugin fires are queued and delivered after the current
one; a plugin that overrides :meth:`Plugin.settle` (a Checkpoint) and set its ``due`` event
is called again once that event and every event it set off were delivered. Each call is
timed into a bounded :class:`DispatchTrace`; a plugin's exception becomes a
:class:`PluginError` naming the plugin and where it raised.
"""

from __future__ import annotations

import collections
import dataclasses
import time as _time
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple, TypeAlias

from graphmod._core._display._table import html_table, text_table
from graphmod._train._events import AnyOf, Event, Template, Time, as_template, plugin_name
from graphmod._train._loop._steps import Step
from graphmod._train._plugin import Plugin
from graphmod.typing import JSON, LoopLike

Listener: TypeAlias = Callable[[Event], object]
"""What a loop calls with each event it matches: a :class:`Plugin`, or a plain callable."""

PluginEntry: TypeAlias = "tuple[Registration, Plugin]"
"""The registration of a :class:`Plugin` instance (not a plain callable), with the plugin."""


class PluginError(RuntimeError):
    """A plugin raised: the loop stopped (plugins saw an ``interrupt`` event) and re-raised.

    The message names the plugin and the event and step, or the phase (``setup``,
    ``teardown``); the plugin's own exception is the ``__cause__``.

    Examples:
        >>> import graphmod as gm
        >>> issubclass(gm.PluginError, RuntimeError)
        True
    """


@dataclasses.dataclass(frozen=True)
class Registration:
    """One registered plugin: its template (None: its own handlers), priority and name."""

    template: Template | None
    plugin: Listener
    priority: int
    order: int
    name: str


class Dispatch(NamedTuple):
    """One plugin call (``kind="plugin"``): which event, at which step, which plugin, in
    which order, how long it took; or, in a loop of several models, one model's step
    (``kind="model"``): event ``"train"``, the iteration, the model's name as ``plugin``,
    its position in the declared order as ``order`` and the host seconds of the call (its
    dispatch: the device may still be computing). An immutable record; a named tuple,
    since one is made per call (a third of a frozen dataclass's cost).

    Examples:
        >>> from graphmod._train._loop import Dispatch
        >>> Dispatch("train", 3, "gen", 1, 0.0, kind="model").kind
        'model'
    """

    event: str
    step: int
    plugin: str
    order: int
    seconds: float
    kind: str = "plugin"


_TRACE_HEADERS = ("event", "step", "order", "plugin", "ms")
_SHOWN = 20  # rows a repr shows


class DispatchTrace:
    """The latest dispatches of a loop (a bounded buffer, oldest dropped first); prints as
    a table.

    Each plugin call is a row; in a loop of several models each model's step is one too
    (``kind="model"``, event ``"train"``, shown as ``model NAME``), so the trace says which
    model stepped at which iteration, in which order, among the plugin calls around it. A
    loop of one step records no step rows (its hot path appends nothing).

    Examples:
        >>> from graphmod._train._loop import Dispatch, DispatchTrace
        >>> trace = DispatchTrace(maxlen=3)
        >>> for i in range(3):
        ...     trace.append(Dispatch("step", i, "print", 0, 0.0))
        >>> trace.append(Dispatch("train", 3, "gen", 1, 0.0, kind="model"))
        >>> [d.step for d in trace]
        [1, 2, 3]
        >>> print(repr(trace))
        DispatchTrace: 2 plugin calls, 1 model step
        event  step  order  plugin     ms
        -----  ----  -----  ---------  -----
        step   1     0      print      0.000
        step   2     0      print      0.000
        train  3     1      model gen  0.000
    """

    def __init__(self, maxlen: int = 4096) -> None:
        self._records: collections.deque[Dispatch] = collections.deque(maxlen=maxlen)
        # The deque's own append (C): a model's step costs the loop no Python frame here.
        self.append: Callable[[Dispatch], None] = self._records.append

    def __iter__(self) -> Iterator[Dispatch]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __reversed__(self) -> Iterator[Dispatch]:
        return reversed(self._records)

    def __str__(self) -> str:
        return text_table(_TRACE_HEADERS, self._rows(len(self)))

    def __repr__(self) -> str:  # a notebook's or shell's echo: the latest calls only
        return f"{self._caption(_SHOWN)}\n{text_table(_TRACE_HEADERS, self._rows(_SHOWN))}"

    def _repr_html_(self) -> str:
        return html_table(_TRACE_HEADERS, self._rows(_SHOWN), self._caption(_SHOWN))

    def _caption(self, shown: int) -> str:
        latest = f", the latest {shown}" if len(self) > shown else ""
        steps = sum(d.kind == "model" for d in self._records)
        counted = f"{len(self) - steps} plugin calls" + (
            f", {steps} model step{'' if steps == 1 else 's'}" if steps else "")
        return f"DispatchTrace: {counted}{latest}"

    def _rows(self, count: int) -> list[tuple]:
        chosen = list(self._records)[-count:] if count else []
        return [(d.event, d.step, d.order, f"model {d.plugin}" if d.kind == "model"
                 else d.plugin, f"{d.seconds * 1e3:.3f}") for d in chosen]


class PluginTable:
    """The registered plugins of one loop, and the events on their way to them.

    ``queue`` holds events fired during a delivery; ``current`` is the registration being
    called; ``seconds`` sums the time spent in plugins (the loop's ``train_seconds`` leave
    it out); ``terminated`` is set by a delivered ``terminate`` event.
    """

    def __init__(self) -> None:
        self.entries: list[Registration] = []
        self.queue: collections.deque[Event] = collections.deque()
        self.trace = DispatchTrace()
        self.current: Registration | None = None
        self.seconds = 0.0
        self._began: float | None = None  # when the plugin call in progress began
        self.terminated = False
        self.templates: list[Template] = []  # alternatives apart, for planning fused steps
        self._orders: tuple[list[Registration], list[Registration]] = ([], [])
        self._previous: dict[tuple[int, str], Time] = {}
        self._settling: list[PluginEntry] = []  # plugins with work put off (settle)

    def __repr__(self) -> str:
        """The plugins in order, each with the events it runs on (a :class:`Plugin`
        without ``every``: its ``on_<type>`` handlers), e.g. ``checkpoint at
        On('epoch_end'), progress_bar``."""
        return ", ".join(e.name if e.template is None else f"{e.name} at {e.template!r}"
                         for e in self.entries) or "none"

    def register(self, template: Template | str | None, plugin: object,
                 priority: int | None) -> None:
        """Adds ``plugin`` (see :meth:`graphmod.Loop.on`); a plain callable whose name is
        taken gets a numbered one, two :class:`Plugin` s with one name are refused."""
        if not callable(plugin):
            raise TypeError(f"loop.on: plugin must be callable, got {plugin!r}")
        if template is None and isinstance(plugin, Plugin):
            template = plugin.every
        template = None if template is None else as_template(template, "loop.on(template)")
        name = plugin_name(plugin)
        taken = {e.name for e in self.entries}
        if name in taken:
            if isinstance(plugin, Plugin):
                raise ValueError(f"two plugins are named {name!r}: pass name=... to one of "
                                 "them (names key plugin state in checkpoints)")
            name = next(f"{name}_{i}" for i in range(2, len(taken) + 3)
                        if f"{name}_{i}" not in taken)
        rank: int = getattr(plugin, "priority", 0) if priority is None else priority
        self.entries.append(Registration(template, plugin, rank, len(self.entries), name))
        if isinstance(plugin, Plugin) and type(plugin).settle is not Plugin.settle:
            self._settling.append((self.entries[-1], plugin))  # it may put work off (due)
        self.templates += [] if template is None else _parts(template)
        # Dispatch orders, computed once: registration order, and LIFO for *_end events.
        self._orders = (sorted(self.entries, key=lambda e: (-e.priority, e.order)),
                        sorted(self.entries, key=lambda e: (-e.priority, -e.order)))

    def _plugin_objects(self) -> list[PluginEntry]:
        """The registrations of :class:`Plugin` instances (not plain callables), in order."""
        return [(e, e.plugin) for e in self.entries if isinstance(e.plugin, Plugin)]

    def wrap(self, step: Step) -> Step:
        """``step`` wrapped by each plugin's ``wrap_step``, the first registered outermost."""
        for _, plugin in reversed(self._plugin_objects()):
            step = plugin.wrap_step(step)
        return step

    def state_dict(self) -> dict[str, JSON]:
        """Each :class:`Plugin`'s ``state_dict()``, by name (as checkpoints hold them)."""
        return {e.name: plugin.state_dict() for e, plugin in self._plugin_objects()}

    def load_state_dict(self, saved: Mapping[str, JSON]) -> None:
        """Gives each :class:`Plugin` named in ``saved`` its state back."""
        for entry, plugin in self._plugin_objects():
            if entry.name not in saved:
                continue
            state = saved[entry.name]
            if not isinstance(state, dict):
                raise TypeError(f"loop.load_state_dict: the state of plugin {entry.name!r} is "
                                f"a {type(state).__name__}, not the dict its state_dict() "
                                "returns; was the checkpoint written by this plugin?")
            plugin.load_state_dict(state)

    def saves_on_interrupt(self) -> bool:
        """Whether a plugin (a Checkpoint) saves the run on an interrupt."""
        return any(getattr(e.plugin, "save_on_interrupt", False) for e in self.entries)

    def plugin_seconds(self, now: float) -> float:
        """The time spent in plugins until ``now`` (``perf_counter``), the call in
        progress included, so an event a plugin fires is not timed as training."""
        return self.seconds + (now - self._began if self._began is not None else 0.0)

    def previous(self, issuer: object, type: str, default: Time) -> Time:
        """The time of the last event of ``type`` from ``issuer`` (``default``: none yet)."""
        return self._previous.get((id(issuer), type), default)

    def deliver(self, event: Event) -> None:
        """Calls every plugin whose template (or own handlers) match ``event``, in order."""
        self._previous[(id(event.issuer), event.type)] = event.time
        if event.type == "terminate":
            self.terminated = True
        entries = self._orders[1 if _is_end(event.type) else 0]
        for order, entry in enumerate(entries):
            if entry.plugin is event.issuer:
                continue
            if entry.template is None:
                if isinstance(entry.plugin, Plugin) and not entry.plugin.handles(event.type):
                    continue
            elif not entry.template.matches(event):
                continue
            self._call(entry, event, order)

    def settle(self) -> None:
        """Calls ``settle(event)`` of each plugin whose ``due`` event was delivered with
        every event it set off (a Checkpoint saves then, after Validation and
        EarlyStopping recorded that event's results)."""
        for order, (entry, plugin) in enumerate(self._settling):
            if (due := plugin.due) is not None:
                self._call(entry, due, order, plugin.settle)

    def deliver_interrupt(self, event: Event, error: BaseException) -> None:
        """Gives each plugin, last registered first, the ``interrupt`` event: a
        :class:`Plugin` through its ``on_interrupt`` whatever its template (a Checkpoint
        saves), a callable if its template matches. A plugin's error becomes a note of
        ``error``; a second Ctrl-C stops the delivery."""
        for order, entry in enumerate(reversed(self.entries)):
            handler: Listener | None = None
            if isinstance(entry.plugin, Plugin):
                handler = getattr(entry.plugin, "on_interrupt", None)
                if handler is None:
                    continue
            elif entry.template is not None and not entry.template.matches(event):
                continue
            try:
                self._call(entry, event, order, handler)
            except PluginError as failure:  # the original error is what the user needs first
                error.add_note(f"also: {failure}")
            except KeyboardInterrupt:
                break  # Ctrl-C again (in an interactive session): abort, saving nothing more

    def _call(self, entry: Registration, event: Event, order: int,
              handler: Listener | None = None) -> None:
        begin = _time.perf_counter()
        outermost = self._began is None  # a plugin's time counts once, however nested
        if outermost:
            self._began = begin
        self.current = entry
        try:
            (handler or entry.plugin)(event)
        except BaseException as exc:
            error = _plugin_error(
                entry.name, f"on the {event.type!r} event at step {event.time.step}", exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            self.current = None
            spent = _time.perf_counter() - begin
            if outermost:
                self.seconds += spent
                self._began = None
            self.trace.append(Dispatch(event.type, event.time.step, entry.name, order, spent))

    def setup(self, loop: LoopLike) -> list[PluginEntry]:
        """Sets the plugins up in order; if one raises, those set up are torn down."""
        done: list[PluginEntry] = []
        for entry, plugin in self._plugin_objects():
            try:
                plugin.setup(loop)  # may restore the loop (Checkpoint(resume=True))
            except BaseException as exc:
                error = _plugin_error(entry.name, "in setup", exc)
                self.teardown(loop, done, error)
                if error is exc:
                    raise
                raise error from exc
            done.append((entry, plugin))
        return done

    def teardown(self, loop: LoopLike, done: list[PluginEntry],
                 error: BaseException | None) -> None:
        """Tears every set-up plugin down (LIFO), also when one raises: the run's own error
        wins, else the first teardown error is raised; the others become its notes."""
        failures: list[BaseException] = []
        for entry, plugin in reversed(done):
            try:
                plugin.teardown(loop, error)
            except Exception as exc:
                failures.append(_plugin_error(entry.name, "in teardown", exc))
        if not failures:
            return
        head = error if error is not None else failures.pop(0)
        for failure in failures:
            head.add_note(f"also: {failure}")
        if error is None:
            raise head


def _plugin_error(name: str, where: str, exc: BaseException) -> BaseException:
    """A plugin's exception as a :class:`PluginError` naming the plugin and where it
    raised; a PluginError (a nested loop's) or a KeyboardInterrupt is kept as it is."""
    if isinstance(exc, PluginError) or not isinstance(exc, Exception):
        return exc
    error = PluginError(f"plugin {name!r} raised {where}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _is_end(event_type: str) -> bool:
    return event_type == "end" or event_type.endswith("_end")


def _parts(template: Template) -> list[Template]:
    """The alternatives of a template (``On(...) | On(...)``), planned one by one."""
    if isinstance(template, AnyOf):
        return [part for t in template.templates for part in _parts(t)]
    return [template]
