"""A small training run for the provenance tests; also run as a script in a fresh process.

Usage:
    python provenance_workload.py rebuild RECORD.json OUT.npz FINGERPRINT.txt

rebuilds the model, managers and optimizer from RECORD.json, compiles :func:`cost` over
them, checks the data against the record, trains as recorded and writes the final variables
to OUT.npz and the rebuilt program's fingerprint to FINGERPRINT.txt.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import jax
import numpy as np
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod.data import ArraySource


def cost(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return ((model(x) - y) ** 2).mean()


def source() -> ArraySource:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype(np.float32)
    y = (x @ rng.normal(size=(4, 2))).astype(np.float32)
    return ArraySource({"x": x, "y": y}, 8, shuffle=True, seed=3, name="toy-regression")


def build(rate: float = 0.1) -> tuple[gm.TrainStep, gm.TrainState]:
    """The step (with a recorded optimizer) and the first state."""
    mlp = gm.bricks.MLP([4, 8, 2], activation=jax.nn.tanh, rngs=nnx.Rngs(params=5))
    program = gm.compile(cost, mlp, managers=[
        managers.Dropout(rate, bricks=mlp.linear_layers, roles=[roles.INPUT]),
        managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT]),
    ])
    step = gm.optimize(program, gm.provenance.optimizer("adam", learning_rate=1e-2))
    data = source()
    first = next(iter(data.iter_epoch(0)))
    state = step.init(program.init(first["x"][:2], first["y"][:2]), jax.random.key(7))
    return step, state


def train(rate: float = 0.1, epochs: int = 2) -> tuple[gm.Loop, gm.TrainState]:
    step, state = build(rate)
    loop = gm.Loop(step, source(), epochs=epochs)
    return loop, loop.run(state)


def flat(variables: Any) -> dict[str, np.ndarray]:
    """Leaf path → host array, for .npz files."""
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]}


def rebuild_and_train(record_file: str, out: str, fingerprint_file: str) -> None:
    record = gm.provenance.read(record_file)
    again = gm.rebuild(record)
    program = again.compile(cost)
    args, kwargs = again.example_arguments()
    variables = program.init(*args, **kwargs)
    pathlib.Path(fingerprint_file).write_text(program.provenance.fingerprint)
    data = source()
    again.check_data(data)
    step = gm.optimize(program, again.optimizer)
    state = step.init(variables, again.seeds["train"])
    settings = record.inputs["loop"]
    loop = gm.Loop(step, data, epochs=settings["epochs"], steps=settings["steps"],
                   steps_per_call=settings["steps_per_call"])
    state = loop.run(state)
    np.savez(out, **flat(state.variables))


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    if command != "rebuild":
        raise SystemExit(f"unknown command {command!r}")
    rebuild_and_train(*arguments)
