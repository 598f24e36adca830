"""Helpers shared by the built-in plugins: schedule arguments, metric lookup (reading
metrics on the host is :mod:`graphmod._train._host_metrics`'s, shared with the loop)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from graphmod._train._events import Event, Template, as_template
from graphmod._train._loop._models import Models
from graphmod.typing import LoopLike


def template_or(every: Template | str | None, default: Template, who: str) -> Template:
    """``every`` as a template (an ``On(...)`` or an event type name), else ``default``."""
    if every is None:
        return default
    return as_template(every, f"{who}(every=...)")


def metric_names(names: Iterable[Any], who: str) -> tuple[str, ...]:
    """Metric names checked to be non-empty strings."""
    names = tuple(names)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{who}: metric names must be non-empty strings, got {name!r}")
    return names


def event_metrics(event: Event) -> dict[str, Any]:
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
    limits = []
    if getattr(loop, "max_steps", None) is not None:
        limits.append(loop.max_steps)
    epochs = getattr(loop, "epochs", None)
    if epochs is not None and hasattr(loop.data, "__len__"):
        limits.append(epochs * len(loop.data))
    return min(limits) if limits else None
