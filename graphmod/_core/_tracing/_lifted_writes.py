"""Writes to an NNX transform's copies of model variables inside ``graphmod.remat``.

``nnx.scan`` over layers (``nnx.vmap``, ``nnx.cond`` ...) hands its body copies of a layer's
variables, made at the body's trace level, and Flax refuses to write a variable from another
level: ``jax.checkpoint`` around a call in the body (``managers.Remat(bricks=[Block])`` on a
scanned ``Block``) is one. Inside a :func:`graphmod.remat` region such a write (a batch
norm's statistics, an ``nnx.Rngs`` count) is kept here instead, and read back by the region;
the region returns the values, and ``graphmod.remat`` writes them to the copies after the
checkpoint, at the level the copies belong to, as ``nnx.remat`` does with the state it
lifts.

Sharp edges
    Only the copies' writes Flax would refuse are kept (a variable made inside the region
    is its own); a raw ``jax.checkpoint`` around such a write is still refused by Flax,
    as without graphmod.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeAlias

import jax
from flax import nnx

# A region's writes: id(variable) -> (variable, value written in the region).
Writes: TypeAlias = dict[int, tuple[nnx.Variable, jax.Array]]
# One per graphmod.remat region in progress, innermost last.
_REGIONS: contextvars.ContextVar[tuple[Writes, ...]] = (
    contextvars.ContextVar("graphmod_lifted", default=()))


@contextlib.contextmanager
def lifting() -> Iterator[Writes]:
    """A region whose writes to other levels' variables are kept; yields them, in the order
    first written.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> count = nnx.BatchStat(jnp.zeros(()))
        >>> with lifting() as writes:
        ...     write(count, jnp.ones(()))
        ...     float(read(count))
        1.0
        >>> [float(value) for _, value in writes.values()], float(count.get_value())
        ([1.0], 0.0)
    """
    writes: Writes = {}
    token = _REGIONS.set((*_REGIONS.get(), writes))
    try:
        yield writes
    finally:
        _REGIONS.reset(token)


def lifts(variable: nnx.Variable) -> bool:
    """Whether a write to ``variable`` is kept by the innermost region: one is in progress
    and Flax would refuse the write (the variable belongs to another trace level)."""
    return bool(_REGIONS.get()) and not variable._trace_state.is_valid()


def write(variable: nnx.Variable, value: jax.Array) -> None:
    """Keeps ``value`` as ``variable``'s in the innermost region."""
    _REGIONS.get()[-1][id(variable)] = (variable, value)


def read(variable: nnx.Variable) -> jax.Array | None:
    """The value a region in progress kept as ``variable``'s (the innermost's), else None."""
    for writes in reversed(_REGIONS.get()):
        if id(variable) in writes:
            return writes[id(variable)][1]
    return None
