"""Managers of the training examples: ``LabelSmoothing`` rewrites the ``TARGET`` inputs of
cost applications, ``Mixup`` mixes inputs and targets of pairs of examples.

Sharp edges:

- Integer labels become one-hot rows, which needs ``num_classes=``.
- ``Mixup`` mixes along axis 0 of every argument of the call it selects, with one
  permutation per call: every selected argument's leading axis must be the same batch.
- ``Mixup`` needs an application that takes both the examples and their targets; a cost
  computed outside the model's bricks (``optax`` on the logits) has no targets to mix.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod import roles
from graphmod.typing import HookContext
from managers._checks import ManagerOptions, default_filter, require_floating


class LabelSmoothing(gm.Manager):
    """Label smoothing (Szegedy et al., 2016) of the targets of cost applications in
    training, as ``optax.smooth_labels``: ``(1 - alpha) * targets + alpha / classes``.

    Selects every ``TARGET`` input by default (``graphmod.bricks.SoftmaxCrossEntropy``'s
    ``targets``). Probability targets keep their shape; integer labels become smoothed
    one-hot rows over ``num_classes`` (then required: integer labels do not say how many
    classes there are). Labels tagged twice on their way (an application with
    ``targets=["y"]`` around its cost brick, as ``Mixup`` needs) are smoothed once, where
    they are first selected (``once``). Inference is the identity; ``alpha`` may be
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
    kinds = ("augmentation",)  # Selective Backprop ranks the examples before
    once = True  # targets passed from a classifier's application into its cost: smoothed once

    def __init__(self, alpha: float | gm.Dynamic, *, num_classes: int | None = None,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**default_filter(kwargs, roles=[roles.TARGET]))
        self.alpha, self.num_classes = _configured(self, alpha, num_classes,
                                                   lambda a: 0.0 <= a <= 1.0, "a float in [0, 1]")

    def rewrite_input(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        if not call.training:
            return value
        value = _one_hot(self, call, name, value)
        alpha = jnp.asarray(self.hp("alpha"), value.dtype)
        return (1 - alpha) * value + alpha / value.shape[-1]


class Mixup(gm.Manager):
    """Mixup (Zhang et al., 2018) on the inputs and targets of one application: in
    training, every ``INPUT`` and ``TARGET`` argument of a selected call becomes
    ``lam * v + (1 - lam) * v[perm]``, with one ``lam ~ Beta(alpha, alpha)`` and one
    permutation ``perm`` of the batch per call and step, shared by the call's arguments
    (``call.rng(per_variable=False)``), so each mixed example's target is its inputs' mix.

    Select the application that takes both the examples and their targets (a brick with
    ``@application(inputs=[...], targets=[...])`` around the model and its cost) with
    ``bricks=`` or ``applications=``: the filter must be given, since every layer's input
    is an ``INPUT`` too, and the bricks inside the selected one then see the mixed values.
    Integer labels become one-hot rows over ``num_classes``. A cost linear in its targets
    (cross-entropy) then equals ``lam * cost(y) + (1 - lam) * cost(y[perm])``. Inference
    is the identity; ``alpha`` may be :func:`graphmod.dynamic`.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> class Classifier(gm.Brick):
        ...     def __init__(self):
        ...         self.linear = gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0))
        ...         self.cost = gm.bricks.SoftmaxCrossEntropy()
        ...     @gm.application(inputs=["x"], targets=["y"], outputs=["cost"])
        ...     def apply(self, x, y):
        ...         return self.cost(self.linear(x), y)
        >>> mixup = managers.Mixup(0.4, num_classes=2, bricks=[Classifier])
        >>> program = gm.compile(lambda m, x, y: m(x, y), Classifier(), managers=[mixup])
        >>> x, y = jnp.eye(4, 3), jnp.array([0, 1, 0, 1])
        >>> out, _ = program.train(program.init(x, y), x, y, rng=jax.random.key(0))
        >>> [(r.path, r.name) for r in program.rewrites.train]
        [('/', 'x'), ('/', 'y')]
    """

    hparams = ("alpha",)
    kinds = ("augmentation",)  # Selective Backprop ranks the examples before

    def __init__(self, alpha: float | gm.Dynamic, *, num_classes: int | None = None,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        if not any(kwargs.get(f) is not None for f in ("bricks", "applications", "path",
                                                      "filter")):
            raise TypeError(
                "Mixup: name the application whose inputs and targets it mixes with bricks=, "
                "applications= or path= (every layer's input is an INPUT too), e.g. "
                "Mixup(0.2, bricks=[Classifier])")
        if kwargs.get("roles") is None and kwargs.get("filter") is None:
            kwargs["roles"] = [roles.INPUT, roles.TARGET]
        super().__init__(**kwargs)
        self.alpha, self.num_classes = _configured(
            self, alpha, num_classes, lambda a: a > 0,
            "a float > 0 (the Beta distribution's concentration; 0.2-0.4 is usual)")

    # A gm.ApplicationCall: its rng(per_variable=False), which HookContext does not name.
    def rewrite_input(self, call: gm.ApplicationCall, name: str, value: jax.Array
                      ) -> jax.Array:
        if not call.training:
            return value
        if call.role is not None and call.role.is_a(roles.TARGET):
            value = _one_hot(self, call, name, value)
        require_floating(self, call, name, value)  # token ids cannot be mixed
        if jnp.ndim(value) == 0:
            raise ValueError(f"Mixup {self.name!r}: {name!r} of {call.path} is a scalar; "
                             "it mixes examples along axis 0 of batched values")
        weight_key, order_key = jax.random.split(call.rng(per_variable=False))
        alpha = jnp.asarray(self.hp("alpha"), jnp.float32)
        lam = jax.random.beta(weight_key, alpha, alpha).astype(value.dtype)
        perm = jax.random.permutation(order_key, value.shape[0])
        return lam * value + (1 - lam) * value[perm]


def _configured(manager: gm.Manager, alpha: float | gm.Dynamic, num_classes: int | None,
                valid: Callable[[float], bool], requirement: str
                ) -> tuple[float | gm.Dynamic, int | None]:
    """``alpha`` (a number, or a dynamic one) and ``num_classes``, checked."""
    value = alpha.value if isinstance(alpha, gm.Dynamic) else alpha
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not valid(value):
        raise ValueError(f"{type(manager).__name__}(alpha={alpha!r}): must be {requirement}")
    if num_classes is not None and (isinstance(num_classes, bool)
                                    or not isinstance(num_classes, int) or num_classes < 2):
        raise ValueError(f"{type(manager).__name__}(num_classes={num_classes!r}): must be an "
                         "int >= 2")
    return alpha, num_classes


def _one_hot(manager: LabelSmoothing | Mixup, call: HookContext, name: str,
             value: jax.Array) -> jax.Array:
    """Integer labels as one-hot rows over the manager's ``num_classes``; others as given."""
    if not jnp.issubdtype(jnp.result_type(value), jnp.integer):
        return value
    if manager.num_classes is None:
        raise ValueError(
            f"{type(manager).__name__} {manager.name!r}: {name!r} of {call.path} holds "
            "integer labels; pass num_classes= to use them as one-hot rows")
    return jax.nn.one_hot(value, manager.num_classes)
