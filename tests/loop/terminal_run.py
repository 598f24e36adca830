"""A tiny run for tests/loop/test_terminal.py, in a subprocess: 2 steps an epoch, a
checkpoint each epoch, a progress bar and Print on standard error; with ``--interrupt-at N``
a plugin sends the process SIGINT (a Ctrl-C) at step N.

Usage: python terminal_run.py DIR [--interrupt-at N]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import jax
import numpy as np
import optax
from flax import nnx

import graphmod as gm
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint, Print, ProgressBar


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--interrupt-at", type=int, default=None)
    args = parser.parse_args()
    program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(),
                         gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
    x, y = np.ones((16, 2), np.float32), np.zeros((16, 1), np.float32)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
    loop = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=4, plugins=[
        Checkpoint(args.directory, every=gm.On("epoch_end"), overwrite=True),
        ProgressBar(file=sys.stderr),
        Print("loss", every=gm.On("epoch_end"), file=sys.stderr)])
    if args.interrupt_at is not None:
        loop.on(gm.On("step", step=gm.at(args.interrupt_at)),
                lambda event: os.kill(os.getpid(), signal.SIGINT))
    loop.run(state)


if __name__ == "__main__":
    main()
