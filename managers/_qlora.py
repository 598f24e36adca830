"""``QLoRA``: low-rank adapters trained over a frozen base stored quantized (Dettmers et
al., 2023), as Qwix's ``LoraProvider(weight_qtype=..., tile_size=...)`` does in one rule.

How it works
    ``QLoRA`` is a :class:`Quantized` manager that also owns LoRA's pair per weight: each
    read of a selected weight is ``dequantize(q, scale) + (alpha / rank) * A @ B``, with
    ``q`` and ``scale`` STATE (never trained, no gradient) and ``A``, ``B`` PARAMETERs,
    all at ``variables["managers"][name][<brick path>][<weight name>]``. ``A`` and ``B``
    are drawn as ``LoRA``'s would be for the same weight and ``seed`` (``B`` zeros: at
    init the model is the quantized base). The workflow is PEFT's and Qwix's: quantize a
    trained float model, train the adapters, merge on demand::

        qlora = managers.QLoRA(rank=8, group=64)
        program, variables = managers.quantize(float_program, pretrained, qlora)
        step = graphmod.optimize(program, optax.adam(1e-3), trainable=[qlora])
        ...
        float_program.infer(qlora.merge(state.variables), x)  # a float model, merged

    ``managers.quantize`` stores the base weights as placeholders and ``q`` (int4 packed
    two to a byte, or int8), so the trained state holds the quantized base and the
    adapters only; ``trainable=[qlora]`` gives optax the adapters alone.

Sharp edges
    ``merge`` gives float weights equal to the dequantized base plus the adapter (what the
    QLoRA program read), not the float weights the base was quantized from. As for
    ``Quantized``, ``managers.quantize`` needs filters by class or path, not by brick
    instance. ``nf4`` is not a stored type here: ``dtype`` is ``"int4"`` or ``"int8"``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod.typing import Variables
from managers._checks import ManagerOptions
from managers._layout import WeightLayout
from managers._lora import adapted
from managers._merge import merged
from managers._quantize import Quantized, dequantize_matrix, is_placeholder


class QLoRA(Quantized):
    """LoRA's adapters over a frozen quantized base: each selected weight reads
    ``dequantize(q, scale) + (alpha / rank) * A @ B``, the base ``q`` and ``scale`` as
    STATE (no gradient), ``A`` and ``B`` as PARAMETERs (drawn as ``LoRA``'s, ``B`` zeros),
    at ``variables["managers"]["qlora"][<brick path>][<weight name>]``.

    Args:
        rank: the adapters' rank (a positive int).
        dtype: the base's stored type, ``"int4"`` (per ``group``) or ``"int8"``.
        group: fan-in values per scale; a tuple picks, per weight, the largest that
            divides its fan-in; None (int8 only): one scale per output unit.
        alpha: the adapters' scale numerator (may be :func:`graphmod.dynamic`).
        seed: draws ``A`` (as ``LoRA`` with this seed would).
        extended: Qwix's bound ``qmax + 0.5`` (True) or ``FakeQuant``'s ``qmax``.

    Build the training program with ``managers.quantize(float_program, variables,
    qlora)``, train with ``graphmod.optimize(..., trainable=[qlora])``, fold back with
    :meth:`merge`. Unless its filter chooses variables it adapts the weights (role
    ``WEIGHT``) of the applications it selects.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x), nnx.Linear(64, 8, rngs=nnx.Rngs(0)))
        >>> x = jnp.ones((1, 64))
        >>> variables = program.init(x)
        >>> qlora = managers.QLoRA(rank=2, group=32)
        >>> served, stored = managers.quantize(program, variables, qlora)
        >>> {k: v.shape for k, v in stored["managers"]["qlora"]["/"]["kernel"].items()}
        {'a': (64, 2), 'b': (2, 8), 'q': (32, 8), 'scale': (2, 8)}
        >>> merged = qlora.merge(stored)  # variables of the float program
        >>> bool(jnp.allclose(program.infer(merged, x), served.infer(stored, x), atol=1e-6))
        True
    """

    hparams = ("alpha",)

    def __init__(self, rank: int, dtype: str = "int4", *,
                 group: int | tuple[int, ...] | None = (128, 64, 32),
                 alpha: float | gm.Dynamic = 1.0, seed: int = 0, extended: bool = True,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        # Neither name given (tested on the keys: an `in` test narrows kwargs' type).
        if not kwargs.keys() & {"manager_name", "name"}:
            kwargs["manager_name"] = "qlora"  # not the class name's snake case, q_lo_r_a
        if dtype not in ("int4", "int8"):
            raise ValueError(f"QLoRA(dtype={dtype!r}): the base is stored as 'int4' (with a "
                             "group) or 'int8'; for float bases use managers.LoRA")
        if dtype == "int4" and group is None:
            raise ValueError("QLoRA(dtype='int4', group=None): int4 needs a group of fan-in "
                             "values per scale, e.g. group=64 or group=(128, 64, 32)")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"QLoRA(rank={rank!r}): must be a positive int (the adapters' "
                             "rank, e.g. rank=8)")
        number = alpha.value if isinstance(alpha, gm.Dynamic) else alpha
        if isinstance(number, bool) or not isinstance(number, numbers.Real) \
                or not math.isfinite(number):
            raise ValueError(f"QLoRA(alpha={alpha!r}): must be a finite float")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"QLoRA(seed={seed!r}): expected an int")
        super().__init__(dtype, group=group, extended=extended, **kwargs)
        self.rank = rank
        self.alpha = alpha
        self.seed = seed

    # A gm.ApplicationCall: adapted draws A with its init_key.
    def rewrite_parameter(self, call: gm.ApplicationCall, name: str,
                          value: jax.Array) -> jax.Array:
        base = super().rewrite_parameter(call, name, value)  # the dequantized weight
        return adapted(self, call, name, base)

    def merge(self, variables: Variables) -> Variables:
        """Float variables for the program without this manager (the one given to
        ``managers.quantize``): each weight is its dequantized base plus the adapter, what
        the QLoRA program read; this manager's entries are removed. The alpha folded in is
        the one stored in ``variables`` when ``alpha`` is dynamic. Raises
        :class:`graphmod.errors.VariablesMismatch` if ``variables`` hold none of its entries.

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm, managers
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: m(x), nnx.Linear(8, 2, rngs=nnx.Rngs(0)))
            >>> variables = program.init(jnp.ones((1, 8)))
            >>> qlora = managers.QLoRA(rank=1, group=4)
            >>> _, stored = managers.quantize(program, variables, qlora)
            >>> merged = qlora.merge(stored)
            >>> merged["model"]["kernel"].shape, sorted(merged["managers"])
            ((8, 2), [])
        """
        def fold(weight: jax.Array, entries: Mapping[str, jax.Array],
                 hparams: Mapping[str, jax.Array]) -> jax.Array:
            shape = jnp.shape(weight)[:-1] if is_placeholder(weight) else jnp.shape(weight)
            a, b, scale = entries["a"], entries["b"], entries["scale"]
            # B's size-1 axes are the fan-in ones where they do not lead (LoRA's layout).
            fan_in = tuple(range(len(shape) - 1)) if b.ndim == 2 else tuple(
                axis for axis, n in enumerate(b.shape[1:]) if n == 1)
            layout = WeightLayout(tuple(shape), fan_in)
            group = a.shape[0] // scale.shape[0]
            alpha = jnp.asarray(hparams.get("alpha", self.alpha), jnp.float32)
            matrix = dequantize_matrix(entries["q"], scale, self.dtype, group) \
                + alpha / self.rank * (a @ b.reshape(b.shape[0], -1))
            return layout.from_matrix(matrix).astype(jnp.result_type(weight))

        return merged(self, variables, fold, lambda entries: entries["a"].ndim - 2)
