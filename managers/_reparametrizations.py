"""Reparametrizations: read-time rewrites of weights (the stored parameter never changes).

``WeightNorm``, ``WeightStandardization``, ``SpectralNorm`` and ``MaxNorm`` rewrite a weight
each time an application reads it; the optimizer keeps training the stored weight (and the
manager's own variables), so removing the manager gives back the raw weights. Unless their
filter chooses variables (``roles=``, ``path=``, ``variable_name=``, ``name_regex=`` or
``filter=``) they rewrite the weights (role ``WEIGHT``) of the applications it selects:
``WeightNorm(bricks=[nnx.Conv])`` normalizes every convolution's kernel, not its bias.

Sharp edges
    The output axis of a weight is its last one (``Linear``'s ``W`` is ``(in, out)``, a
    convolution's ``(..., in, out)``); the norms are over the other axes, per output unit.
    Flax's ``nnx.LinearGeneral`` has several output axes (its ``out_features``) and an
    ``nnx.Einsum`` kernel's inputs are the axes its equation contracts (Gemma's query
    ``BTD,NDH->BTNH``: one norm over ``D`` per head and feature, ``g`` of shape ``(N, H)``):
    see ``managers._layout``.
    A weight read by two applications (tied weights) is rewritten in each of them:
    ``SpectralNorm`` then runs its power iteration once per call. ``SpectralNorm``'s
    gradient holds the iteration's vectors constant (as Flax does). ``MaxNorm`` clips at
    read time with a gradient through the rescaling; Keras projects the stored weight
    after each update instead, so the stored weight may grow past ``max_norm`` here.
"""

from __future__ import annotations

import numbers
from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod import roles
from graphmod.typing import HookContext
from managers._checks import ManagerOptions, roles_by_default
from managers._layout import weight_layout


def _positive(cls: str, argument: str, value: float | gm.Dynamic) -> None:
    number = value.value if isinstance(value, gm.Dynamic) else value
    if isinstance(number, bool) or not isinstance(number, numbers.Real) or not number > 0:
        raise ValueError(f"{cls}({argument}={value!r}): must be a float > 0")


def _norm(value: jax.Array, axes: tuple[int, ...], epsilon: float) -> jax.Array:
    """The L2 norm over ``axes`` (kept), ``epsilon`` added under the root."""
    return jnp.sqrt(jnp.sum(jnp.square(value), axes, keepdims=True) + epsilon)


class WeightNorm(gm.Manager):
    """Weight normalization (Salimans & Kingma, 2016): ``W = g * V / ||V||`` per output
    unit, ``V`` the stored weight and ``g`` a parameter the manager owns.

    ``g`` starts at ``||V||``, so the function is unchanged at init; it lives at
    ``variables["managers"]["weight_norm"][<brick path>][<weight name>]["g"]``. As
    ``flax.nnx.WeightNorm`` (which starts its scale at 1), the norm is
    ``sqrt(sum(V ** 2) + epsilon)`` over every axis but the last.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0))
        >>> with managers.WeightNorm(roles=[gm.roles.WEIGHT]):
        ...     program = gm.compile(lambda m, x: m(x), lin)
        >>> x = jnp.ones((1, 3))
        >>> variables = program.init(x)
        >>> variables["managers"]["weight_norm"]["/"]["W"]["g"].shape
        (2,)
        >>> bool(jnp.allclose(program.infer(variables, x), lin(x), atol=1e-6))
        True
    """

    kinds = ("parameter_rewrite",)  # EMA and a cost on the stored weight go first

    def __init__(self, *, epsilon: float = 1e-12, **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**roles_by_default(kwargs))
        _positive("WeightNorm", "epsilon", epsilon)
        self.epsilon = epsilon

    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        layout = weight_layout(self, call, name, value)
        norm = lambda w: _norm(w, layout.fan_in, self.epsilon).reshape(layout.units_shape)
        g = call.variable("g", norm, role=roles.PARAMETER)
        return value * layout.per_unit(g.value / norm(value)).astype(value.dtype)


class WeightStandardization(gm.Manager):
    """Weight standardization (Qiao et al., 2019): each output unit's weights shifted to
    zero mean and scaled to unit variance over their inputs, ``(W - mean) / sqrt(var +
    epsilon)``. Pair it with a normalization of the outputs as the paper does. With
    ``gain=True`` it owns a PARAMETER ``gain`` per output unit (starting at 1) that scales
    the standardized weights, as NF-Nets' scaled weight standardization does.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(4, 2, rngs=nnx.Rngs(0))
        >>> with managers.WeightStandardization(roles=[gm.roles.WEIGHT]):
        ...     program = gm.compile(lambda m, x: m(x), lin)
        >>> x = jnp.eye(4)
        >>> w = program.infer(program.init(x), x) - lin.b[...]  # the rows of W as read
        >>> [abs(round(float(v), 4)) for v in w.mean(0)], [round(float(v), 3) for v in w.std(0)]
        ([0.0, 0.0], [1.0, 1.0])
    """

    kinds = ("parameter_rewrite",)  # EMA and a cost on the stored weight go first

    def __init__(self, *, epsilon: float = 1e-5, gain: bool = False,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**roles_by_default(kwargs))
        _positive("WeightStandardization", "epsilon", epsilon)
        if not isinstance(gain, bool):
            raise TypeError(f"WeightStandardization(gain={gain!r}): expected True or False")
        self.epsilon = epsilon
        self.gain = gain

    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        layout = weight_layout(self, call, name, value)
        # Centred before the variance, as by hand: XLA orders that step's fusions as the
        # hand-written one's; variance first ran 4% slower, same flops and fusions.
        centred = value - value.mean(layout.fan_in, keepdims=True)
        var = value.var(layout.fan_in, keepdims=True)  # one jitted jnp.var, as by hand
        scale = jax.lax.rsqrt(var + self.epsilon)
        if self.gain:
            gain = call.variable("gain", lambda: jnp.ones(layout.units_shape),
                                 role=roles.PARAMETER)
            scale = scale * layout.per_unit(gain.value)
        return (centred * scale).astype(value.dtype)


