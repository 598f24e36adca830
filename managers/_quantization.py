"""``FakeQuant``: quantization-aware training by quantize-dequantize with a
straight-through gradient.

Weights (``rewrite_parameter``) are quantized symmetrically per output unit (the last
axis: one scale per channel; an ``nnx.LinearGeneral``'s output axes, the axes an
``nnx.Einsum`` does not contract: ``managers._layout``), activations
(``rewrite_input``/``rewrite_output``) per tensor, each scale
``max |x| / (2 ** (bits - 1) - 1)`` of the values at hand (dynamic range, as Qwix's and
AQT's default for training). The forward pass sees
``round(x / scale) * scale`` clipped to the integer range; the backward pass sees the
identity (the straight-through estimator), so the stored weights train in full precision.

Sharp edges
    Scales come from the current values (no calibrated or learned scale, no zero point:
    symmetric only). A tensor of zeros keeps scale 1.
"""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod import roles
from graphmod.typing import HookContext
from managers._checks import ManagerOptions, require_floating, roles_by_default
from managers._layout import weight_layout


def fake_quant(value: jax.Array, bits: int, axes: tuple[int, ...] | None) -> jax.Array:
    """``value`` quantized to signed ``bits``-bit integers and back (scale from
    ``max |value|`` over ``axes``, all when None), with the straight-through gradient.

    Examples:
        >>> import jax.numpy as jnp
        >>> fake_quant(jnp.array([0.0, 0.26, 1.0]), 2, None).tolist()
        [0.0, 0.0, 1.0]
    """
    levels = 2 ** (bits - 1) - 1
    biggest = jnp.max(jnp.abs(value), axis=axes, keepdims=True)
    scale = jnp.where(biggest > 0, biggest / levels, 1).astype(value.dtype)
    quantized = jnp.clip(jnp.round(value / scale), -levels, levels) * scale
    return value + jax.lax.stop_gradient(quantized - value)


class FakeQuant(gm.Manager):
    """Quantize-dequantize of the selected weights (per channel) and activations (per
    tensor) to ``bits``-bit symmetric integers, with a straight-through gradient (see
    the module docstring). Unless its filter chooses variables (``roles=``, ``path=``,
    ``variable_name=``, ``name_regex=``, ``filter=``) it quantizes the weights, inputs and
    outputs (not the biases) of the applications it selects. For serving,
    ``managers.quantize(program, trained_variables)`` converts the trained variables to
    stored int8 (or int4) weights with these scales and rounding: the served program gives
    this program's inference outputs.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0), use_bias=False)
        >>> program = gm.compile(lambda m, x: m(x), lin,
        ...                      managers=[managers.FakeQuant(2, roles=[gm.roles.WEIGHT])])
        >>> x = jnp.eye(3)
        >>> w = program.infer(program.init(x), x)  # W as read: 3 levels per column
        >>> [len(set(column.tolist())) <= 3 for column in w.T]
        [True, True]
    """

    kinds = ("parameter_rewrite",)  # EMA and a cost on the stored weight go first

    def __init__(self, bits: int = 8, **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**roles_by_default(kwargs, (roles.WEIGHT, roles.INPUT,
                                                       roles.OUTPUT)))
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
            raise ValueError(f"FakeQuant(bits={bits!r}): must be an int from 2 to 16")
        self.bits = bits

    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        return fake_quant(value, self.bits, weight_layout(self, call, name, value).fan_in)

    def _activation(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        require_floating(self, call, name, value)
        return fake_quant(value, self.bits, None)

    def rewrite_input(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._activation(call, name, value)

    def rewrite_output(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        return self._activation(call, name, value)
