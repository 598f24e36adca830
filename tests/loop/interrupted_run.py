"""A training run for the stop-signal tests (Ctrl-C, SIGTERM), run in subprocesses (see
test_interrupt.py).

Usage:
    python interrupted_run.py run DIR [--steps-per-call K] [--sync] [--sleep S]
                                      [--kill-at-step N] [--kill-in-save N]
                                      [--term-in-write N]
    python interrupted_run.py hold DIR
    python interrupted_run.py verify OUT DIR [DIR ...] [--via loop|plugin]

``run`` trains STEPS steps, saving a checkpoint every 2 steps (keep 2), with a plugin that
sleeps S seconds at each step event (so a Ctrl-C often lands in a plugin); it writes
DIR/started once warmed up (compiled, first checkpoint saved) and DIR/where.txt with the
main thread's stack when SIGINT arrives. ``--kill-at-step N`` sends SIGINT from inside the
N-th jitted step's execution (a host callback in the loss: only in such runs, since a
program with a callback cannot be kept in JAX's compilation cache); ``--kill-in-save N``
sends it as the N-th save starts; ``--term-in-write N`` sends SIGTERM once the N-th
checkpoint write has put its files on disk, before it is renamed into place (from the
writer's thread, unless ``--sync``).

``hold`` pauses at step 7 while DIR/hold exists (checkpoints of steps 2, 4 and 6 on disk)
and writes DIR/ready; once interrupted, a plugin writes DIR/interrupting and stalls in its
``on_interrupt`` (before the Checkpoint's), so that a second Ctrl-C lands there.

``verify`` trains the whole run uninterrupted (OUT/reference.npz), then continues each DIR
from its checkpoints (``Loop.resume``, or a Loop with ``Checkpoint(resume=True)``) and
writes DIR/resumed.npz.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx

import graphmod as gm
import managers
from graphmod import On, at, each, roles
from graphmod._train._checkpoint import Checkpointer
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint

STEPS = 40
EVERY = On("step", step=each(2))
_kill_at = [0, 0]  # [target step, steps run so far]: SIGINT from inside a jitted step


def _count_and_kill() -> None:
    _kill_at[1] += 1
    if _kill_at[1] == _kill_at[0]:
        os.kill(os.getpid(), signal.SIGINT)


def _cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
    return ((model(x) - y) ** 2).mean()


def _cost_killing(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
    jax.debug.callback(_count_and_kill)
    return _cost(model, x, y)


def build(kill: bool = False) -> tuple[gm.TrainStep, ArraySource,
                                       Callable[[], gm.TrainState]]:
    """The step, the data and a function making a fresh first state (donated by a run)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 3))).astype(np.float32)
    mlp = gm.bricks.MLP([5, 16, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(_cost_killing if kill else _cost, mlp, managers=[
        managers.Dropout(0.2, bricks=mlp.linear_layers, roles=[roles.INPUT]),
        managers.BatchNorm(bricks=mlp.linear_layers[:1], roles=[roles.OUTPUT])])
    step = gm.optimize(program, optax.adam(1e-2))
    variables = program.init(x[:2], y[:2])
    return (step, ArraySource({"x": x, "y": y}, 10, shuffle=True, seed=3),
            lambda: step.init(variables, jax.random.key(42)))


class KillingCheckpoint(Checkpoint):
    """A Checkpoint that sends SIGINT to its own process as its ``kill``-th save starts."""

    def __init__(self, *args: object, kill: int = 0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.kill, self.saves = kill, 0

    def save(self, event: gm.Event) -> None:
        self.saves += 1
        if self.saves == self.kill:
            os.kill(os.getpid(), signal.SIGINT)
        super().save(event)


def _term_in_write(write: int) -> None:
    """Sends this process SIGTERM once the ``write``-th checkpoint write (counted from 1)
    has written its files, before they are put in place."""
    original, writes = Checkpointer._orbax_save, [0]

    def orbax_save(self: Checkpointer, *args: object) -> None:
        original(self, *args)
        writes[0] += 1
        if writes[0] == write:
            os.kill(os.getpid(), signal.SIGTERM)

    Checkpointer._orbax_save = orbax_save  # type: ignore[method-assign]


def _record_where(directory: pathlib.Path) -> socket.socket:
    """Writes the main thread's stack to DIR/where.txt when SIGINT arrives (keep the socket
    returned open until then)."""
    receive, send = socket.socketpair()
    send.setblocking(False)
    signal.set_wakeup_fd(send.fileno())  # written by the C handler, whatever Python does
    main = threading.main_thread().ident

    def watch() -> None:
        if not receive.recv(1):
            return
        frame = sys._current_frames().get(main)
        stack = traceback.extract_stack(frame) if frame is not None else []
        (directory / "where.txt").write_text(
            "\n".join(f"{f.filename}:{f.lineno} {f.name}" for f in stack))

    threading.Thread(target=watch, daemon=True).start()
    return send


def _warm_up(step: gm.TrainStep, data: ArraySource,
             first: Callable[[], gm.TrainState]) -> None:
    """Compiles one step and a fused dispatch of two, on a state thrown away."""
    batch = next(data.iter_epoch(0))
    state, _ = step(first(), **batch)
    jax.block_until_ready(step.steps(state, jax.tree.map(lambda *b: np.stack(b), batch, batch)))


def _save(path: pathlib.Path, state: gm.TrainState) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(state.variables)[0]
    np.savez(path, **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves},
             step=np.asarray(state.step))


def run(args: argparse.Namespace) -> None:
    directory = pathlib.Path(args.directory)
    step, data, first = build(kill=args.kill_at_step > 0)
    _warm_up(step, data, first)
    checkpoint = KillingCheckpoint(directory, every=EVERY, keep=2, asynchronous=not args.sync,
                                   kill=args.kill_in_save)
    loop = gm.Loop(step, data, steps=STEPS, steps_per_call=args.steps_per_call,
                   plugins=[checkpoint])
    loop.on(On("step"), lambda e: time.sleep(args.sleep))
    loop.on(On("step", step=at(2)), lambda e: (directory / "started").write_text("2"))
    wakeup = _record_where(directory)
    if args.term_in_write:
        _term_in_write(args.term_in_write)
    state = first()
    _kill_at[:] = [args.kill_at_step, 0]  # building ran the program once
    _save(directory / "final.npz", loop.run(state))
    wakeup.close()


class Stall(gm.Plugin):
    """Stalls in ``on_interrupt`` (a slow save, say), after writing DIR/interrupting."""

    def __init__(self, directory: pathlib.Path) -> None:
        super().__init__()
        self.directory = directory

    def on_interrupt(self, event: gm.Event) -> None:
        (self.directory / "interrupting").write_text(str(event.time.step))
        time.sleep(300)


def hold(args: argparse.Namespace) -> None:
    directory = pathlib.Path(args.directory)
    step, data, first = build()

    def pause(event: gm.Event) -> None:
        checkpoint.wait()
        (directory / "ready").write_text(str(event.time.step))
        while (directory / "hold").exists():
            time.sleep(0.02)

    checkpoint = Checkpoint(directory, every=EVERY, keep=None)
    loop = gm.Loop(step, data, steps=STEPS, plugins=[checkpoint, Stall(directory)])
    loop.on(On("step", step=at(7)), pause)
    loop.run(first())


def verify(args: argparse.Namespace) -> None:
    step, data, first = build()
    _save(pathlib.Path(args.out) / "reference.npz",
          gm.Loop(step, data, steps=STEPS).run(first()))
    for name in args.directories:
        directory = pathlib.Path(name)
        checkpoint = Checkpoint(directory, every=EVERY, keep=2, resume=args.via == "plugin")
        if args.via == "loop":
            final = gm.Loop.resume(directory, step, data, plugins=[checkpoint])
        else:
            final = gm.Loop(step, data, steps=STEPS, plugins=[checkpoint]).run(first())
        _save(directory / "resumed.npz", final)


def main() -> None:
    # A foreground program's Ctrl-C, even where the parent ignored SIGINT (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run")
    one.add_argument("directory")
    one.add_argument("--steps-per-call", type=int, default=1)
    one.add_argument("--sync", action="store_true")
    one.add_argument("--sleep", type=float, default=0.05)
    one.add_argument("--kill-at-step", type=int, default=0)
    one.add_argument("--kill-in-save", type=int, default=0)
    one.add_argument("--term-in-write", type=int, default=0)
    commands.add_parser("hold").add_argument("directory")
    check = commands.add_parser("verify")
    check.add_argument("out")
    check.add_argument("directories", nargs="*")
    check.add_argument("--via", choices=("loop", "plugin"), default="loop")
    args = parser.parse_args()
    {"run": run, "hold": hold, "verify": verify}[args.command](args)


if __name__ == "__main__":
    main()
