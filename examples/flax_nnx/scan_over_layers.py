# From google/flax, examples/nnx_toy_examples/06_scan_over_layers.py (commit 18f8f311c275,
# file last changed in 571c9e40b496), copied unmodified: the two model classes and their
# imports (the script's demo lines at the end are left out).
# Copyright 2024 The Flax Authors. Licensed under the Apache License, Version 2.0
# (http://www.apache.org/licenses/LICENSE-2.0).
"""Flax's scan-over-layers MLP (NNX), as published in google/flax ``examples/nnx_toy_examples``.

``ScanMLP`` builds ``n_layers`` ``Block`` s (``nnx.Linear``, ``nnx.BatchNorm``, its own
``nnx.Dropout(0.5)`` keeping an ``nnx.Rngs``) stacked on a leading layer axis with
``nnx.vmap`` + ``nnx.split_rngs`` at construction, and applies them with ``nnx.scan``.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> model = ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0))
>>> model.layers.linear.kernel.shape
(3, 4, 4)
>>> model.eval()
>>> model(jnp.ones((2, 4))).shape
(2, 4)
"""

import jax
from flax import nnx


class Block(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(dim, dim, rngs=rngs)
    self.bn = nnx.BatchNorm(dim, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x: jax.Array):
    return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
  """
  An MLP that uses `vmap` during `__init__` to create a Block instance
  with an additional `layer` axis, and `scan` during `__call__` to apply
  the sequence of layers iteratively over the input / output `x`.
  """

  def __init__(self, dim: int, *, n_layers: int, rngs: nnx.Rngs):
    self.n_layers = n_layers

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(axis_size=n_layers)
    def create_block(rngs: nnx.Rngs):
      return Block(dim, rngs=rngs)

    self.layers = create_block(rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    @nnx.scan
    def scan_fn(x: jax.Array, block: Block):
      x = block(x)
      return x, None

    x, _ = scan_fn(x, self.layers)

    return x
