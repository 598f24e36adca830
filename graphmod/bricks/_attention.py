"""``MultiHeadAttention``: scaled dot-product attention whose weights are an application
output, so attention dropout (or any rewrite of the weights) is a manager, not a layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from graphmod._core._bricks._application import application
from graphmod._core._bricks._brick import Brick
from graphmod.bricks._checks import check_sizes
from graphmod.bricks._linear import Linear


def causal_mask(length: int) -> jax.Array:
    """``(1, length, length)`` booleans, True where a position may attend (itself and
    earlier ones), for :class:`MultiHeadAttention`'s ``mask``.

    Examples:
        >>> import graphmod as gm
        >>> gm.bricks.causal_mask(3)[0].astype(int).tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    return jnp.tril(jnp.ones((1, length, length), bool))


class MultiHeadAttention(Brick):
    """Multi-head scaled dot-product attention, as ``flax.nnx.MultiHeadAttention`` (same
    math: queries scaled by ``1/sqrt(head_dim)``, a softmax over the keys, masked positions
    at the dtype's lowest value).

    ``apply(inputs_q, inputs_kv=None, mask=None)`` projects queries, keys and values with
    the ``query``, ``key`` and ``value`` Linear layers (``(in, qkv_features)`` weights, split
    into ``num_heads`` heads), attends, and projects back with ``out``. The weights come from
    the application ``attention_weights(query, key, mask) -> weights`` (shape ``(..., heads,
    q_length, kv_length)``): ``managers.Dropout(0.1, bricks=[MultiHeadAttention],
    applications=["attention_weights"], roles=[OUTPUT])`` is attention dropout. ``causal``:
    self-attention sees only earlier positions when no ``mask`` is given.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> attention = gm.bricks.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))
        >>> attention(jnp.ones((3, 5, 8))).shape
        (3, 5, 8)
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, *, causal: bool = False,
                 use_bias: bool = True, rngs: nnx.Rngs) -> None:
        qkv_features = qkv_features or in_features
        out_features = out_features or in_features
        check_sizes("MultiHeadAttention", num_heads=num_heads, in_features=in_features,
                    qkv_features=qkv_features, out_features=out_features)
        if qkv_features % num_heads:
            raise ValueError(f"MultiHeadAttention: qkv_features={qkv_features} must be a "
                             f"multiple of num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = qkv_features // num_heads
        self.causal = causal
        self.query, self.key, self.value = (
            Linear(in_features, qkv_features, use_bias=use_bias, rngs=rngs) for _ in range(3))
        self.out = Linear(qkv_features, out_features, use_bias=use_bias, rngs=rngs)

    def _heads(self, x: jax.Array) -> jax.Array:
        return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)

    @application(inputs=["query", "key"], outputs=["weights"])
    def attention_weights(self, query: jax.Array, key: jax.Array,
                          mask: jax.Array | None = None) -> jax.Array:
        """Softmax over the keys of ``query · key / sqrt(head_dim)``, per head."""
        query = query / jnp.sqrt(self.head_dim).astype(query.dtype)
        logits = jnp.einsum("...qhd,...khd->...hqk", query, key)
        if mask is not None:
            logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        return jax.nn.softmax(logits, axis=-1)

    @application(inputs=["inputs_q", "inputs_kv"], outputs=["output"])
    def apply(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None,
              mask: jax.Array | None = None) -> jax.Array:
        kv = inputs_q if inputs_kv is None else inputs_kv
        if mask is None and self.causal:
            mask = causal_mask(inputs_q.shape[-2])
        query, key = self._heads(self.query(inputs_q)), self._heads(self.key(kv))
        value = self._heads(self.value(kv))
        weights = self.attention_weights(query, key, mask)
        mixed = jnp.einsum("...hqk,...khd->...qhd", weights, value)
        return self.out(mixed.reshape(*mixed.shape[:-2], -1))
