"""Evaluation data checked against the training data's metadata before anything runs, and
its targets transformed as training transformed them.

A program compiled with fitted transforms (``compile(..., transforms=)``) knows the fields,
shapes, dtypes and label sets its training data had. ``evaluate`` and ``Validation`` hand
their source here before their first batch runs: every field of the first batch is checked
(shape, canonical dtype: the targets too, which the predictor never sees), and every label
field of every example (on the host: the source's own cached metadata when it has one, else
one pass over its padded batches, real rows only), so that nothing is computed on data the
model was not trained for.

Targets: a program transforms the arguments its function takes; a field the evaluation's
predictor does not take (the targets metrics compare with) but the transforms change (labels
through ``Vocabulary``, ``OneHot``) is transformed on the host the same way
(:func:`transformed_targets`), so metrics compare predictions with what the cost saw.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import numpy as np

from graphmod._core._program._arguments import argument_names
from graphmod._core._program._input_transforms import abstract_value
from graphmod._core._program._program_core import ProgramCore
from graphmod._train._engine import Mask, PaddedSource

__all__ = ["check_evaluation_data", "transformed_targets"]


def _fields(batch: object) -> dict[str | int, object]:
    """A batch's fields as the metadata names them: dict keys, tuple indices, or ``0``."""
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, tuple | list):
        return dict(enumerate(batch))
    return {0: batch}


def check_evaluation_data(program: ProgramCore, source: PaddedSource | Iterable[object],
                          first: object, where: str) -> None:
    """Refuses ``source`` (``first``: its first batch) when it does not fit the metadata of
    ``program``'s transforms: a field's shape or dtype, a label never seen in training."""
    transforms = program.transforms
    if transforms is None:
        return
    fields = _fields(first)
    checked = set(transforms.fields())
    known = {f: v for f, v in fields.items() if f in checked}
    # As jit sees them (float64 is float32 without x64), like the program's own check.
    transforms.check({f: jax.tree.map(abstract_value, v) for f, v in known.items()}, where)
    metadata = getattr(transforms, "metadata", None)  # graphmod's FittedTransforms have it
    if metadata is None:
        return
    labelled = [f for f in metadata.fields if metadata[f].labels is not None and f in fields]
    if not labelled:
        return
    try:  # cached by the source: no pass over the data
        own = getattr(source, "metadata", None)
    except (TypeError, ValueError):  # fields metadata cannot hold (nested dicts): read them
        own = None
    if own is not None and all(f in own and own[f].labels is not None for f in labelled):
        metadata.check_labels({f: np.array([v for v, _ in own[f].labels]) for f in labelled},
                              where)
        return
    for batch, mask in _padded(source):
        real = np.asarray(mask, bool)
        values = _fields(batch)
        metadata.check_labels({f: np.asarray(values[f])[real] for f in labelled}, where)


def _padded(source: PaddedSource | Iterable[object]) -> Iterable[tuple[object, Mask]]:
    """The source's ``(batch, mask)`` pairs (every row real for a plain iterable)."""
    if isinstance(source, PaddedSource):
        return source.iter_padded()
    return ((batch, np.ones(len(jax.tree.leaves(batch)[0]), bool)) for batch in source)


def transformed_targets(program: ProgramCore, batch: object) -> object:
    """``batch`` with the fields ``program``'s function does not take but its transforms
    change replaced by their transformed values (NumPy, on the host)."""
    transforms = program.transforms
    if transforms is None:
        return batch
    names, fields = argument_names(program.fn), _fields(batch)
    targets = [f for f in transforms.transformed() if f in fields and f not in names
               and not (isinstance(f, int) and f < len(names))]
    if not targets:
        return batch
    return _replaced(batch, {f: np.asarray(v) for f, v in transforms.apply(
        {f: fields[f] for f in targets}).items()})


def _replaced(batch: object, new: Mapping[str | int, object]) -> object:
    """``batch`` with the fields in ``new`` replaced."""
    if isinstance(batch, Mapping):
        return {**batch, **new}
    if isinstance(batch, tuple | list):
        return type(batch)(new.get(i, v) for i, v in enumerate(batch))
    return new.get(0, batch)
