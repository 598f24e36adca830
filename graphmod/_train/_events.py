"""Events of a training loop, their times on every timeline, and templates that match them.

An event has a ``type`` (``begin``, ``epoch_begin``, ``step``, ``epoch_end``, ``end``,
``interrupt``, or any type a plugin fires), an ``issuer`` (the loop or a plugin), a ``time``
on every timeline, the ``prev_time`` of the previous event of that type from the same
issuer, and data. A template ``On(type, issuer=..., **fields)`` matches events: a field
holds a value (equality), a :class:`~graphmod.Schedule` (evaluated on the range
``(prev_time.field, time.field]`` of a timeline) or a one-argument predicate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from graphmod._core._naming import did_you_mean
from graphmod._train._schedule import Schedule
from graphmod.typing import ArrayLike, LoopLike, PyTree

TIMELINES = ("step", "epoch", "examples", "seconds", "train_seconds")
# What every loop can fire: its own events, and `validated` (graphmod.plugins.Validation's,
# often fired by hand); other types must be declared by the plugin that fires them.
STANDARD_EVENTS = ("begin", "epoch_begin", "step", "epoch_end", "end", "interrupt", "terminate",
                   "validated")
_INTEGER_TIMELINES = ("step", "epoch", "examples")


@dataclasses.dataclass(frozen=True)
class Time:
    """A point on every timeline of a loop.

    Examples:
        >>> from graphmod import Time
        >>> Time(step=3, epoch=0, examples=384).step
        3
    """

    step: int = 0
    epoch: int = 0
    examples: int = 0
    seconds: float = 0.0
    train_seconds: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(eq=False)
class Event:
    """One event dispatched by a loop to its plugins.

    ``loop`` is the loop dispatching it (what a plugin may use of it:
    :class:`graphmod.typing.LoopLike`). ``state`` is valid while the event is dispatched
    (the next step donates it: copy what you keep); ``metrics`` are the latest step's
    metrics, still on the device until read (or the metrics it was fired with); ``data``
    entries read as attributes.

    Examples:
        >>> from graphmod import Event, Time
        >>> e = Event("validated", None, Time(step=10), Time(step=5), None, data={"best": 1})
        >>> e.type, e.time.step, e.best, e.field("step")
        ('validated', 10, 1, 10)
    """

    type: str
    issuer: object
    time: Time
    prev_time: Time | None
    loop: LoopLike
    state: PyTree = None
    metrics: Mapping[str, ArrayLike] = dataclasses.field(default_factory=dict)
    data: dict[str, object] = dataclasses.field(default_factory=dict)

    # An entry of ``data`` is what its issuer fired: handed to the plugin as it came.
    def __getattr__(self, name: str) -> Any:
        data = self.__dict__.get("data", {})
        if name in data:
            return data[name]
        raise AttributeError(f"{self.type} event has no field {name!r}")

    def field(self, name: str) -> object:
        """A field by name: a timeline of ``time``, else an attribute or data entry."""
        if name in TIMELINES:
            return getattr(self.time, name)
        return getattr(self, name)


class Template:
    """Base of event templates; combine with ``|``.

    Examples:
        >>> from graphmod import On
        >>> sorted((On("begin") | On("end")).types())
        ['begin', 'end']
    """

    def matches(self, event: Event) -> bool:
        raise NotImplementedError

    def types(self) -> set[str]:
        """The event types this template can match."""
        raise NotImplementedError

    def unsourced_types(self) -> set[str]:
        """The event types it matches from any issuer (checked to be fireable at run)."""
        return self.types()

    def __or__(self, other: Template) -> Template:
        if not isinstance(other, Template):
            raise TypeError(f"template | {other!r}: both sides must be On(...) templates")
        return AnyOf((self, other))


@dataclasses.dataclass(frozen=True, eq=False)
class On(Template):
    """Matches events of ``type`` (and ``issuer``) whose fields match.

    Examples:
        >>> from graphmod import Event, On, Time, each
        >>> t = On("step", examples=each(1000))
        >>> e = Event("step", None, Time(step=8, examples=1024), Time(step=7, examples=896), None)
        >>> t.matches(e)
        True
    """

    type: str
    issuer: object = None
    fields: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __init__(self, type: str, issuer: object = None, **fields: object) -> None:
        if not isinstance(type, str) or not type:
            raise TypeError(f"On(type): expected an event type name, got {type!r}")
        for name, matcher in fields.items():
            if isinstance(matcher, Schedule) and name not in TIMELINES:
                raise ValueError(f"On({type!r}, {name}=...): a schedule needs a timeline "
                                 f"field, one of {', '.join(TIMELINES)}")
            fractional = matcher.fractional() if isinstance(matcher, Schedule) else None
            if fractional is not None and name in _INTEGER_TIMELINES:
                raise ValueError(
                    f"On({type!r}, {name}={matcher!r}): {fractional!r} places points between "
                    f"the integers of the {name} timeline, so it would fire never or off its "
                    f"rule. Use integers on {', '.join(_INTEGER_TIMELINES)}; fractions only "
                    "on seconds or train_seconds")
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "issuer", issuer)
        object.__setattr__(self, "fields", dict(fields))

    def types(self) -> set[str]:
        return {self.type}

    def unsourced_types(self) -> set[str]:
        return {self.type} if self.issuer is None else set()

    def matches(self, event: Event) -> bool:
        if event.type != self.type:
            return False
        if self.issuer is not None and not _issuer_matches(self.issuer, event.issuer):
            return False
        return all(_field_matches(event, n, m) for n, m in self.fields.items())

    def schedules(self) -> dict[str, Schedule] | None:
        """Its fields if all are schedules on timelines (plannable ahead), else None."""
        schedules = {n: m for n, m in self.fields.items() if isinstance(m, Schedule)}
        return schedules if len(schedules) == len(self.fields) else None

    def __repr__(self) -> str:
        parts = [repr(self.type)] + ([f"issuer={self.issuer!r}"] if self.issuer else []) + [
            f"{k}={v!r}" for k, v in self.fields.items()]
        return f"On({', '.join(parts)})"


@dataclasses.dataclass(frozen=True, eq=False)
class AnyOf(Template):
    """Matches when any of its templates matches (``On(...) | On(...)``)."""

    templates: tuple[Template, ...]

    def matches(self, event: Event) -> bool:
        return any(t.matches(event) for t in self.templates)

    def types(self) -> set[str]:
        return set().union(*(t.types() for t in self.templates))

    def unsourced_types(self) -> set[str]:
        return set().union(*(t.unsourced_types() for t in self.templates))

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.templates))


def plugin_name(plugin: object) -> str:
    """A readable name for any plugin or issuer: its ``name``, else the function's name."""
    name = getattr(plugin, "name", None)
    if isinstance(name, str):
        return name
    return getattr(plugin, "__name__", type(plugin).__name__)


