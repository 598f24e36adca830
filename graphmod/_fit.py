"""``fit``: the standard run in one call, and the ``FitResult`` it returns.

What it assembles
    ``fit(cost, model, data, ...)`` does what a script does by hand, in this order:
    :func:`graphmod.compile` (with ``managers``, and ``mesh``/``rules``/``batch_axis`` when
    given), ``program.init`` on the first batch of ``data``, :func:`graphmod.optimize` and
    ``step.init`` with ``jax.random.key(seed)``, then a :class:`graphmod.Loop` with these
    plugins, registered in this order: the run's history (``"history"``, below), a
    :class:`~graphmod.plugins.Validation` of held-out data (each epoch's end, and the run's
    end when that step was not validated yet), an
    :class:`~graphmod.plugins.EarlyStopping`, a :class:`~graphmod.plugins.ProgressBar` with
    a :class:`~graphmod.plugins.Print` line per validation, a
    :class:`~graphmod.plugins.Logger` and a :class:`~graphmod.plugins.Checkpoint` in the run
    directory, then ``plugins``. Each can be replaced by an instance or turned off; nothing
    else differs from the same run assembled by hand (the same numbers, bit for bit).

History
    The ``"history"`` plugin records every step event's scalar metrics (copies to the host
    started, never waited for, as the progress bar does; with ``steps_per_call=k``, one row
    per dispatch: its last step's), the mean of each over every epoch, and why the run was
    terminated. Its record is part of each checkpoint, so a continued run's history is the
    whole run's.

Continuing a run
    With a checkpoint, a second ``fit`` into the same directory continues the run saved
    there: as :meth:`graphmod.Loop.resume` does, the newest checkpoint that verifies is
    restored and the loop goes on from its step. A run that had finished (its epochs or
    steps done, or terminated, e.g. by early stopping) is not run again: the result is
    rebuilt from its checkpoint and nothing in the directory changes. Before anything is
    restored, a directory of another run is refused naming what differs: the program's
    settings (bricks, parameters, managers, function, optimizer, ...: the checks of
    ``Loop.resume``, which only warns of them), the data (their description; allowed with
    ``allow_data_change=True``), the seed, the validation data and metrics, and early
    stopping. Other ``epochs``/``steps`` are not another run: the run is extended.

Sharp edges
    ``EarlyStopping(restore_best=True)`` puts the best state back at the end of the call
    that ran it; checkpoints hold the last step's state, so a later ``fit`` of the finished
    run returns that one (``early_stopping="<metric>"`` builds one with
    ``restore_best=False``: ``result.best`` names the best evaluation). A directory whose
    checkpoints another ``Loop`` wrote continues like ``Loop.resume`` would, with the
    history of this call only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import jax
import numpy as np
import optax
from flax import nnx

from graphmod._core._managers._manager import Manager
from graphmod._core._naming import did_you_mean
from graphmod._core._number_checks import is_whole_number
from graphmod._records._collect import data_record
from graphmod._records._optimizer import optimizer as recorded_optimizer
from graphmod._records._record import Provenance
from graphmod._train import _program
from graphmod._train._batch import step_arguments
from graphmod._train._checkpoint import CheckpointError, CheckpointReader
from graphmod._train._engine import PaddedSource
from graphmod._train._events import Event, On
from graphmod._train._host_metrics import copying, on_host, scalar_metrics
from graphmod._train._loop import Loop
from graphmod._train._loop._resume import (
    data_changes,
    newest_meta,
    read_checkpoint,
    setting_changes,
)
from graphmod._train._optimize import TrainStep, optimize
from graphmod._train._plugin import Plugin
from graphmod._train._program import Program
from graphmod._train._train_state import TrainState
from graphmod.data import ArraySource, FittedTransforms, Transformation, Transforms
from graphmod.data._grain import as_source
from graphmod.metrics import Metric
from graphmod.metrics import get as metric_named
from graphmod.plugins import Checkpoint, EarlyStopping, Logger, Print, ProgressBar, Validation
from graphmod.plugins._common import directory_argument
from graphmod.plugins._validation import MetricFn
from graphmod.provenance import diff
from graphmod.typing import (
    JSON,
    ArrayLike,
    AxisName,
    Batch,
    LoopLike,
    Metrics,
    PathLike,
    ShardingRule,
    Variables,
)

__all__ = ["FitResult", "fit"]

Table: TypeAlias = dict[str, list[float]]
"""Columns of equal length by name (``step`` and ``epoch`` hold ints; a missing value NaN)."""
History: TypeAlias = dict[str, Table]
"""``{"steps": {...}, "epochs": {...}, "validation": {...}}``: columns of equal length."""
Evaluations: TypeAlias = Sequence[tuple[int, Mapping[str, ArrayLike]]]
"""A Validation's history: ``(step, {"valid/<name>": value})`` per evaluation."""



