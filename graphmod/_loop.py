"""``Loop``: runs a train step over data; everything around the run happens in plugins.

Order of events
    ``begin``, then per epoch ``epoch_begin``, ``step`` events, ``epoch_end``; finally
    ``end`` (``interrupt`` instead when the run stops on an error or KeyboardInterrupt).
    Plugins receive an event in registration order, ``*_end`` and ``end`` in reverse
    (LIFO), higher ``priority`` first. Events a plugin fires are queued and dispatched
    after the current one; a ``terminate`` event stops the run after the current step.

Speed
    The hot loop never waits on the device: metrics stay on the device until a plugin that
    is due reads them, batches are put on an accelerator one step ahead (on the CPU, where
    the device is the host, jit takes the NumPy batch directly: faster than a put), and with
    ``steps_per_call=k`` up to k steps run in one ``lax.scan`` dispatch whenever no planned
    template is due inside them. Templates whose fields are schedules on the ``step``,
    ``epoch`` or ``examples`` timelines are planned exactly; catch-all plugins and schedules
    on wall-clock timelines see one ``step`` event per dispatch, covering its range.

Ctrl-C
    In the main thread, Ctrl-C only asks the run to stop: the loop finishes the step or
    event in progress, plugins get the ``interrupt`` event with the state of that finished
    step (a ``Checkpoint`` saves it and says so), and ``run`` raises ``KeyboardInterrupt``
    (a script then exits with status 130). A second Ctrl-C aborts at once, saving nothing
    more. See ``graphmod._interrupt``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time as _time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphmod._batch import step_arguments
from graphmod._clock import utc_now
from graphmod._command import recorded_command
from graphmod._events import (
    AnyOf,
    Event,
    On,
    Template,
    Time,
    as_template,
    check_event_types,
    plugin_name,
)
from graphmod._interrupt import SigintGuard
from graphmod._optimize import TrainState, TrainStep
from graphmod._plugin import Plugin
from graphmod._table import text_table
from graphmod._validation import is_key

_PLANNABLE = ("step", "epoch", "examples")


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
class _Entry:
    template: Template | None
    plugin: Any
    priority: int
    order: int
    name: str


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """One plugin call: which event, which plugin, in which order, how long it took."""

    event: str
    step: int
    plugin: str
    order: int
    seconds: float


class DispatchTrace:
    """The latest dispatches of a loop (a bounded buffer); prints as a table.

    Examples:
        >>> from graphmod._loop import Dispatch, DispatchTrace
        >>> trace = DispatchTrace(maxlen=2)
        >>> for i in range(3):
        ...     trace.append(Dispatch("step", i, "print", 0, 0.0))
        >>> [d.step for d in trace]
        [1, 2]
    """

    def __init__(self, maxlen: int = 4096) -> None:
        self._records: collections.deque[Dispatch] = collections.deque(maxlen=maxlen)

    def append(self, record: Dispatch) -> None:
        self._records.append(record)

    def __iter__(self) -> Iterator[Dispatch]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __reversed__(self) -> Iterator[Dispatch]:
        return reversed(self._records)

    def __str__(self) -> str:
        rows = [(d.event, d.step, d.order, d.plugin, f"{d.seconds * 1e3:.3f}") for d in self]
        return text_table(("event", "step", "order", "plugin", "ms"), rows)


def _is_end(event_type: str) -> bool:
    return event_type == "end" or event_type.endswith("_end")


def _batch_size(batch: Any) -> int:
    first = batch
    while isinstance(first, dict | tuple | list):  # the common shapes, without flattening
        if not first:
            raise ValueError("a batch holds no arrays")
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return int(np.shape(first)[0])


class Loop:
    """Runs ``step(state, *batch)`` (or ``**batch`` for dict batches) over ``data``.

    Args:
        step: a train step, e.g. from :func:`graphmod.optimize`: ``(state, metrics)``.
        data: an :class:`graphmod.data.ArraySource` or any iterable of batches (iterated
            once per epoch).
        epochs: stop after this many epochs.
        steps: stop after this many steps (whichever comes first; default: one epoch).
        plugins: plugins registered in order (a :class:`Plugin` with its ``every``
            template, a plain callable for every event).
        steps_per_call: fuse up to this many steps into one dispatch when no plugin is due.
        allow_data_change: continue from a checkpoint (``Loop.resume``,
            ``Checkpoint(resume=True)``) although the data differ from the checkpoint's
            description; the change is recorded in the checkpoints written afterwards.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> seen = []
        >>> loop = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=2)
        >>> _ = loop.on(gm.On("step", step=gm.each(4)), lambda e: seen.append(e.time.step))
        >>> state = loop.run(state)
        >>> seen, int(state.step)
        ([4, 8], 8)
    """

    def __init__(
        self,
        step: Callable[..., Any],
        data: Iterable[Any],
        *,
        epochs: int | None = None,
        steps: int | None = None,
        plugins: Iterable[Any] = (),
        steps_per_call: int = 1,
        allow_data_change: bool = False,
    ) -> None:
        if not callable(step):
            raise TypeError(f"Loop(step, data): step must be callable, got {step!r}")
        if not isinstance(data, Iterable):
            raise TypeError(f"Loop(step, data): data must be iterable, got {type(data).__name__}")
        if hasattr(data, "__len__") and len(data) == 0:  # type: ignore[arg-type]
            raise ValueError("Loop(step, data): the data source is empty (no batch per epoch)")
        for label, value in (("epochs", epochs), ("steps", steps),
                             ("steps_per_call", steps_per_call)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Loop({label}={value!r}): must be a positive int")
        self.step = step
        self.data = data
        self.epochs = epochs if epochs is not None or steps is not None else 1
        self.max_steps = steps
        self.steps_per_call = steps_per_call
        self.allow_data_change = allow_data_change
        # Data changes allowed on resumes: [{"step": ..., "fields": [...]}] (in checkpoints).
        self.data_changes: list[dict[str, Any]] = []
        self.time = Time()
        self.position = 0  # batches done in the current epoch
        self.state: Any = None
        self.trace = DispatchTrace()
        self._entries: list[_Entry] = []
        self._orders: tuple[list[_Entry], list[_Entry]] = ([], [])
        self._prefetch = jax.default_backend() != "cpu"
        self._queue: collections.deque[Event] = collections.deque()
        self._prev: dict[tuple[int, str], Time] = {}
        self._terminated = False
        self._plugin_seconds = 0.0
        self._clock: tuple[float, Time] | None = None
        self._metrics: Any = {}
        self._current: _Entry | None = None
        self._started = False
        self._guard: SigintGuard | None = None  # set while run() handles Ctrl-C
        self.started_at: str | None = None  # wall-clock start of the run (UTC, ISO 8601)
        self.ended_at: str | None = None
        for plugin in plugins:
            self.on(None, plugin)

    # -- registration -------------------------------------------------------------------------
    def on(self, template: Template | str | None, plugin: Any, *,
           priority: int | None = None) -> Any:
        """Registers ``plugin`` for events matching ``template``; None: a :class:`Plugin`'s
        own ``every`` (its ``on_<type>`` methods when that is None), every event for a
        plain callable."""
        if not callable(plugin):
            raise TypeError(f"loop.on: plugin must be callable, got {plugin!r}")
        if template is None and isinstance(plugin, Plugin):
            template = plugin.every
        template = None if template is None else as_template(template, "loop.on(template)")
        name = plugin_name(plugin)
        taken = {e.name for e in self._entries}
        if name in taken:
            if isinstance(plugin, Plugin):
                raise ValueError(f"two plugins are named {name!r}: pass name=... to one of "
                                 "them (names key plugin state in checkpoints)")
            name = next(f"{name}_{i}" for i in range(2, len(taken) + 3)
                        if f"{name}_{i}" not in taken)
        if priority is None:
            priority = getattr(plugin, "priority", 0)
        self._entries.append(_Entry(template, plugin, priority, len(self._entries), name))
        # Dispatch orders, computed once: registration order, and LIFO for *_end events.
        self._orders = (sorted(self._entries, key=lambda e: (-e.priority, e.order)),
                        sorted(self._entries, key=lambda e: (-e.priority, -e.order)))
        return plugin

    @property
    def plugins(self) -> list[Any]:
        """The registered plugins, in registration order."""
        return [e.plugin for e in self._entries]

    # -- what plugins call --------------------------------------------------------------------
    def fire(self, type: str, **data: Any) -> None:
        """Queues an event issued by the plugin being dispatched (or the loop)."""
        issuer = self._current.plugin if self._current is not None else self
        self._queue.append(self._event(type, issuer, data))

    def terminate(self) -> None:
        """Stops the run after the current step (fires a ``terminate`` event)."""
        self.fire("terminate")

    def update_state(self, fn: Callable[[Any], Any]) -> None:
        """Replaces the train state by ``fn(state)``, cast to each leaf's dtype (no retrace)."""
        old = self.state
        new = fn(old)
        if jax.tree.structure(new) != jax.tree.structure(old):
            who = self._current.name if self._current is not None else "update_state"
            raise ValueError(f"{who}: update_state(fn) must keep the state's structure")

        def cast(n: Any, o: Any) -> Any:
            dtype = getattr(o, "dtype", None)
            if n is o or dtype is None or is_key(o):
                return n  # a leaf fn kept costs nothing (Anneal touches one of hundreds)
            return jnp.asarray(n, dtype=dtype)

        self.state = jax.tree.map(cast, new, old)

    @property
    def start_time(self) -> Time:
        """The time at which the current run started (or resumed)."""
        return self._clock[1] if self._clock is not None else self.time

    @property
    def metrics(self) -> Any:
        """The latest step's metrics (on the device until read)."""
        return self._metrics

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything but the train state needed to continue exactly: counters, timelines,
        data position, the loop's settings and each plugin's state (JSON-serialisable)."""
        data = getattr(self.data, "state_dict", None)
        return {
            "time": self.time.to_dict(),
            "started_at": self.started_at,
            "position": self.position,
            "loop": {"epochs": self.epochs, "steps": self.max_steps,
                     "steps_per_call": self.steps_per_call},
            "plugins": {e.name: e.plugin.state_dict() for e in self._entries
                        if isinstance(e.plugin, Plugin)},
            "data": data() if callable(data) else None,
            "data_changes": list(self.data_changes),
            # What `graphmod resume DIR` runs again.
            "command": recorded_command(),
        }

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        """Continues from :meth:`state_dict`'s record (the run's ``begin`` is not repeated).

        Refuses, before changing anything, data whose description (size, shapes, dtypes,
        content hash, batch size, seed, shuffling) differs from the one the checkpoint's
        provenance records, unless the loop was made with ``allow_data_change=True``."""
        changes = self._data_changes(meta)
        self.time = Time(**meta["time"])
        self.started_at = meta.get("started_at")
        self.position = int(meta["position"])
        self._started = True
        saved = meta.get("plugins", {})
        for entry in self._entries:
            if isinstance(entry.plugin, Plugin) and entry.name in saved:
                entry.plugin.load_state_dict(saved[entry.name])
        if meta.get("data") is not None and hasattr(self.data, "load_state_dict"):
            self.data.load_state_dict(meta["data"])
        self.data_changes = changes

    def _data_changes(self, meta: dict[str, Any]) -> list[dict[str, Any]]:
        """The run's allowed data changes, one more if these data differ from the
        checkpoint's; raises naming the differing fields unless ``allow_data_change``."""
        from graphmod.provenance._collect import data_record

        changes = list(meta.get("data_changes", []))
        saved = ((meta.get("provenance") or {}).get("inputs") or {}).get("data")
        if saved is None:  # no provenance (a step not from graphmod.optimize): not checkable
            return changes
        now = data_record(self.data)
        fields = sorted(k for k in set(saved) | set(now)
                        if k != "name" and saved.get(k) != now.get(k))  # a name is a label
        if not fields:
            return changes
        if not self.allow_data_change:
            lines = "\n  ".join(f"{k}: checkpoint {_short(saved.get(k))}, "
                                f"these data {_short(now.get(k))}" for k in fields)
            raise ValueError(
                f"resume: the data differ from those the checkpoint of step "
                f"{meta['time']['step']} was trained on ({', '.join(fields)}):\n  {lines}\n"
                "Pass the run's own data to continue it exactly, or allow_data_change=True "
                "(to Loop.resume, or to the Loop of a Checkpoint(resume=True)) to continue "
                "on these data; the change is recorded in later checkpoints")
        return [*changes, {"step": int(meta["time"]["step"]), "fields": fields}]

    @classmethod
    def resume(cls, directory: str, step: Callable[..., Any], data: Iterable[Any], *,
               plugins: Iterable[Any] = (), state: Any = None, checkpoint: int | None = None,
               allow_data_change: bool = False, **settings: Any) -> Any:
        """Continues the run saved in ``directory`` exactly where its latest checkpoint
        stopped, and returns the final state.

        ``state`` is a template of the train state (any state of the same program); by
        default it is derived from ``step`` (a :func:`graphmod.optimize` step) and the first
        batch of ``data``. ``settings`` override the saved ``epochs``/``steps``/
        ``steps_per_call``. Data whose description differs from the checkpoint's are
        refused (naming the fields) unless ``allow_data_change=True``, which is recorded
        (``data_changes`` in later checkpoints). A missing ``directory`` is an error, and
        nothing is created.
        """
        from graphmod._checkpoint import Checkpointer

        path = os.path.abspath(os.fspath(directory))
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"Loop.resume: no checkpoint in {path}: "
                f"{'not a directory' if os.path.exists(path) else 'no such directory'} "
                "(nothing was created); pass the directory a Checkpoint plugin saved into")
        reader = Checkpointer(path, keep=None)
        try:
            template = state if state is not None else _abstract_state(step, data)
            restored, meta = reader.restore(template, checkpoint)
        finally:
            reader.close()
        loop = cls(step, data, plugins=plugins, allow_data_change=allow_data_change,
                   **{**meta["loop"], **settings})
        loop.load_state_dict(meta)
        return loop.run(restored)

    # -- running --------------------------------------------------------------------------------
    def run(self, state: Any) -> Any:
        """Runs to the end (epochs/steps) or a ``terminate``; returns the final state.

        Ctrl-C (in the main thread) stops the run after the step or event in progress:
        plugins get an ``interrupt`` event holding that finished step's state, then
        ``KeyboardInterrupt`` is raised; a second Ctrl-C aborts at once. A plugin's error in
        ``setup`` or ``teardown`` raises a :class:`PluginError` naming it and the phase;
        every plugin set up is torn down, also when another's teardown raises.
        """
        check_event_types([(e.name, e.template) for e in self._entries if e.template is not None],
                          self.plugins)
        self._check_state(state)
        self.state = state
        self._terminated = False
        step = self.step
        for entry in reversed(self._entries):
            if isinstance(entry.plugin, Plugin):
                step = entry.plugin.wrap_step(step)
        multi = self._multi_step(step) if self.steps_per_call > 1 else None
        with SigintGuard(self._notice()) as guard:
            self._guard = guard
            try:
                self._run_plugins(step, multi)
            finally:
                self._guard = None
        if guard.requested:  # Ctrl-C during the last teardowns: the run itself completed
            raise KeyboardInterrupt(f"interrupted after the run ended at step {self.time.step}")
        return self.state

    def _check_state(self, state: Any) -> None:
        """Refuses a state the step cannot take, naming the argument and the fix."""
        make = "state = step.init(program.init(*example_batch), jax.random.key(0))"
        if state is None:
            raise TypeError(f"Loop.run(state): state is None; pass the train state to start "
                            f"from, e.g. {make}")
        if isinstance(self.step, TrainStep) and not isinstance(state, TrainState):
            raise TypeError(f"Loop.run(state): a graphmod.optimize step takes a "
                            f"graphmod.TrainState, got {type(state).__name__}; make one with "
                            "state = step.init(variables, jax.random.key(0))")

    def _run_plugins(self, step: Callable[..., Any], multi: Callable[..., Any] | None) -> None:
        """Sets the plugins up, runs, and tears them down (also on an error or Ctrl-C)."""
        done = self._setup()
        error: BaseException | None = None
        try:
            self._check_interrupt()
            self._run_events(step, multi)
        except BaseException as exc:
            error = exc
            if isinstance(exc, KeyboardInterrupt) and self._guard is not None \
                    and self._guard.requested:  # Ctrl-C, here or in a nested loop
                error = KeyboardInterrupt(f"interrupted at step {self.time.step}")
            self._interrupt(error)
            if error is not exc:
                raise error from None  # a short traceback, not one through the loop
            raise
        finally:
            self._teardown(done, error)

    def _run_events(self, step: Callable[..., Any], multi: Callable[..., Any] | None) -> None:
        """``begin`` (unless resumed), the epochs with their steps, ``end``."""
        self._clock = (_time.perf_counter(), self.time)
        self._plugin_seconds = 0.0
        if not self._started:
            self.started_at = utc_now()
            self._emit("begin")
            self._started = True
        while not self._finished():
            if self.position == 0:
                self._emit("epoch_begin")
            self._run_epoch(step, multi)
            if self._terminated or self._finished_steps():
                break
            self.time = dataclasses.replace(self.time, epoch=self.time.epoch + 1)
            self.position = 0
            self._emit("epoch_end")
        self.ended_at = utc_now()
        self._emit("end")

    def _setup(self) -> list[_Entry]:
        """Sets the plugins up in order; if one raises, those set up are torn down."""
        done: list[_Entry] = []
        for entry in self._entries:
            if not isinstance(entry.plugin, Plugin):
                continue
            try:
                entry.plugin.setup(self)  # may restore the loop (Checkpoint(resume=True))
            except BaseException as exc:
                error = _plugin_error(entry.name, "in setup", exc)
                self._teardown(done, error)
                if error is exc:
                    raise
                raise error from exc
            done.append(entry)
        return done

    def _teardown(self, done: list[_Entry], error: BaseException | None) -> None:
        """Tears every set-up plugin down (LIFO), also when one raises: the run's own error
        wins, else the first teardown error is raised; the others become its notes."""
        failures: list[BaseException] = []
        for entry in reversed(done):
            try:
                entry.plugin.teardown(self, error)
            except Exception as exc:
                failures.append(_plugin_error(entry.name, "in teardown", exc))
        if not failures:
            return
        head = error if error is not None else failures.pop(0)
        for failure in failures:
            head.add_note(f"also: {failure}")
        if error is None:
            raise head

    def _notice(self) -> str:
        """The line printed at the first Ctrl-C."""
        saving = " and saving it" if self._saves_on_interrupt() else ""
        return (f"graphmod: Ctrl-C: finishing the current step{saving}; press Ctrl-C again "
                "to abort at once (saving nothing more)")

    def _saves_on_interrupt(self) -> bool:
        """Whether a plugin (a Checkpoint) saves the run on an interrupt."""
        return any(getattr(e.plugin, "save_on_interrupt", False) for e in self._entries)

    def _check_interrupt(self) -> None:
        """Stops the run here, a safe point (the state is a finished step), after Ctrl-C."""
        if self._guard is not None and self._guard.requested:
            raise KeyboardInterrupt

    def _finished_steps(self) -> bool:
        return self.max_steps is not None and self.time.step >= self.max_steps

    def _finished(self) -> bool:
        if self._terminated or self._finished_steps():
            return True
        return self.epochs is not None and self.time.epoch >= self.epochs

    def _run_epoch(self, step: Callable[..., Any], multi: Callable[..., Any] | None) -> None:
        # buffer: [size, host batch, device batch or None]; the head is put on the device
        # before the current step is dispatched, so the copy overlaps the computation.
        buffer: collections.deque[list[Any]] = collections.deque()
        batches = self._batches()
        produced = False
        while True:
            while len(buffer) < self.steps_per_call + 1:
                try:
                    host = next(batches)
                except StopIteration:
                    break
                produced = True
                buffer.append([_batch_size(host), host, None])
            if not buffer:
                break
            count = self._plan([entry[0] for entry in buffer])
            chunk = [buffer.popleft() for _ in range(count)]
            if count == 1:
                size, host, device = chunk[0]
                batch = device if device is not None else self._put(host)
            else:
                size = sum(entry[0] for entry in chunk)
                batch = self._put(jax.tree.map(lambda *xs: np.stack(xs), *[e[1] for e in chunk]))
            if self._prefetch and buffer and buffer[0][2] is None:
                buffer[0][2] = self._put(buffer[0][1])
            if count == 1:
                self.state, self._metrics = _call(step, self.state, batch)
            else:
                assert multi is not None
                self.state, stacked_metrics = multi(self.state, batch)
                self._metrics = jax.tree.map(lambda m: m[-1], stacked_metrics)
            self.position += count
            self._advance(count, size)
            self._emit("step")
            if self._terminated or self._finished_steps():
                return
        if not produced and self.position == 0:
            raise ValueError(f"the data source yielded no batch in epoch {self.time.epoch}")

    def _put(self, batch: Any) -> Any:
        # On the CPU the device is the host: jit takes NumPy batches faster than a put.
        return jax.device_put(batch) if self._prefetch else batch

    def _batches(self) -> Iterator[Any]:
        data = self.data
        if hasattr(data, "iter_epoch"):
            return iter(data.iter_epoch(self.time.epoch, start=self.position))
        iterator = iter(data)
        for _ in range(self.position):  # resume inside an epoch of a plain iterable
            next(iterator)
        return iterator

    def _plan(self, sizes: list[int]) -> int:
        """How many buffered steps to run in one call: none planned may fall inside."""
        limit = min(len(sizes), self.steps_per_call)
        if self.max_steps is not None:
            limit = min(limit, self.max_steps - self.time.step)
        if limit <= 1:
            return 1
        templates = [part for e in self._entries if e.template is not None
                     for part in _parts(e.template)]
        step_templates = [t for t in templates if "step" in t.types()]
        plans = []
        for t in step_templates:
            fields = t.schedules() if isinstance(t, On) and t.issuer is None else None
            if fields is None:
                return 1  # a predicate we cannot evaluate ahead: one step at a time
            if fields and all(k in _PLANNABLE for k in fields):
                plans.append(fields)
            # else: a catch-all, or a wall-clock schedule, sees one event per dispatch
        now = self.time
        for i in range(1, limit):
            nxt = dataclasses.replace(now, step=now.step + 1, examples=now.examples + sizes[i - 1])
            for fields in plans:
                if all(s(getattr(now, k), getattr(nxt, k)) for k, s in fields.items()):
                    return i
            now = nxt
        return limit

    def _multi_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        # A graphmod.optimize step keeps one fused function across loops and resumes.
        if step is self.step and callable(getattr(step, "steps", None)):
            return step.steps  # type: ignore[attr-defined]

        def run(state: Any, batches: Any) -> tuple[Any, Any]:
            return jax.lax.scan(lambda s, b: _call(step, s, b), state, batches)

        return jax.jit(run, donate_argnums=0)

    # -- time and events ----------------------------------------------------------------------
    def _now(self) -> Time:
        assert self._clock is not None
        start, base = self._clock
        elapsed = _time.perf_counter() - start
        t = self.time
        return Time(t.step, t.epoch, t.examples, base.seconds + elapsed,
                    base.train_seconds + elapsed - self._plugin_seconds)

    def _advance(self, steps: int, examples: int) -> None:
        t = self._now()
        self.time = Time(t.step + steps, t.epoch, t.examples + examples, t.seconds,
                         t.train_seconds)

    def _event(self, type: str, issuer: Any, data: dict[str, Any]) -> Event:
        if self._clock is not None:
            self.time = self._now()
        # The first event of a type covers the range since the run started.
        start = self.start_time
        # An event fired with metrics (e.g. "validated") carries them as its metrics.
        metrics = data.pop("metrics") if "metrics" in data else self._metrics
        return Event(type, issuer, self.time, self._prev.get((id(issuer), type), start), self,
                     self.state, metrics, data)

    def _emit(self, type: str, **data: Any) -> None:
        self._dispatch(self._event(type, self, data))
        while self._queue:
            self._dispatch(self._queue.popleft())
        self._check_interrupt()

    def _dispatch(self, event: Event) -> None:
        self._prev[(id(event.issuer), event.type)] = event.time
        if event.type == "terminate":
            self._terminated = True
        entries = self._orders[1 if _is_end(event.type) else 0]
        for order, entry in enumerate(entries):
            if entry.plugin is event.issuer:
                continue
            if entry.template is None:
                if isinstance(entry.plugin, Plugin) and not entry.plugin.handles(event.type):
                    continue
            elif not entry.template.matches(event):
                continue
            self._call_plugin(entry, event, order)

    def _call_plugin(self, entry: _Entry, event: Event, order: int,
                     handler: Callable[[Event], Any] | None = None) -> None:
        begin = _time.perf_counter()
        self._current = entry
        try:
            (handler or entry.plugin)(event)
        except BaseException as exc:
            error = _plugin_error(
                entry.name, f"on the {event.type!r} event at step {event.time.step}", exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            self._current = None
            spent = _time.perf_counter() - begin
            self._plugin_seconds += spent
            self.trace.append(Dispatch(event.type, event.time.step, entry.name, order, spent))

    def _interrupt(self, exc: BaseException) -> None:
        """Lets plugins react (save, close) to a stop on an error or KeyboardInterrupt."""
        self._queue.clear()
        if self.state is not None and _donated(self.state):
            self.state = None  # cut off inside a donating step call: no state left to save
        event = self._event("interrupt", self, {"error": exc})
        for order, entry in enumerate(reversed(self._entries)):
            handler = None
            if isinstance(entry.plugin, Plugin):  # whatever its template: Checkpoint saves
                handler = getattr(entry.plugin, "on_interrupt", None)
                if handler is None:
                    continue
            elif entry.template is not None and not entry.template.matches(event):
                continue
            try:
                self._call_plugin(entry, event, order, handler)
            except PluginError as failure:  # the original error is what the user needs first
                exc.add_note(f"also: {failure}")
            except KeyboardInterrupt:
                break  # Ctrl-C again (in an interactive session): abort, saving nothing more
        if isinstance(exc, KeyboardInterrupt):
            why = ("the step call it cut off had taken the state" if self.state is None else
                   None if self._saves_on_interrupt() else
                   "no plugin saves on an interrupt: add graphmod.plugins.Checkpoint")
            if why is not None:  # else the Checkpoint says what it saved
                print(f"graphmod: interrupted at step {self.time.step}; nothing was saved "
                      f"({why})", file=sys.stderr)


def _plugin_error(name: str, where: str, exc: BaseException) -> BaseException:
    """A plugin's exception as a :class:`PluginError` naming the plugin and where it
    raised; a PluginError (a nested loop's) or a KeyboardInterrupt is kept as it is."""
    if isinstance(exc, PluginError) or not isinstance(exc, Exception):
        return exc
    error = PluginError(f"plugin {name!r} raised {where}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _donated(state: Any) -> bool:
    """Whether a state's buffers were donated to a step call that never returned."""
    return any(isinstance(leaf, jax.Array) and leaf.is_deleted()
               for leaf in jax.tree.leaves(state))


def _short(value: Any) -> str:
    """A described field for an error message (a hash cut to its first characters)."""
    return repr(value[:12] + "...") if isinstance(value, str) and len(value) > 16 \
        else repr(value)


def _parts(template: Template) -> list[Template]:
    """The alternatives of a template (``On(...) | On(...)``), planned one by one."""
    if isinstance(template, AnyOf):
        return [part for t in template.templates for part in _parts(t)]
    return [template]


def _call(step: Callable[..., Any], state: Any, batch: Any) -> Any:
    args, kwargs = step_arguments(batch)
    return step(state, *args, **kwargs)


def _abstract_state(step: Any, data: Iterable[Any]) -> Any:
    """The shapes of ``step``'s train state, from the first batch of ``data``."""
    if not hasattr(step, "abstract_state"):
        raise TypeError("Loop.resume: pass state=<a train state of this program> (the step "
                        "is no graphmod.optimize step, so its state's shapes are unknown)")
    first = next(iter(data.iter_epoch(0) if hasattr(data, "iter_epoch") else data))
    if isinstance(first, dict):
        return step.abstract_state(**first)
    return step.abstract_state(*first) if isinstance(first, tuple | list) \
        else step.abstract_state(first)