def _issuer_matches(want: object, issuer: object) -> bool:
    if isinstance(want, type):
        return isinstance(issuer, want)
    if isinstance(want, str):
        return plugin_name(issuer) == want
    return want is issuer


def _field_matches(event: Event, name: str, matcher: object) -> bool:
    if isinstance(matcher, Schedule):
        now = getattr(event.time, name)
        prev = getattr(event.prev_time, name) if event.prev_time is not None else None
        return matcher(now) if prev is None else matcher(prev, now)
    try:
        value = event.field(name)
    except AttributeError:
        return False
    if callable(matcher) and not isinstance(matcher, type):
        return bool(matcher(value))
    return bool(value == matcher)


def check_event_types(listeners: Iterable[tuple[str, Template]],
                      plugins: Iterable[object]) -> None:
    """Refuses a template whose type nothing registered can fire (``On("stpe")``): known
    are the standard events and those the plugins declare in ``fires``; a template that
    names its ``issuer`` is that issuer's business."""
    known: set[str] = set(STANDARD_EVENTS)
    for plugin in plugins:
        fires = getattr(plugin, "fires", ())
        known.update((fires,) if isinstance(fires, str) else fires)
    for name, template in listeners:
        for unknown in sorted(template.unsourced_types() - known):
            raise ValueError(
                f"plugin {name!r} listens for {unknown!r} events ({template!r}), which no "
                f"registered plugin declares it fires and the loop never fires"
                f"{did_you_mean(unknown, known)}. Known: {', '.join(sorted(known))}. A "
                f"plugin that fires its own type declares it (class attribute fires = "
                f"({unknown!r},), also settable on a function), or the template names who "
                f"fires it: On({unknown!r}, issuer=...)")


def as_template(value: object, argument: str) -> Template:
    """``value`` as a template: a Template, or an event type name."""
    if isinstance(value, Template):
        return value
    if isinstance(value, str):
        return On(value)
    raise TypeError(f"{argument}: expected On(...) or an event type name, got {value!r}")


EventHandler = Callable[[Event], object]
