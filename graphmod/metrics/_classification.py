"""Classification metrics: accuracy, cross-entropy, per-class precision, recall and F1.

Two answers they never give silently. An example whose class scores hold a NaN or an
infinity ranks no class: it counts as wrong (accuracy, top-k, recall, F1), since a score
that is not a number says nothing of the classes. A target label outside the predictions'
classes (below 0, or at or above their number) is refused: ``jnp.take_along_axis`` and
``one_hot`` would read -1 as the last class and drop 7 of 3 classes without a word. Inside
``jax.jit`` no value can raise, so each metric counts its targets per class, with a bucket
below 0 and one above the classes, among its sums, and ``result`` refuses a count outside;
:func:`graphmod.evaluate`, which holds each batch on the host before it runs, refuses the
first bad label by its example index and value (``Metric.check_batch``), with no wait on
the device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphmod.metrics._base import Metric, weights_like


def check_classification(name: str, predictions: jax.ShapeDtypeStruct, targets: Any,
                         field: str) -> None:
    """Raises unless predictions are class scores ``(batch, ..., classes)`` and targets are
    integer labels ``(batch, ...)`` or class probabilities ``(batch, ..., classes)``."""
    shape = tuple(predictions.shape)
    if len(shape) < 2 or shape[-1] < 2 or not jnp.issubdtype(predictions.dtype, jnp.floating):
        raise ValueError(
            f"metric {name!r}: predictions must be floating class scores of shape (batch, "
            f"..., classes) with at least 2 classes; got shape {shape} and dtype "
            f"{predictions.dtype}. Pass predict= a function returning logits"
        )
    labels, probabilities = shape[:-1], shape
    got = tuple(targets.shape)
    fits = got == (labels if jnp.issubdtype(targets.dtype, jnp.integer) else probabilities)
    if not fits:
        raise ValueError(
            f"metric {name!r}: predictions of shape {shape} and targets {field!r} of shape "
            f"{got} ({targets.dtype}) disagree in shape: expected integer class labels of "
            f"shape {labels} or class probabilities (one-hot) of shape {probabilities}"
        )


def check_labels(name: str, labels: np.ndarray, classes: int, field: str, first: int) -> None:
    """Raises naming the first of integer ``labels`` (a batch's real rows, the first example
    ``first`` of the source) outside ``range(classes)``, its example and the fix.

    Examples:
        >>> import numpy as np
        >>> check_labels("accuracy", np.array([0, 2, 7]), 3, "y", first=8)
        Traceback (most recent call last):
        ...
        ValueError: metric 'accuracy': targets 'y' hold the label 7 at example 10, outside \
the 3 classes of the predictions (labels are integers in [0, 3)). Fix the labels, or give \
the model 8 outputs if the data have 8 classes
    """
    outside = (labels < 0) | (labels >= classes)
    if not outside.any():
        return
    where = np.argwhere(outside)[0]
    value = int(labels[tuple(where)])
    at = f"example {first + int(where[0])}" + (
        f", position {tuple(int(i) for i in where[1:])}" if len(where) > 1 else "")
    fix = (f"give the model {value + 1} outputs if the data have {value + 1} classes"
           if value >= classes else "leave out the examples of a label below 0 (an "
           "'ignore' label such as -1) or map them to a class")
    raise ValueError(f"metric {name!r}: targets {field!r} hold the label {value} at {at}, "
                     f"outside the {classes} classes of the predictions (labels are "
                     f"integers in [0, {classes})). Fix the labels, or {fix}")


def _labels(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    if jnp.issubdtype(targets.dtype, jnp.integer):
        return targets
    return jnp.argmax(targets, axis=-1)


def _label_counts(labels: jax.Array, classes: int, w: jax.Array) -> jax.Array:
    """The weighted count of the labels below 0, of each class, and at or above ``classes``
    (a scatter-add: one pass over the labels, summed over batches like any other sum)."""
    bucket = (jnp.clip(labels.astype(jnp.int32), -1, classes) + 1).ravel()  # uint8 too
    return jnp.zeros(classes + 2, jnp.float32).at[bucket].add(w.ravel())


def _scored(predictions: jax.Array) -> jax.Array:
    """Whether each example's class scores are all finite (a NaN or inf ranks no class)."""
    return jnp.isfinite(predictions).all(axis=-1)


