"""``StochasticDepth``: drops whole residual branches per example (Huang et al., 2016)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np

import graphmod as gm
from graphmod import roles
from graphmod.typing import HookContext, PyTree, WrapContext
from managers._checks import ManagerOptions, default_filter, require_floating


class StochasticDepth(gm.Manager):
    """In training, each example's residual branch is kept with probability ``1 - rate``
    and scaled by ``1 / (1 - rate)`` (so its expected value is unchanged), or dropped;
    inference is the identity. Acts on the output of ``graphmod.bricks.Residual``'s
    ``residual`` application by default (every residual block: a ``TransformerBlock`` has
    two), one draw per example along axis 0. ``rate`` may be :func:`graphmod.dynamic`.

    A Flax module it selects that is not a graphmod brick (``bricks=[ResBlock]``: an
    unmodified Flax block returning ``x + branch(x)``; a bonsai-style block adding two
    branches; Gemma's ``Block``) is taken as a block whose output is its first input plus
    branches: the branches, ``output - input``, are what is dropped, so a dropped
    example's block returns its input exactly (the identity path is never dropped). The
    output of a graphmod brick's application is taken as a branch (``Residual.residual``
    declares one) unless ``block=True``.

    Args:
        rate: the probability of dropping an example's branch, in [0, 1].
        block: whether a selected call's output is a block's (its first input plus its
            branches) rather than a branch's; default: a block for a Flax module that is
            not a graphmod brick, a branch for a graphmod brick.
        **kwargs: the filter (default: ``Residual``'s ``residual`` output) and ``name``.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> block = gm.bricks.Residual(gm.bricks.Linear(4, 4, rngs=nnx.Rngs(0)))
        >>> program = gm.compile(lambda m, x: m(x), block,
        ...                      managers=[managers.StochasticDepth(0.5)])
        >>> x = jnp.ones((6, 4))
        >>> out, _ = program.train(program.init(x), x, rng=jax.random.key(0))
        >>> sorted({bool(jnp.allclose(row, 1.0)) for row in out})  # some rows dropped
        [False, True]
        >>> class Block(nnx.Module):  # a Flax block as written, nothing graphmod's
        ...     def __init__(self):
        ...         self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        ...     def __call__(self, x):
        ...         return x + self.linear(x)
        >>> flax = gm.compile(lambda m, x: m(x), Block(),
        ...                   managers=[managers.StochasticDepth(1.0, bricks=[Block])])
        >>> out, _ = flax.train(flax.init(x), x, rng=jax.random.key(0))
        >>> bool((out == x).all())  # rate 1: every example's branch dropped
        True
    """

    hparams = ("rate",)

    def __init__(self, rate: float | gm.Dynamic, *, block: bool | None = None,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        super().__init__(**default_filter(kwargs, bricks=[gm.bricks.Residual],
                                          applications=["residual"], roles=[roles.OUTPUT]))
        value = rate.value if isinstance(rate, gm.Dynamic) else rate
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not 0.0 <= value <= 1.0:
            raise ValueError(f"StochasticDepth(rate={rate!r}): must be a float in [0, 1]")
        if block not in (None, True, False):
            raise TypeError(f"StochasticDepth(block={block!r}): expected True, False or None")
        self.rate = rate
        self.block = block

    def _active(self, call: HookContext) -> bool:
        return call.training and (isinstance(self.rate, gm.Dynamic) or self.rate != 0)

    def rewrite_output(self, call: HookContext, name: str, value: jax.Array) -> jax.Array:
        if self._is_block(call):  # ``wrap`` drops its branches
            return value
        require_floating(self, call, name, value)
        if not self._active(call):
            return value
        kept, scale = self._draw(call, name, value)
        return jnp.where(kept, value * scale, jnp.zeros((), value.dtype))

    def wrap(self, call: WrapContext, next: Callable[..., PyTree], args: tuple[PyTree, ...],
             kwargs: dict[str, PyTree]) -> PyTree:
        out = next(*args, **kwargs)
        if not (self._is_block(call) and self._active(call)):
            return out
        x = args[0] if args else None
        if not (isinstance(x, jax.Array | np.ndarray) and isinstance(out, jax.Array | np.ndarray)
                and x.shape == out.shape):
            raise ValueError(
                f"StochasticDepth {self.name!r}: {call.path} ({type(call.brick).__name__}."
                f"{call.application}) is taken as a residual block, output = input + branch, "
                f"but its first input {getattr(x, 'shape', type(x).__name__)} and its output "
                f"{getattr(out, 'shape', type(out).__name__)} differ; select the block whose "
                "output adds to its input, or pass block=False to drop the output itself")
        require_floating(self, call, "output", out)
        kept, scale = self._draw(call, "output", out)
        x = x.astype(out.dtype)
        # The identity path as it came, bitwise, where the branches are dropped.
        return jnp.where(kept, x + (out - x) * scale, x)

    def _draw(self, call: HookContext, name: str, value: jax.Array | np.ndarray
              ) -> tuple[jax.Array, jax.Array]:
        """Per example (axis 0): whether its branch is kept, and the scale ``1 / keep``
        (0 at rate 1, where nothing is kept)."""
        if jnp.ndim(value) < 1:
            raise ValueError(f"StochasticDepth {self.name!r}: {name!r} of {call.path} is a "
                             "scalar; it drops examples along axis 0 (the batch)")
        keep = 1.0 - jnp.asarray(self.hp("rate"), jnp.float32)
        kept = jax.random.bernoulli(call.rng(), keep, (value.shape[0],) + (1,) * (
            value.ndim - 1))
        scale = jnp.where(keep > 0, 1.0 / jnp.maximum(keep, 1e-12), 0.0)
        return kept, scale.astype(value.dtype)

    def _is_block(self, call: HookContext) -> bool:
        """Whether the call's output is a block's, its first input plus branches."""
        return not isinstance(call.brick, gm.Brick) if self.block is None else self.block
