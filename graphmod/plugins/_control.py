"""``Control``: answers commands while a loop runs (from ``graphmod control RUN_DIR ...`` or
from Python); ``BackgroundRun``: a loop running in a thread (``loop.start(state)``).

Where commands run
    ``status`` is answered at once by the thread that received it, from what the loop
    keeps anyway (its time on every timeline, its latest metrics: read only when asked, with
    a timeout, so a step in progress or compiling never blocks it). Every other command is
    queued and applied by the loop's own thread between two steps, at a ``step`` event:
    the loop checks the queue once per step (one truthiness test of a
    ``collections.deque``: no lock, no system call). A command is checked before it is
    queued (its arguments, the hyperparameter's name and range, a Checkpoint to save with):
    a refused one changes nothing. An applied one is a row of the loop's dispatch trace
    (event ``"command"``, the plugin's name), an entry of the plugin's ``state_dict``
    (``{"commands": [{"time", "step", "command", "arguments", "origin"}, ...]}``, so
    checkpoints record it) and a ``command`` event whose ``name`` is the command's (the
    ``event`` command's own name for ``event NAME``), which plugins match with
    ``On("command", name="...")``.

Pausing
    ``pause`` holds the loop thread after the step it was applied at, waiting on a
    ``threading.Event`` (no CPU; it wakes twice a second to notice a stop signal, since a
    Ctrl-C or SIGTERM only sets a flag the loop checks). Commands sent meanwhile are applied
    at once, in the same place: ``set``, ``save``, ``resume``, ``stop``.

Sharp edges
    A value ``set`` for an optimizer hyperparameter that ``optax.inject_hyperparams`` was
    given as a schedule is recomputed by optax at the next update: it lasts one step. A
    ``save`` waits for its write (the run holds still meanwhile); the saves a Checkpoint
    makes on its own schedule do not. A run of several processes cannot be controlled yet.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import threading
import time as _time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
import optax

from graphmod._core._clock import utc_now
from graphmod._core._managers._manager import HParam
from graphmod._train._control import (
    ControlServer,
    Refused,
    Request,
    check_arguments,
    parse_address,
)
from graphmod._train._events import Event, Time
from graphmod._train._host_metrics import copying, on_host, scalar_metrics
from graphmod._train._loop._dispatch import Dispatch, DispatchTrace
from graphmod._train._loop._models import Models, model_state, with_model_state
from graphmod._train._optimize import TrainStep
from graphmod._train._plugin import Plugin
from graphmod.plugins._anneal import _Replaces, _variables, _with_variables
from graphmod.plugins._checkpoint import Checkpoint
from graphmod.plugins._common import planned_steps, registered
from graphmod.typing import JSON, ArrayLike, LoopLike, PyTree


class _Startable(LoopLike, Protocol):
    """A loop that :class:`BackgroundRun` runs in its thread: a :class:`graphmod.Loop`
    (which imports this module to start one)."""

    @property
    def plugins(self) -> Sequence[object]: ...

    def run(self, state: PyTree) -> object: ...

_log = logging.getLogger("graphmod.control")
_PAUSE_POLL_S = 0.5  # a paused loop looks for a stop signal this often
_METRICS_WAIT_S = 1.0  # status waits this long for the latest step's metrics
_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
_Injected: TypeAlias = optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState


@dataclasses.dataclass
class _Pending:
    """A checked command on its way to the loop thread, and its answer to come."""

    command: str
    args: dict[str, JSON]
    origin: str
    answer: concurrent.futures.Future[dict[str, JSON]] = dataclasses.field(
        default_factory=concurrent.futures.Future)


@dataclasses.dataclass(frozen=True)
class _Setting:
    """A hyperparameter ``set NAME=VALUE`` may change: a manager's dynamic one (``hparam``)
    or an optimizer's injected one (``key``), of ``model`` in a loop of several."""

    name: str
    model: str | None
    hparam: HParam | None = None
    key: str | None = None
    valid: tuple[float, float] | None = None

    def check(self, value: float) -> None:
        if self.valid is not None and not self.valid[0] <= value <= self.valid[1]:
            low, high = self.valid
            raise Refused(f"set: {self.name}={value!r} is outside its valid range [{low}, "
                          f"{high}]")

    def _own(self, loop: LoopLike, state: PyTree) -> PyTree:
        return model_state(loop, state, self.model, "Control")

    def get(self, loop: LoopLike) -> float:
        """The value the train state holds now (reads it from the device)."""
        own = self._own(loop, loop.state)
        if self.hparam is not None:
            return float(self.hparam.get(_variables(own, "Control")))
        return float(np.asarray(next(n.hyperparams[key] for n in _injected(_opt_state(own))
                                     if (key := self.key) is not None
                                     and key in n.hyperparams)))

    def apply(self, loop: LoopLike, value: float) -> None:
        """Writes ``value`` into the train state (cast to the stored dtype: no retrace)."""
        def write(state: PyTree) -> PyTree:
            own = self._own(loop, state)
            if self.hparam is not None:
                new = _with_variables(own, self.hparam.set(_variables(own, "Control"), value))
            elif isinstance(own, _Replaces):  # a graphmod.TrainState, another NamedTuple
                new = own._replace(opt_state=jax.tree.map(
                    lambda node: self._replace(node, value), _opt_state(own),
                    is_leaf=_is_injected))
            else:
                raise TypeError(f"set {self.name}: the train state ({type(own).__name__}) "
                                "is no NamedTuple such as a graphmod.TrainState, whose "
                                "opt_state could be replaced")
            return with_model_state(loop, state, self.model, new)

        loop.update_state(write)

    def _replace(self, node: PyTree, value: float) -> PyTree:
        key = self.key
        if _is_injected(node) and key is not None and key in node.hyperparams:
            return node._replace(hyperparams={**node.hyperparams, key: value})
        return node