@runtime_checkable
class _Epochs(Protocol):
    """Training data that order each epoch themselves (an ArraySource, a GrainSource)."""

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]: ...


_HISTORY = "history"  # the history plugin's name: keys its record in checkpoints
_VALIDATION_BATCH = 256  # the batch size of validation data given as arrays
# How a metric's name says which way is better (its last part, after any "valid/").
_HIGHER = ("accuracy", "f1", "precision", "recall", "auc", "r2")
_LOWER = ("loss", "error", "mse", "mae", "cross_entropy", "perplexity")


@dataclasses.dataclass(frozen=True, eq=False)
class FitResult:
    """What :func:`fit` returns: the final state, the metrics' history, the evaluations,
    the run's provenance, and the loop that ran (its step and program).

    Attributes:
        state: the final train state (``state.variables`` are the trained variables).
        history: ``{"steps": ..., "epochs": ..., "validation": ...}``, each a dict of
            equal-length lists to plot: ``steps`` holds ``step``, ``epoch`` (from 1) and
            each scalar step metric (``loss``, the cost's own metrics, ...) per step;
            ``epochs`` holds ``epoch``, ``step`` and each step metric's mean over the
            epoch; ``validation`` holds ``step`` and each validation metric
            (``valid/loss``, ``valid/accuracy``, ...).
        evaluation: the last validation, ``{"step": ..., "valid/<name>": value, ...}``
            (None without validation).
        best: the best validation by ``monitor``, in the same form (None without one).
        monitor: ``(metric, "min" | "max")``: early stopping's metric, else the first
            validation metric whose name says which way is better (``loss``,
            ``accuracy``, ...); None when neither.
        provenance: the run's record (:attr:`graphmod.Loop.provenance`).
        loop: the :class:`graphmod.Loop` built (its ``plugins``, ``time``, ``metrics``).
        resumed_from: the checkpoint's step this call continued from (None: a new run).
        directory: the run directory (None: none was given).

    Examples:
        >>> import numpy as np, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> x = np.random.default_rng(0).normal(size=(32, 2)).astype(np.float32)
        >>> result = gm.fit(lambda m, x, y: ((m(x) - y) ** 2).mean(),
        ...                 gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)),
        ...                 ArraySource((x, x[:, :1]), batch_size=8), epochs=2,
        ...                 validation=(x, x[:, :1]), progress=False)
        >>> result.history["epochs"]["epoch"], result.monitor, result.steps_run
        ([1, 2], ('valid/loss', 'min'), 8)
    """

    state: TrainState
    history: History
    evaluation: Metrics | None
    best: Metrics | None
    monitor: tuple[str, str] | None
    provenance: Provenance
    loop: Loop
    resumed_from: int | None
    directory: str | None

    @property
    def step(self) -> TrainStep:
        """The train step (:func:`graphmod.optimize`'s) the loop ran."""
        step = self.loop.step
        assert isinstance(step, TrainStep)  # fit's loop runs the step it optimized
        return step

    @property
    def program(self) -> Program:
        """The compiled program (``result.program.derive(...)`` predicts with it)."""
        return self.step.program

    @property
    def steps_run(self) -> int:
        """How many steps this call ran (0 for a finished run fitted again)."""
        return self.loop.time.step - (self.resumed_from or 0)

    def __repr__(self) -> str:
        time = self.loop.time
        lines = [f"FitResult: step {time.step}, epoch {time.epoch}"
                 + (f", continued from step {self.resumed_from}"
                    if self.resumed_from is not None else "")]
        for label, entry in (("last", self.evaluation), ("best", self.best)):
            if entry is not None:
                shown = ", ".join(f"{k} {v:.4g}" for k, v in entry.items()
                                  if k != "step" and isinstance(v, float))
                lines.append(f"  {label} validation (step {entry['step']}): {shown}")
        if self.directory is not None:
            lines.append(f"  run directory: {self.directory}")
        return "\n".join(lines)


