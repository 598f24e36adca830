"""``Metric``: a quantity computed from sums over the batches of an evaluation (the one
metric protocol of :func:`graphmod.evaluate` and the ``Validation`` plugin)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from graphmod._core._bricks._construction import class_path
from graphmod.typing import PyTree


class Metric:
    """Base class of evaluation metrics, computed from sums over batches.

    ``statistics(predictions, targets, weights)`` runs inside ``jax.jit`` on one batch
    (``weights`` is 1 for real examples and 0 for the padding of a short final batch,
    broadcast against the targets' leading axes) and returns a dict of sums;
    :func:`graphmod.evaluate` adds them up over the batches in float64 and calls
    ``result(totals)``. ``check`` runs first on the shapes of the first batch and raises
    a clear error when predictions and targets cannot be compared; :func:`graphmod.evaluate`
    calls ``check_batch`` with the targets of each batch on the host (values a traced
    ``statistics`` cannot raise on: a label outside the classes). A metric with
    ``takes_batch = True`` (e.g. :class:`graphmod.metrics.Mean`) gets the program's outputs
    as they are and the whole batch as ``targets``, and is not shape-checked.

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> class MeanPrediction(metrics.Metric):
        ...     name = "mean_prediction"
        ...     needs_targets = False
        ...     def statistics(self, predictions, targets, weights):
        ...         return {"sum": (predictions * weights).sum(), "count": weights.sum()}
        ...     def result(self, totals):
        ...         return float(totals["sum"] / totals["count"])
        >>> m = MeanPrediction()
        >>> m.result(m.statistics(jnp.array([1.0, 3.0]), None, jnp.ones(2)))
        2.0
    """

    name: str = "metric"
    needs_targets: bool = True
    takes_batch: bool = False

    def check(self, predictions: jax.ShapeDtypeStruct, targets: jax.ShapeDtypeStruct | None,
              field: str) -> None:
        """Raises if predictions and targets of these shapes cannot be compared."""

    def check_batch(self, predictions: jax.ShapeDtypeStruct, targets: np.ndarray, field: str,
                    first: int) -> None:
        """Raises if the targets of one batch (its real rows, on the host; ``first`` the
        index of its first example in the source) hold values the metric cannot score."""

    def statistics(self, predictions: jax.Array, targets: PyTree,
                   weights: jax.Array) -> dict[str, jax.Array]:
        """Sums over one batch (traced). ``targets``: the batch's targets (an array; None
        for a metric that needs none), or the whole batch for one that ``takes_batch``."""
        raise NotImplementedError

    def result(self, totals: dict[str, np.ndarray]) -> Any:
        """The metric from the sums over every batch."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """What the evaluation's provenance records about this metric."""
        settings = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {"name": self.name, "class": class_path(type(self)), **settings}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def weights_like(weights: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Per-example ``weights`` (batch,) broadcast to ``shape`` (batch, ...)."""
    return weights.reshape(weights.shape + (1,) * (len(shape) - 1)) * np.ones(shape, np.float32)
