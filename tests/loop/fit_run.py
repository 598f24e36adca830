"""The run of the ``graphmod.fit`` tests: a small classifier with dropout, its data, and a
subprocess entry that is killed mid-run.

Usage: python -m tests.loop.fit_run DIRECTORY --hang-at STEP

Fits into DIRECTORY; at step STEP (mid-epoch) it saves a checkpoint, writes
DIRECTORY/ready and hangs until it is killed (SIGKILL). The functions are imported from
``tests.loop.fit_run`` in the subprocess too, so the cost's recorded module is the same in
the killed run and in the test that continues it.
"""

from __future__ import annotations

import argparse
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod.data import ArraySource

EPOCHS = 3  # of 6 steps each


def arrays(shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """136 examples of 4 features in 3 classes (``shift`` moves the features)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(136, 4)).astype(np.float32) + np.float32(shift)
    y = np.argmax(x @ rng.normal(size=(4, 3)), axis=-1).astype(np.int32)
    return x, y


def cost(model: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, dict]:
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": (jnp.argmax(logits, -1) == y).mean()}


def parts(width: int = 16) -> tuple[gm.bricks.MLP, list[gm.Manager]]:
    """The model and its managers (dropout on every layer's input)."""
    mlp = gm.bricks.MLP([4, width, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    return mlp, [managers.Dropout(0.1, bricks=mlp.linear_layers, roles=[roles.INPUT])]


def training_data(shift: float = 0.0) -> ArraySource:
    x, y = arrays(shift)
    return ArraySource((x[:96], y[:96]), 16, shuffle=True, seed=1)


def held_out() -> tuple[np.ndarray, np.ndarray]:
    x, y = arrays()
    return x[96:], y[96:]


def fit(directory: Any = None, *, width: int = 16, shift: float = 0.0,
        optimizer: Any = None, data: Any = None, **options: Any) -> gm.FitResult:
    """The fit of the tests (options override its arguments)."""
    model, chosen = parts(width)
    settings: dict[str, Any] = {
        "managers": chosen, "optimizer": optimizer or optax.adam(1e-2), "epochs": EPOCHS,
        "validation": held_out(), "directory": directory, "progress": False, **options}
    return gm.fit(cost, model, training_data(shift) if data is None else data, **settings)


def hang_at(step: int, directory: str) -> Any:
    """A plugin that, at ``step``, saves a checkpoint, says so and waits to be killed."""
    def hang(event: gm.Event) -> None:
        if event.type != "step" or event.time.step != step:
            return
        checkpoint = next(p for p in event.loop.plugins
                          if isinstance(p, gm.plugins.Checkpoint))
        checkpoint.save(event)
        checkpoint.wait()
        pathlib.Path(directory, "ready").write_text(str(step))
        while True:  # killed here with SIGKILL
            time.sleep(1)

    return hang


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--hang-at", type=int, required=True)
    args = parser.parse_args()
    fit(args.directory, plugins=[hang_at(args.hang_at, args.directory)])


if __name__ == "__main__":
    from tests.loop import fit_run  # the functions under their module's own name

    fit_run.main()