def _is_injected(node: object) -> TypeGuard[_Injected]:
    return isinstance(node, _INJECTED)


def _opt_state(state: PyTree) -> PyTree:
    """The optimizer state of a train state (None: it has none)."""
    return getattr(state, "opt_state", None)


def _injected(opt_state: PyTree) -> list[_Injected]:
    """The ``optax.inject_hyperparams`` states inside an optimizer state."""
    return [n for n in jax.tree.leaves(opt_state, is_leaf=_is_injected) if _is_injected(n)]


def settings_of(loop: LoopLike) -> dict[str, _Setting]:
    """What ``set`` may change in ``loop``'s run, by name: each manager's dynamic
    hyperparameter as ``manager/hparam`` (``dropout/rate``), each numeric hyperparameter of
    an optimizer made with ``optax.inject_hyperparams`` by its name (``learning_rate``, also
    ``lr``); in a loop of several models, each prefixed with its model (``gen/lr``)."""
    steps = loop.step
    models = ([(n, s) for n, s in steps.steps.items() if s is not None]
              if isinstance(steps, Models) else [(None, steps)])
    found: dict[str, _Setting] = {}
    for model, step in models:
        prefix = f"{model}/" if model is not None else ""
        if isinstance(step, TrainStep):
            for manager in step.program.managers:
                for name in manager.dynamic_hparams():
                    hparam = manager.hparam(name)
                    key = f"{prefix}{manager.name}/{name}"
                    found[key] = _Setting(key, model, hparam=hparam, valid=hparam.valid)
        own = model_state(loop, loop.state, model, "Control")
        for node in _injected(_opt_state(own)):
            for key, value in node.hyperparams.items():
                if isinstance(value, jax.Array | np.ndarray | np.generic) and value.ndim == 0 \
                        and jnp.issubdtype(value.dtype, jnp.floating):
                    valid = (0.0, math.inf) if key == "learning_rate" else None
                    found[prefix + key] = _Setting(prefix + key, model, key=key, valid=valid)
        if prefix + "learning_rate" in found:
            found[prefix + "lr"] = dataclasses.replace(found[prefix + "learning_rate"],
                                                       name=prefix + "lr")
    return found


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else repr(value)  # JSON has no NaN or infinity


