"""A run over a Grain pipeline with a worker process, for the SIGKILL test (in a subprocess).

Usage: python grain_run.py DIRECTORY JOURNAL OUT.npz [--kill-at STEP] [--resume]

The pipeline: 40 examples shuffled (seed 7), repeated twice (Grain reshuffles its second
epoch), mapped, batched by 8 and prefetched by one worker process (``mp_prefetch``): one
pass of 10 batches, the loop's one epoch. A checkpoint every 3 steps. JOURNAL gets a line
per step: the example indices of its batch and the loss (a hex float: bitwise). With
--kill-at the process waits for its saves and SIGKILLs itself at that step; with --resume it
continues from DIRECTORY's newest checkpoint with ``Loop.resume``. The final variables go
to OUT.npz.

The top level imports only NumPy and Grain: Grain spawns its worker processes, which import
this module again for the pipeline's functions (graphmod and the model are built in
:func:`train`).
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import grain
import numpy as np

ROWS, BATCH, REPEATS, SAVE_EVERY = 40, 8, 2, 3
STEPS = ROWS * REPEATS // BATCH


def example(index: int) -> dict[str, np.ndarray]:
    """Example ``index``: features drawn from its index, a target, and the index itself."""
    x = np.random.default_rng(int(index)).normal(size=4).astype(np.float32)
    return {"x": x, "y": (x[:2] * 2.0).astype(np.float32), "idx": np.int32(index)}


def pipeline(workers: int = 1) -> Any:
    ds = grain.MapDataset.range(ROWS).shuffle(seed=7).repeat(REPEATS).map(example).batch(BATCH)
    return ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))


def train(directory: str, journal: str, *, kill_at: int | None = None,
          resume: bool = False) -> Any:
    """Runs (or resumes) the run; returns the final train state."""
    import jax
    import optax
    from flax import nnx

    import graphmod as gm
    import managers
    from graphmod import On, at, each, roles
    from graphmod.plugins import Checkpoint

    mlp = gm.bricks.MLP([4, 8, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))

    def cost(m, x, y, idx):
        return ((m(x) - y) ** 2).mean(), {"idx": idx}

    program = gm.compile(cost, mlp, managers=[
        managers.Dropout(0.2, bricks=mlp.linear_layers, roles=[roles.INPUT])])
    step = gm.optimize(program, optax.adam(1e-2))
    examples = [example(i) for i in range(2)]
    first = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
    state = step.init(program.init(**first), jax.random.key(0))
    with open(journal, "a", buffering=1) as lines:  # line by line: a SIGKILL loses none
        def write(event: gm.Event) -> None:  # every event: Loop.resume registers it so
            if event.type == "step":
                ids = ",".join(str(i) for i in np.asarray(event.metrics["idx"]).tolist())
                loss = float(event.metrics["loss"]).hex()
                lines.write(f"step {event.time.step} {ids} {loss}\n")

        checkpoint = Checkpoint(directory, every=On("step", step=each(SAVE_EVERY)))
        if resume:
            state = gm.Loop.resume(directory, step, pipeline(), plugins=[write, checkpoint])
        else:
            loop = gm.Loop(step, pipeline(), epochs=1, plugins=[write, checkpoint])
            if kill_at is not None:
                def kill(event: gm.Event) -> None:
                    checkpoint.wait()
                    os.kill(os.getpid(), signal.SIGKILL)

                loop.on(On("step", step=at(kill_at)), kill)
            state = loop.run(state)
    return state


def variables(state: Any) -> dict[str, np.ndarray]:
    """The final variables and step count, by path."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(state.variables)[0]
    return {**{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves},
            "step": np.asarray(state.step)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("journal")
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    state = train(args.directory, args.journal, kill_at=args.kill_at, resume=args.resume)
    np.savez(args.out, **variables(state))


if __name__ == "__main__":
    main()
