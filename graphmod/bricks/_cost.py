"""Cost bricks: their targets are tagged ``TARGET`` and their result ``COST``, so managers
can rewrite the labels (``managers.LabelSmoothing``) and filters can select the cost."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from graphmod._core._bricks._application import application
from graphmod._core._bricks._brick import Brick


class SoftmaxCrossEntropy(Brick):
    """The mean softmax cross-entropy of ``logits`` against ``targets``: integer class
    labels (``optax.softmax_cross_entropy_with_integer_labels``) or probabilities over the
    last axis, e.g. one-hot or smoothed (``optax.softmax_cross_entropy``).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> cost = gm.bricks.SoftmaxCrossEntropy()
        >>> round(float(cost(jnp.zeros((2, 4)), jnp.array([0, 3]))), 4)  # log(4)
        1.3863
    """

    @application(inputs=["logits"], targets=["targets"], outputs=["cost"], costs=["cost"])
    def apply(self, logits: jax.Array, targets: jax.Array) -> jax.Array:
        if jnp.issubdtype(jnp.result_type(targets), jnp.integer):
            if jnp.shape(targets) != jnp.shape(logits)[:-1]:
                raise ValueError(
                    f"SoftmaxCrossEntropy: integer targets of shape {jnp.shape(targets)} must "
                    f"match logits of shape {jnp.shape(logits)} without its last axis")
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        if jnp.shape(targets) != jnp.shape(logits):
            raise ValueError(f"SoftmaxCrossEntropy: probability targets of shape "
                             f"{jnp.shape(targets)} must match logits {jnp.shape(logits)}")
        return optax.softmax_cross_entropy(logits, targets).mean()


class SquaredError(Brick):
    """The mean squared error of ``predictions`` against ``targets`` of the same shape.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> float(gm.bricks.SquaredError()(jnp.array([1.0, 3.0]), jnp.array([0.0, 1.0])))
        2.5
    """

    @application(inputs=["predictions"], targets=["targets"], outputs=["cost"],
                 costs=["cost"])
    def apply(self, predictions: jax.Array, targets: jax.Array) -> jax.Array:
        if jnp.shape(targets) != jnp.shape(predictions):
            raise ValueError(f"SquaredError: targets of shape {jnp.shape(targets)} must match "
                             f"predictions of shape {jnp.shape(predictions)}")
        return jnp.mean(jnp.square(predictions - targets))
