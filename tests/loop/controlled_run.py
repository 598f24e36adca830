"""A training run for the control tests (``graphmod control``), run in a subprocess (see
test_control.py).

Usage:
    python controlled_run.py DIR OUT

Trains until stopped (or for at most ``DEADLINE_S`` seconds) with a ``Checkpoint(DIR)``
every ``SAVE_EVERY`` steps and a ``Control()`` listening in DIR. The train step's first
trace in the loop is slow: it writes OUT/tracing, sleeps ``TRACE_SLEEP_S`` seconds, then
writes OUT/traced (a step that compiles while ``status`` is asked). A ``command`` event
named ``report...`` (``graphmod control DIR event report1``) writes OUT/report1.json: the
step, how many times the step was traced since the loop started, the learning rate and
dropout rate in the train state, how many signatures the jitted step compiled, and a digest
of the parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

import graphmod as gm
import managers
from graphmod import On, at, each, roles
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint, Control

SAVE_EVERY = 200
TRACE_SLEEP_S = 1.5
DEADLINE_S = 240.0  # a run the test lost track of ends by itself
_tracing = {"slow": None, "traces": 0}  # the loop's traces, once "slow" names OUT


def _cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
    out = _tracing["slow"]
    if out is not None:  # the loop's first trace: slow, and said so
        _tracing["slow"] = None
        (out / "tracing").write_text("1")
        time.sleep(TRACE_SLEEP_S)
        (out / "traced").write_text("1")
    _tracing["traces"] += 1
    return ((model(x) - y) ** 2).mean()


def build() -> tuple[gm.TrainStep, ArraySource, gm.TrainState, managers.Dropout]:
    """The step (a dynamic dropout rate, an injected learning rate), the data and a first
    state."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    y = (x @ rng.normal(size=(4, 2))).astype(np.float32)
    mlp = gm.bricks.MLP([4, 16, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    dropout = managers.Dropout(gm.dynamic(0.1), bricks=mlp.linear_layers, roles=[roles.INPUT])
    program = gm.compile(_cost, mlp, managers=[dropout])
    step = gm.optimize(program, optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
    state = step.init(program.init(x[:2], y[:2]), jax.random.key(0))
    return step, ArraySource({"x": x, "y": y}, 8, shuffle=True, seed=1), state, dropout


def digest(variables: dict) -> str:
    """A digest of every array of ``variables``."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        h.update(jax.tree_util.keystr(path).encode() + np.asarray(leaf).tobytes())
    return h.hexdigest()


def main() -> None:
    directory, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    step, data, state, dropout = build()
    began = time.monotonic()

    def report(event: gm.Event) -> None:
        s = event.loop.state
        record = {"step": event.time.step, "traces": _tracing["traces"],
                  "compiled": step._step._cache_size(),  # the jitted step's signatures
                  "lr": float(s.opt_state.hyperparams["learning_rate"]),
                  "rate": float(dropout.hparam("rate").get(s.variables)),
                  "params": digest(s.variables["model"])}
        partial = out / f".{event.name}.json"
        partial.write_text(json.dumps(record))
        os.replace(partial, out / f"{event.name}.json")

    def pace(event: gm.Event) -> None:
        time.sleep(0.002)  # a few hundred steps a second: fewer checkpoints, less CPU
        if time.monotonic() - began > DEADLINE_S:
            event.loop.terminate("the test's deadline")

    loop = gm.Loop(step, data, steps=10**7, plugins=[
        # Saved at step 2 too: the first save traces the cost once more (the provenance's
        # graph fingerprint), before the test counts traces.
        Checkpoint(directory, every=On("step", step=at(2) | each(SAVE_EVERY)), keep=None),
        Control(requests_per_second=5000)])
    loop.on(On("command", name=lambda name: name.startswith("report")), report)
    loop.on(On("step"), pace)
    _tracing["slow"], _tracing["traces"] = out, 0
    loop.run(state)


if __name__ == "__main__":
    main()
