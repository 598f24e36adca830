"""A weight's layout: which of its axes feed one output unit, as its layer defines them.

The managers that work per output unit (WeightNorm, WeightStandardization, SpectralNorm,
MaxNorm, FakeQuant, LoRA) read a weight as a matrix ``(fan_in, units)``. Most layers keep
their inputs first and their outputs last (``Linear``'s ``(in, out)``, a convolution's
``(..., in, out)``). Flax's ``nnx.LinearGeneral`` ends with several output axes (a query
projection's ``(features, heads, head_dim)``), and an ``nnx.Einsum`` kernel's inputs are the
axes its equation contracts, anywhere (Gemma's ``BTD,NDH->BTNH``: ``D``, between the heads
``N`` and ``H``). Qwix's LoRA splits an einsum's kernel the same way, by the axes its
equation contracts (it keeps a batch axis, one in all three operands, with the inputs;
here it is an output unit's).

Sharp edges
    The layout is the layer's when the weight is read by the layer that owns it (an
    ``nnx.Einsum`` called with another ``einsum_str`` than its own is read with its own).
    Any other reader, and any other layer, gets the default: every axis but the last.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

import graphmod as gm
from graphmod.typing import HookContext
from managers._checks import require_floating


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """A weight's ``shape`` and its ``fan_in`` axes; every other axis is an output unit's.

    Examples:
        >>> import jax.numpy as jnp
        >>> layout = WeightLayout((2, 8, 4), fan_in=(1,))  # Gemma's query kernel, N D H
        >>> layout.units_shape, layout.matrix(jnp.zeros((2, 8, 4))).shape
        ((2, 4), (8, 8))
        >>> layout.per_unit(jnp.zeros((2, 4))).shape  # broadcasts against the weight
        (2, 1, 4)
    """

    shape: tuple[int, ...]
    fan_in: tuple[int, ...]

    @property
    def units(self) -> tuple[int, ...]:
        """The output units' axes."""
        return tuple(a for a in range(len(self.shape)) if a not in self.fan_in)

    @property
    def units_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.units)

    @property
    def fan_in_size(self) -> int:
        """The matrix's rows: the inputs feeding one output unit."""
        return math.prod(self.shape[a] for a in self.fan_in)

    @property
    def units_size(self) -> int:
        """The matrix's columns: the output units."""
        return math.prod(self.units_shape)

    @property
    def leading(self) -> bool:
        """Whether the fan-in axes come first: the matrix is a reshape, no transpose."""
        return self.fan_in == tuple(range(len(self.fan_in)))

    # Where the fan-in axes lead (Linear, convolutions) a layout is a reshape or nothing:
    # no transpose or broadcast shape is traced, so those steps compile as before layouts.
    def matrix(self, weight: jax.Array) -> jax.Array:
        """``weight`` as ``(fan_in, units)``."""
        if not self.leading:
            weight = jnp.transpose(weight, self.fan_in + self.units)
        return weight.reshape(self.fan_in_size, self.units_size)

    def from_matrix(self, matrix: jax.Array) -> jax.Array:
        """The inverse of :meth:`matrix`: a ``(fan_in, units)`` matrix in the weight's shape."""
        if self.leading:
            return matrix.reshape(self.shape)
        order = self.fan_in + self.units
        grouped = matrix.reshape(tuple(self.shape[a] for a in order))
        return jnp.transpose(grouped, tuple(order.index(a) for a in range(len(order))))

    def per_unit(self, values: jax.Array) -> jax.Array:
        """``values``, one per output unit (any shape of that size), shaped to broadcast
        against the weight."""
        if self.leading:  # the units trail: broadcasting puts them in place
            return values.reshape(self.units_shape)
        return values.reshape(tuple(1 if a in self.fan_in else n
                                    for a, n in enumerate(self.shape)))


def weight_layout(manager: gm.Manager, call: HookContext, name: str,
                  value: jax.Array | jax.ShapeDtypeStruct) -> WeightLayout:
    """The layout of ``value``, the weight ``name`` read by ``call``. Raises naming the
    manager and the parameter if ``value`` is not floating or has fewer than two axes (a
    bias)."""
    require_floating(manager, call, name, value)
    shape = tuple(jnp.shape(value))
    if len(shape) < 2:  # a matrix at least
        raise ValueError(
            f"{type(manager).__name__} {manager.name!r} selected {name!r} of shape "
            f"{shape} at {call.parameter or call.path}: it rewrites weights with an "
            "output axis and at least one input axis. Narrow its filter (e.g. "
            "roles=[graphmod.roles.WEIGHT]) to leave this variable out.")
    return WeightLayout(shape, _fan_in(call.brick, name, len(shape)))


def _fan_in(layer: object, name: str, ndim: int) -> tuple[int, ...]:
    default = tuple(range(ndim - 1))
    if name != "kernel":
        return default
    if isinstance(layer, nnx.LinearGeneral) and len(layer.out_features) < ndim:
        return tuple(range(ndim - len(layer.out_features)))
    if isinstance(layer, nnx.Einsum):
        return _contracted(layer.einsum_str, ndim) or default
    return default


def _contracted(equation: str, ndim: int) -> tuple[int, ...] | None:
    """The kernel axes ``equation`` (``"BTD,NDH->BTNH"``) sums over, or None if it is not
    an input-kernel equation with explicit kernel axes that leaves some axes out."""
    operands, arrow, output = equation.replace(" ", "").partition("->")
    inputs, _, kernel = operands.partition(",")
    if not arrow or "," in kernel or "." in kernel or len(kernel) != ndim:
        return None
    fan_in = tuple(a for a, letter in enumerate(kernel)
                   if letter in inputs and letter not in output)
    return fan_in if 0 < len(fan_in) < ndim else None
