"""Shared by the plugin tests: one compiled Problem per session, scripted events, counted
metric reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from examples.flax_nnx.scan_over_layers import ScanMLP
from graphmod.data import ArraySource
from tests.loop.conftest import Problem


@pytest.fixture(scope="session")
def problem() -> Problem:
    return Problem()


class LayerMetric:
    """Flax's scan over layers trained with ``ActivationStats``: a metric with one value
    per layer (:attr:`name`, shape ``(3,)``)."""

    name = "activation_stats:/layers/linear.apply.output.mean"

    def __init__(self) -> None:
        model = ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0))
        stats = managers.ActivationStats(bricks=[nnx.Linear], statistics=["mean"])
        program = gm.compile(lambda m, x: (m(x) ** 2).mean(), model, managers=[stats])
        self.x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
        self.step = gm.optimize(program, optax.sgd(0.1))
        self.variables = program.init(self.x[:1])

    def loop(self, plugins: list[gm.Plugin], seen: list[np.ndarray], every: gm.On) -> gm.Loop:
        """A loop of one epoch whose due events put the per-layer metric in ``seen``."""
        loop = gm.Loop(self.step, ArraySource({"x": self.x}, 8), epochs=1, plugins=plugins)
        loop.on(every, lambda e: seen.append(np.asarray(e.metrics[self.name])))
        return loop

    def state(self) -> gm.TrainState:
        return self.step.init(self.variables, jax.random.key(0))


@pytest.fixture(scope="session")
def layer_metric() -> LayerMetric:
    return LayerMetric()


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
