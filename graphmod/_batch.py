"""How a batch becomes the arguments of a step: one rule for the loop and fused steps."""

from __future__ import annotations

from typing import Any


def step_arguments(batch: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` a batch is passed as: a dict by name, a tuple or list by
    position, anything else as the one argument.

    Examples:
        >>> from graphmod._batch import step_arguments
        >>> step_arguments({"x": 1}), step_arguments((1, 2)), step_arguments(3)
        (((), {'x': 1}), ((1, 2), {}), ((3,), {}))
    """
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, tuple | list):
        return tuple(batch), {}
    return (batch,), {}
