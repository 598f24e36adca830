"""A run of two models (a discriminator and a generator) for the kill-and-resume tests, run
in a subprocess.

Usage: python several_models_run.py DIRECTORY OUT.npz [--resume]

The run: ``disc`` steps every iteration, ``gen`` every other one reading ``disc``'s
variables, three epochs of five shuffled batches, a checkpoint every three steps. With
--resume it continues from DIRECTORY's checkpoint with ``Loop.resume``, giving neither the
schedules nor the reads (the checkpoint's record of the models has them). The final states
(both models' variables, optimizer states, step counts and keys) and the loop's time go to
OUT.npz. DIRECTORY.journal gets a line where the process starts (its step, epoch and data
position, once restored), one per step (both models' losses, as hex floats: bitwise), and
the point where it kills itself.

``GRAPHMOD_TEST_KILL=KIND:ITERATION`` makes the process SIGKILL itself at a chosen point:

- ``between``: at that iteration, after ``disc``'s step and before ``gen``'s;
- ``mid_step``: at that iteration, as soon as ``disc``'s step is dispatched (the device
  may still be computing it);
- ``mid_save``: in the writer thread of that iteration's checkpoint, once orbax wrote it
  and before it is marked and put in place.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

import graphmod as gm
import managers
from graphmod import On, each, roles
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint

EPOCHS, BATCHES, BATCH, SAVE_EVERY, GEN_EVERY = 3, 5, 8, 3, 2
KILL = "GRAPHMOD_TEST_KILL"


class Run:
    """The two programs, their steps and first states, and the data."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(BATCHES * BATCH, 2)).astype(np.float32)
        self.z = rng.normal(size=(BATCHES * BATCH, 3)).astype(np.float32)
        disc = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        gen = gm.bricks.Linear(3, 2, rngs=nnx.Rngs(1))

        def d_cost(m, x, z):
            return ((m(x) - 1.0) ** 2).mean()

        # Dropout draws from disc's key: the resumed keys must be the same too.
        d_program = gm.compile(d_cost, disc, managers=[
            managers.Dropout(0.2, bricks=[disc], roles=[roles.INPUT])])
        judge = d_program.derive(lambda m, x: m(x))  # disc's variables, inferring

        def g_cost(m, x, z, disc):
            return ((judge.infer(disc, m(z)) - 1.0) ** 2).mean()

        g_program = gm.compile(g_cost, gen)
        d_vars = d_program.init(self.x[:4], self.z[:4])
        g_vars = g_program.init(self.x[:4], self.z[:4], disc=d_vars)
        adam = gm.provenance.optimizer("adam", learning_rate=1e-2)
        self.steps = {"disc": gm.optimize(d_program, adam), "gen": gm.optimize(g_program, adam)}
        self.first = {"disc": self.steps["disc"].init(d_vars, jax.random.key(0)),
                      "gen": self.steps["gen"].init(g_vars, jax.random.key(1))}

    def source(self) -> ArraySource:
        return ArraySource((self.x, self.z), BATCH, shuffle=True, seed=3)

    def loop(self, *plugins: Any) -> gm.Loop:
        return gm.Loop(self.steps, self.source(), epochs=EPOCHS, plugins=plugins,
                       schedules={"gen": each(GEN_EVERY)}, reads={"gen": ["disc"]})


def _write(journal: str, line: str) -> None:
    with open(journal, "a") as file:  # closed at once: a SIGKILL loses nothing written
        file.write(line + "\n")


def _die(journal: str, what: str) -> None:
    _write(journal, f"killed {what}")
    os.kill(os.getpid(), signal.SIGKILL)


class Journal(gm.Plugin):
    """Notes where the process starts (after a Checkpoint restored the run), each step's
    losses, and keeps the loop."""

    def __init__(self, path: str) -> None:
        super().__init__(name="journal")
        self.path = path
        self.loop: Any = None

    def setup(self, loop: Any) -> None:
        self.loop = loop
        _write(self.path, f"start {loop.time.step} {loop.time.epoch} {loop.position}")

    def on_step(self, event: gm.Event) -> None:
        losses = [float(event.metrics[k]).hex() if k in event.metrics else "-"
                  for k in ("disc/loss", "gen/loss")]
        _write(self.path, f"step {event.time.step} {' '.join(losses)}")


class Killer(gm.Plugin):
    """Kills the process between the models' steps, or inside disc's, at one iteration,
    once the checkpoints saved before are on disk (so where the next run resumes is known)."""

    def __init__(self, run: Run, journal: Journal, checkpoint: Checkpoint, kind: str,
                 iteration: int) -> None:
        super().__init__(name="killer")
        self.run, self.journal, self.checkpoint = run, journal, checkpoint
        self.kind, self.iteration = kind, iteration

    def wrap_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        if step is not self.run.steps["disc"]:
            return step

        def disc_step(state: Any, *batch: Any, **reads: Any) -> Any:
            if self.journal.loop.time.step + 1 != self.iteration:  # the iteration being run
                return step(state, *batch, **reads)
            self.checkpoint.wait()
            out = step(state, *batch, **reads)  # dispatched: the device may be computing it
            if self.kind == "between":
                jax.block_until_ready(out)  # disc stepped; gen, next, has not
            _die(self.journal.path, f"{self.kind}:{self.iteration}")

        return disc_step


def kill_mid_save(journal: str, iteration: int) -> None:
    """Kills the writer of ``iteration``'s checkpoint once orbax wrote it, before it is
    marked as a checkpoint and renamed into place."""
    from graphmod._train._checkpoint import _writer

    mark = _writer.write_marker

    def marking(path: str, run_id: str, step: int) -> None:
        if step == iteration:
            _die(journal, f"mid_save:{iteration}")
        mark(path, run_id, step)

    _writer.write_marker = marking


def outcome(loop: gm.Loop, states: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every leaf of both models' states and the loop's time, by name."""
    leaves = jax.tree_util.tree_flatten_with_path(states)[0]
    return {**{jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves},
            "time": np.asarray([loop.time.step, loop.time.epoch, loop.time.examples])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    run = Run()
    journal = Journal(f"{args.directory}.journal")
    checkpoint = Checkpoint(args.directory, every=On("step", step=each(SAVE_EVERY)))
    plugins: list[Any] = [checkpoint, journal]
    if os.environ.get(KILL):
        kind, at = os.environ[KILL].split(":")
        if kind == "mid_save":
            kill_mid_save(journal.path, int(at))
        else:
            plugins.append(Killer(run, journal, checkpoint, kind, int(at)))
    if args.resume:  # no schedules, no reads, no state: the checkpoint's record has them
        states = gm.Loop.resume(args.directory, run.steps, run.source(), plugins=plugins)
    else:
        states = run.loop(*plugins).run(run.first)
    np.savez(args.out, **outcome(journal.loop, states))
    os.sync()


if __name__ == "__main__":
    main()