class _Classification(Metric):
    """Scores of classes against integer labels or class probabilities: shapes checked
    before the first batch, labels on the host per batch and in the sums on the device."""

    def check(self, predictions: jax.ShapeDtypeStruct, targets: Any, field: str) -> None:
        check_classification(self.name, predictions, targets, field)

    def check_batch(self, predictions: jax.ShapeDtypeStruct, targets: np.ndarray, field: str,
                    first: int) -> None:
        if np.issubdtype(targets.dtype, np.integer):
            check_labels(self.name, targets, predictions.shape[-1], field, first)

    def _refuse_outside(self, counts: np.ndarray) -> None:
        """Raises if the label counts of :func:`_label_counts` hold labels outside."""
        below, above, classes = int(counts[0]), int(counts[-1]), len(counts) - 2
        if below or above:
            raise ValueError(
                f"metric {self.name!r}: {below + above} target labels lie outside the "
                f"{classes} classes of the predictions ({below} below 0, {above} at or "
                f"above {classes}); labels are integers in [0, {classes}). Fix the labels "
                "(graphmod.evaluate names the first), or the model's number of outputs")


class Accuracy(_Classification):
    """The fraction of examples whose highest-scoring class is the target class; with
    ``top_k=k``, whose target class is among the ``k`` highest-scoring. Classes scoring the
    same rank by index, as ``argmax`` and ``lax.top_k`` do (a model scoring every class
    alike gets class 0 right, not every class). Named ``"accuracy"``, or
    ``"top_k_accuracy"`` for ``k > 1`` (``metrics.get("top_5_accuracy")``).

    Targets are integer labels, or class probabilities / one-hot (their argmax is the
    label).

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> scores, labels = jnp.array([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]]), jnp.array([0, 1])
        >>> m, top2 = metrics.Accuracy(), metrics.Accuracy(top_k=2)
        >>> m.result(m.statistics(scores, labels, jnp.ones(2))), top2.name
        (0.5, 'top_2_accuracy')
        >>> top2.result(top2.statistics(scores, labels, jnp.ones(2)))
        1.0
    """

    name = "accuracy"

    def __init__(self, top_k: int = 1) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"Accuracy(top_k={top_k!r}): must be an int of at least 1")
        self.top_k = top_k
        if top_k > 1:
            self.name = f"top_{top_k}_accuracy"

    def check(self, predictions: jax.ShapeDtypeStruct, targets: Any, field: str) -> None:
        super().check(predictions, targets, field)
        if self.top_k >= predictions.shape[-1]:
            raise ValueError(
                f"metric {self.name!r}: top_k={self.top_k} needs more than {self.top_k} "
                f"classes; the predictions have {predictions.shape[-1]} (shape "
                f"{tuple(predictions.shape)}), so every example would count as correct")

    def statistics(self, predictions: jax.Array, targets: jax.Array,
                   weights: jax.Array) -> dict[str, jax.Array]:
        labels = _labels(predictions, targets)
        w = weights_like(weights, labels.shape)
        target = jnp.take_along_axis(predictions, labels[..., None], axis=-1)
        before = jnp.arange(predictions.shape[-1]) < labels[..., None]
        # Classes ranked above the target: scoring higher, or as high with a lower index.
        ahead = ((predictions > target) | ((predictions == target) & before)).sum(axis=-1)
        hit = ((ahead < self.top_k) & _scored(predictions)).astype(jnp.float32)
        return {"correct": (hit * w).sum(), "count": w.sum(),
                "labels": _label_counts(labels, predictions.shape[-1], w)}

    def result(self, totals: dict[str, np.ndarray]) -> float:
        self._refuse_outside(totals["labels"])
        return float(totals["correct"] / totals["count"])


class CrossEntropy(_Classification):
    """The mean cross-entropy between the predicted class distribution and the targets.

    Args:
        from_logits: predictions are logits (default) rather than probabilities.

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> m = metrics.CrossEntropy()
        >>> round(m.result(m.statistics(jnp.zeros((1, 2)), jnp.array([1]), jnp.ones(1))), 4)
        0.6931
    """

    name = "cross_entropy"

    def __init__(self, *, from_logits: bool = True) -> None:
        self.from_logits = from_logits

    def statistics(self, predictions: jax.Array, targets: jax.Array,
                   weights: jax.Array) -> dict[str, jax.Array]:
        scores = predictions.astype(jnp.float32)
        log_p = jax.nn.log_softmax(scores) if self.from_logits \
            else jnp.log(jnp.clip(scores, 1e-12, 1.0))
        if jnp.issubdtype(targets.dtype, jnp.integer):
            loss = -jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
        else:
            loss = -(targets.astype(jnp.float32) * log_p).sum(-1)
        w = weights_like(weights, loss.shape)
        return {"sum": (loss * w).sum(), "count": w.sum(),
                "labels": _label_counts(_labels(predictions, targets), scores.shape[-1], w)}

    def result(self, totals: dict[str, np.ndarray]) -> float:
        self._refuse_outside(totals["labels"])
        return float(totals["sum"] / totals["count"])


