"""Evaluation metrics for :func:`graphmod.evaluate`.

Metrics are named by string (``"accuracy"``, ``"top_5_accuracy"`` (any ``k``),
``"cross_entropy"``, ``"mean_squared_error"`` or ``"mse"``, ``"mean_absolute_error"`` or
``"mae"``, ``"precision"``, ``"recall"``, ``"f1"`` per class, ``"macro_precision"``,
``"macro_recall"``, ``"macro_f1"``, ``"confusion_matrix"``) or given as instances;
:class:`Mean` averages a function's per-example values (``Validation(metrics={name: fn})``).

Examples:
    >>> from graphmod import metrics
    >>> metrics.get("f1"), metrics.get("mse").name
    (F1(name='f1'), 'mse')
"""

import re
from typing import Any

from graphmod._core._naming import did_you_mean
from graphmod.metrics._base import Metric
from graphmod.metrics._classification import (
    F1,
    Accuracy,
    ConfusionMatrix,
    CrossEntropy,
    Precision,
    Recall,
)
from graphmod.metrics._per_example import Mean
from graphmod.metrics._regression import MeanAbsoluteError, MeanSquaredError

_NAMED = {
    "accuracy": Accuracy,
    "cross_entropy": CrossEntropy,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "confusion_matrix": ConfusionMatrix,
    "precision": Precision,
    "recall": Recall,
    "f1": F1,
    "macro_precision": lambda: Precision(average="macro"),
    "macro_recall": lambda: Recall(average="macro"),
    "macro_f1": lambda: F1(average="macro"),
}


def get(metric: Any) -> Metric:
    """A :class:`Metric` from its name or itself; a named one is keyed by the name given
    (``"mse"`` results read as ``evaluation["mse"]``).

    Examples:
        >>> from graphmod import metrics
        >>> metrics.get("macro_f1").name, metrics.get("top_5_accuracy").top_k
        ('macro_f1', 5)
    """
    if isinstance(metric, Metric):
        return metric
    if isinstance(metric, str) and metric in _NAMED:
        named = _NAMED[metric]()
        named.name = metric  # an alias keys its results as the caller wrote it
        return named
    top = re.fullmatch(r"top_([1-9][0-9]*)_accuracy", metric) if isinstance(metric, str) else None
    if top:
        return Accuracy(top_k=int(top.group(1)))
    hint = did_you_mean(metric, _NAMED) if isinstance(metric, str) else ""
    raise ValueError(f"unknown metric {metric!r}{hint}: use a graphmod.metrics.Metric or one "
                     f"of {', '.join(sorted(_NAMED))}, top_<k>_accuracy")


__all__ = [
    "F1",
    "Accuracy",
    "ConfusionMatrix",
    "CrossEntropy",
    "Mean",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Metric",
    "Precision",
    "Recall",
    "get",
]