def fit(
    cost: Callable[..., Any],
    model: nnx.Module,
    data: Iterable[Batch],
    *,
    managers: Iterable[Manager] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    epochs: int | None = None,
    steps: int | None = None,
    validation: ArraySource | Batch | Validation | None = None,
    metrics: Mapping[str, MetricFn] | Sequence[str | Metric] | None = None,
    predict: Callable[..., Any] | Program | None = None,
    directory: PathLike | None = None,
    checkpoint: bool | Checkpoint | None = True,
    early_stopping: str | EarlyStopping | None = None,
    seed: int = 0,
    plugins: Iterable[Plugin | Callable[[Event], object]] = (),
    progress: bool | ProgressBar | None = True,
    log: bool | Logger | None = True,
    steps_per_call: int = 1,
    allow_data_change: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    rules: Sequence[ShardingRule] = (),
    batch_axis: AxisName | None = None,
    transforms: Mapping[str | int, Transformation | Sequence[Transformation]] | Transforms
    | FittedTransforms | None = None,
) -> FitResult:
    """Compiles, initialises, optimizes and runs the standard loop; continues a run saved in
    ``directory``. See the module docstring for what it assembles and how it continues.

    Args:
        cost: ``cost(model, *batch)`` returning a scalar cost or ``(cost, metrics)``.
        model: the model (bricks or any ``flax.nnx.Module``).
        data: the training data: an :class:`graphmod.data.ArraySource` or a re-iterable
            of batches (a list, a loader); its first batch gives ``init``'s examples.
        managers: the managers to compile with (default: those active in ``with`` blocks).
        optimizer: an optax transformation (default
            ``graphmod.provenance.optimizer("adam", learning_rate=1e-3)``).
        epochs, steps: when the run ends, as :class:`graphmod.Loop` takes them.
        validation: held-out data (an ``ArraySource``, or arrays such as ``(x, y)``, batched
            by 256 with the last batch padded), or a ``Validation`` plugin; None: none.
        metrics: the validation's metrics: ``{name: fn(outputs, batch)}`` or
            :func:`graphmod.evaluate`'s names (``["accuracy"]``), computed on ``predict``'s
            outputs; None: the cost function's own outputs (``valid/loss`` and its metrics).
        predict: ``predict(model, *inputs)`` (or a derived program) for ``metrics``
            (default ``lambda m, x: m(x)``).
        directory: the run directory, for checkpoints and the log; None: neither.
        checkpoint: a ``Checkpoint`` in ``directory`` (the default: each epoch and the end,
            keeping 3), False (or None) for none, or a ``Checkpoint`` of your own.
        early_stopping: a validation metric's name (``"valid/accuracy"``: patience 5, the
            direction told by the name) or an ``EarlyStopping``; None: none.
        seed: the train step's key (dropout masks and other randomness of the steps).
        plugins: more plugins, registered after fit's own.
        progress: a progress bar (and a line per validation); False or None: none; or a
            ``ProgressBar`` of your own.
        log: a ``Logger`` writing ``log.csv`` in ``directory`` at each epoch's end and
            validation; False or None: none; or a ``Logger`` of your own.
        steps_per_call, allow_data_change: as :class:`graphmod.Loop` takes them.
        mesh, rules, batch_axis: as :func:`graphmod.compile` takes them (a run on a mesh).
        transforms: ``{field: transformation}`` (e.g. ``{"x": graphmod.data.Standardize()}``)
            or a ``graphmod.data.Transforms``, fitted on ``data`` (the training data only)
            and compiled into the program, so validation and the saved model see inputs
            transformed alike; a continued run reuses the transforms its checkpoint
            recorded (refitting would be a data change); or ``FittedTransforms`` as they
            are.

    Returns:
        A :class:`FitResult`.

    Examples:
        >>> import tempfile, numpy as np, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
        >>> data = ArraySource((x, x.sum(1, keepdims=True)), batch_size=16, shuffle=True)
        >>> cost = lambda m, x, y: ((m(x) - y) ** 2).mean()
        >>> run = dict(epochs=3, progress=False, directory=tempfile.mkdtemp())
        >>> first = gm.fit(cost, gm.bricks.Linear(3, 1, rngs=nnx.Rngs(0)), data, **run)
        >>> len(first.history["steps"]["loss"]), first.resumed_from
        (12, None)
        >>> again = gm.fit(cost, gm.bricks.Linear(3, 1, rngs=nnx.Rngs(0)), data, **run)
        >>> again.resumed_from, again.steps_run  # finished: nothing ran
        (12, 0)
        >>> again.history == first.history
        True
    """
    data, held_out = as_source(data), as_source(validation)  # Grain: GrainSources
    _check_data(data)
    valid_source = _validation_source(held_out)
    _check_choices(metrics, predict, valid_source, held_out, early_stopping, seed,
                   checkpoint, progress, log, epochs=epochs, steps=steps,
                   steps_per_call=steps_per_call)
    run_directory = _run_directory(directory, checkpoint)
    first = _first_batch(data)

    args, kwargs = step_arguments(first)
    newest = _newest_meta(run_directory, checkpoint)  # a run to continue, if any
    fitted = _fitted(transforms, data, newest)
    program = _program.compile(cost, model, managers=managers, mesh=mesh, rules=rules,
                               batch_axis=batch_axis, transforms=fitted)
    step = optimize(program, _optimizer(optimizer))
    state = step.init(program.init(*args, **kwargs), jax.random.key(seed))

    valid = held_out if isinstance(held_out, Validation) else None
    if valid is None and valid_source is not None:
        valid = _validation(program, valid_source, metrics, predict)
    produced = _produced(valid, state.variables) if valid is not None else []
    stopping = _early_stopping(early_stopping, produced, step, state, first)
    history = _History(_settings(seed, valid, produced, stopping))
    chosen = [history, *([valid] if valid is not None else []),
              *([stopping] if stopping is not None else []),
              *_progress(progress, valid), *_log(log, run_directory),
              *_checkpoint(checkpoint, run_directory), *plugins]
    loop = Loop(step, data, epochs=epochs, steps=steps, plugins=chosen,
                steps_per_call=steps_per_call, allow_data_change=allow_data_change)

    saved = _saved_run(newest, run_directory, step, data, history, allow_data_change)
    resumed_from = None
    if saved is not None and run_directory is not None:  # a saved run has its directory
        state, meta = read_checkpoint(run_directory, state, step, data, None)
        loop.load_state_dict(meta)
        resumed_from = loop.time.step
    if saved is None or not _finished(loop, history.terminated):
        state = loop.run(state)
    assert isinstance(state, TrainState)  # what fit's step makes, and its loop returns
    monitor = _monitor(stopping, produced)
    evaluations = valid.history if valid is not None else []
    return FitResult(state, history.tables(evaluations), _entry(evaluations[-1:]),
                     _best(evaluations, monitor), monitor, loop.provenance, loop,
                     resumed_from, run_directory)


