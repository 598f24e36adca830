"""``LabelSmoothing``: rewrites the ``TARGET`` inputs of cost applications."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod import roles
from managers._checks import default_filter


class LabelSmoothing(gm.Manager):
    """Label smoothing (Szegedy et al., 2016) of the targets of cost applications in
    training, as ``optax.smooth_labels``: ``(1 - alpha) * targets + alpha / classes``.

    Selects every ``TARGET`` input by default (``graphmod.bricks.SoftmaxCrossEntropy``'s
    ``targets``). Probability targets keep their shape; integer labels become smoothed
    one-hot rows over ``num_classes`` (then required: integer labels do not say how many
    classes there are). Inference is the identity; ``alpha`` may be
    :func:`graphmod.dynamic`.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> cost = gm.bricks.SoftmaxCrossEntropy()
        >>> program = gm.compile(lambda m, logits, y: m(logits, y), cost,
        ...                      managers=[managers.LabelSmoothing(0.1, num_classes=4)])
        >>> logits, y = jnp.zeros((2, 4)), jnp.array([0, 3])
        >>> out, _ = program.train(program.init(logits, y), logits, y, rng=jax.random.key(0))
        >>> round(float(out), 4)  # uniform logits: log(4) whatever the smoothing
        1.3863
    """

    hparams = ("alpha",)

    def __init__(self, alpha: float | gm.Dynamic, *, num_classes: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**default_filter(kwargs, roles=[roles.TARGET]))
        value = alpha.value if isinstance(alpha, gm.Dynamic) else alpha
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not 0.0 <= value <= 1.0:
            raise ValueError(f"LabelSmoothing(alpha={alpha!r}): must be a float in [0, 1]")
        if num_classes is not None and (isinstance(num_classes, bool)
                                        or not isinstance(num_classes, int) or num_classes < 2):
            raise ValueError(f"LabelSmoothing(num_classes={num_classes!r}): must be an int >= 2")
        self.alpha = alpha
        self.num_classes = num_classes

    def rewrite_input(self, call: gm.ApplicationCall, name: str, value: jax.Array) -> jax.Array:
        if not call.training:
            return value
        if jnp.issubdtype(jnp.result_type(value), jnp.integer):
            if self.num_classes is None:
                raise ValueError(
                    f"LabelSmoothing {self.name!r}: {name!r} of {call.path} holds integer "
                    "labels; pass num_classes= to smooth them as one-hot rows")
            value = jax.nn.one_hot(value, self.num_classes)
        alpha = jnp.asarray(self.hp("alpha"), value.dtype)
        return (1 - alpha) * value + alpha / value.shape[-1]
