"""A training run for the resume tests, run in a subprocess.

Usage: python resumable_run.py DIRECTORY OUT.npz [--stop-at STEP] [--until STEP] [--resume]

With --stop-at, the run saves a checkpoint at that step (mid-epoch), writes DIRECTORY/ready
and then hangs until it is killed. With --resume it continues from DIRECTORY's latest
checkpoint. With --until it stops early (as a user would), for `graphmod resume`. The final
variables go to OUT.npz.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import jax
import numpy as np
import optax
from flax import nnx

import graphmod as gm
import managers
from graphmod import On, at, each, roles
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint


def build() -> tuple[gm.TrainStep, ArraySource, gm.TrainState]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 3))).astype(np.float32)
    mlp = gm.bricks.MLP([5, 16, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(
        lambda m, x, y: ((m(x) - y) ** 2).mean(), mlp,
        managers=[managers.Dropout(0.2, bricks=mlp.linear_layers, roles=[roles.INPUT]),
                  managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT])])
    step = gm.optimize(program, optax.adam(1e-2))
    state = step.init(program.init(x[:2], y[:2]), jax.random.key(42))
    return step, ArraySource({"x": x, "y": y}, 16, shuffle=True, seed=3), state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("out")
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--until", type=int, help="stop (terminate) after this step")
    args = parser.parse_args()
    step, data, state = build()
    checkpoint = Checkpoint(args.directory, every=On("step", step=each(4)), keep=2)
    plugins: list = [checkpoint]
    if args.stop_at is not None:
        def hang(event: gm.Event) -> None:
            checkpoint.save(event)
            checkpoint.wait()
            pathlib.Path(args.directory, "ready").write_text(str(event.time.step))
            while True:  # killed here with SIGKILL
                time.sleep(1)

        plugins.append(hang)
    if args.resume:
        state = gm.Loop.resume(args.directory, step, data, plugins=plugins)
    else:
        loop = gm.Loop(step, data, epochs=4, plugins=plugins[:1])
        if args.stop_at is not None:
            loop.on(On("step", step=at(args.stop_at)), plugins[1])
        if args.until is not None:
            def stop(event: gm.Event) -> None:  # a user stopping the run, after a save
                checkpoint.save(event)
                event.loop.terminate()

            loop.on(On("step", step=at(args.until)), stop)
        state = loop.run(state)
    leaves = jax.tree_util.tree_flatten_with_path(state.variables)[0]
    np.savez(args.out, **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves},
             step=np.asarray(state.step))
    os.sync()


if __name__ == "__main__":
    main()