class Control(Plugin):
    """Lets a running loop be paused, resumed, stopped, saved, retuned and asked where it
    is, between two steps, from the shell (``graphmod control RUN_DIR COMMAND``) or from
    Python (:meth:`command`, or :meth:`graphmod.Loop.start`'s handle).

    Commands: ``status`` (step, epoch, latest metrics, steps per second, the time left when
    the run's length is known), ``pause``, ``resume``, ``stop`` (saves through the loop's
    :class:`Checkpoint` plugins, then ends the run as a normal end; ``save=False`` ends it
    without saving), ``save`` (a checkpoint now, through the loop's Checkpoint plugins),
    ``set`` (a dynamic hyperparameter, by name: a manager's ``gm.dynamic(...)`` one as
    ``manager/hparam``, e.g. ``dropout/rate``, checked against the manager's
    ``hparam_ranges``; an optimizer made with ``optax.inject_hyperparams``: ``lr`` or
    ``learning_rate`` and its other numeric hyperparameters; written into the train state,
    so nothing recompiles) and ``event`` (fires a ``command`` event of that ``name``).
    ``save`` and a saving ``stop`` are refused in a loop without a Checkpoint. The applied
    commands are listed in ``commands`` (time, step, command, arguments, origin), which
    checkpoints save; ``status`` changes nothing and is not listed.

    From its setup to its teardown the plugin listens (unless ``serve=False``) on a Unix
    socket in the run directory or on a loopback TCP port, and writes the token a request
    must carry into ``graphmod-control.json`` there (mode 600); the command line guide's
    ``graphmod control`` section says how a request looks and what keeps it safe.

    Args:
        directory: the run directory to listen in (default: the first Checkpoint's).
        address: ``"127.0.0.1:PORT"``, ``"[::1]:PORT"`` or ``"localhost:PORT"`` to listen
            on TCP (0: a free port); any other address is refused here, before anything
            binds. Default: a Unix socket in ``directory``.
        serve: listen for requests from outside the process (False: Python only).
        requests_per_second: requests served a second (a token bucket, bursts of as many).
        name: the plugin's name.

    Raises:
        ValueError: an address off the loopback interface (or not ``HOST:PORT``), a
            ``requests_per_second`` that is not a positive number; at setup, a run
            directory holding control files graphmod did not write, or still answering.

    Examples:
        >>> import jax, numpy as np, optax, tempfile, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import Control
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
        ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
        >>> step = gm.optimize(program, optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
        >>> x = np.ones((32, 2), np.float32)
        >>> state = step.init(program.init(x[:1]), jax.random.key(0))
        >>> control = Control(tempfile.mkdtemp())
        >>> loop = gm.Loop(step, ArraySource((x,), batch_size=8), steps=8, plugins=[control])
        >>> _ = loop.on(gm.On("step", step=3), lambda e: control.command(
        ...     "set", {"name": "lr", "value": 0.0}, wait=0))  # sent after Control's turn
        >>> state = loop.run(state)
        >>> [(c["step"], c["command"], c["arguments"]) for c in control.commands]
        [(4, 'set', {'name': 'lr', 'value': 0.0})]
        >>> float(state.opt_state.hyperparams["learning_rate"])
        0.0
    """

    fires = ("command",)

    def __init__(self, directory: str | os.PathLike | None = None, *, address: str | None = None,
                 serve: bool = True, requests_per_second: float = 20.0,
                 name: str = "control") -> None:
        super().__init__(name=name)
        self.directory = None if directory is None else os.path.abspath(os.fspath(directory))
        self.address = parse_address(address)  # refused here, before anything binds
        if not isinstance(serve, bool):
            raise TypeError(f"Control(serve={serve!r}): expected True or False")
        if isinstance(requests_per_second, bool) or not isinstance(
                requests_per_second, int | float) or not 0 < requests_per_second < math.inf:
            raise ValueError(f"Control(requests_per_second={requests_per_second!r}): expected "
                             "a positive number")
        self.serve = serve
        self.requests_per_second = float(requests_per_second)
        self.commands: list[dict[str, JSON]] = []  # every applied command (state_dict)
        self._queue: collections.deque[_Pending] = collections.deque()
        self._lock = threading.Lock()  # between a sender queueing and the teardown
        self._wakeup = threading.Event()  # set when a command is queued
        self._ready = threading.Event()  # set from the end of setup to teardown
        self._setups = 0  # the runs set up so far
        self._accepting = False
        self._paused = False
        self._loop: LoopLike | None = None
        self._first: Time | None = None  # the time of this run's first step event
        self._server: ControlServer | None = None
        self._checkpoints: list[Checkpoint] = []
        self._settings: dict[str, _Setting] = {}

    # -- the run ----------------------------------------------------------------------------
    def setup(self, loop: LoopLike) -> None:
        if self.serve and jax.process_count() > 1:
            raise ValueError("Control: a run of several processes cannot be controlled yet "
                             "(every process would have to apply a command at one step); "
                             "leave Control out of such a run")
        self._loop = loop
        self._first = None
        self._checkpoints = [p for p in registered(loop) if isinstance(p, Checkpoint)]
        self._settings = settings_of(loop)
        self._paused = False
        if self.serve:
            directory = self.directory or next((c.directory for c in self._checkpoints), None)
            if directory is None:
                raise ValueError(f"Control {self.name!r}: no run directory to listen in; pass "
                                 "Control(directory=...) or register a Checkpoint plugin")
            server = ControlServer(directory, self.address, self._request,
                                   requests_per_second=self.requests_per_second)
            server.open()
            self._server = server
        with self._lock:
            self._accepting = True
        self._setups += 1
        self._ready.set()

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        with self._lock:
            self._accepting = False
            pending = list(self._queue)
            self._queue.clear()
        self._ready.clear()
        self._paused = False
        for item in pending:
            item.answer.set_exception(Refused(f"{item.command}: the run ended at step "
                                              f"{loop.time.step} before applying it"))
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def on_step(self, event: Event) -> None:
        if self._first is None:  # the rate counts from here: the first step's compile out
            self._first = event.time
        if self._queue:  # with the check above, the loop's whole cost when nothing was sent
            self._apply_queued(event)

    def state_dict(self) -> dict[str, JSON]:
        return {"commands": list(self.commands)}

    def load_state_dict(self, state: dict[str, JSON]) -> None:
        commands = state.get("commands", [])
        self.commands = [dict(c) for c in commands if isinstance(c, dict)] \
            if isinstance(commands, list) else []

    def provenance_record(self) -> list[dict[str, JSON]]:
        """Every command applied so far (:attr:`commands`), for the run's record."""
        return list(self.commands)

    # -- commands, from any thread ----------------------------------------------------------
    def _request(self, request: Request) -> dict[str, JSON]:
        return self.command(request.command, request.args, wait=request.wait, origin="socket")

    def command(self, command: str, args: Mapping[str, JSON] | None = None, *,
                wait: float | None = None, origin: str = "python") -> dict[str, JSON]:
        """Sends ``command`` with ``args`` to the running loop and returns its answer (a
        dict with a ``message``); ``status`` is answered at once, the others once the loop
        applied them, or after ``wait`` seconds (None: however long it takes) with
        ``{"queued": True, ...}``. Raises :class:`ValueError` (a ``Refused``) for a command
        refused before or when applied, naming why; nothing changed then.

        Examples:
            >>> from graphmod.plugins import Control
            >>> try:
            ...     Control(serve=False).command("pause")
            ... except ValueError as error:
            ...     print(error)
            pause: the run is not running
        """
        args = check_arguments(command, dict(args or {}))
        if command == "status":
            return self.status()
        self._check(command, args)
        pending = _Pending(command, args, origin)
        with self._lock:
            if not self._accepting:
                raise Refused(f"{command}: the run is not running")
            self._queue.append(pending)
        self._wakeup.set()
        try:
            return pending.answer.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            step = self._loop.time.step if self._loop is not None else 0
            return {"queued": True, "message": f"{command}: queued; the loop applies it after "
                                               f"the step in progress (step {step} done)"}

    def _check(self, command: str, args: dict[str, JSON]) -> None:
        """Refuses what cannot be applied, before it is queued."""
        if command in ("save", "stop") and args.get("save", True) and not self._checkpoints:
            raise Refused(f"{command}: the loop has no Checkpoint plugin to save with; add "
                          "graphmod.plugins.Checkpoint(directory)" + (
                              ", or stop without saving (stop --no-save; "
                              "run.stop(save=False))" if command == "stop" else ""))
        if command == "set":
            setting = self._settings.get(_name(args))
            if setting is None:
                known = ", ".join(sorted(self._settings)) or "none (no dynamic manager " \
                    "hyperparameter, no optimizer made with optax.inject_hyperparams)"
                raise Refused(f"set: {args['name']!r} is not a hyperparameter of this run; "
                              f"it has: {known}")
            setting.check(_value(args))

    def status(self) -> dict[str, JSON]:
        """Where the run is: ``step``, ``epoch``, ``examples``, ``seconds``, ``running``,
        ``paused``, ``steps_per_second`` (since this run's first step: its compile left
        out), ``planned_steps`` and ``seconds_left`` (None when the run's length is
        unknown), the latest ``metrics`` (as floats; None with ``metrics_pending`` when the
        step is still running), the ``pending`` commands and the names ``set`` takes
        (``settable``).

        Examples:
            >>> import numpy as np, graphmod as gm
            >>> from graphmod.plugins import Control
            >>> control = Control(serve=False)
            >>> loop = gm.Loop(lambda state, x: (state + 1, {}), [(np.ones(4),)] * 3,
            ...                plugins=[control])
            >>> loop.run(0), control.status()["step"], control.status()["running"]
            (3, 3, False)
        """
        loop = self._loop
        if loop is None:
            raise Refused("status: the run has not started")
        now, first = loop.time, self._first or loop.start_time
        steps, seconds = now.step - first.step, now.seconds - first.seconds
        rate = steps / seconds if steps > 0 and seconds > 0 else None
        planned = planned_steps(loop)
        left = (planned - now.step) / rate if rate and planned is not None else None
        metrics = _read_metrics(loop.metrics)
        return {"step": now.step, "epoch": now.epoch, "examples": now.examples,
                "seconds": now.seconds, "running": self._accepting, "paused": self._paused,
                "steps_per_second": rate, "planned_steps": planned, "seconds_left": left,
                "metrics": metrics, "metrics_pending": metrics is None,
                "pending": len(self._queue), "settable": [*sorted(self._settings)],
                "message": f"step {now.step}"}

    # -- commands, in the loop thread -------------------------------------------------------
    def _apply_queued(self, event: Event) -> None:
        loop = event.loop
        while True:
            while self._queue:
                self._apply(self._queue.popleft(), event)
            if not self._paused or _stop_requested(loop):
                return
            self._wakeup.wait(_PAUSE_POLL_S)
            self._wakeup.clear()  # a command queued since is in the queue: looked at next

    def _apply(self, pending: _Pending, event: Event) -> None:
        begin = _time.perf_counter()
        loop, step = event.loop, event.time.step
        entry = {"time": utc_now(), "step": step, "command": pending.command,
                 "arguments": pending.args, "origin": pending.origin}
        self.commands.append(entry)  # before a save, so that its checkpoint records it
        try:
            answer = getattr(self, f"_{pending.command}")(event, pending.args)
        except Exception as error:
            self.commands.remove(entry)
            if not isinstance(error, Refused):
                _log.warning("Control: %s failed", pending.command, exc_info=True)
                error = Refused(f"{pending.command} failed at step {step}: "
                                f"{type(error).__name__}: {error}")
            pending.answer.set_exception(error)
            return
        name = pending.args["name"] if pending.command == "event" else pending.command
        loop.fire("command", name=name, arguments=dict(pending.args), origin=pending.origin)
        if isinstance(loop.trace, DispatchTrace):  # a graphmod.Loop's
            loop.trace.append(Dispatch("command", step, self.name, 0,
                                       _time.perf_counter() - begin))
        pending.answer.set_result({"step": step, **answer})

    def _pause(self, event: Event, args: dict[str, JSON]) -> dict[str, JSON]:
        self._paused = True
        return {"paused": True, "message": f"paused at step {event.time.step}"}

    def _resume(self, event: Event, args: dict[str, JSON]) -> dict[str, JSON]:
        was, self._paused = self._paused, False
        return {"paused": False, "message": f"resumed at step {event.time.step}" if was
                else f"was not paused (step {event.time.step})"}

    def _stop(self, event: Event, args: dict[str, JSON]) -> dict[str, JSON]:
        saved = self._save_now(event) if args.get("save", True) else []
        self._paused = False
        step = event.time.step
        event.loop.terminate(f"stopped by a control command at step {step}")
        where = f", saved to {', '.join(saved)}" if saved else ", not saved"
        return {"stopping": True, "saved": [*saved],
                "message": f"stopping at step {step}{where}"}

    def _save(self, event: Event, args: dict[str, JSON]) -> dict[str, JSON]:
        saved = self._save_now(event)
        return {"saved": [*saved], "message": f"saved step {event.time.step} to "
                                           f"{', '.join(saved)}"}

    def _save_now(self, event: Event) -> list[str]:
        """Saves the state at ``event`` through every Checkpoint and waits for the writes."""
        for checkpoint in self._checkpoints:
            checkpoint.save(event)
            checkpoint.wait()
        return [c.directory for c in self._checkpoints]

    def _set(self, event: Event, args: dict[str, JSON]) -> dict[str, JSON]:
        setting, value = self._settings[_name(args)], _value(args)
        previous = setting.get(event.loop)
        setting.apply(event.loop, value)
        return {"name": setting.name, "value": value, "previous": _json_number(previous),
                "message": f"{setting.name} = {value:g} from step {event.time.step + 1} "
                           f"(was {previous:g})"}

    def _event(self, event: Event, args: dict[str, JSON]) -> dict[str, JSON]:
        return {"message": f"fired the command event {args['name']!r} at step "
                           f"{event.time.step}"}


