"""``LoRA``: low-rank adapters on weights (Hu et al., 2021), without model surgery.

Sharp edges
    LoRA freezes nothing by itself: pass ``trainable=[lora]`` to ``graphmod.optimize`` or
    the base weights train too. A convolution's kernel ``(..., in, out)`` gets ``A`` of
    shape ``(fan_in, rank)``, the product reshaped to the kernel. An ``nnx.Einsum`` kernel
    whose contracted axes are not its first (Gemma's query ``NDH``, contracting ``D``) gets
    ``B`` of shape ``(rank, *kernel shape)`` with the contracted axes 1, so the stored
    pair says which axes are the inputs (``managers._layout``). A tied weight has one
    adapter, applied in each application that reads it, and :meth:`LoRA.merge` folds it
    in once.
"""

from __future__ import annotations

import math
import numbers
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod import roles
from graphmod.typing import Variables
from managers._checks import ManagerOptions, roles_by_default
from managers._layout import WeightLayout, weight_layout
from managers._merge import merged

if TYPE_CHECKING:  # QLoRA's module imports this one
    from managers._qlora import QLoRA


class LoRA(gm.Manager):
    """``W + (alpha / rank) * A @ B`` for each selected weight ``W``, read as a matrix
    ``(fan_in, units)`` (``A``: ``(fan_in, rank)``, ``B``: ``(rank, units)``, the product
    in ``W``'s shape), at read time. A weight's units are its last axis (``Linear``'s
    ``(in, out)``), an ``nnx.LinearGeneral``'s output axes, or the axes an ``nnx.Einsum``
    does not contract.

    The manager owns ``A`` (normal, scaled by ``1/sqrt(fan_in)``, drawn from ``seed`` and
    the weight's path; in a scan over layers also the layer's position) and ``B`` (zeros,
    so the model is unchanged at init) as PARAMETERs at
    ``variables["managers"]["lora"][<brick path>][<weight name>]``. Train only them with
    ``graphmod.optimize(program, tx, trainable=[lora])``: the base weights get no gradient
    and no optimizer state. :meth:`merge` folds the adapters into the weights for export.
    ``alpha`` may be :func:`graphmod.dynamic`. Unless its filter chooses variables (``roles=``,
    ``path=``, ``variable_name=``, ``name_regex=``, ``filter=``) it adapts the weights (role
    ``WEIGHT``) of the applications it selects.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> lora = managers.LoRA(rank=2, roles=[gm.roles.WEIGHT])
        >>> program = gm.compile(lambda m, x: m(x), lin, managers=[lora])
        >>> x = jnp.ones((1, 4))
        >>> variables = program.init(x)
        >>> {k: v.shape for k, v in variables["managers"]["lora"]["/"]["W"].items()}
        {'a': (4, 2), 'b': (2, 3)}
        >>> bool(jnp.allclose(program.infer(variables, x), lin(x)))  # B = 0: unchanged
        True
    """

    hparams = ("alpha",)
    kinds = ("parameter_rewrite",)  # EMA and a cost on the stored weight go first

    def __init__(self, rank: int, *, alpha: float | gm.Dynamic = 1.0, seed: int = 0,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        if "manager_name" not in kwargs and "name" not in kwargs:
            kwargs["manager_name"] = "lora"  # not the class name's snake case, lo_r_a
        super().__init__(**roles_by_default(kwargs))
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA(rank={rank!r}): must be a positive int")
        number = alpha.value if isinstance(alpha, gm.Dynamic) else alpha
        if isinstance(number, bool) or not isinstance(number, numbers.Real) \
                or not math.isfinite(number):
            raise ValueError(f"LoRA(alpha={alpha!r}): must be a finite float")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"LoRA(seed={seed!r}): expected an int")
        self.rank = rank
        self.alpha = alpha
        self.seed = seed

    def rewrite_parameter(self, call: gm.ApplicationCall, name: str,
                          value: jax.Array) -> jax.Array:
        return adapted(self, call, name, value)

    def merge(self, variables: Variables) -> Variables:
        """``variables`` with every adapter folded into its weight and this manager's
        entries removed: a program compiled without it gives the same outputs. The alpha
        folded in is the one stored in ``variables`` when ``alpha`` is dynamic. Raises
        :class:`graphmod.errors.VariablesMismatch` if ``variables`` hold none of its entries.

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm, managers
            >>> from flax import nnx
            >>> lin = gm.bricks.Linear(4, 3, rngs=nnx.Rngs(0))
            >>> lora = managers.LoRA(rank=2, roles=[gm.roles.WEIGHT])
            >>> program = gm.compile(lambda m, x: m(x), lin, managers=[lora])
            >>> variables = program.init(jnp.ones((1, 4)))
            >>> sorted(lora.merge(variables)["managers"])
            []
        """
        def fold(base: jax.Array, adapter: Mapping[str, jax.Array],
                 hparams: Mapping[str, jax.Array]) -> jax.Array:
            alpha = jnp.asarray(hparams.get("alpha", self.alpha), jnp.float32)
            update = alpha / self.rank * _product(adapter["a"], adapter["b"], base.shape)
            return base + update.astype(base.dtype)

        return merged(self, variables, fold, lambda adapter: adapter["a"].ndim - 2)


def adapted(manager: LoRA | QLoRA, call: gm.ApplicationCall, name: str,
            value: jax.Array) -> jax.Array:
    """``value + (alpha / rank) A @ B``, the adapters owned by ``manager`` (``rank``,
    ``seed`` and the ``alpha`` hyperparameter of a LoRA or QLoRA): ``A`` drawn from the
    parameter's path, ``B`` zero, so the adapted weight starts as ``value``. ``call`` is a
    ``gm.ApplicationCall``: its ``init_key``, which HookContext does not name, draws ``A``."""
    layout = weight_layout(manager, call, name, value)
    fan_in = layout.fan_in_size
    seed = zlib.crc32(f"{manager.seed}:{call.parameter}".encode()) & 0x7FFFFFFF
    a = call.variable("a", lambda: jax.random.normal(call.init_key(seed), (
        fan_in, manager.rank)) / math.sqrt(fan_in), role=roles.PARAMETER)
    b = call.variable("b", lambda: jnp.zeros(_b_shape(layout, manager.rank)),
                      role=roles.PARAMETER)
    scale = jnp.asarray(manager.hp("alpha"), jnp.float32) / manager.rank
    return value + (scale * _product(a.value, b.value, value.shape)).astype(value.dtype)


def _b_shape(layout: WeightLayout, rank: int) -> tuple[int, ...]:
    """``B``'s shape: ``(rank, units)`` when the weight's fan-in axes come first, else
    ``(rank, *shape)`` with the fan-in axes 1, so that the stored pair says where they are
    and :meth:`LoRA.merge` needs no model."""
    if layout.leading:
        return (rank, layout.units_size)
    return (rank, *(1 if a in layout.fan_in else n for a, n in enumerate(layout.shape)))


def _product(a: jax.Array, b: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``A @ B`` in the weight's ``shape``, ``B`` shaped by :func:`_b_shape`."""
    if b.ndim == 2:  # (rank, units): a reshape
        return (a @ b).reshape(shape)
    # An axis of size 1 in B is a fan-in axis, or a unit axis of size 1 (either way).
    fan_in = tuple(axis for axis, n in enumerate(b.shape[1:]) if n == 1)
    return WeightLayout(tuple(shape), fan_in).from_matrix(a @ b.reshape(b.shape[0], -1))
