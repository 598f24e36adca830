"""``Conv``: N-dimensional channels-last convolution, mirroring ``flax.nnx.Conv``."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as _Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from graphmod._core._bricks._application import application
from graphmod._core._bricks._brick import Brick
from graphmod._core._number_checks import is_whole_number
from graphmod._core._tracing._variables import Bias, Filter
from graphmod.bricks._checks import check_sizes

Padding = str | int | _Sequence[int | tuple[int, int]]

_PAD_MODES = {"CIRCULAR": "wrap", "REFLECT": "reflect"}


def _per_axis(value: int | _Sequence[int] | None, rank: int, argument: str) -> tuple[int, ...]:
    """``value`` broadcast to one positive int per spatial axis (None means 1, as Flax)."""
    if value is None:
        value = 1
    values = (value,) * rank if isinstance(value, int) else tuple(value)
    if len(values) != rank:
        raise ValueError(f"Conv({argument}={value!r}): give an int or {rank} ints, one per "
                         f"spatial axis of kernel_size")
    for item in values:
        check_sizes("Conv", **{argument: item})
    return values


def _canonical_padding(padding: Padding, rank: int) -> str | tuple[tuple[int, int], ...]:
    """A ``lax`` padding, or one of ``CIRCULAR``/``REFLECT``/``CAUSAL`` handled by hand."""
    if isinstance(padding, str):
        upper = padding.upper()
        if upper not in ("SAME", "SAME_LOWER", "VALID", "CAUSAL", *_PAD_MODES):
            raise ValueError(
                f"Conv(padding={padding!r}): use 'SAME', 'SAME_LOWER', 'VALID', 'CIRCULAR', "
                "'REFLECT', 'CAUSAL', an int, or one int or (low, high) pair per spatial axis"
            )
        if upper == "CAUSAL" and rank != 1:
            raise ValueError(f"Conv(padding='CAUSAL') needs a 1-D kernel, got {rank}-D")
        return upper
    if isinstance(padding, int) and is_whole_number(padding):  # an int, not a bool
        return ((padding, padding),) * rank
    pairs: list[tuple[int, int]] = []
    if isinstance(padding, _Sequence) and len(padding) == rank:
        for item in padding:
            if isinstance(item, int) and is_whole_number(item):
                pairs.append((item, item))
            elif (isinstance(item, _Sequence) and len(item) == 2
                  and all(is_whole_number(p) for p in item)):
                pairs.append((int(item[0]), int(item[1])))
    if len(pairs) != rank:
        raise ValueError(
            f"Conv(padding={padding!r}): give a string, an int, or {rank} ints or (low, high) "
            "pairs, one per spatial axis"
        )
    return tuple(pairs)


class Conv(Brick):
    """An N-d convolution over channels-last inputs, mirroring ``flax.nnx.Conv``.

    ``kernel_size`` sets the number of spatial axes N: a tuple of N ints, or an int for a
    1-D convolution (as Flax). Inputs are ``(*batch, *spatial, in_features)``: one batch
    axis, several (flattened for the convolution), or none. The filter ``W`` has shape
    ``(*kernel_size, in_features // feature_group_count, out_features)``, the bias ``b``
    ``(out_features,)``; both match Flax's ``kernel`` and ``bias``.

    Args:
        in_features: size of the input's last (channel) axis.
        out_features: number of output channels.
        kernel_size: an int (1-D) or one int per spatial axis.
        strides: an int or one per spatial axis.
        padding: ``"SAME"``, ``"VALID"``, ``"SAME_LOWER"``, ``"CIRCULAR"``, ``"REFLECT"``,
            ``"CAUSAL"`` (1-D), an int, or an int or ``(low, high)`` pair per spatial axis.
        input_dilation, kernel_dilation: an int or one per spatial axis.
        feature_group_count: grouped convolution; divides ``in_features`` and
            ``out_features``.
        use_bias: whether to add ``b``.
        kernel_init, bias_init: initializers (Flax's defaults).
        rngs: NNX random streams (``params`` is used).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> conv = gm.bricks.Conv(3, 8, (3, 3), strides=2, rngs=nnx.Rngs(0))
        >>> conv(jnp.ones((2, 16, 16, 3))).shape, conv.W.shape, conv.W.role, conv.b.role
        ((2, 8, 8, 8), (3, 3, 3, 8), FILTER, BIAS)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | _Sequence[int],
        strides: int | _Sequence[int] | None = 1,
        *,
        padding: Padding = "SAME",
        input_dilation: int | _Sequence[int] | None = 1,
        kernel_dilation: int | _Sequence[int] | None = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        kernel_init: Callable = nnx.initializers.lecun_normal(),
        bias_init: Callable = nnx.initializers.zeros_init(),
        rngs: nnx.Rngs,
    ) -> None:
        check_sizes("Conv", in_features=in_features, out_features=out_features,
                    feature_group_count=feature_group_count)
        if isinstance(kernel_size, int) and is_whole_number(kernel_size):
            kernel_size = (kernel_size,)
        if not isinstance(kernel_size, _Sequence) or not kernel_size:
            raise ValueError(f"Conv(kernel_size={kernel_size!r}): give an int or a non-empty "
                             "tuple of ints, one per spatial axis")
        kernel_size = tuple(kernel_size)
        for size in kernel_size:
            check_sizes("Conv", kernel_size=size)
        rank = len(kernel_size)
        for argument, count in (("in_features", in_features), ("out_features", out_features)):
            if count % feature_group_count:
                raise ValueError(
                    f"Conv(feature_group_count={feature_group_count}): must divide "
                    f"{argument}={count}"
                )
        self.in_features = in_features
        self.out_features = out_features
        self.kernel_size = kernel_size
        self.strides = _per_axis(strides, rank, "strides")
        self.padding = _canonical_padding(padding, rank)
        self.input_dilation = _per_axis(input_dilation, rank, "input_dilation")
        if isinstance(self.padding, str) and any(d > 1 for d in self.input_dilation):
            raise ValueError(
                f"Conv(input_dilation={input_dilation!r}) needs explicit padding (ints or "
                f"(low, high) pairs), not padding={padding!r}: lax has no string padding "
                "for dilated inputs"
            )
        self.kernel_dilation = _per_axis(kernel_dilation, rank, "kernel_dilation")
        self.feature_group_count = feature_group_count
        self.use_bias = use_bias
        shape = (*kernel_size, in_features // feature_group_count, out_features)
        self.W = Filter(kernel_init(rngs.params(), shape))
        self.b = Bias(bias_init(rngs.params(), (out_features,))) if use_bias else None

    @application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        rank = len(self.kernel_size)
        shape = jnp.shape(input_)
        if len(shape) < rank + 1 or shape[-1] != self.in_features:
            raise ValueError(
                f"Conv.apply: input_ of shape {shape} does not fit a {rank}-D convolution "
                f"with in_features={self.in_features}; expected (*batch, {rank} spatial axes, "
                f"{self.in_features})"
            )
        batch = shape[: len(shape) - rank - 1]
        x = jnp.reshape(input_, (-1, *shape[len(batch):]))  # exactly one batch axis
        padding = self.padding
        if isinstance(padding, str) and (padding in _PAD_MODES or padding == "CAUSAL"):
            dilated = [(k - 1) * d + 1 for k, d in zip(self.kernel_size, self.kernel_dilation,
                                                       strict=True)]
            if padding == "CAUSAL":
                pads = [(dilated[0] - 1, 0)]
                mode = "constant"
            else:
                pads = [((k - 1) // 2, k // 2) for k in dilated]
                mode = _PAD_MODES[padding]
            x = jnp.pad(x, [(0, 0), *pads, (0, 0)], mode=mode)
            padding = "VALID"
        spatial = tuple(range(1, rank + 1))
        numbers = jax.lax.ConvDimensionNumbers(
            lhs_spec=(0, rank + 1, *spatial),
            rhs_spec=(rank + 1, rank, *range(rank)),
            out_spec=(0, rank + 1, *spatial),
        )
        kernel = self.W[...]
        dtype = jnp.promote_types(x.dtype, kernel.dtype)
        output = jax.lax.conv_general_dilated(
            x.astype(dtype), kernel.astype(dtype), self.strides, padding,
            lhs_dilation=self.input_dilation, rhs_dilation=self.kernel_dilation,
            dimension_numbers=numbers, feature_group_count=self.feature_group_count,
        )
        if self.b is not None:
            output = output + self.b[...]
        return jnp.reshape(output, (*batch, *output.shape[1:]))
