"""Means of per-example values: :class:`Mean` of a function of the outputs and the batch
(``Validation(metrics={name: fn})``), :class:`Output` of a program's own outputs
(``Validation`` without ``metrics``).

Both mask the padding of a short final batch exactly. A metric function must return one
value per example: its scalar is refused by name, since a mean over a padded batch counts
the repeated padding row. A program's own scalar output (a training function's mean loss)
is accepted and weighted by the batch's real rows, which is exact only when no batch is
padded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphmod._records._collect import function_record
from graphmod.metrics._base import Metric
from graphmod.typing import ArrayLike


def per_example_sums(name: str, value: ArrayLike, weights: jax.Array, *,
                     scalars: bool) -> dict[str, jax.Array]:
    """``{"sum", "count"}`` of per-example ``value`` (further axes averaged per example)
    over the real rows; a scalar counts once per real row where ``scalars``, else raises."""
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        value = value.astype(jnp.float32)
    rows, count = weights.shape[0], weights.sum()
    if value.ndim == 0:
        if not scalars:
            raise ValueError(
                f"metric {name!r} returned a scalar, not one value per example: a mean over "
                "a batch counts the padding of the short final batch. Return per-example "
                f"values (first axis the batch size {rows}), e.g. without a final .mean()")
        return {"sum": value * count, "count": count}
    if value.shape[0] != rows:
        detail = "" if scalars else (" (a scalar only from a program's own outputs: a metric "
                                     "function returns one value per example)")
        raise ValueError(
            f"metric {name!r} has shape {value.shape}; expected a scalar or per-example "
            f"values with a first axis of the batch size {rows}{detail}")
    per_example = value.reshape(rows, -1).mean(axis=1)
    return {"sum": jnp.where(weights > 0, per_example, 0).sum(), "count": count}


class Mean(Metric):
    """The mean over examples of ``fn(outputs, batch)``, one value per example.

    ``fn`` gets the program's outputs and the whole batch, runs inside ``jax.jit`` (use
    ``jnp``) and returns an array whose first axis is the batch (further axes are averaged
    per example). A scalar is refused, naming the metric.

    Args:
        fn: ``fn(outputs, batch) -> per-example array``.
        name: the metric's name.

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> hits = metrics.Mean(lambda out, batch: out.argmax(-1) == batch[1], name="hits")
        >>> totals = hits.statistics(jnp.array([[2.0, 1.0], [0.0, 1.0]]),
        ...                          (None, jnp.array([0, 0])), jnp.ones(2))
        >>> hits.result(totals)
        0.5
    """

    needs_targets = False
    takes_batch = True
    scalars = False

    def __init__(self, fn: Callable[[Any, Any], ArrayLike], *, name: str = "mean") -> None:
        if not callable(fn):
            raise TypeError(f"metrics.Mean(fn): fn must be callable as fn(outputs, batch), "
                            f"got {fn!r}")
        if not isinstance(name, str):
            raise TypeError(f"metrics.Mean(name={name!r}): expected a string")
        self.fn = fn
        self.name = name

    def statistics(self, predictions: object, targets: object,
                   weights: jax.Array) -> dict[str, jax.Array]:
        return per_example_sums(self.name, self.fn(predictions, targets), weights,
                                scalars=self.scalars)

    def result(self, totals: dict[str, np.ndarray]) -> float:
        return float(totals["sum"] / totals["count"])

    def config(self) -> dict[str, Any]:
        """The metric's name and class, and where its function is defined."""
        return {**super().config(), "fn": function_record(self.fn)}


class Output(Mean):
    """The mean of one of a program's own outputs (``Validation`` without ``metrics``):
    an entry of a returned dict, of ``(cost, dict)``'s dict, or ``"loss"`` for the cost.
    Per-example values are averaged over the real rows, a scalar counts once per real row.

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod.metrics._per_example import Output
        >>> loss = Output("loss")
        >>> loss.result(loss.statistics((jnp.float32(2.0), {}), None, jnp.ones(3)))
        2.0
    """

    scalars = True

    def __init__(self, key: str) -> None:  # no fn to hold: the key picks the output
        self.name = key

    def fn(self, outputs: object, batch: object) -> Any:  # the program's output, as it is
        """The output named like this metric."""
        return named_outputs(outputs)[self.name]


def named_outputs(outputs: Any) -> dict[str, Any]:
    """A program's output as named values: a dict, ``(cost, dict)``, or a scalar loss.

    Examples:
        >>> from graphmod.metrics._per_example import named_outputs
        >>> sorted(named_outputs((1.0, {"accuracy": 0.5})))
        ['accuracy', 'loss']
    """
    if isinstance(outputs, Mapping):
        return dict(outputs)
    if isinstance(outputs, tuple) and len(outputs) == 2 and isinstance(outputs[1], Mapping):
        first = outputs[0]
        base = named_outputs(first) if isinstance(first, Mapping | tuple) else {"loss": first}
        return {**base, **outputs[1]}
    shape = getattr(outputs, "shape", None)
    if not isinstance(outputs, tuple | list) and len(np.shape(outputs) if shape is None
                                                     else shape) == 0:
        return {"loss": outputs}
    raise TypeError(f"Validation: the program returned {shape or type(outputs).__name__}, "
                    "not metrics (a dict of per-example or scalar values, (cost, dict), or a "
                    "scalar); pass metrics={name: fn(outputs, batch) -> per-example array}")
