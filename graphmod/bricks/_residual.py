"""``Residual`` (``x + branch(norm(x))``) and ``TransformerBlock`` (pre-norm attention and
MLP, each residual): the branch is an application output, so ``managers.StochasticDepth``
can drop it."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from graphmod._core._bricks._application import application
from graphmod._core._bricks._brick import Brick
from graphmod.bricks._attention import MultiHeadAttention
from graphmod.bricks._checks import check_sizes
from graphmod.bricks._linear import MLP
from graphmod.bricks._norm import LayerNorm


class Residual(Brick):
    """``output = input_ + residual(input_)``, the ``residual`` application computing
    ``branch(norm(input_))`` (``norm`` optional: pre-norm when given).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> block = gm.bricks.Residual(gm.bricks.Linear(4, 4, rngs=nnx.Rngs(0)))
        >>> block(jnp.zeros((2, 4))).shape
        (2, 4)
    """

    def __init__(self, branch: Callable[[jax.Array], jax.Array], *,
                 norm: Callable[[jax.Array], jax.Array] | None = None) -> None:
        if not callable(branch):
            raise TypeError(f"Residual(branch): expected a brick or callable, got {branch!r}")
        self.branch = branch
        self.norm = norm

    @application(inputs=["input_"], outputs=["residual"])
    def residual(self, input_: jax.Array) -> jax.Array:
        """The branch's output, before it is added back."""
        return self.branch(input_ if self.norm is None else self.norm(input_))

    @application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        return input_ + self.residual(input_)


class TransformerBlock(Brick):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``
    (``attention``, ``mlp``: :class:`Residual` bricks around a :class:`MultiHeadAttention`
    and an :class:`MLP` ``[features, mlp_features, features]`` with GELU).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> block = gm.bricks.TransformerBlock(8, 2, 16, causal=True, rngs=nnx.Rngs(0))
        >>> block(jnp.ones((3, 5, 8))).shape
        (3, 5, 8)
    """

    def __init__(self, features: int, num_heads: int, mlp_features: int, *,
                 causal: bool = False,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
                 rngs: nnx.Rngs) -> None:
        check_sizes("TransformerBlock", features=features, num_heads=num_heads,
                    mlp_features=mlp_features)
        self.attention = Residual(
            MultiHeadAttention(num_heads, features, causal=causal, rngs=rngs),
            norm=LayerNorm(features, rngs=rngs))
        self.mlp = Residual(MLP([features, mlp_features, features], activation=activation,
                                rngs=rngs), norm=LayerNorm(features, rngs=rngs))

    @application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        return self.mlp(self.attention(input_))
