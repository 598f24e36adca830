"""Shared helpers for graphmod's tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax

RANDOM_PRIMITIVES = {"random_bits", "random_seed", "random_wrap", "random_unwrap",
                     "threefry2x32", "random_fold_in", "random_split"}


def iter_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a (closed) jaxpr, recursing into sub-jaxprs (jit, scan, cond...)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    yield from iter_eqns(sub)


def primitives(jaxpr: Any) -> list[str]:
    """The primitive names of every equation, recursively."""
    return [eqn.primitive.name for eqn in iter_eqns(jaxpr)]


def has_random(jaxpr: Any) -> bool:
    return bool(RANDOM_PRIMITIVES & set(primitives(jaxpr)))
