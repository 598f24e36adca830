"""A small data-parallel run for ``graphmod run --processes``: the MLP of
``tests/test_sharding.py`` trained by ``graphmod.Loop`` on a mesh over every device of every
process; process 0 writes the final variables to the ``.npz`` file named by the first
argument. With a second argument (a directory) the run checkpoints there every epoch and
resumes from it; with a third (an epoch, or ``-``) it stops after that epoch; with a fourth
(seconds) it pauses that long after each step, so that a test can interrupt it. Each
process also writes how many values it compared with the other processes' after the first
step (JAX's ``assert_equal``, an all-gather that waits for every process) to
``OUT.compared-<process index>``.

``tests/distributed/test_distributed.py`` runs it as 2 processes x 4 devices and compares
with :func:`train` in one process holding 8.
"""

from __future__ import annotations

import pathlib
import sys
import time

import graphmod as gm

if __name__ == "__main__":
    gm.distributed.initialize()  # before anything touches a device

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from graphmod import On, at
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint
from tests.test_sharding import X, Y, mlp, regularizers, squared_error


def train(directory: str | None = None, stop_after: int | None = None,
          pause: float = 0.0, compared: list | None = None) -> dict:
    """The final variables of 4 epochs of FSDP training on a mesh over every device, whole
    on the host (checkpointed in ``directory`` and resumed from it, when given); the
    values compared across processes after the first step are appended to ``compared``."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    program = gm.compile(squared_error, mlp(), managers=regularizers(), mesh=mesh,
                         **gm.sharding.fsdp())
    step = gm.optimize(program, optax.sgd(0.1))
    plugins = [] if directory is None else [Checkpoint(directory, resume=True)]
    loop = gm.Loop(step, ArraySource((X, Y), batch_size=16, shuffle=True, seed=0), epochs=4,
                   plugins=plugins)
    if stop_after is not None:
        loop.on(On("epoch_end", epoch=at(stop_after)), lambda event: event.loop.terminate())
    if pause:
        loop.on(On("step"), lambda event: time.sleep(pause))
    if compared is not None:
        check = multihost_utils.assert_equal

        def counted(*args: object, **kwargs: object) -> None:
            compared.append(args[0])
            check(*args, **kwargs)

        multihost_utils.assert_equal = counted  # called by jax.device_put, looked up there
        loop.on(On("step", step=at(1)), lambda event: compared.clear())
    state = loop.run(step.init(program.init(X[:8], Y[:8]), jax.random.key(0)))
    return multihost_utils.process_allgather(state.variables, tiled=True)


def flat(variables: dict) -> dict[str, np.ndarray]:
    """``variables`` as ``{key path: array}``, as the run's ``.npz`` file holds them."""
    leaves = jax.tree_util.tree_flatten_with_path(variables)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


if __name__ == "__main__":
    out, *rest = sys.argv[1:]
    stop = rest[1] if len(rest) > 1 and rest[1] != "-" else None
    compared: list = []
    variables = train(rest[0] if rest else None, stop and int(stop),
                      float(rest[2]) if len(rest) > 2 else 0.0, compared)
    pathlib.Path(f"{out}.compared-{jax.process_index()}").write_text(str(len(compared)))
    if jax.process_index() == 0:
        np.savez(out, **flat(variables))
