"""A long run with the everyday plugins neither leaks memory nor retraces."""

from __future__ import annotations

import gc
import os
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
from graphmod.data import ArraySource
from graphmod.plugins import EarlyStopping, Logger, ProgressBar

STEPS = 50_000
WARM_UP = 5_000
PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_bytes() -> int:
    """Resident memory of this process now, after a full collection."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_fifty_thousand_steps_with_plugins_keep_memory_flat_and_never_retrace(
        tmp_path: Any) -> None:
    traces = [0]

    def cost(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        traces[0] += 1  # Python runs only while JAX traces
        return ((model(x) - y) ** 2).mean()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 2)).astype(np.float32)
    y = (x @ np.ones((2, 1), np.float32)).astype(np.float32)
    program = gm.compile(cost, gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
    step = gm.optimize(program, optax.sgd(1e-3))
    state = step.init(program.init(x[:4], y[:4]), jax.random.key(0))
    traces[0] = 0
    resident: dict[str, int] = {}
    with open(os.devnull, "w") as sink:
        loop = gm.Loop(step, ArraySource((x, y), batch_size=4, shuffle=True), steps=STEPS,
                       plugins=[ProgressBar(file=sink),
                                Logger(tmp_path, tensorboard=False),
                                EarlyStopping("valid/loss", patience=STEPS)])
        # A validation stand-in: a "validated" event every 500 steps, improving each time.
        loop.on(gm.On("step", step=gm.each(500)),
                lambda e: e.loop.fire("validated", metrics={"valid/loss": 1 / e.time.step}))
        loop.on(gm.On("step", step=gm.at(WARM_UP)),
                lambda e: resident.setdefault("warm", _resident_bytes()))
        loop.on("end", lambda e: resident.setdefault("end", _resident_bytes()))
        state = loop.run(state)
    assert int(state.step) == STEPS
    assert traces[0] == 1  # traced once, at the first step
    grown = resident["end"] - resident["warm"]
    assert grown < 5 * 2**20, f"resident memory grew by {grown / 2**20:.2f} MB after warm-up"
    logged = (tmp_path / "log.csv").read_text().splitlines()
    assert len(logged) == 1 + STEPS // 100  # a header, one row per 100 steps
