"""Reading a saved model's fitted transforms back: the data a fresh process compiles with."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from graphmod._records._record import Provenance
from graphmod.data import FittedTransforms
from graphmod.provenance._files import read


def transforms(source: str | os.PathLike | Provenance | Mapping[str, Any], *,
               step: int | None = None) -> FittedTransforms | None:
    """The transformations fitted on the training data that a record holds (None: the
    program had none), rebuilt as data through graphmod's own transformation kinds.

    So that a fresh process gives a saved model raw inputs, transformed as in training::

        program = gm.compile(fn, model, transforms=gm.provenance.transforms(DIR))
        variables = program.load(DIR)  # after program.init(...)

    Args:
        source: a directory ``program.save`` or a run's checkpoints wrote (``step``: which
            checkpoint, default the latest), a JSON file, a :class:`graphmod.Provenance`
            of a program, a training run or an evaluation, or its ``to_dict()``.
        step: the checkpoint to read in a run directory.

    Returns:
        The :class:`graphmod.data.FittedTransforms`, or None.

    Examples:
        >>> import numpy as np, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource, Standardize, Transforms
        >>> fitted = Transforms({"x": Standardize()}).fit(
        ...     ArraySource({"x": np.array([[1.0], [3.0]], np.float32)}, 2))
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(1, 1, rngs=nnx.Rngs(0)),
        ...                      transforms=fitted)
        >>> _ = program.init(jnp.ones((1, 1)))
        >>> gm.provenance.transforms(program.provenance) == fitted
        True
    """
    if isinstance(source, str | os.PathLike):
        source = read(source, step=step)
    record = source.to_dict() if isinstance(source, Provenance) else dict(source)
    inputs = record.get("inputs", {})
    if record.get("kind") == "evaluation":  # the evaluated model's own record
        inputs = (inputs.get("model") or {}).get("inputs", {})
    if "models" in inputs and "transforms" not in inputs:
        raise ValueError(
            f"provenance.transforms: a record of several models ({sorted(inputs['models'])}); "
            "pass one model's record, e.g. provenance.transforms(record['models'][name])")
    found = inputs.get("transforms")
    return None if found is None else FittedTransforms.from_record(found)
