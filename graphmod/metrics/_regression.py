"""Regression metrics: mean squared and mean absolute error."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphmod.metrics._base import Metric, weights_like


class MeanSquaredError(Metric):
    """The mean over examples and elements of ``(prediction - target) ** 2``.

    Predictions and targets must have the same shape (``(batch, 1)`` and ``(batch,)``
    disagree: reshape one of them in ``predict``).

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> m = metrics.MeanSquaredError()
        >>> m.result(m.statistics(jnp.array([[1.0], [3.0]]), jnp.array([[0.0], [1.0]]),
        ...                       jnp.ones(2)))
        2.5
    """

    name = "mean_squared_error"
    error = staticmethod(jnp.square)  # of each element's difference

    def check(self, predictions: jax.ShapeDtypeStruct, targets: Any, field: str) -> None:
        if tuple(predictions.shape) != tuple(targets.shape):
            raise ValueError(
                f"metric {self.name!r}: predictions of shape {tuple(predictions.shape)} and "
                f"targets {field!r} of shape {tuple(targets.shape)} disagree in shape: they "
                "must be equal (reshape one of them in predict=)"
            )

    def statistics(self, predictions: jax.Array, targets: jax.Array,
                   weights: jax.Array) -> dict[str, jax.Array]:
        error = self.error(predictions.astype(jnp.float32) - targets.astype(jnp.float32))
        w = weights_like(weights, error.shape)
        return {"sum": (error * w).sum(), "count": w.sum()}

    def result(self, totals: dict[str, np.ndarray]) -> float:
        return float(totals["sum"] / totals["count"])


class MeanAbsoluteError(MeanSquaredError):
    """The mean over examples and elements of ``|prediction - target|`` (shapes as for
    :class:`MeanSquaredError`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> m = metrics.MeanAbsoluteError()
        >>> m.result(m.statistics(jnp.array([[1.0], [3.0]]), jnp.array([[0.0], [1.0]]),
        ...                       jnp.ones(2)))
        1.5
    """

    name = "mean_absolute_error"
    error = staticmethod(jnp.abs)