# -- the history plugin -----------------------------------------------------------------------
class _History(Plugin):
    """Records each step event's scalar metrics, their mean per epoch, and a terminate's
    reason, without waiting on the device (see the module docstring)."""

    def __init__(self, settings: dict[str, JSON]) -> None:
        super().__init__(name=_HISTORY, every=On("step") | On("epoch_end") | On("terminate"))
        self.settings = settings
        self.steps: Table = {"step": [], "epoch": []}
        self.epochs: Table = {"epoch": [], "step": []}
        self.terminated: str | None = None
        self._pending: list[tuple[dict[str, int], Metrics]] = []  # on their way

    def __call__(self, event: Event) -> None:
        if event.type == "step":
            head = {"step": event.time.step, "epoch": event.time.epoch + 1}
            self._pending.append((head, copying(event.metrics)))
            while self._pending and on_host(self._pending[0][1]):
                self._write(*self._pending.pop(0))
        elif event.type == "epoch_end":
            self.flush()
            epochs, start = self.steps["epoch"], len(self.steps["epoch"])
            while start and epochs[start - 1] == event.time.epoch:  # the epoch's rows: the last
                start -= 1
            means = {name: float(np.mean(values[start:])) if start < len(values) else math.nan
                     for name, values in self.steps.items() if name not in ("step", "epoch")}
            _append(self.epochs, {"epoch": event.time.epoch, "step": event.time.step, **means})
        else:
            self.terminated = getattr(event, "reason", None) or "terminated"

    def _write(self, head: dict[str, int], metrics: Metrics) -> None:
        _append(self.steps, {**head, **scalar_metrics(metrics)})

    def flush(self) -> None:
        """Writes the rows whose metrics are still on their way (waits for the device)."""
        while self._pending:
            self._write(*self._pending.pop(0))

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        if error is None:
            self.flush()
        self._pending = []

    def state_dict(self) -> dict[str, JSON]:
        self.flush()  # a checkpoint holds every step up to its own
        return {"steps": _json(self.steps), "epochs": _json(self.epochs),
                "terminated": self.terminated, "settings": self.settings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.epochs = _copied(state["steps"]), _copied(state["epochs"])
        self.terminated = state.get("terminated")
        self._pending = []

    def tables(self, evaluations: Evaluations) -> History:
        """The history: steps, epochs, and the validations ``evaluations`` (Validation's)."""
        validation: Table = {"step": []}
        for at, results in evaluations:
            _append(validation, {"step": at, **{k: float(v) for k, v in results.items()
                                                if isinstance(v, float | np.floating)}})
        return {"steps": _copied(self.steps), "epochs": _copied(self.epochs),
                "validation": validation}


def _copied(table: Mapping[str, Sequence[float]]) -> Table:
    return {name: list(column) for name, column in table.items()}


def _json(table: Table) -> dict[str, JSON]:
    """``table`` as a checkpoint's JSON holds it (the same columns)."""
    return {name: list(column) for name, column in table.items()}


def _append(table: Table, row: Mapping[str, float]) -> None:
    """Adds ``row`` to the columns of ``table``; a column new or missing gets NaNs."""
    length = len(next(iter(table.values()))) if table else 0
    for name in row:
        table.setdefault(name, [math.nan] * length)
    for name, column in table.items():
        column.append(row.get(name, math.nan))


# -- checking the arguments (before anything runs) --------------------------------------------
def _check_data(data: object) -> None:
    if isinstance(data, Mapping | tuple | np.ndarray | jax.Array | str | bytes):
        raise TypeError(
            f"fit(data=...): a {type(data).__name__} is one batch, not a data source; pass "
            "graphmod.data.ArraySource((x, y), batch_size=32, shuffle=True) or a list of "
            "batches")
    if not isinstance(data, Iterable):
        raise TypeError(f"fit(data=...): expected a graphmod.data.ArraySource or an iterable "
                        f"of batches, got {type(data).__name__}")
    if isinstance(data, Iterator):
        raise TypeError(
            f"fit(data=...): a {type(data).__name__} is an iterator, used up by one pass "
            "(and by reading the first batch for init); pass data that iterate again: an "
            "ArraySource, a list of batches, or an object whose __iter__ starts anew")


def _first_batch(data: Iterable[Batch]) -> Batch:
    """The first batch of epoch 0 (``init``'s examples), read as the loop will read it."""
    batches = data.iter_epoch(0) if isinstance(data, _Epochs) else iter(data)
    first = next(iter(batches), None)
    if first is None:
        raise ValueError("fit(data=...): the data yield no batch; pass at least one batch")
    return first


def _validation_source(validation: object) -> PaddedSource | None:
    """The held-out source ``validation=`` names (arrays become an ArraySource)."""
    if validation is None or isinstance(validation, Validation):
        return None if validation is None else validation.source
    if isinstance(validation, PaddedSource):
        return validation
    if isinstance(validation, Mapping | tuple | np.ndarray | jax.Array):
        leaves = jax.tree.leaves(validation)
        rows = int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0
        if rows == 0:
            raise ValueError("fit(validation=...): no examples (the arrays are empty or "
                             "scalars); pass arrays with one row per example, e.g. (x, y)")
        return ArraySource(validation, min(_VALIDATION_BATCH, rows), drop_remainder=False,
                           name="validation")
    raise TypeError(
        f"fit(validation=...): expected an ArraySource, arrays such as (x_test, y_test), or "
        f"a Validation plugin, got {type(validation).__name__} (a list of batches cannot "
        "be padded: wrap the arrays in ArraySource(..., drop_remainder=False))")


def _check_choices(metrics: object, predict: object, source: PaddedSource | None,
                   validation: object, early_stopping: object, seed: object,
                   checkpoint: object, progress: object, log: object,
                   **counts: object) -> None:
    """Refuses a metric, predict, stopping, seed, count or plugin argument fit cannot use."""
    if (metrics is not None or predict is not None) and (
            source is None or isinstance(validation, Validation)):
        what = "metrics" if metrics is not None else "predict"
        raise ValueError(f"fit({what}=...): {what} belong to the validation; pass "
                         "validation=(x_test, y_test) (or an ArraySource), or give them to "
                         "your Validation plugin")
    if isinstance(metrics, Mapping):
        for name, fn in metrics.items():
            if not isinstance(name, str) or not callable(fn):
                raise TypeError(f"fit(metrics=...): entry {name!r} must map a name to "
                                f"fn(outputs, batch) -> per-example values, got {fn!r}")
    elif metrics is not None:
        if isinstance(metrics, str) or not isinstance(metrics, Sequence) or not metrics:
            raise TypeError(f"fit(metrics={metrics!r}): expected {{name: fn(outputs, "
                            "batch)}} or a list of metric names such as ['accuracy']")
        for metric in metrics:
            try:
                metric_named(metric)
            except ValueError as error:  # an unknown name: the message lists the known ones
                raise ValueError(f"fit(metrics=...): {error}") from None
    if predict is not None and not (callable(predict) or isinstance(predict, Program)):
        raise TypeError(f"fit(predict=...): expected predict(model, *inputs) or a derived "
                        f"program, got {type(predict).__name__}")
    if not (early_stopping is None or isinstance(early_stopping, str | EarlyStopping)):
        raise TypeError(f"fit(early_stopping={early_stopping!r}): expected a validation "
                        "metric's name such as 'valid/accuracy', or an EarlyStopping")
    if isinstance(early_stopping, str) and source is None:
        raise ValueError(f"fit(early_stopping={early_stopping!r}): early stopping reads a "
                         "validation metric; pass validation=(x_test, y_test) too")
    if not is_whole_number(seed, least=0):
        raise TypeError(f"fit(seed={seed!r}): expected an int >= 0 (the train step's key "
                        "is jax.random.key(seed))")
    for name, count in counts.items():
        if count is not None and not is_whole_number(count, least=1):
            raise ValueError(f"fit({name}={count!r}): must be a positive int, e.g. {name}=10"
                             + (" (or None)" if name != "steps_per_call" else ""))
    for name, value, kind in (("checkpoint", checkpoint, Checkpoint),
                              ("progress", progress, ProgressBar), ("log", log, Logger)):
        if not isinstance(value, bool | kind) and value is not None:
            raise TypeError(f"fit({name}={value!r}): expected True, False or a "
                            f"{kind.__name__} plugin")


def _run_directory(directory: PathLike | None, checkpoint: object) -> str | None:
    """The run directory: ``directory``, or a given Checkpoint's; refuses a file, or two."""
    if isinstance(checkpoint, Checkpoint):
        if directory is not None and os.path.abspath(os.fspath(directory)) \
                != checkpoint.directory:
            raise ValueError(f"fit(directory={os.fspath(directory)!r}, checkpoint=...): the "
                             f"Checkpoint writes to {checkpoint.directory}; pass one run "
                             "directory (leave directory out, or use the same)")
        directory = checkpoint.directory
    if directory is None:
        return None
    return directory_argument(directory, "fit", "directory", "run directory",
                              "pass a directory (it is created when missing)")


def _optimizer(optimizer: object) -> optax.GradientTransformation | optax.MultiSteps:
    if optimizer is None:
        return recorded_optimizer("adam", learning_rate=1e-3)
    if not isinstance(optimizer, optax.GradientTransformation | optax.MultiSteps):
        raise TypeError(f"fit(optimizer=...): expected an optax transformation such as "
                        f"graphmod.provenance.optimizer('adam', learning_rate=1e-3), got "
                        f"{type(optimizer).__name__}")
    return optimizer


# -- the plugins ------------------------------------------------------------------------------
def _validation(program: Program, source: PaddedSource,
                metrics: Mapping[str, MetricFn] | Sequence[str | Metric] | None,
                predict: Callable[..., Any] | Program | None) -> Validation:
    """A Validation of ``program``'s own outputs, or of ``predict``'s with ``metrics``."""
    if metrics is None and predict is None:
        chosen = program
    elif isinstance(predict, Program):
        chosen = predict
    else:
        chosen = program.derive(predict if predict is not None else lambda m, x: m(x))
        assert isinstance(chosen, Program)  # derive makes a program of its own class
    unvalidated = _Unvalidated()
    valid = Validation(chosen, source, metrics=metrics,
                       every=On("epoch_end") | On("end", step=unvalidated))
    unvalidated.validation = valid
    return valid


class _Unvalidated:
    """True at a step ``validation`` has not evaluated yet: the run's end after a step that
    was no epoch's end (an epoch's end was validated already)."""

    validation: Validation | None = None

    def __call__(self, step: int) -> bool:
        history = self.validation.history if self.validation is not None else []
        return not history or history[-1][0] != step


def _produced(valid: Validation, variables: Variables) -> list[str]:
    """The metric names ``valid`` fires, found by the check its setup makes of its first
    batch against the program, and by an abstract trace of its metrics on that batch: data
    that do not fit, or a metric function returning no per-example values, are refused now,
    not at the first validation an epoch later."""
    engine = valid._prepare(variables)
    batch, mask = next(iter(valid.source.iter_padded()))
    try:
        jax.eval_shape(engine._sums, variables, batch, mask)
    except ValueError as error:
        raise ValueError(f"fit: the validation's metrics fail on its first batch: {error}"
                         ) from None
    return [valid.prefix + metric.name for metric in engine.metrics]


def _early_stopping(early_stopping: str | EarlyStopping | None, produced: list[str],
                    step: TrainStep,
                    state: TrainState, first: Batch) -> EarlyStopping | None:
    """The EarlyStopping, its metric checked against what the plugins and the step produce."""
    if early_stopping is None:
        return None
    if isinstance(early_stopping, EarlyStopping):
        metric = early_stopping.metric
        if metric in produced:
            return early_stopping
        args, kwargs = step_arguments(first)
        known = [*produced, *jax.eval_shape(step, state, *args, **kwargs)[1]]
        if metric in known:
            return early_stopping
        raise ValueError(f"fit(early_stopping=EarlyStopping({metric!r})): no plugin or step "
                         f"produces {metric!r}{did_you_mean(metric, known)}; the validation "
                         f"produces {produced}, the step {known[len(produced):]}")
    if early_stopping not in produced:
        raise ValueError(f"fit(early_stopping={early_stopping!r}): the validation produces no "
                         f"{early_stopping!r}{did_you_mean(early_stopping, produced)}; it "
                         f"produces {produced}")
    mode = _direction(early_stopping)
    if mode is None:
        raise ValueError(f"fit(early_stopping={early_stopping!r}): its name does not say "
                         "whether higher or lower is better; pass EarlyStopping("
                         f"{early_stopping!r}, mode='max' or 'min')")
    return EarlyStopping(early_stopping, mode=mode, restore_best=False)


def _direction(metric: str) -> str | None:
    """``"max"`` or ``"min"`` when the metric's name says which way is better."""
    last = metric.rsplit("/", 1)[-1]
    if last.endswith(_HIGHER):
        return "max"
    return "min" if last.endswith(_LOWER) else None


def _progress(progress: bool | ProgressBar | None, valid: Validation | None) -> list[Plugin]:
    if isinstance(progress, ProgressBar):
        return [progress]
    if not progress:
        return []
    return [ProgressBar(), *([Print(every=On("validated"))] if valid is not None else [])]


def _log(log: bool | Logger | None, directory: str | None) -> list[Plugin]:
    if isinstance(log, Logger):
        return [log]
    if not log or directory is None:
        return []
    return [Logger(directory, every=On("epoch_end") | On("validated"))]


def _checkpoint(checkpoint: bool | Checkpoint | None, directory: str | None) -> list[Plugin]:
    if isinstance(checkpoint, Checkpoint):
        return [checkpoint]
    if not checkpoint or directory is None:
        return []
    return [Checkpoint(directory)]


# -- continuing a run -------------------------------------------------------------------------
def _settings(seed: int, valid: Validation | None, produced: list[str],
              stopping: EarlyStopping | None) -> dict[str, JSON]:
    """The settings of the run that its program's record does not hold, as JSON."""
    settings: dict[str, object] = {
        "seed": seed,
        "validation": None if valid is None else {"data": data_record(valid.source),
                                                  "metrics": produced},
        "early_stopping": None if stopping is None else {
            "metric": stopping.metric, "mode": stopping.mode, "patience": stopping.patience,
            "min_delta": stopping.min_delta},
    }
    return json.loads(json.dumps(settings))  # as a checkpoint gives it back


def _newest_meta(directory: str | None, checkpoint: bool | Checkpoint | None
                 ) -> dict[str, Any] | None:
    """The newest checkpoint's record in ``directory`` (None: a new run)."""
    if directory is None or not checkpoint or getattr(checkpoint, "overwrite", False) \
            or not os.path.isdir(directory):
        return None  # no checkpoint, or one told to replace what is there
    reader = CheckpointReader(directory)
    try:
        return newest_meta(reader) if reader.steps() else None
    finally:
        reader.close()


def _fitted(transforms: Mapping[str | int, Transformation | Sequence[Transformation]] | Transforms
            | FittedTransforms | None, data: Iterable[Batch], meta: Mapping[str, Any] | None
            ) -> FittedTransforms | None:
    """``transforms=`` fitted on the training ``data``; a continued run's recorded ones
    (in ``meta``) when they are of the same transformations."""
    if transforms is None or isinstance(transforms, FittedTransforms):
        return transforms
    spec = transforms if isinstance(transforms, Transforms) else Transforms(transforms)
    fitted = spec.fit(data)
    recorded = (((meta or {}).get("provenance") or {}).get("inputs") or {}).get("transforms")
    kinds = lambda record: {field: [(link["kind"], link["config"]) for link in links]
                            for field, links in record["transforms"].items()}
    if recorded is not None and kinds(recorded) == kinds(
            json.loads(json.dumps(fitted.record()))):
        return FittedTransforms.from_record(recorded)  # what the saved variables were fit to
    return fitted


def _saved_run(meta: dict[str, Any] | None, directory: str | None, step: TrainStep,
               data: Iterable[Batch], history: _History, allow_data_change: bool
               ) -> dict[str, Any] | None:
    """The newest checkpoint's record ``meta`` (in ``directory``) to continue from (None:
    a new run), having refused another run's before anything is restored."""
    if meta is None or directory is None:  # no checkpoint read: a new run
        return None
    differences = [*_setting_lines(meta.get("provenance"), step),
                   *_changed("", ((meta.get("plugins") or {}).get(_HISTORY) or {}).get(
                       "settings"), history.settings)]
    if not allow_data_change:
        saved = ((meta.get("provenance") or {}).get("inputs") or {}).get("data")
        new = data_changes(meta, data, True)[len(meta.get("data_changes", [])):]
        change = new[0] if new else {"fields": []}  # the new change, by field name
        listed = change["fields"] if isinstance(change, dict) else None
        differences += _changed("data.", saved, data_record(data),
                                [str(f) for f in listed] if isinstance(listed, list) else None)
    if differences:
        at = (meta.get("time") or {}).get("step")
        raise CheckpointError(
            directory, f"fit: the directory holds another run, whose checkpoint of step {at} "
            "differs from this one in\n  " + "\n  ".join(differences) + "\nNothing was run, "
            "read further or changed",
            "fit into another directory, or with the run's own settings"
            + ("; for other data, allow_data_change=True" if any(
                line.startswith("data.") for line in differences) else ""))
    return meta


def _changed(prefix: str, saved: Mapping[str, object] | None, now: Mapping[str, object],
             fields: Iterable[str] | None = None) -> list[str]:
    """A line per field of ``fields`` (default: all that differ) with its two values; none
    when nothing was ``saved``."""
    if saved is None:
        return []
    if fields is None:
        fields = [k for k in sorted({*saved, *now}) if saved.get(k) != now.get(k)]
    return [f"{prefix}{k}: checkpoint {_short(saved.get(k))}, now {_short(now.get(k))}"
            for k in fields]


def _setting_lines(saved: Mapping[str, Any] | None, step: TrainStep) -> list[str]:
    """One line per differing field of the program's settings (``Loop.resume``'s check)."""
    changed = setting_changes(saved, step)
    if not changed or saved is None:
        return []
    fields = diff(Provenance.from_dict(saved), step.provenance).inputs
    lines = [f"{d.field}: checkpoint {a}, now {b}" for d in fields
             if re.split(r"[^A-Za-z_]", d.field, maxsplit=1)[0] in changed
             for _, a, b in [d.row(60, 40)]]
    return lines[:8] or [f"{', '.join(changed)} differ"]


def _short(value: object) -> str:
    """A recorded value for an error message (a hash cut to its first characters)."""
    if isinstance(value, str) and len(value) > 16:
        return repr(value[:12] + "...")
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _finished(loop: Loop, terminated: str | None) -> bool:
    """Whether the restored run has nothing left to do (``Loop.run`` would end at once)."""
    time = loop.time
    return (terminated is not None or (loop.max_steps is not None and time.step >= loop.max_steps)
            or (loop.epochs is not None and time.epoch >= loop.epochs))


# -- the evaluations --------------------------------------------------------------------------
def _monitor(stopping: EarlyStopping | None, produced: list[str]) -> tuple[str, str] | None:
    if stopping is not None:
        return stopping.metric, stopping.mode
    return next(((name, mode) for name in produced
                 if (mode := _direction(name)) is not None), None)


def _entry(evaluations: Evaluations) -> Metrics | None:
    if not evaluations:
        return None
    at, results = evaluations[0]
    return {"step": at, **results}


def _best(evaluations: Evaluations, monitor: tuple[str, str] | None) -> Metrics | None:
    """The first of the evaluations best by ``monitor`` (NaN never is)."""
    if monitor is None:
        return None
    metric, mode = monitor
    best: tuple[float, tuple[int, Mapping[str, ArrayLike]]] | None = None
    for entry in evaluations:
        value = entry[1].get(metric)
        if not isinstance(value, float) or math.isnan(value):
            continue
        if best is None or (value > best[0] if mode == "max" else value < best[0]):
            best = value, entry
    return None if best is None else _entry([best[1]])
