"""``LayerNorm``: normalization over the feature axis, mirroring ``flax.nnx.LayerNorm``."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from graphmod._core._bricks._application import application
from graphmod._core._bricks._brick import Brick
from graphmod._core._number_checks import is_real_number
from graphmod._core._tracing._variables import Bias, Parameter
from graphmod.bricks._checks import check_sizes


class LayerNorm(Brick):
    """Normalizes each example over its last axis, then scales and shifts it (Ba et al.).

    ``output = (input_ - mean) / sqrt(var + epsilon) * scale + bias``, with the mean and
    the biased variance over the last axis, computed in at least float32. The result has
    the dtype of ``input_`` promoted with the parameters used, as ``flax.nnx.LayerNorm``
    (whose ``scale`` and ``bias`` these are).

    Args:
        num_features: size of the last input axis.
        epsilon: added to the variance for numerical stability.
        use_scale: whether to learn ``scale`` (a ``PARAMETER``, ones at init).
        use_bias: whether to learn ``bias`` (a ``BIAS``, zeros at init).
        scale_init, bias_init: initializers.
        rngs: NNX random streams (``params`` is used).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> norm = gm.bricks.LayerNorm(3, rngs=nnx.Rngs(0))
        >>> y = norm(jnp.array([[1.0, 2.0, 3.0]]))
        >>> [round(v, 3) for v in y[0].tolist()], norm.scale.role, norm.bias.role
        ([-1.225, 0.0, 1.225], PARAMETER, BIAS)
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        use_scale: bool = True,
        use_bias: bool = True,
        scale_init: Callable = nnx.initializers.ones_init(),
        bias_init: Callable = nnx.initializers.zeros_init(),
        rngs: nnx.Rngs,
    ) -> None:
        check_sizes("LayerNorm", num_features=num_features)
        if not is_real_number(epsilon) or not epsilon > 0:
            raise ValueError(f"LayerNorm(epsilon={epsilon!r}): must be a float > 0")
        self.num_features = num_features
        self.epsilon = float(epsilon)
        self.use_scale = use_scale
        self.use_bias = use_bias
        self.scale = Parameter(scale_init(rngs.params(), (num_features,))) if use_scale \
            else None
        self.bias = Bias(bias_init(rngs.params(), (num_features,))) if use_bias else None

    @application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        shape = jnp.shape(input_)
        if not shape or shape[-1] != self.num_features:
            raise ValueError(f"LayerNorm.apply: input_ of shape {shape} must end with "
                             f"num_features={self.num_features}")
        params = [p[...] for p in (self.scale, self.bias) if p is not None]
        dtype = jnp.result_type(input_, *params)
        x = jnp.asarray(input_, jnp.promote_types(jnp.result_type(input_), jnp.float32))
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        if self.scale is not None:
            y = y * self.scale[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(dtype)
