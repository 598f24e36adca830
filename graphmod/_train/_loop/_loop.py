"""``Loop``: runs a train step over data; everything around the run happens in plugins.

The class holds the run's counters, state and settings and drives epochs and steps; plugins
and events are :mod:`._dispatch`'s, reading batches ahead and fusing steps :mod:`._steps`',
resuming :mod:`._resume`'s, stop signals (Ctrl-C, SIGTERM) :mod:`graphmod._train._interrupt`'s.
The order of events and the speed rules are in :mod:`graphmod._train._loop`.
"""

from __future__ import annotations

import dataclasses
import time as _time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

import jax

from graphmod._core._clock import utc_now
from graphmod._records._record import Provenance
from graphmod._train._command import working_directory
from graphmod._train._events import Event, Template, Time, check_event_types
from graphmod._train._interrupt import SignalGuard, StopAgreement, report_unsaved
from graphmod._train._loop._dispatch import DispatchTrace, Listener, PluginTable
from graphmod._train._loop._models import LoopStep, Models, loop_step, run_provenance
from graphmod._train._loop._resume import (
    LoopSettings,
    RestoresPosition,
    loop_record,
    read_checkpoint,
    recorded_models,
    resume_changes,
    saved_loop,
    saved_settings,
)
from graphmod._train._loop._steps import (
    ReadAhead,
    Step,
    StepMetrics,
    batch_placer,
    bounded,
    call_step,
    cast_like,
    check_first_batch,
    check_loop_settings,
    check_start_state,
    check_transforms_source,
    donated,
    epoch_batches,
    fused_steps,
    step_mesh,
    steps_in_flight,
    steps_to_fuse,
)
from graphmod._train._optimize import TrainStep
from graphmod._train._schedule import Schedule
from graphmod._train._train_state import TrainState
from graphmod.data._grain import as_source
from graphmod.typing import JSON, Batch, PathLike, PyTree

if TYPE_CHECKING:  # the plugins import the loop's modules
    from graphmod.plugins._control import BackgroundRun

Registered = TypeVar("Registered")  # a plugin, handed back by Loop.on


