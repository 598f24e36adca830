"""Shared by the plugin tests: one compiled Problem per session, scripted events, counted
metric reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import pytest

import graphmod as gm
from tests.loop.conftest import Problem


@pytest.fixture(scope="session")
def problem() -> Problem:
    return Problem()


def fire_scores(scores: Iterable[float], metric: str = "valid/loss") -> Callable[[gm.Event], None]:
    """A plugin for ``epoch_end`` that fires ``validated`` with the next scripted score."""
    values = iter(scores)

    def scripted(event: gm.Event) -> None:
        event.loop.fire("validated", metrics={metric: next(values)})

    return scripted


def own_metrics(event: gm.Event) -> dict[str, Any]:
    """The metrics a fired event carries (as ``loop.fire(..., metrics=...)`` passed them)."""
    return dict(event.metrics)


def host(tree: Any) -> Any:
    """A host copy of a tree of arrays (to keep what the next step donates)."""
    return jax.tree.map(np.asarray, tree)


class Counted:
    """A device scalar that counts how often it is fetched to the host."""

    ndim = 0

    def __init__(self, value: jax.Array, reads: list[int]) -> None:
        self.value = value
        self.reads = reads

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self.reads[0] += 1
        return np.asarray(self.value, dtype=dtype)


def counting(step: Any) -> tuple[Callable[..., Any], list[int]]:
    """``step`` whose metrics count their host reads in the returned one-item list."""
    reads = [0]

    def counted(state: Any, **batch: Any) -> tuple[Any, dict]:
        state, metrics = step(state, **batch)
        return state, {k: Counted(v, reads) for k, v in metrics.items()}

    return counted, reads
