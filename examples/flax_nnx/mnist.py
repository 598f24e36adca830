# From google/flax, examples/mnist/train.py (the NNX CNN; commit 18f8f311c275, file last
# changed in 0ef9abb2e358), copied unmodified: only the model class and its imports.
# Copyright 2024 The Flax Authors. Licensed under the Apache License, Version 2.0
# (http://www.apache.org/licenses/LICENSE-2.0).
"""Flax's MNIST CNN (NNX), as published in google/flax ``examples/mnist``.

Two ``nnx.Conv`` with ``nnx.BatchNorm``, its own ``nnx.Dropout(0.025)`` twice, average
pooling and two ``nnx.Linear``; ``__call__(x, rngs)`` takes the images ``[batch, 28, 28, 1]``
and an ``nnx.Rngs`` for its dropout, and returns 10 logits.

>>> from flax import nnx
>>> import jax.numpy as jnp
>>> model = CNN(rngs=nnx.Rngs(0))
>>> model.eval()
>>> model(jnp.ones((2, 28, 28, 1)), nnx.Rngs(1)).shape
(2, 10)
"""

from functools import partial

from flax import nnx


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x
