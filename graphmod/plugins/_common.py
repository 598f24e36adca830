"""Helpers shared by the built-in plugins: schedule arguments, metric lookup, host reads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from graphmod._train._events import Event, Template, as_template
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


def host_value(value: Any) -> float | np.ndarray:
    """A metric on the host (this syncs the device): a float for a scalar, else an array."""
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array


# The most values a one-dimensional metric may have to be logged one per index.
PER_INDEX_AT_MOST = 64


def scalars(metrics: Mapping[str, Any], names: tuple[str, ...] = (), *,
            per_index: bool = False) -> dict[str, Any]:
    """The scalar metrics among ``names`` (all when empty), in order, left where they are
    (``np.ndim`` reads no device data); ``per_index``: also the one-dimensional ones of at
    most :data:`PER_INDEX_AT_MOST` values (one per layer of a scan over layers, one per
    member of an ensemble)."""
    def chosen(value: Any) -> bool:
        ndim = np.ndim(value)
        return ndim == 0 or (per_index and ndim == 1
                             and np.shape(value)[0] <= PER_INDEX_AT_MOST)

    return {name: metrics[name] for name in (names or tuple(metrics))
            if name in metrics and chosen(metrics[name])}


def copying(metrics: Mapping[str, Any], names: tuple[str, ...] = (), *,
            per_index: bool = False) -> dict[str, Any]:
    """:func:`scalars`, with their copies to the host started (nothing waits)."""
    chosen = scalars(metrics, names, per_index=per_index)
    for value in chosen.values():
        if isinstance(value, jax.Array):
            value.copy_to_host_async()
    return chosen


def on_host(metrics: Mapping[str, Any]) -> bool:
    """Whether every value of ``metrics`` can be read without waiting on the device."""
    return all(not isinstance(v, jax.Array) or v.is_ready() for v in metrics.values())


def scalar_metrics(metrics: Mapping[str, Any], names: tuple[str, ...] = (), *,
                   per_index: bool = False) -> dict[str, float]:
    """The scalar metrics among ``names`` (all when empty) as Python floats, in order;
    ``per_index``: a one-dimensional one (see :func:`scalars`) as a float per index,
    ``name[i]``.

    Examples:
        >>> import numpy as np
        >>> metrics = {"loss": np.float32(0.5), "mean": np.array([1.0, 2.0])}
        >>> scalar_metrics(metrics)
        {'loss': 0.5}
        >>> scalar_metrics(metrics, per_index=True)
        {'loss': 0.5, 'mean[0]': 1.0, 'mean[1]': 2.0}
    """
    chosen = scalars(metrics, names, per_index=per_index)
    values = jax.device_get(list(chosen.values()))  # one transfer for them all
    floats: dict[str, float] = {}
    for name, value in zip(chosen, values, strict=True):
        if np.ndim(value):
            floats.update({f"{name}[{i}]": float(v) for i, v in enumerate(value)})
        else:
            floats[name] = float(value)
    return floats


def planned_steps(loop: LoopLike) -> int | None:
    """The step at which ``loop`` stops unless terminated (None when unknown)."""
    limits = []
    if getattr(loop, "max_steps", None) is not None:
        limits.append(loop.max_steps)
    epochs = getattr(loop, "epochs", None)
    if epochs is not None and hasattr(loop.data, "__len__"):
        limits.append(epochs * len(loop.data))
    return min(limits) if limits else None
