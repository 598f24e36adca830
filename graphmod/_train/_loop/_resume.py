"""Continuing a run from a checkpoint: reading it back, and checking the data against it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from graphmod._core._warn import warn
from graphmod._records._collect import data_record
from graphmod._train._batch import step_arguments
from graphmod._train._checkpoint import CheckpointError, CheckpointReader
from graphmod._train._command import recorded_command
from graphmod._train._host_metrics import scalar_metrics
from graphmod._train._loop._models import Models
from graphmod._train._loop._steps import check_first_batch
from graphmod._train._optimize import TrainStep
from graphmod._train._schedule import Schedule


def read_checkpoint(directory: str | os.PathLike, template: Any, step: Any,
                    data: Iterable[Any], checkpoint: int | None) -> tuple[Any, dict[str, Any]]:
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
            changed = setting_changes(saved and saved.to_dict(), step)
            if changed:
                error.add_note(f"The checkpoint's run was trained with other settings: "
                               f"{changed} (graphmod inspect shows its record); resume with "
                               "those it was trained with")
            raise
    finally:
        reader.close()
    return state, meta


def resume_changes(meta: Mapping[str, Any], data: Iterable[Any], step: Any,
                   allowed: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's data changes and setting changes, each with one more if ``data`` or
    ``step``'s settings (model, managers, optimizer, trainable=) differ from those the
    checkpoint of ``meta`` was trained with: data are refused unless ``allowed`` (see
    :func:`data_changes`), settings are warned of and recorded with their values before."""
    check_models(meta, step, "resume")
    changes = list(meta.get("setting_changes", []))
    saved = meta.get("provenance")
    changed = setting_changes(saved, step)
    models = model_changes(meta.get("models"), step)
    if changed or models:
        at = int(meta["time"]["step"])
        warn(f"resume: this run's {[*changed, *models]} differ from those the checkpoint of "
             f"step {at} was trained with (graphmod inspect shows its record): it "
             "goes on with these, and later checkpoints record the change "
             "(setting_changes, with the settings before)")
        changes.append({"step": at, "settings": {
            **{k: _setting_before(saved, k, step) for k in changed}, **models}})
    return data_changes(meta, data, allowed), changes


def recorded_models(meta: Mapping[str, Any], step: Any, given: Mapping[str, Any]
                    ) -> dict[str, Any]:
    """The ``schedules=`` and ``reads=`` of a loop of several models (``step``: a dict of
    steps) as the checkpoint of ``meta`` records them, for ``Loop.resume``; those
    ``given`` are left out (the caller's win), and so are those of a model the loop now
    freezes. Schedules are parsed back from their descriptions
    (:meth:`graphmod.Schedule.parse`: the schedule grammar alone, never evaluated); a text
    that is no schedule is refused naming the record's field."""
    saved = meta.get("models")
    if not saved or not isinstance(step, Mapping):
        return {}
    stepping = {name for name, one in step.items() if one is not None}
    recorded: dict[str, Any] = {}
    if "schedules" not in given:
        at = (meta.get("time") or {}).get("step")
        schedules = {}
        for i, model in enumerate(saved):
            if model["schedule"] is None or model["name"] not in stepping:
                continue
            try:
                schedules[model["name"]] = Schedule.parse(
                    model["schedule"], field=f"Loop.resume: the checkpoint of step {at}: "
                    f"models[{i}].schedule (model {model['name']!r})")
            except ValueError as error:
                raise ValueError(f"{error}. Nothing was run; pass the schedules yourself, "
                                 "Loop.resume(..., schedules={...})") from None
        recorded["schedules"] = schedules
    if "reads" not in given:
        recorded["reads"] = {model["name"]: list(model["reads"]) for model in saved
                             if model["reads"] and model["name"] in stepping}
    return recorded