class ConfusionMatrix(_Classification):
    """Counts of (target class, predicted class): rows are targets, columns predictions.
    An example with a NaN or infinite score predicts no class: it is in no column, so its
    row sums to less than the class's examples (precision, recall and F1 count them).

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> m = metrics.ConfusionMatrix()
        >>> m.result(m.statistics(jnp.array([[2.0, 1.0], [0.0, 1.0]]), jnp.array([0, 0]),
        ...                       jnp.ones(2))).tolist()
        [[1, 1], [0, 0]]
    """

    name = "confusion_matrix"

    def statistics(self, predictions: jax.Array, targets: jax.Array,
                   weights: jax.Array) -> dict[str, jax.Array]:
        classes = predictions.shape[-1]
        labels = _labels(predictions, targets)
        w = weights_like(weights, labels.shape)
        truth = jax.nn.one_hot(labels, classes) * w[..., None]
        guess = jax.nn.one_hot(jnp.argmax(predictions, axis=-1), classes) \
            * _scored(predictions)[..., None]
        return {"counts": jnp.einsum("...i,...j->ij", truth, guess),
                "labels": _label_counts(labels, classes, w)}

    def result(self, totals: dict[str, np.ndarray]) -> np.ndarray:
        self._refuse_outside(totals["labels"])
        return np.rint(totals["counts"]).astype(np.int64)


_AVERAGES = (None, "macro", "micro", "weighted")


class _PerClass(ConfusionMatrix):
    average: str | None

    def __init__(self, *, average: str | None = None) -> None:
        if average not in _AVERAGES:
            raise ValueError(f"{type(self).__name__}(average={average!r}): must be one of "
                             f"{_AVERAGES}")
        self.average = average
        base = type(self).__name__.lower()
        self.name = base if average is None else f"{average}_{base}"

    def _per_class(self, totals: dict[str, np.ndarray]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per class: true positives, predicted counts, target counts (support: the
        examples predicting no class too)."""
        counts = np.asarray(totals["counts"], np.float64)
        return np.diag(counts), counts.sum(0), np.asarray(totals["labels"][1:-1], np.float64)

    def _score(self, tp: np.ndarray, predicted: np.ndarray, support: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def result(self, totals: dict[str, np.ndarray]) -> Any:
        self._refuse_outside(totals["labels"])
        tp, predicted, support = self._per_class(totals)
        if self.average == "micro":
            return float(self._score(tp.sum(keepdims=True), predicted.sum(keepdims=True),
                                     support.sum(keepdims=True))[0])
        scores = self._score(tp, predicted, support)
        if self.average is None:
            return scores
        if self.average == "macro":
            return float(scores.mean())
        return float((scores * support).sum() / max(support.sum(), 1.0))


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float64), where=b > 0)


class Precision(_PerClass):
    """Per class: of the examples predicted as the class, the fraction that are (0 where
    nothing was predicted as it). ``average="macro"``, ``"micro"`` or ``"weighted"``
    (by support) gives one number.

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> m = metrics.Precision()
        >>> m.result(m.statistics(jnp.array([[2.0, 1.0], [3.0, 1.0]]), jnp.array([0, 1]),
        ...                       jnp.ones(2))).tolist()
        [0.5, 0.0]
    """

    def _score(self, tp: np.ndarray, predicted: np.ndarray, support: np.ndarray) -> np.ndarray:
        return _ratio(tp, predicted)


class Recall(_PerClass):
    """Per class: of the examples of the class, the fraction predicted as it (0 for a class
    with no example). ``average=`` as for :class:`Precision`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> m = metrics.Recall()
        >>> m.result(m.statistics(jnp.array([[2.0, 1.0], [3.0, 1.0]]), jnp.array([0, 1]),
        ...                       jnp.ones(2))).tolist()
        [1.0, 0.0]
    """

    def _score(self, tp: np.ndarray, predicted: np.ndarray, support: np.ndarray) -> np.ndarray:
        return _ratio(tp, support)


class F1(_PerClass):
    """Per class: the harmonic mean of precision and recall (0 where both are 0).
    ``average=`` as for :class:`Precision`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import metrics
        >>> m = metrics.F1()
        >>> m.result(m.statistics(jnp.array([[2.0, 1.0], [3.0, 1.0]]), jnp.array([0, 1]),
        ...                       jnp.ones(2))).round(4).tolist()
        [0.6667, 0.0]
    """

    def _score(self, tp: np.ndarray, predicted: np.ndarray, support: np.ndarray) -> np.ndarray:
        return _ratio(2 * tp, predicted + support)
