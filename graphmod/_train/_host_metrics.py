"""Metrics read on the host: which of a step's metrics are scalars, their copies to the host
started without waiting, and their values as floats, a one-dimensional metric (one value per
layer of a scan over layers, per member of an ensemble) as one float per index, keyed
``name[i]``. Shared by the loop's checkpoint record and the plugins that show or log metrics.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax
import numpy as np

from graphmod.typing import ArrayLike

# The most values a one-dimensional metric may have to be read one per index.
PER_INDEX_AT_MOST = 64

_INDEX = re.compile(r"\[\d+\]$")  # the key of one index of a metric: "name[i]"


def host_value(value: ArrayLike) -> float | np.ndarray:
    """A metric on the host (this syncs the device): a float for a scalar, else an array.

    Examples:
        >>> import numpy as np
        >>> host_value(np.float32(0.5)), host_value(np.array([1, 2])).tolist()
        (0.5, [1, 2])
    """
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array


def scalars(metrics: Mapping[str, ArrayLike], names: tuple[str, ...] = (), *,
            per_index: bool = False) -> dict[str, ArrayLike]:
    """The scalar metrics among ``names`` (all when empty), in order, left where they are
    (``np.ndim`` reads no device data); ``per_index``: also the one-dimensional ones of at
    most :data:`PER_INDEX_AT_MOST` values.

    Examples:
        >>> import numpy as np
        >>> list(scalars({"loss": 0.5, "mean": np.ones(2)}, per_index=True))
        ['loss', 'mean']
    """
    def chosen(value: ArrayLike) -> bool:
        ndim = np.ndim(value)
        return ndim == 0 or (per_index and ndim == 1
                             and np.shape(value)[0] <= PER_INDEX_AT_MOST)

    return {name: metrics[name] for name in (names or tuple(metrics))
            if name in metrics and chosen(metrics[name])}


def copying(metrics: Mapping[str, ArrayLike], names: tuple[str, ...] = (), *,
            per_index: bool = False) -> dict[str, ArrayLike]:
    """:func:`scalars`, with their copies to the host started (nothing waits).

    Examples:
        >>> import jax.numpy as jnp
        >>> copying({"loss": jnp.float32(0.5), "logits": jnp.ones((2, 3))})
        {'loss': Array(0.5, dtype=float32)}
    """
    chosen = scalars(metrics, names, per_index=per_index)
    for value in chosen.values():
        if isinstance(value, jax.Array):
            value.copy_to_host_async()
    return chosen


def on_host(metrics: Mapping[str, ArrayLike]) -> bool:
    """Whether every value of ``metrics`` can be read without waiting on the device.

    Examples:
        >>> on_host({"loss": 0.5})
        True
    """
    # jax.Array's stub omits is_ready, which every concrete array (ArrayImpl) has.
    return all(not isinstance(v, jax.Array)
               or v.is_ready()  # pyright: ignore[reportAttributeAccessIssue]
               for v in metrics.values())


def scalar_metrics(metrics: Mapping[str, ArrayLike], names: tuple[str, ...] = (), *,
                   per_index: bool = False) -> dict[str, float]:
    """The scalar metrics among ``names`` (all when empty) as Python floats, in order (one
    transfer for them all); ``per_index``: a one-dimensional one as a float per index,
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
    values = jax.device_get(list(chosen.values()))
    floats: dict[str, float] = {}
    for name, value in zip(chosen, values, strict=True):
        if np.ndim(value):
            floats.update({f"{name}[{i}]": float(v) for i, v in enumerate(value)})
        else:
            floats[name] = float(value)
    return floats


def metric_of(key: str) -> str:
    """The metric a key of :func:`scalar_metrics` reads: ``name`` of ``name[i]``.

    Examples:
        >>> metric_of("mean[3]"), metric_of("loss")
        ('mean', 'loss')
    """
    return _INDEX.sub("", key)