def newest_meta(reader: CheckpointReader, step: int | None = None) -> dict[str, Any]:
    """The meta record of ``step`` (default the newest readable) for the checks made before
    a restore, or ``{}`` where none reads (the restore then says why)."""
    try:
        return reader.meta(step)
    except (CheckpointError, FileNotFoundError):
        return {}


def _model_names(step: Any) -> list[str] | None:
    """The names of a loop's models (``step``: :class:`Models` or a dict of steps by name),
    or None for a loop of one step."""
    if isinstance(step, Models):
        return list(step.names)
    return list(step) if isinstance(step, Mapping) else None


def check_models(meta: Mapping[str, Any], step: Any, who: str) -> None:
    """Refuses, before anything is restored, a loop whose models are not by name those the
    checkpoint of ``meta`` holds (its ``models`` record; none: nothing to check)."""
    saved = meta.get("models")
    if not saved:
        return
    names, now = [model["name"] for model in saved], _model_names(step)
    if now is not None and sorted(now) == sorted(names):
        return
    at = (meta.get("time") or {}).get("step", meta.get("step"))
    this = (f"this loop's are {now}" if now is not None
            else "this loop runs one step, not named models")
    raise ValueError(
        f"{who}: the checkpoint of step {at} holds the models {names}; {this} (nothing was "
        f"restored). Resume with the steps of {names}, by those names (Loop({{"
        + ", ".join(f"{name!r}: ..." for name in names) + "}, data, ...)), or start a new "
        "run in another directory")


def model_changes(saved: Any, step: Any) -> dict[str, Any]:
    """The settings of a loop's models that differ from a checkpoint's ``models`` record
    ``saved``, each with its value before: ``order`` (the names), ``frozen.<name>``,
    ``schedules.<name>`` (a schedule's description, None: every iteration) and
    ``reads.<name>``; none for a record without models or a loop of one step."""
    if not saved or not isinstance(step, Models):
        return {}
    now = {model["name"]: model for model in step.record()}
    changes: dict[str, Any] = {}
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


def setting_changes(saved: Mapping[str, Any] | None, step: Any) -> list[str]:
    """The settings of the training record ``saved`` (a checkpoint's provenance) that
    ``step`` (a ``graphmod.optimize`` step) does not share; none for another step. For
    several models (``step``: :class:`Models` or a dict of steps), each stepping model's
    against its own record, named ``<setting>.<model>`` (``optimizer.gen``)."""
    if not saved or saved.get("kind") != "training":
        return []
    steps = step.steps if isinstance(step, Models) else step
    if isinstance(steps, Mapping):
        records = (saved.get("inputs") or {}).get("models")
        if not isinstance(records, Mapping):
            return []
        return [f"{setting}.{name}" for name, one in steps.items()
                if one is not None and isinstance(records.get(name), Mapping)
                for setting in setting_changes(records[name], one)]
    if not hasattr(step, "provenance"):
        return []
    now, before = step.provenance.to_dict()["inputs"], saved.get("inputs", {})
    return [k for k in _SETTINGS if k in before and k in now
            and _compared(k, before[k], now[k]) != _compared(k, now[k], before[k])]


def _setting_before(saved: Mapping[str, Any], key: str, step: Any) -> Any:
    """The value of a changed setting (a :func:`setting_changes` name) in ``saved``."""
    if isinstance(step, Models | Mapping):
        setting, name = key.split(".", 1)  # setting names hold no dot; model names may
        return saved["inputs"]["models"][name]["inputs"][setting]
    return saved["inputs"][key]


def _compared(setting: str, record: Any, other: Any) -> Any:
    """``record`` of ``setting`` without the fields ``other`` lacks of those added later."""
    if not (isinstance(record, dict) and isinstance(other, dict)):
        return record
    return {k: v for k, v in record.items() if k not in _ADDED.get(setting, ()) or k in other}


