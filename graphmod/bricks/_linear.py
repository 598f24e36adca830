"""``Linear`` and ``MLP``: affine maps and stacks of them."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from graphmod._core._bricks._application import application
from graphmod._core._bricks._brick import Brick
from graphmod._core._tracing._variables import Bias, Weight
from graphmod.bricks._checks import check_sizes


class Linear(Brick):
    """``output = input_ @ W + b``, mirroring ``flax.nnx.Linear``'s signature.

    Args:
        in_features: size of the last input axis.
        out_features: size of the last output axis.
        use_bias: whether to add the bias ``b``.
        kernel_init: initializer of ``W`` (default: Lecun normal, as Flax).
        rngs: NNX random streams (``params`` is used).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0))
        >>> lin(jnp.ones((4, 3))).shape, lin.W.role, lin.b.role
        ((4, 2), WEIGHT, BIAS)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        kernel_init: Callable = nnx.initializers.lecun_normal(),
        bias_init: Callable = nnx.initializers.zeros_init(),
        rngs: nnx.Rngs,
    ) -> None:
        check_sizes("Linear", in_features=in_features, out_features=out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.W = Weight(kernel_init(rngs.params(), (in_features, out_features)))
        self.b = Bias(bias_init(rngs.params(), (out_features,))) if use_bias else None

    @application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        output = input_ @ self.W
        if self.b is not None:
            output = output + self.b
        return output


class MLP(Brick):
    """Linear layers with an activation between them (not after the last).

    Args:
        dims: ``[in, hidden..., out]``; ``len(dims) - 1`` linear layers.
        activation: applied after every layer but the last.
        rngs: NNX random streams.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([3, 8, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> len(mlp.linear_layers), mlp(jnp.ones((5, 3))).shape
        (2, (5, 2))
    """

    def __init__(
        self,
        dims: Sequence[int],
        *,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        use_bias: bool = True,
        rngs: nnx.Rngs,
    ) -> None:
        dims = list(dims)
        if len(dims) < 2:
            raise ValueError(f"MLP(dims={dims}): needs at least an input and an output size")
        check_sizes("MLP", **{f"dims[{i}]": dim for i, dim in enumerate(dims)})
        self.dims = dims
        self.activation = activation
        self.linear_layers = nnx.List(
            Linear(a, b, use_bias=use_bias, rngs=rngs) for a, b in itertools.pairwise(dims)
        )

    @application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        output = input_
        last = len(self.linear_layers) - 1
        for index, layer in enumerate(self.linear_layers):
            output = layer(output)
            if index < last:
                output = self.activation(output)
        return output