class Loop:
    """Runs ``step(state, *batch)`` (or ``**batch`` for dict batches) over ``data``.

    Args:
        step: a train step, e.g. from :func:`graphmod.optimize`: ``(state, metrics)``; or a
            dict of them by model name, run in its order at each iteration on the same
            batch, with a dict of their states by name as the loop's state (a step None:
            a frozen model, whose state others read); see "Several models in one run".
        data: an :class:`graphmod.data.ArraySource` or any iterable of batches (iterated
            once per epoch).
        epochs: stop after this many epochs.
        steps: stop after this many steps (whichever comes first; default: one epoch).
        plugins: plugins registered in order (a :class:`Plugin` with its ``every``
            template, a plain callable for every event).
        steps_per_call: fuse up to this many steps into one dispatch when no plugin is due.
        allow_data_change: continue from a checkpoint (``Loop.resume``,
            ``Checkpoint(resume=True)``) although the data differ from the checkpoint's
            description, or train a program whose transforms were fitted on other data;
            the change is recorded in the checkpoints written afterwards.
        schedules: for a dict of steps, the iterations at which a model steps (the step
            timeline, from 1), e.g. ``{"gen": gm.each(5)}``; default every iteration.
        reads: for a dict of steps, the models whose current variables a step gets as
            keywords named after them, e.g. ``{"gen": ["disc"]}``: ``g_step(g_state,
            *batch, disc=d_state.variables)``. Metrics are named ``model/metric``.

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

        Two models, the second stepping every other iteration:

        >>> loop = gm.Loop({"a": step, "b": step}, ArraySource((x, y), batch_size=8),
        ...                schedules={"b": gm.each(2)})
        >>> states = loop.run({"a": state, "b": jax.tree.map(jnp.copy, state)})
        >>> int(states["a"].step), int(states["b"].step), sorted(loop.metrics)
        (12, 10, ['a/loss', 'b/loss'])
    """

    def __init__(
        self,
        step: LoopStep,
        data: Iterable[Batch],
        *,
        epochs: int | None = None,
        steps: int | None = None,
        plugins: Iterable[Listener] = (),
        steps_per_call: int = 1,
        allow_data_change: bool = False,
        schedules: Mapping[str, Schedule] | None = None,
        reads: Mapping[str, Sequence[str] | str] | None = None,
    ) -> None:
        step = loop_step(step, schedules, reads, steps_per_call)
        data = as_source(data)  # a Grain pipeline: a GrainSource, resuming on its state
        check_loop_settings(step, data, epochs=epochs, steps=steps,
                            steps_per_call=steps_per_call)
        check_transforms_source(step.steps.values() if isinstance(step, Models) else [step],
                                data, allow_data_change)
        self.step: Step | Models = step
        self.data: Iterable[Batch] = data
        self.epochs = epochs if epochs is not None or steps is not None else 1
        self.max_steps = steps
        self.steps_per_call = steps_per_call
        self.allow_data_change = allow_data_change
        # Where the run started: a script's relative arguments are relative to it (resume).
        self.started_in = working_directory()
        # Data changes allowed on resumes: [{"step": ..., "fields": [...]}] (in checkpoints).
        self.data_changes: list[JSON] = []
        self.setting_changes: list[JSON] = []  # resumed with other settings
        self.time = Time()
        self.position = 0  # batches done in the current epoch
        self.state: PyTree = None
        self._plugins = PluginTable()
        self._put = batch_placer(step)
        self._clock: tuple[float, Time] | None = None
        self._metrics: StepMetrics = {}
        self._started = False
        self._guard: SignalGuard | None = None  # set while run() handles stop signals
        self._stopped: dict[str, JSON] | None = None  # the stop its checkpoints record
        self._agreement: StopAgreement | None = None  # set while a run of processes runs
        self.started_at: str | None = None  # wall-clock start of the run (UTC, ISO 8601)
        self.ended_at: str | None = None
        for plugin in plugins:
            self.on(None, plugin)

    def __repr__(self) -> str:
        ends = [f"{n} {u}" for n, u in ((self.epochs, "epochs"), (self.max_steps, "steps"))
                if n is not None]
        return (f"Loop: {' or '.join(ends)}, at step {self.time.step}, steps_per_call="
                f"{self.steps_per_call}\n  data: {self.data!r}\n  plugins: {self._plugins!r}"
                "\n  " + repr(self.step).replace("\n", "\n  "))

    # -- registration -------------------------------------------------------------------------
    def on(self, template: Template | str | None, plugin: Registered, *,
           priority: int | None = None) -> Registered:
        """Registers ``plugin`` for events matching ``template``; None: a :class:`Plugin`'s
        own ``every`` (its ``on_<type>`` methods when that is None), every event for a
        plain callable."""
        self._plugins.register(template, plugin, priority)
        return plugin

    @property
    def plugins(self) -> list[Listener]:
        """The registered plugins, in registration order."""
        return [e.plugin for e in self._plugins.entries]

    # -- what plugins call --------------------------------------------------------------------
    def fire(self, type: str, **data: object) -> None:
        """Queues an event issued by the plugin being dispatched (or the loop)."""
        current = self._plugins.current
        issuer = current.plugin if current is not None else self
        self._plugins.queue.append(self._event(type, issuer, data))

    def terminate(self, reason: str | None = None) -> None:
        """Stops the run after the current step (fires a ``terminate`` event whose
        ``reason`` a progress bar or log shows, e.g. ``"early stopping: ..."``)."""
        self.fire("terminate", reason=reason)

    def update_state(self, fn: Callable[[PyTree], PyTree]) -> None:
        """Replaces the train state by ``fn(state)``, cast to each leaf's dtype (no retrace)."""
        current = self._plugins.current
        self.state = cast_like(fn(self.state), self.state,
                               current.name if current is not None else "update_state")

    @property
    def start_time(self) -> Time:
        """The time at which the current run started (or resumed)."""
        return self._clock[1] if self._clock is not None else self.time

    @property
    def trace(self) -> DispatchTrace:
        """The last plugin calls (event, step, plugin, order, seconds), newest last; in a
        loop of several models each model's step too (``kind="model"``, event ``"train"``,
        the model's name as ``plugin``): see :class:`DispatchTrace`."""
        return self._plugins.trace

    @trace.setter
    def trace(self, trace: DispatchTrace) -> None:  # e.g. a longer or shorter buffer
        self._plugins.trace = trace

    @property
    def metrics(self) -> StepMetrics:
        """The latest step's metrics (on the device until read)."""
        return self._metrics

    # -- checkpoints ----------------------------------------------------------------------------
    @property
    def provenance(self) -> Provenance:
        """The run's record: the step's (program, optimizer, train seed), the data, the
        loop's settings and what happened so far (steps, examples, epochs, times). For
        several models, each stepping model's own training record under its name
        (``record.models``; a frozen model's is None), with their ``order``, ``schedules``
        (descriptions), ``reads`` and ``frozen`` names.

        Examples:
            >>> import jax, jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> step = gm.optimize(program, gm.provenance.optimizer("sgd", 0.1))
            >>> loop = gm.Loop(step, [(jnp.ones((4, 2)),)] * 3, epochs=1)
            >>> _ = loop.run(step.init(program.init(jnp.ones((4, 2))), jax.random.key(0)))
            >>> loop.provenance["loop"]["epochs"], loop.provenance.derived["steps"]
            (1, 3)
            >>> two = gm.Loop({"a": step, "b": None}, [(jnp.ones((4, 2)),)] * 3)
            >>> states = {"a": step.init(program.init(jnp.ones((4, 2))), jax.random.key(1)),
            ...           "b": {"w": jnp.ones(2)}}
            >>> _ = two.run(states)
            >>> record = two.provenance
            >>> record["order"], record["frozen"], record.models["a"]["optimizer"]["name"]
            (('a', 'b'), ('b',), 'sgd')
        """
        return run_provenance(self)

    def state_dict(self) -> dict[str, JSON]:
        """Everything but the train state needed to continue exactly: counters, timelines,
        data position, the loop's settings and each plugin's state (JSON-serialisable); once
        the run is stopped (Ctrl-C, SIGTERM, ...), ``"stopped"``: the signal (None where
        another process of the run got it) and the step."""
        record = loop_record(self, self._plugins.state_dict())
        if self._stopped is not None:
            record["stopped"] = self._stopped
        return record

    def load_state_dict(self, meta: Mapping[str, JSON]) -> None:
        """Continues from :meth:`state_dict`'s record (the run's ``begin`` is not repeated).

        Refuses, before changing anything, data whose description (size, shapes, dtypes,
        content hash, batch size, seed, shuffling) differs from the one the checkpoint's
        provenance records, unless the loop was made with ``allow_data_change=True``."""
        changes = resume_changes(meta, self.data, self.step, self.allow_data_change)
        saved = saved_loop(meta)
        self.time = saved.time
        self.started_at = saved.started_at
        self.position = saved.position
        self._started = True
        self._plugins.load_state_dict(saved.plugins)
        self._metrics = saved.metrics  # a finished run's, resumed: its last
        if saved.data is not None and isinstance(self.data, RestoresPosition):
            self.data.load_state_dict(saved.data)
        self.data_changes, self.setting_changes = changes

    @classmethod
    def resume(cls, directory: PathLike, step: LoopStep, data: Iterable[Batch], *,
               plugins: Iterable[Listener] = (), state: PyTree | None = None,
               checkpoint: int | None = None, allow_data_change: bool = False,
               **settings: Unpack[LoopSettings]) -> Any:
        """Continues the run saved in ``directory`` exactly where its latest checkpoint
        stopped, and returns the final state.

        ``state`` is a template of the train state (any state of the same program); by
        default it is derived from ``step`` (a :func:`graphmod.optimize` step) and the first
        batch of ``data`` (for a dict of steps, from each program's ``init`` examples; a
        frozen model's needs ``state=``). ``settings`` override the saved ``epochs``/``steps``/
        ``steps_per_call``. Data whose description differs from the checkpoint's are
        refused (naming the fields) unless ``allow_data_change=True``, which is recorded
        (``data_changes`` in later checkpoints). A missing ``directory`` is an error, and
        nothing is created. For a dict of steps, the schedules and reads are the
        checkpoint's (its record of the models: schedules parsed back from their
        descriptions, never evaluated) unless given as ``schedules=`` or ``reads=``; other
        model names than the checkpoint's are refused before anything is restored, and a
        changed schedule, reads or frozen model is warned of (``setting_changes``).
        """
        data = as_source(data)  # one GrainSource for the checks and the run
        restored, meta = read_checkpoint(directory, state, step, data, checkpoint)
        chosen: LoopSettings = {**saved_settings(meta), **recorded_models(meta, step, settings),
                                **settings}
        loop = cls(step, data, plugins=plugins, allow_data_change=allow_data_change, **chosen)
        loop.load_state_dict(meta)
        return loop.run(restored)

    # -- running --------------------------------------------------------------------------------
    def run(self, state: PyTree) -> Any:  # the state the user's step returned last
        """Runs to the end (epochs/steps) or a ``terminate``; returns the final state.

        Ctrl-C or SIGTERM (in the main thread; more signals with ``GRAPHMOD_STOP_SIGNALS``,
        see the loop guide's "Ctrl-C, SIGTERM and other stop signals") stops the run after
        the step or event in progress: plugins get an ``interrupt`` event holding that
        finished step's state (its checkpoints record the stop), then ``KeyboardInterrupt``
        is raised (for a signal other than Ctrl-C's, a ``SignalInterrupt``, with which a
        script exits with 128 + the signal: 143 for SIGTERM); a second signal aborts at once.
        In a run of several processes (:mod:`graphmod.distributed`) a stop signal to any
        process stops every process at one step they agree on, so that they can save it
        together (see :mod:`graphmod.distributed`). A plugin's error in ``setup`` or
        ``teardown`` raises a :class:`PluginError` naming it and the phase; every plugin set up
        is torn down, also when another's teardown raises.
        """
        check_event_types([(e.name, e.template) for e in self._plugins.entries
                           if e.template is not None], self.plugins)
        if isinstance(self.step, Models):
            self.step.check(state, self.data, self.time.epoch, self.position)
        else:
            check_start_state(self.step, state)
            check_first_batch(self.step, self.data, self.time.epoch, self.position)
        self.state = state
        self._plugins.terminated = False
        self._stopped = None
        step = (self.step.wrapped(self._plugins.wrap) if isinstance(self.step, Models)
                else self._plugins.wrap(self.step))
        multi = fused_steps(step, self.step) if self.steps_per_call > 1 else None
        limit = steps_in_flight(self.step)
        step, multi = bounded(step, limit), multi and bounded(multi, limit)
        with SignalGuard(self._plugins.saves_on_interrupt()) as guard, step_mesh(self.step):
            self._guard = guard
            try:
                self._run_plugins(step, multi)
            finally:
                self._guard = None
            if guard.requested:  # a stop during the last teardowns: the run itself completed
                raise guard.stop(self.time.step, ended=True)
        return self.state

    def _run_plugins(self, step: Step | Models, multi: Step | None) -> None:
        """Sets the plugins up, runs, and tears them down (also on an error or Ctrl-C)."""
        done = self._plugins.setup(self)
        error: BaseException | None = None
        try:
            if isinstance(self.step, TrainStep) and isinstance(self.state, TrainState):
                self.state = self.step.place(self.state)  # restored: saved on any mesh
            self._agree_on_stops()
            self._check_interrupt()
            self._run_events(step, multi)
        except BaseException as exc:
            error = exc
            guard = self._guard
            if isinstance(exc, KeyboardInterrupt) and guard is not None \
                    and guard.requested:  # a stop signal, here or in a nested loop
                error = guard.stop(self.time.step)
            if isinstance(error, KeyboardInterrupt):
                taken = guard.signal if guard is not None else None  # None: another process's
                self._stopped = {"signal": taken.name if taken else None, "step": self.time.step}
            self._interrupt(error)
            if error is not exc:
                raise error from None  # a short traceback, not one through the loop
            raise
        finally:
            self._agreement = None
            self._plugins.teardown(self, done, error)

    def _agree_on_stops(self) -> None:
        """In a run of several processes, stops (Ctrl-C, a preemption notice) are agreed
        on by every process (:class:`StopAgreement`); by the outermost loop alone, whose
        steps are the run's."""
        guard = self._guard
        if guard is not None and guard.outermost:
            self._agreement = StopAgreement.start(self.time.step)
            guard.notify_peers = self._agreement is not None

    def _run_events(self, step: Step | Models, multi: Step | None) -> None:
        """``begin`` (unless resumed), the epochs with their steps, ``end``."""
        self._clock = (_time.perf_counter(), self.time)
        self._plugins.seconds = 0.0
        if not self._started:
            self.started_at = utc_now()
            self._emit("begin")
            self._started = True
        while not self._finished():
            if self.position == 0:
                self._emit("epoch_begin")
            if not self._run_epoch(step, multi) or self._plugins.terminated:
                break  # an epoch whose last batch was also the last step still ends
            self.time = dataclasses.replace(self.time, epoch=self.time.epoch + 1)
            self.position = 0
            self._emit("epoch_end")
        self.ended_at = utc_now()
        self._emit("end")

    def _check_interrupt(self) -> None:
        """Stops the run here, a safe point (the state is a finished step), after a stop
        signal."""
        if self._guard is not None and self._guard.requested:
            raise KeyboardInterrupt
        if self._agreement is not None and self._agreement.reached(self.time.step):
            raise KeyboardInterrupt(f"interrupted at step {self.time.step} (every process "
                                    "stops at this step)")

    def _finished_steps(self) -> bool:
        return self.max_steps is not None and self.time.step >= self.max_steps

    def _finished(self) -> bool:
        if self._plugins.terminated or self._finished_steps():
            return True
        return self.epochs is not None and self.time.epoch >= self.epochs

    def _run_epoch(self, step: Step | Models, multi: Step | None) -> bool:
        """Runs the epoch's steps until its batches or the run's steps run out; returns
        whether every batch of the epoch was taken."""
        batches = ReadAhead(epoch_batches(self.data, self.time.epoch, self.position),
                            self.steps_per_call + 1, self._put)
        while sizes := batches.fill():
            count = steps_to_fuse(self._plugins.templates, self.time, sizes,
                                  self.steps_per_call, self.max_steps)
            size, batch = batches.take(count)
            if isinstance(step, Models):  # one iteration: the steps due, in order, traced
                self.state, self._metrics = step(self.time.step + 1, self.state, batch,
                                                 self._metrics, self._plugins.trace.append)
            elif count == 1:
                self.state, self._metrics = call_step(step, self.state, batch)
            else:
                assert multi is not None
                self.state, stacked_metrics = multi(self.state, batch)
                self._metrics = jax.tree.map(lambda m: m[-1], stacked_metrics)
            self.position += count
            self.time = self._now(count, size)
            self._emit("step", fresh=True)
            if self._plugins.terminated or self._finished_steps():
                return batches.over
        if not batches.produced and self.position == 0:
            raise ValueError(f"the data source yielded no batch in epoch {self.time.epoch}")
        return True

    # -- time and events ----------------------------------------------------------------------
    def _now(self, steps: int = 0, examples: int = 0) -> Time:
        """The loop's time now, ``steps`` and ``examples`` further on."""
        assert self._clock is not None
        start, base = self._clock
        now = _time.perf_counter()
        elapsed = now - start
        t = self.time
        return Time(t.step + steps, t.epoch, t.examples + examples, base.seconds + elapsed,
                    base.train_seconds + elapsed - self._plugins.plugin_seconds(now))

    def _event(self, type: str, issuer: object, data: dict[str, object], fresh: bool = False
               ) -> Event:
        if self._clock is not None and not fresh:  # fresh: the time was just advanced
            self.time = self._now()
        start = self.start_time  # the first event of a type covers the run so far
        # An event fired with metrics (e.g. "validated") carries them as its metrics.
        metrics = self._metrics
        if "metrics" in data:
            fired = data.pop("metrics")
            if not isinstance(fired, Mapping):
                raise TypeError(f"loop.fire({type!r}, metrics=...): expected a dict of metrics "
                                f"by name, got {fired.__class__.__name__}")
            metrics = fired
        return Event(type, issuer, self.time, self._plugins.previous(issuer, type, start),
                     self, self.state, metrics, data)

    def _emit(self, type: str, fresh: bool = False) -> None:
        if self._plugins.entries:  # no plugin: no event to make (the loop's hot path)
            self._plugins.deliver(self._event(type, self, {}, fresh))
        while self._plugins.queue:
            self._plugins.deliver(self._plugins.queue.popleft())
        self._plugins.settle()
        self._check_interrupt()

    def _interrupt(self, exc: BaseException) -> None:
        """Lets plugins react (save, close) to a stop on an error or KeyboardInterrupt."""
        self._plugins.queue.clear()
        if self.state is not None and donated(self.state):
            self.state = None  # cut off inside a donating step call: no state left to save
        self._plugins.deliver_interrupt(self._event("interrupt", self, {"error": exc}), exc)
        if isinstance(exc, KeyboardInterrupt):
            report_unsaved(self.time.step, state_taken=self.state is None,
                           saved=self._plugins.saves_on_interrupt())

    # -- in the background ----------------------------------------------------------------------
    def start(self, state: PyTree) -> BackgroundRun:
        """Runs the loop in a background thread and returns a handle at once (a
        ``BackgroundRun``): the notebook stays usable while it trains, its progress bar
        updating. The handle's ``status()``, ``pause()``, ``resume()``,
        ``set(name, value)``, ``save()``, ``event(name)`` and ``stop()`` are the commands of
        the loop's :class:`graphmod.plugins.Control` (one with ``serve=False`` is added if
        the loop has none); ``result()`` returns the final state (re-raising the run's
        exception), ``running`` says whether it still runs. Stop signals stay with the main
        thread: Ctrl-C never reaches a background run; ``stop()`` ends it.

        Examples:
            >>> import numpy as np, graphmod as gm
            >>> loop = gm.Loop(lambda count, x: (count + 1, {}), [(np.ones(3),)] * 12)
            >>> run = loop.start(0)  # returns at once; the loop counts to 12 meanwhile
            >>> run.result(), run.running
            (12, False)
        """
        # Here, not at the top: the plugins import the loop's modules (a cycle otherwise).
        from graphmod.plugins._control import BackgroundRun

        return BackgroundRun(self, state)