class SpectralNorm(gm.Manager):
    """Spectral normalization (Miyato et al., 2018): ``W / sigma``, ``sigma`` the largest
    singular value of ``W`` (read as a matrix ``(fan_in, units)``), estimated by power
    iteration.

    Owns, per weight, the iteration's vector ``u`` and the estimate ``sigma`` (STATE). A
    training step runs ``steps`` iterations from the stored ``u`` (no gradient through
    them), divides by the new estimate and stores ``u`` and ``sigma``, as
    ``flax.nnx.SpectralNorm`` does; inference divides by the stored ``sigma``. ``u`` starts
    at a fixed unit vector (all ones, normalized), ``sigma`` at 1.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0))
        >>> with managers.SpectralNorm(roles=[gm.roles.WEIGHT]):
        ...     program = gm.compile(lambda m, x: m(x).sum(), lin)
        >>> variables = program.init(jnp.ones((1, 3)))
        >>> sorted(variables["managers"]["spectral_norm"]["/"]["W"])
        ['sigma', 'u']
    """

    kinds = ("parameter_rewrite",)  # EMA and a cost on the stored weight go first

    def __init__(self, *, steps: int = 1, epsilon: float = 1e-12,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**roles_by_default(kwargs))
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"SpectralNorm(steps={steps!r}): must be a positive int")
        _positive("SpectralNorm", "epsilon", epsilon)
        self.steps = steps
        self.epsilon = epsilon

    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        layout = weight_layout(self, call, name, value)
        out = layout.units_size
        u = call.variable("u", lambda: jnp.full((1, out), out ** -0.5, jnp.float32))
        sigma = call.variable("sigma", lambda: jnp.ones((), jnp.float32))
        if not call.training:
            return value / sigma.value.astype(value.dtype)
        matrix = layout.matrix(value).astype(jnp.float32)
        normalize = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x) + self.epsilon)
        vector = u.value
        for _ in range(self.steps):
            left = normalize(vector @ matrix.T)
            vector = normalize(left @ matrix)
        vector, left = jax.lax.stop_gradient(vector), jax.lax.stop_gradient(left)
        estimate = (left @ matrix @ vector.T)[0, 0]
        u.value, sigma.value = vector, jax.lax.stop_gradient(estimate)
        return (value / jnp.where(estimate != 0, estimate, 1).astype(value.dtype))


class MaxNorm(gm.Manager):
    """A max-norm constraint (Srivastava et al., 2014): each output unit's weight vector
    is scaled down to norm ``max_norm`` when it is longer, at read time.

    ``axis`` (an int or a tuple of ints) names the axes each norm runs over, as Keras'
    ``MaxNorm(axis=)``; the default, None, is the weight's inputs (every axis but the last:
    a Linear's inputs, a convolution's window and inputs; an ``nnx.Einsum``'s contracted
    axes), one norm per output unit. ``max_norm`` may be :func:`graphmod.dynamic`. The
    gradient flows through the rescaling (a read-time
    constraint, not a projection of the stored weight after each step as Keras does).

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0), use_bias=False)
        >>> with managers.MaxNorm(0.1, roles=[gm.roles.WEIGHT]):
        ...     program = gm.compile(lambda m, x: m(x), lin)
        >>> x = jnp.eye(3)
        >>> norms = jnp.linalg.norm(program.infer(program.init(x), x), axis=0)
        >>> bool(jnp.all(norms <= 0.1 + 1e-6))
        True
    """

    hparams = ("max_norm",)
    kinds = ("parameter_rewrite",)  # EMA and a cost on the stored weight go first

    def __init__(self, max_norm: float | gm.Dynamic, *,
                 axis: int | tuple[int, ...] | None = None,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**roles_by_default(kwargs))
        _positive("MaxNorm", "max_norm", max_norm)
        axes = (axis,) if isinstance(axis, int) else axis
        if axis is not None and not (isinstance(axes, tuple | list) and axes and all(
                isinstance(a, int) and not isinstance(a, bool) for a in axes)):
            raise TypeError(f"MaxNorm(axis={axis!r}): expected None, an int or a tuple of ints")
        self.max_norm = max_norm
        self.axis = axis

    def rewrite_parameter(self, call: HookContext, name: str,
                          value: jax.Array) -> jax.Array:
        axes = weight_layout(self, call, name, value).fan_in
        if self.axis is not None:
            axes = _given_axes(self, name, value, self.axis)
        norms = _norm(value, axes, 0.0)
        limit = jnp.asarray(self.hp("max_norm"), value.dtype)
        return value * jnp.minimum(1, limit / jnp.maximum(norms, 1e-12)).astype(value.dtype)


def _given_axes(manager: MaxNorm, name: str, value: jax.Array,
                axis: int | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """``axis`` as non-negative axes of ``value``; raises naming the manager if one is out
    of range."""
    ndim = jnp.ndim(value)
    given = (axis,) if isinstance(axis, int) else tuple(axis)
    if any(not -ndim <= a < ndim for a in given):
        raise ValueError(
            f"MaxNorm {manager.name!r}(axis={axis!r}) selected {name!r} of shape "
            f"{jnp.shape(value)}: an axis is out of range. Give axes in "
            f"[-{ndim}, {ndim}) or axis=None (every axis but the last).")
    return tuple(sorted({a % ndim for a in given}))
