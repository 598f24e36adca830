"""Continuing a run from a checkpoint: reading it back, and checking the data against it."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import NoReturn, Protocol, TypedDict, TypeGuard, runtime_checkable

from graphmod._core._warn import warn
from graphmod._records._collect import RunSettings, data_record
from graphmod._train._batch import step_arguments
from graphmod._train._checkpoint import CheckpointError, CheckpointReader
from graphmod._train._command import recorded_command
from graphmod._train._events import TIMELINES, Time
from graphmod._train._host_metrics import scalar_metrics
from graphmod._train._loop._models import LoopStep, Models
from graphmod._train._loop._steps import EpochSource, Step, StepMetrics, check_first_batch
from graphmod._train._optimize import TrainStep
from graphmod._train._schedule import Schedule
from graphmod.typing import JSON, Batch, PathLike, PyTree


class LoopSettings(TypedDict, total=False):
    """The settings ``Loop.resume`` takes again (``**settings``), else reads back from
    the checkpoint: ``Loop(epochs=, steps=, steps_per_call=, schedules=, reads=)``."""

    epochs: int | None
    steps: int | None
    steps_per_call: int
    schedules: Mapping[str, Schedule] | None
    reads: Mapping[str, Sequence[str] | str] | None


class ModelRecord(TypedDict):
    """One model of a loop over several models as its checkpoints record it
    (:meth:`Models.record`, read back by :func:`saved_models`)."""

    name: str
    steps: bool
    schedule: str | None
    reads: list[str]


def read_checkpoint(directory: PathLike, template: PyTree | None, step: LoopStep,
                    data: Iterable[Batch], checkpoint: int | None
                    ) -> tuple[PyTree, dict[str, JSON]]:
    """The train state and meta record of ``directory``'s checkpoint (``checkpoint``: a
    step, default the newest that verifies); ``template`` is a train state of the same
    program, or None to derive its shapes from ``step`` and the first batch of ``data``."""
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"Loop.resume: no checkpoint in {path}: "
            f"{'not a directory' if os.path.exists(path) else 'no such directory'} "
            "(nothing was created); pass the directory a Checkpoint plugin saved into")
    check_first_batch(step, data, 0, 0)  # as Loop.run would, before anything is read
    reader = CheckpointReader(path)
    try:
        check_models(newest_meta(reader, checkpoint), step, "Loop.resume")
        if template is None:
            template = _abstract_state(step, data)
        try:
            state, meta = reader.restore(template, checkpoint, loop=True)
        except ValueError as error:  # another program's state: which settings changed
            saved = reader.provenance(checkpoint)
            changed = setting_changes(None if saved is None else saved.to_dict(), step)
            if changed:
                error.add_note(f"The checkpoint's run was trained with other settings: "
                               f"{changed} (graphmod inspect shows its record); resume with "
                               "those it was trained with")
            raise
    finally:
        reader.close()
    return state, meta


def resume_changes(meta: Mapping[str, JSON], data: Iterable[Batch], step: Step | Models,
                   allowed: bool) -> tuple[list[JSON], list[JSON]]:
    """The run's data changes and setting changes, each with one more if ``data`` or
    ``step``'s settings (model, managers, optimizer, trainable=) differ from those the
    checkpoint of ``meta`` was trained with: data are refused unless ``allowed`` (see
    :func:`data_changes`), settings are warned of and recorded with their values before."""
    check_models(meta, step, "resume")
    changes = _list(meta.get("setting_changes"))
    recorded = meta.get("provenance")
    saved = recorded if isinstance(recorded, Mapping) else {}
    changed = setting_changes(saved, step)
    models = model_changes(saved_models(meta, "resume"), step)
    if changed or models:
        at = saved_time(meta).step
        warn(f"resume: this run's {[*changed, *models]} differ from those the checkpoint of "
             f"step {at} was trained with (graphmod inspect shows its record): it "
             "goes on with these, and later checkpoints record the change "
             "(setting_changes, with the settings before)")
        changes.append({"step": at, "settings": {
            **{k: _setting_before(saved, k, step) for k in changed}, **models}})
    return data_changes(meta, data, allowed), changes


def recorded_models(meta: Mapping[str, JSON], step: LoopStep, given: LoopSettings
                    ) -> LoopSettings:
    """The ``schedules=`` and ``reads=`` of a loop of several models (``step``: a dict of
    steps) as the checkpoint of ``meta`` records them, for ``Loop.resume``; those
    ``given`` are left out (the caller's win), and so are those of a model the loop now
    freezes. Schedules are parsed back from their descriptions
    (:meth:`graphmod.Schedule.parse`: the schedule grammar alone, never evaluated); a text
    that is no schedule is refused naming the record's field."""
    saved = saved_models(meta, "Loop.resume")
    if not saved or not isinstance(step, Mapping):
        return {}
    stepping = {name for name, one in step.items() if one is not None}
    recorded: LoopSettings = {}
    if "schedules" not in given:
        at = _field(meta, "time", "step")
        schedules: dict[str, Schedule] = {}
        for i, model in enumerate(saved):
            schedule = model["schedule"]
            if schedule is None or model["name"] not in stepping:
                continue
            try:
                schedules[model["name"]] = Schedule.parse(
                    schedule, field=f"Loop.resume: the checkpoint of step {at}: "
                    f"models[{i}].schedule (model {model['name']!r})")
            except ValueError as error:
                raise ValueError(f"{error}. Nothing was run; pass the schedules yourself, "
                                 "Loop.resume(..., schedules={...})") from None
        recorded["schedules"] = schedules
    if "reads" not in given:
        recorded["reads"] = {model["name"]: list(model["reads"]) for model in saved
                             if model["reads"] and model["name"] in stepping}
    return recorded


def newest_meta(reader: CheckpointReader, step: int | None = None) -> dict[str, JSON]:
    """The meta record of ``step`` (default the newest readable) for the checks made before
    a restore, or ``{}`` where none reads (the restore then says why)."""
    try:
        return reader.meta(step)
    except (CheckpointError, FileNotFoundError):
        return {}


def _model_names(step: LoopStep | Models) -> list[str] | None:
    """The names of a loop's models (``step``: :class:`Models` or a dict of steps by name),
    or None for a loop of one step."""
    if isinstance(step, Models):
        return list(step.names)
    return list(step) if isinstance(step, Mapping) else None


def check_models(meta: Mapping[str, JSON], step: LoopStep | Models, who: str) -> None:
    """Refuses, before anything is restored, a loop whose models are not by name those the
    checkpoint of ``meta`` holds (its ``models`` record; none: nothing to check)."""
    saved = saved_models(meta, who)
    if not saved:
        return
    names, now = [model["name"] for model in saved], _model_names(step)
    if now is not None and sorted(now) == sorted(names):
        return
    time = meta.get("time")
    at = time.get("step", meta.get("step")) if isinstance(time, dict) else meta.get("step")
    this = (f"this loop's are {now}" if now is not None
            else "this loop runs one step, not named models")
    raise ValueError(
        f"{who}: the checkpoint of step {at} holds the models {names}; {this} (nothing was "
        f"restored). Resume with the steps of {names}, by those names (Loop({{"
        + ", ".join(f"{name!r}: ..." for name in names) + "}, data, ...)), or start a new "
        "run in another directory")


def saved_models(meta: Mapping[str, JSON], who: str) -> list[ModelRecord]:
    """The ``models`` record of a checkpoint's ``meta`` (none for a loop of one step),
    refused, naming ``who`` reads it, when it is not what a loop of several models wrote."""
    saved = meta.get("models")
    if not saved:
        return []
    if isinstance(saved, list) and all(_is_model_record(model) for model in saved):
        return [model for model in saved if _is_model_record(model)]
    raise ValueError(f"{who}: the checkpoint's models record is not one a loop of several "
                     f"models writes ({str(saved)[:200]}); was it written by graphmod?")


def _is_model_record(value: JSON) -> TypeGuard[ModelRecord]:
    """Whether ``value`` holds a :class:`ModelRecord`'s fields, each of its type."""
    if not isinstance(value, dict) or not isinstance(value.get("steps"), bool):
        return False
    reads, schedule = value.get("reads"), value.get("schedule", ...)
    return (isinstance(value.get("name"), str) and (schedule is None or isinstance(schedule, str))
            and isinstance(reads, list) and all(isinstance(read, str) for read in reads))


def model_changes(saved: Sequence[ModelRecord], step: LoopStep | Models) -> dict[str, JSON]:
    """The settings of a loop's models that differ from a checkpoint's ``models`` record
    ``saved``, each with its value before: ``order`` (the names), ``frozen.<name>``,
    ``schedules.<name>`` (a schedule's description, None: every iteration) and
    ``reads.<name>``; none for a record without models or a loop of one step."""
    if not saved or not isinstance(step, Models):
        return {}
    now = dict(zip(step.names, step.record(), strict=True))
    changes: dict[str, JSON] = {}
    if [model["name"] for model in saved] != list(now):
        changes["order"] = [model["name"] for model in saved]
    for before in saved:
        after = now.get(before["name"])
        if after is None:
            continue
        for key, label in (("steps", "frozen"), ("schedule", "schedules"), ("reads", "reads")):
            if before[key] != after[key]:
                value = not before["steps"] if key == "steps" else before[key]
                changes[f"{label}.{before['name']}"] = value
    return changes


# The parts of a training record that make the program and its training: a resumed run
# with others goes on as another run (the data are checked on their own, data_changes).
_SETTINGS = ("bricks", "parameters", "managers", "function", "monitor", "axis_name",
             "optimizer", "skip_nonfinite", "trainable", "transforms")


# Fields a later graphmod added to a setting's record: compared only where both records
# have them, so a checkpoint written before is not taken for one with other settings.
_ADDED = {"optimizer": ("structure",)}


def setting_changes(saved: Mapping[str, JSON] | None, step: LoopStep | Models) -> list[str]:
    """The settings of the training record ``saved`` (a checkpoint's provenance) that
    ``step`` (a ``graphmod.optimize`` step) does not share; none for another step. For
    several models (``step``: :class:`Models` or a dict of steps), each stepping model's
    against its own record, named ``<setting>.<model>`` (``optimizer.gen``)."""
    if not saved or saved.get("kind") != "training":
        return []
    steps = step.steps if isinstance(step, Models) else step
    if isinstance(steps, Mapping):
        records = _field(saved, "inputs", "models")
        if not isinstance(records, Mapping):
            return []
        return [f"{setting}.{name}" for name, one in steps.items()
                if one is not None and isinstance(record := records.get(name), Mapping)
                for setting in setting_changes(record, one)]
    provenance = getattr(steps, "provenance", None)  # a graphmod.optimize step's record
    before = saved.get("inputs", {})
    if provenance is None or not isinstance(before, Mapping):
        return []
    now = provenance.to_dict()["inputs"]
    return [k for k in _SETTINGS if k in before and k in now
            and _compared(k, before[k], now[k]) != _compared(k, now[k], before[k])]


def _setting_before(saved: Mapping[str, JSON], key: str, step: LoopStep | Models) -> JSON:
    """The value of a changed setting (a :func:`setting_changes` name) in ``saved``."""
    if isinstance(step, Models | Mapping):
        setting, name = key.split(".", 1)  # setting names hold no dot; model names may
        return _field(saved, "inputs", "models", name, "inputs", setting)
    return _field(saved, "inputs", key)


def _field(record: Mapping[str, JSON], key: str, *keys: str) -> JSON:
    """``record[key][keys[0]]...`` of a JSON record; None where a key is missing or a value
    on the way is no JSON object."""
    value = record.get(key)
    for inner in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(inner)
    return value


def _list(value: JSON) -> list[JSON]:
    """A list of a checkpoint's meta record (``data_changes``...); none when absent."""
    return list(value) if isinstance(value, list) else []


@dataclasses.dataclass(frozen=True)
class SavedLoop:
    """What the meta record of a checkpoint holds of a loop (see :func:`loop_record`),
    checked: its time, start, position in the epoch, plugins' states, last metrics and the
    data's own position."""

    time: Time
    started_at: str | None
    position: int
    plugins: dict[str, JSON]
    metrics: dict[str, float]
    data: dict[str, JSON] | None


def saved_loop(meta: Mapping[str, JSON]) -> SavedLoop:
    """The loop's record in a checkpoint's ``meta``, refused (naming the field) where it is
    not what a graphmod Loop writes."""
    started, plugins, data = meta.get("started_at"), meta.get("plugins", {}), meta.get("data")
    metrics = meta.get("metrics", {})
    if started is not None and not isinstance(started, str):
        _refuse("started_at", started)
    if not isinstance(plugins, dict):
        _refuse("plugins", plugins)
    if not isinstance(metrics, dict):
        _refuse("metrics", metrics)
    if data is not None and not isinstance(data, dict):
        _refuse("data", data)
    return SavedLoop(saved_time(meta), started, int(_number(meta.get("position"), "position")),
                     plugins, {name: _number(value, f"metrics.{name}")
                               for name, value in metrics.items()}, data)


def saved_settings(meta: Mapping[str, JSON]) -> LoopSettings:
    """The loop's ``epochs``, ``steps`` and ``steps_per_call`` in a checkpoint's ``meta``."""
    saved = meta.get("loop")
    if not isinstance(saved, dict):
        _refuse("loop", saved)
    settings: LoopSettings = {}
    if "epochs" in saved:
        settings["epochs"] = _count(saved["epochs"], "loop.epochs")
    if "steps" in saved:
        settings["steps"] = _count(saved["steps"], "loop.steps")
    if (per_call := _count(saved.get("steps_per_call"), "loop.steps_per_call")) is not None:
        settings["steps_per_call"] = per_call
    return settings


def _count(value: JSON, field: str) -> int | None:
    """``value`` of a meta record's ``field``, checked to be a count or None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    _refuse(field, value)


def saved_time(meta: Mapping[str, JSON]) -> Time:
    """The loop's time in a checkpoint's ``meta`` (its step, epoch, examples, seconds)."""
    time = meta.get("time")
    if not isinstance(time, dict) or not set(time) <= set(TIMELINES):
        _refuse("time", time)
    step, epoch, examples, seconds, train = (_number(time.get(name, 0), f"time.{name}")
                                             for name in TIMELINES)
    return Time(int(step), int(epoch), int(examples), seconds, train)


def _number(value: JSON, field: str) -> float:
    """``value`` of a meta record's ``field``, checked to be a number (an int stays one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        _refuse(field, value)
    return value


def _refuse(field: str, value: JSON) -> NoReturn:
    raise ValueError(f"the checkpoint's meta record holds {field}={str(value)[:100]}, not what "
                     "a graphmod Loop writes; was it written by one (graphmod inspect shows "
                     "it)?")


def _compared(setting: str, record: JSON, other: JSON) -> JSON:
    """``record`` of ``setting`` without the fields ``other`` lacks of those added later."""
    if not (isinstance(record, dict) and isinstance(other, dict)):
        return record
    return {k: v for k, v in record.items() if k not in _ADDED.get(setting, ()) or k in other}


class RecordedLoop(RunSettings, Protocol):
    """What :func:`loop_record` reads of a :class:`graphmod.Loop` (which imports this
    module): its settings and times (:class:`RunSettings`), time, position, step, metrics,
    data and changes."""

    @property
    def time(self) -> Time: ...
    @property
    def started_in(self) -> str | None: ...
    @property
    def position(self) -> int: ...
    @property
    def step(self) -> Step | Models: ...
    @property
    def metrics(self) -> StepMetrics: ...
    @property
    def data(self) -> Iterable[Batch]: ...
    @property
    def data_changes(self) -> list[JSON]: ...
    @property
    def setting_changes(self) -> list[JSON]: ...


def loop_record(loop: RecordedLoop, plugins: dict[str, JSON]) -> dict[str, JSON]:
    """What a checkpoint keeps of ``loop`` besides the train state (``plugins``: its plugins'
    states): counters, timelines, data position and settings, as JSON."""
    return {
        "time": {**loop.time.to_dict()},
        "started_at": loop.started_at,
        "position": loop.position,
        "loop": {"epochs": loop.epochs, "steps": loop.max_steps,
                 "steps_per_call": loop.steps_per_call},
        **({"models": [*loop.step.record()]} if isinstance(loop.step, Models) else {}),
        "plugins": plugins,
        "metrics": {str(name): value for name, value in scalar_metrics(loop.metrics).items()}
        if isinstance(loop.metrics, Mapping) else {},  # JSON: names as strings
        "data": data_position(loop.data, loop.time.epoch, loop.position),
        "data_changes": list(loop.data_changes),
        "setting_changes": list(loop.setting_changes),
        "command": recorded_command(loop.started_in),  # what `graphmod resume DIR` runs
    }


@runtime_checkable
class _ReadsAhead(Protocol):
    """A source that reads ahead of the loop (a :class:`graphmod.data.GrainSource`)."""

    def state_at(self, epoch: int, position: int) -> Mapping[str, JSON]: ...


@runtime_checkable
class _KeepsPosition(Protocol):
    """A source with a position of its own (an ``ArraySource``'s epoch)."""

    def state_dict(self) -> Mapping[str, JSON]: ...


@runtime_checkable
class RestoresPosition(Protocol):
    """A source that continues from the position a checkpoint kept of it."""

    def load_state_dict(self, state: dict[str, JSON]) -> None: ...


def data_position(data: Iterable[Batch], epoch: int, position: int) -> dict[str, JSON] | None:
    """What a checkpoint keeps of the data's own position: a source that reads ahead of
    the loop (``state_at``, e.g. a :class:`graphmod.data.GrainSource`) gives its state at
    the loop's consumed ``(epoch, position)``, another its ``state_dict()`` (None: none)."""
    if isinstance(data, _ReadsAhead):
        return dict(data.state_at(epoch, position))
    return dict(data.state_dict()) if isinstance(data, _KeepsPosition) else None


def data_changes(meta: Mapping[str, JSON], data: Iterable[Batch],
                 allowed: bool) -> list[JSON]:
    """The run's data changes, one more if ``data`` differ from the checkpoint's; raises
    naming the differing fields unless they are ``allowed``."""
    changes = _list(meta.get("data_changes"))
    saved = _field(meta, "provenance", "inputs", "data")
    if not isinstance(saved, dict):  # no provenance (a step not from graphmod.optimize)
        return changes
    now = data_record(data)
    # A name is a label; the metadata follows from the content, which sha256 compares.
    fields = sorted(k for k in set(saved) | set(now)
                    if k not in ("name", "metadata") and saved.get(k) != now.get(k))
    if not fields:
        return changes
    if not allowed:
        lines = "\n  ".join(f"{k}: checkpoint {_short(saved.get(k))}, "
                            f"these data {_short(now.get(k))}" for k in fields)
        raise ValueError(
            f"resume: the data differ from those the checkpoint of step "
            f"{saved_time(meta).step} was trained on ({', '.join(fields)}):\n  {lines}\n"
            "Pass the run's own data to continue it exactly, or allow_data_change=True "
            "(to Loop.resume, or to the Loop of a Checkpoint(resume=True)) to continue "
            "on these data; the change is recorded in later checkpoints")
    return [*changes, {"step": saved_time(meta).step, "fields": [*fields]}]


def _short(value: object) -> str:
    """A described field for an error message (a hash cut to its first characters)."""
    return repr(value[:12] + "...") if isinstance(value, str) and len(value) > 16 \
        else repr(value)


def _abstract_state(step: LoopStep, data: Iterable[Batch]) -> PyTree:
    """The shapes of ``step``'s train state, from the first batch of ``data``; for a dict
    of steps, each model's from its program's ``init`` examples (which hold what it reads)."""
    if isinstance(step, Mapping):
        return {name: _abstract_model_state(name, one) for name, one in step.items()}
    abstract_state = getattr(step, "abstract_state", None)  # a graphmod.optimize step's
    if abstract_state is None:
        raise TypeError("Loop.resume: pass state=<a train state of this program> (the step "
                        "is no graphmod.optimize step, so its state's shapes are unknown)")
    first = next(iter(data.iter_epoch(0) if isinstance(data, EpochSource) else data))
    args, kwargs = step_arguments(first)
    return abstract_state(*args, **kwargs)


def _abstract_model_state(name: str, step: Step | None) -> PyTree:
    """The shapes of one model's train state, from its program's ``init`` examples."""
    record = step.program.record if isinstance(step, TrainStep) else None
    examples = None if record is None else record.examples
    if not isinstance(step, TrainStep) or record is None or examples is None:
        what = ("is frozen (its state is not a train state)" if step is None else
                "is no graphmod.optimize step" if record is None else
                "has a program whose init has not run (no example shapes)")
        raise TypeError(f"Loop.resume: model {name!r} {what}, so its state's shapes are "
                        "unknown; pass state= with a state of every model, e.g. "
                        f"state={{{name!r}: ..., ...}} (the states you started from)")
    positional = record.positional or []
    args = [examples[argument] for argument in positional]
    kwargs = {k: v for k, v in examples.items() if k not in positional}
    return step.abstract_state(*args, **kwargs)