def loop_record(loop: Any, plugins: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint keeps of ``loop`` besides the train state (``plugins``: its plugins'
    states): counters, timelines, data position and settings, as JSON."""
    return {
        "time": loop.time.to_dict(),
        "started_at": loop.started_at,
        "position": loop.position,
        "loop": {"epochs": loop.epochs, "steps": loop.max_steps,
                 "steps_per_call": loop.steps_per_call},
        **({"models": loop.step.record()} if isinstance(loop.step, Models) else {}),
        "plugins": plugins,
        "metrics": {str(name): value for name, value in scalar_metrics(loop.metrics).items()}
        if isinstance(loop.metrics, Mapping) else {},  # JSON: names as strings
        "data": data_position(loop.data, loop.time.epoch, loop.position),
        "data_changes": list(loop.data_changes),
        "setting_changes": list(loop.setting_changes),
        "command": recorded_command(loop.started_in),  # what `graphmod resume DIR` runs
    }


def data_position(data: Iterable[Any], epoch: int, position: int) -> Any:
    """What a checkpoint keeps of the data's own position: a source that reads ahead of
    the loop (``state_at``, e.g. a :class:`graphmod.data.GrainSource`) gives its state at
    the loop's consumed ``(epoch, position)``, another its ``state_dict()`` (None: none)."""
    state_at = getattr(data, "state_at", None)
    if callable(state_at):
        return state_at(epoch, position)
    state_dict = getattr(data, "state_dict", None)
    return state_dict() if callable(state_dict) else None


def data_changes(meta: dict[str, Any], data: Iterable[Any],
                 allowed: bool) -> list[dict[str, Any]]:
    """The run's data changes, one more if ``data`` differ from the checkpoint's; raises
    naming the differing fields unless they are ``allowed``."""
    changes = list(meta.get("data_changes", []))
    saved = ((meta.get("provenance") or {}).get("inputs") or {}).get("data")
    if saved is None:  # no provenance (a step not from graphmod.optimize): not checkable
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
            f"{meta['time']['step']} was trained on ({', '.join(fields)}):\n  {lines}\n"
            "Pass the run's own data to continue it exactly, or allow_data_change=True "
            "(to Loop.resume, or to the Loop of a Checkpoint(resume=True)) to continue "
            "on these data; the change is recorded in later checkpoints")
    return [*changes, {"step": int(meta["time"]["step"]), "fields": fields}]


def _short(value: Any) -> str:
    """A described field for an error message (a hash cut to its first characters)."""
    return repr(value[:12] + "...") if isinstance(value, str) and len(value) > 16 \
        else repr(value)


def _abstract_state(step: Any, data: Iterable[Any]) -> Any:
    """The shapes of ``step``'s train state, from the first batch of ``data``; for a dict
    of steps, each model's from its program's ``init`` examples (which hold what it reads)."""
    if isinstance(step, Mapping):
        return {name: _abstract_model_state(name, one) for name, one in step.items()}
    if not hasattr(step, "abstract_state"):
        raise TypeError("Loop.resume: pass state=<a train state of this program> (the step "
                        "is no graphmod.optimize step, so its state's shapes are unknown)")
    first = next(iter(data.iter_epoch(0) if hasattr(data, "iter_epoch") else data))
    args, kwargs = step_arguments(first)
    return step.abstract_state(*args, **kwargs)


def _abstract_model_state(name: str, step: Any) -> Any:
    """The shapes of one model's train state, from its program's ``init`` examples."""
    record = step.program.record if isinstance(step, TrainStep) else None
    if record is None or record.examples is None:
        what = ("is frozen (its state is not a train state)" if step is None else
                "is no graphmod.optimize step" if record is None else
                "has a program whose init has not run (no example shapes)")
        raise TypeError(f"Loop.resume: model {name!r} {what}, so its state's shapes are "
                        "unknown; pass state= with a state of every model, e.g. "
                        f"state={{{name!r}: ..., ...}} (the states you started from)")
    args = [record.examples[argument] for argument in record.positional]
    kwargs = {k: v for k, v in record.examples.items() if k not in record.positional}
    return step.abstract_state(*args, **kwargs)
