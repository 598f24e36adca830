"""``Embedding``: a lookup table of vectors, mirroring ``flax.nnx.Embed``."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from graphmod._core._bricks._application import application
from graphmod._core._bricks._brick import Brick
from graphmod._core._tracing._variables import Weight
from graphmod.bricks._checks import check_sizes


class Embedding(Brick):
    """Maps integer ids to rows of the table ``W`` of shape ``(num_embeddings, features)``.

    ``apply(input_)`` returns ``W[input_]`` with shape ``(*input_.shape, features)``, like
    ``flax.nnx.Embed`` (whose ``embedding`` is ``W``); ids out of range give NaN, as
    ``jnp.take``. ``attend(query)`` returns ``query @ W.T``, the logits of tied output
    embeddings. ``W`` is a ``WEIGHT``, so weight managers (noise, dropout) rewrite it.

    Args:
        num_embeddings: number of rows (the vocabulary size).
        features: size of each embedding vector.
        embedding_init: initializer of ``W`` (Flax's default: variance scaling, fan-in).
        rngs: NNX random streams (``params`` is used).

    Raises:
        ValueError: a size is not a positive int.
        TypeError: ``apply`` is given ids that are not integers.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> embed = gm.bricks.Embedding(10, 4, rngs=nnx.Rngs(0))
        >>> ids = jnp.array([[1, 2, 3]])
        >>> embed(ids).shape, embed.W.role
        ((1, 3, 4), WEIGHT)
        >>> embed.attend(embed(ids)).shape
        (1, 3, 10)
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        embedding_init: Callable = nnx.initializers.variance_scaling(
            1.0, "fan_in", "normal", out_axis=0),
        rngs: nnx.Rngs,
    ) -> None:
        check_sizes("Embedding", num_embeddings=num_embeddings, features=features)
        self.num_embeddings = num_embeddings
        self.features = features
        self.W = Weight(embedding_init(rngs.params(), (num_embeddings, features)))

    @application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        dtype = jnp.result_type(input_)
        if not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(
                f"Embedding.apply: input_ must hold integer ids, got dtype {dtype}; cast it "
                "with input_.astype(jnp.int32)"
            )
        return jnp.take(self.W[...], input_, axis=0)

    @application(inputs=["query"], outputs=["output"])
    def attend(self, query: jax.Array) -> jax.Array:
        shape = jnp.shape(query)
        if not shape or shape[-1] != self.features:
            raise ValueError(f"Embedding.attend: query of shape {shape} must end with "
                             f"features={self.features}")
        return query @ self.W[...].T
