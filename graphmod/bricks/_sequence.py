"""``Sequence``: bricks and plain callables applied one after another."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as _Sequence
from typing import Any

import jax
from flax import nnx

from graphmod._core._bricks._application import application
from graphmod._core._bricks._brick import Brick


class Sequence(Brick):
    """Applies its layers in order: ``output = layers[-1](...layers[0](input_))``.

    A layer is a brick, any Flax NNX module, or a plain callable such as ``jax.nn.relu``.
    The layers live in an ``nnx.List`` named ``layers``, so their paths are ``/layers/0``,
    ``/layers/1``, ...; a manager can select them with ``bricks=seq.layers[:2]``.

    Args:
        *layers: the layers, or a single list (or tuple) of them.

    Raises:
        ValueError: no layer was given.
        TypeError: a layer is not callable.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> rngs = nnx.Rngs(0)
        >>> seq = gm.bricks.Sequence(
        ...     gm.bricks.Linear(3, 8, rngs=rngs), jax.nn.relu, gm.bricks.Linear(8, 2, rngs=rngs))
        >>> len(seq.layers), seq(jnp.ones((5, 3))).shape
        (3, (5, 2))
    """

    def __init__(self, *layers: Callable[..., Any] | _Sequence[Callable[..., Any]]) -> None:
        if len(layers) == 1 and isinstance(layers[0], list | tuple | nnx.List):
            layers = tuple(layers[0])
        if not layers:
            raise ValueError("Sequence(*layers): give at least one layer (a brick or callable)")
        checked: list[Callable[..., Any]] = []
        for index, layer in enumerate(layers):
            if not callable(layer):
                raise TypeError(
                    f"Sequence(*layers): layers[{index}] = {layer!r} is not callable; give "
                    "bricks, Flax modules or functions"
                )
            checked.append(layer)
        self.layers = nnx.List(checked)

    @application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        output = input_
        for layer in self.layers:
            output = layer(output)
        return output
