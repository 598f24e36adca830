"""Flax's Gemma (NNX), as published in google/flax ``examples/gemma`` (commit 18f8f311c275).

``transformer.Transformer`` is Gemma's text decoder: an ``nnx.Embed`` subclass tied with its
``attend`` for the logits, ``nnx.List`` of ``modules.Block`` (RMSNorm, ``Attention`` with
``nnx.Einsum`` projections, grouped-query heads, optional QK norm, RoPE, local sliding-window
or global attention, a key-value cache passed in and returned; ``FeedForward`` with gated
``nnx.Linear``), its own ``nnx.Dropout`` layers. ``transformer_cfg.TransformerConfig`` has
the published sizes (``gemma3_270m``, ...); every size can be overridden, so tests build
tiny ones. The modules are the published files, their sibling imports made relative and
``jaxtyping.Array`` read as ``jax.Array`` (each file's first lines say what changed).

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from examples.flax_nnx.gemma import transformer, transformer_cfg
>>> config = transformer_cfg.TransformerConfig.gemma3_270m(
...     num_layers=1, num_embed=16, embed_dim=8, hidden_dim=16, num_heads=2, head_dim=4,
...     num_kv_heads=1, sliding_window_size=4)
>>> with nnx.use_eager_sharding(False):  # its sharding annotations, without a mesh
...     model = transformer.Transformer(config, rngs=nnx.Rngs(0))
>>> model.eval()
>>> tokens = jnp.ones((1, 3), jnp.int32)
>>> mask = transformer.make_causal_attn_mask(tokens > 0)
>>> logits, _ = model(tokens, jnp.arange(3)[None], None, mask)
>>> logits.shape
(1, 3, 16)
"""
