"""A training record's start and end times are those of the run, not of the capture."""

from __future__ import annotations

import datetime
import time

import jax
import numpy as np
from flax import nnx

import graphmod as gm
from graphmod.data import ArraySource


def test_started_and_ended_are_noted_when_they_happen() -> None:
    program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(),
                         gm.bricks.Linear(4, 1, rngs=nnx.Rngs(0)))
    step = gm.optimize(program, gm.provenance.optimizer("sgd", 0.1))
    x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
    loop = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=1)
    before = datetime.datetime.now(datetime.UTC)
    loop.run(step.init(program.init(x[:8], y[:8]), jax.random.key(0)))
    after = datetime.datetime.now(datetime.UTC)
    time.sleep(0.5)
    prov = gm.provenance.capture(loop)
    started = datetime.datetime.fromisoformat(prov["started"])
    ended = datetime.datetime.fromisoformat(prov["ended"])
    assert before <= started <= ended <= after