def _name(args: Mapping[str, JSON]) -> str:
    """The ``name`` argument of ``set`` or ``event`` (``check_arguments`` made it a string)."""
    name = args["name"]
    if not isinstance(name, str):
        raise Refused(f"name must be a string, got {name!r}")
    return name


def _value(args: Mapping[str, JSON]) -> float:
    """The ``value`` argument of ``set`` (``check_arguments`` made it a number)."""
    value = args["value"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Refused(f"value must be a number, got {value!r}")
    return value


def _stop_requested(loop: LoopLike) -> bool:
    """Whether a stop signal (Ctrl-C, SIGTERM) asked the loop to stop: its guard's flag,
    which the loop checks after this event (a paused loop must return to it)."""
    guard = getattr(loop, "_guard", None)
    return guard is not None and guard.requested


def _read_metrics(metrics: Mapping[str, ArrayLike]) -> dict[str, JSON] | None:
    """The latest scalar metrics as floats, waiting at most ``_METRICS_WAIT_S`` for the
    step computing them (None if it has not finished)."""
    chosen = copying(metrics)
    deadline = _time.monotonic() + _METRICS_WAIT_S
    while not on_host(chosen):
        if _time.monotonic() > deadline:
            return None
        _time.sleep(0.01)
    return {name: _json_number(value) for name, value in scalar_metrics(chosen).items()}


class BackgroundRun:
    """A loop running in a background thread, from :meth:`graphmod.Loop.start`: the
    notebook stays usable while it trains, and its commands are the ``Control`` plugin's.

    A progress bar keeps updating (tqdm draws from any thread). Stop signals are left to
    the main thread: Ctrl-C interrupts what the notebook or script runs there, never the
    background run; :meth:`stop` ends it. A script that ends while a run trains waits for
    the run to finish (the thread is not a daemon, so that a save is never cut off).

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
        ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> x = np.ones((32, 2), np.float32)
        >>> loop = gm.Loop(step, ArraySource((x,), batch_size=8), steps=10**9)
        >>> run = loop.start(step.init(program.init(x[:1]), jax.random.key(0)))
        >>> run.pause()["paused"]
        True
        >>> held = run.status()["step"]
        >>> run.status()["step"] == held, run.running
        (True, True)
        >>> run.stop(save=False)["stopping"]
        True
        >>> int(run.result().step) == held, run.running
        (True, False)
    """

    def __init__(self, loop: _Startable, state: PyTree) -> None:
        controls = [p for p in loop.plugins if isinstance(p, Control)]
        control = controls[0] if controls else loop.on(None, Control(serve=False))
        if control._ready.is_set():
            raise RuntimeError("loop.start: this loop is running already (one run at a time)")
        self.loop = loop
        self.control: Control = control
        self._state: PyTree = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(state,), name="graphmod-loop")
        setups = control._setups
        self._thread.start()
        while control._setups == setups and self._thread.is_alive():
            control._ready.wait(0.02)  # until the plugins are set up: commands find the run
        if control._setups == setups and self._error is not None:
            raise self._error  # it could not start (a plugin's setup refused, say)

    def _main(self, state: PyTree) -> None:
        try:
            self._state = self.loop.run(state)
        except BaseException as error:  # given to whoever asks for the result
            self._error = error

    @property
    def running(self) -> bool:
        """Whether the loop still runs (paused included)."""
        return self._thread.is_alive()

    def status(self) -> dict[str, JSON]:
        """Where the run is (see :meth:`Control.status`); after its end, where it ended."""
        return self.control.status()

    def pause(self, timeout: float | None = None) -> dict[str, JSON]:
        """Holds the loop still after the step in progress; returns once it is held (or,
        after ``timeout`` seconds, with ``queued``)."""
        return self.control.command("pause", wait=timeout)

    def resume(self, timeout: float | None = None) -> dict[str, JSON]:
        """Lets a paused loop go on."""
        return self.control.command("resume", wait=timeout)

    def set(self, name: str, value: float, timeout: float | None = None) -> dict[str, JSON]:
        """Sets hyperparameter ``name`` (``"dropout/rate"``, ``"lr"``: see ``status()``'s
        ``settable``) to ``value`` from the next step on, without recompiling."""
        return self.control.command("set", {"name": name, "value": value}, wait=timeout)

    def save(self, timeout: float | None = None) -> dict[str, JSON]:
        """Saves a checkpoint now, through the loop's Checkpoint plugins."""
        return self.control.command("save", wait=timeout)

    def event(self, name: str, timeout: float | None = None) -> dict[str, JSON]:
        """Fires a ``command`` event named ``name`` (``On("command", name=name)``)."""
        return self.control.command("event", {"name": name}, wait=timeout)

    def stop(self, save: bool = True, timeout: float | None = None) -> dict[str, JSON]:
        """Ends the run after the step in progress, saving it first (``save=False``: not);
        :meth:`result` then returns the final state."""
        return self.control.command("stop", {"save": save}, wait=timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The final state, once the run ended (waiting up to ``timeout`` seconds, None:
        however long); re-raises the run's exception if it failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the run is still running (step {self.loop.time.step}); "
                               "run.stop() ends it")
        if self._error is not None:
            raise self._error
        return self._state

    def __repr__(self) -> str:
        what = ("paused" if self.control._paused else "running") if self.running else "ended"
        return f"BackgroundRun: {what} at step {self.loop.time.step}"

