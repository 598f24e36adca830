"""Helpers shared by the built-in plugins (and ``graphmod.fit``): schedule arguments, metric
lookup (reading metrics on the host is :mod:`graphmod._train._host_metrics`'s, shared with the
loop), the directory a plugin or a run writes to."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence, Sized
from typing import Protocol, TypeGuard, TypeVar, runtime_checkable

from graphmod._train._events import Event, Template, Time, as_template
from graphmod._train._loop._models import Models
from graphmod.typing import JSON, ArrayLike, LoopLike, PathLike

_Field = TypeVar("_Field", int, float, str)


def template_or(every: Template | str | None, default: Template, who: str) -> Template:
    """``every`` as a template (an ``On(...)`` or an event type name), else ``default``."""
    if every is None:
        return default
    return as_template(every, f"{who}(every=...)")


def directory_argument(path: PathLike, call: str, name: str, kind: str, fix: str) -> str:
    """``path`` (argument ``name`` of ``call``) made absolute; refused when it is no path, or
    names a file (``kind`` says what it should be, ``fix`` what to pass).

    Examples:
        >>> import tempfile
        >>> from graphmod.plugins._common import directory_argument
        >>> with tempfile.NamedTemporaryFile() as file:
        ...     directory_argument(file.name, "fit", "directory", "run directory",
        ...                        "pass a directory")
        Traceback (most recent call last):
        NotADirectoryError: fit(directory=...): is a file, not a run directory; pass a directory
    """
    try:
        location = os.path.abspath(os.fspath(path))
    except TypeError:
        raise TypeError(f"{call}({name}={path!r}): expected a path") from None
    if os.path.exists(location) and not os.path.isdir(location):
        raise NotADirectoryError(f"{call}({name}={location!r}): is a file, not a {kind}; {fix}")
    return location


def metric_names(names: Iterable[object], who: str) -> tuple[str, ...]:
    """Metric names checked to be non-empty strings."""
    checked: list[str] = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{who}: metric names must be non-empty strings, got {name!r}")
        checked.append(name)
    return tuple(checked)


def event_metrics(event: Event) -> dict[str, ArrayLike]:
    """The metrics of an event: those it was fired with (a ``validated`` event's), else
    the latest step's (the loop puts them in ``event.metrics`` either way)."""
    return dict(event.metrics) if event.metrics else {}


def per_model(loop: LoopLike, names: tuple[str, ...]) -> tuple[str, ...]:
    """``names``, each without a model (no ``/``) as one per model with a step in a loop over
    several models (``loss``: ``disc/loss``, ``gen/loss``); as they are otherwise."""
    steps = loop.step
    if not isinstance(steps, Models):
        return names
    models = [name for name, step in steps.steps.items() if step is not None]
    return tuple(chosen for name in names
                 for chosen in ([name] if "/" in name else [f"{m}/{name}" for m in models]))


def planned_steps(loop: LoopLike) -> int | None:
    """The step at which ``loop`` stops unless terminated (None when unknown)."""
    limits: list[int] = []
    max_steps: int | None = getattr(loop, "max_steps", None)  # a graphmod.Loop's settings
    epochs: int | None = getattr(loop, "epochs", None)
    if max_steps is not None:
        limits.append(max_steps)
    if epochs is not None and isinstance(loop.data, Sized):
        limits.append(epochs * len(loop.data))
    return min(limits) if limits else None


@runtime_checkable
class _Registers(Protocol):
    """A loop that lists its plugins (a :class:`graphmod.Loop`)."""

    @property
    def plugins(self) -> Sequence[object]: ...


def registered(loop: LoopLike) -> Sequence[object]:
    """The plugins registered with ``loop``, in order (none for a loop that lists none)."""
    return loop.plugins if isinstance(loop, _Registers) else ()


def is_json_object(value: object) -> TypeGuard[dict[str, JSON]]:
    """Whether ``value`` is a JSON object: a dict of JSON values by string (what a plugin
    records, e.g. an event's data it keeps in its state)."""
    return isinstance(value, dict) and all(isinstance(k, str) and _is_json(v)
                                           for k, v in value.items())


def _is_json(value: object) -> TypeGuard[JSON]:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list):
        return all(_is_json(item) for item in value)
    return is_json_object(value)


def saved_field(state: Mapping[str, JSON], key: str, kind: type[_Field], who: str
                ) -> _Field | None:
    """``state[key]`` of a plugin's saved state, checked to be a ``kind`` or None; refused,
    naming ``who`` and the field, otherwise."""
    value = state[key]
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{who}: the checkpoint's {key} is {value!r}, not a {kind.__name__}; was "
                     "it written by this plugin?")


def loop_time(loop: LoopLike) -> Time:
    """The loop's time as a :class:`graphmod.Time` (an event's ``time``)."""
    time = loop.time
    if isinstance(time, Time):
        return time
    return Time(time.step, time.epoch, time.examples, time.seconds, time.train_seconds)
