"""Loop overhead: graphmod.Loop with plugins against a bare Python ``for`` loop.

Same jitted train step (the digits MLP with Dropout + BatchNorm, Adam, batch 128), same
data, variants interleaved round-robin in one process; each repetition runs a whole
training run from the same initial state and blocks on the result. Reported: the median
wall time of each variant and its ratio to the bare loop.

Variants:
- ``bare``: ``for batch in source: state, _ = step(state, *batch)``.
- ``bare+eval``: the bare loop plus the validation pass the plugin variant does, by hand.
- ``bare+eval+ckpt``: that loop also saving the train state with orbax every 1000 steps, by
  hand (what the Checkpoint plugin writes, less the loop record).
- ``loop``: ``graphmod.Loop`` with no plugin (the machinery alone).
- ``loop+plugins``: ProgressBar, Logger (every 100 steps), Validation every epoch and
  Checkpoint every 1000 steps (compare with ``bare+eval``: the same work by hand).
- ``loop k=50``: ``steps_per_call=50`` (fused steps in one ``lax.scan`` dispatch).
- ``bare k=50``: the same fused steps by hand: each epoch's batches stacked 50 at a time
  and passed to ``step.steps`` in a ``for`` loop. ``bare k=50 / bare`` is what fusing gains
  by itself (XLA's scan against one dispatch per step), the most ``loop k=50`` can gain.

Usage: ``python benchmarks/loop_overhead.py [--quick] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from sklearn.datasets import load_digits

import graphmod as gm
import managers
from graphmod import On, each, plugins, roles
from graphmod.data import ArraySource

HERE = pathlib.Path(__file__).parent


def cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def setup(copies: int) -> dict[str, Any]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    train_x, train_y = np.tile(x[:1500], (copies, 1)), np.tile(y[:1500], copies)
    mlp = gm.bricks.MLP([64, 256, 256, 10], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    with managers.Dropout(0.2, bricks=mlp.linear_layers, roles=[roles.INPUT]), \
            managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[roles.OUTPUT]):
        program = gm.compile(cost, mlp)
    step = gm.optimize(program, optax.adam(1e-3))
    variables = program.init(train_x[:2], train_y[:2])
    predict = program.derive(lambda m, x: m(x))
    valid = ArraySource({"x": x[1500:], "y": y[1500:]}, 128, drop_remainder=False)
    return {
        "step": step, "variables": variables, "predict": predict, "valid": valid,
        "train": ArraySource((train_x, train_y), 128, shuffle=True, seed=0),
        # Built once, like the step: its jitted evaluation compiles once, not per run.
        "validation": plugins.Validation(predict, valid, metrics={"accuracy": accuracy}),
    }


def accuracy(logits: jax.Array, batch: dict) -> jax.Array:
    """Per-example hits (the validation metric)."""
    return (logits.argmax(-1) == batch["y"]).astype(jnp.float32)


def bare(s: dict, epochs: int, evaluate: bool, checkpoint: bool = False) -> gm.TrainState:
    state = s["step"].init(s["variables"], jax.random.key(0))
    saver = ocp.CheckpointManager(tempfile.mkdtemp(), options=ocp.CheckpointManagerOptions(
        max_to_keep=3, create=True)) if checkpoint else None
    steps = 0
    for epoch in range(epochs):
        for x, y in s["train"].iter_epoch(epoch):
            state, _ = s["step"](state, x, y)
            steps += 1
            if saver is not None and steps % 1000 == 0:
                host = jax.tree.map(np.array, state._asdict())  # the next step donates state
                saver.save(steps, args=ocp.args.StandardSave(host))
        if evaluate:
            hits, count = 0.0, 0
            for batch, mask in s["valid"].iter_padded():
                logits = s["predict"].infer(state.variables, batch["x"])
                hits += float((accuracy(logits, batch) * mask).sum())
                count += int(mask.sum())
            _ = hits / count
    if saver is not None:
        saver.wait_until_finished()
        saver.close()
    return jax.block_until_ready(state)


def bare_fused(s: dict, epochs: int, per_call: int = 50) -> gm.TrainState:
    state = s["step"].init(s["variables"], jax.random.key(0))
    for epoch in range(epochs):
        batches = list(s["train"].iter_epoch(epoch))
        for start in range(0, len(batches), per_call):
            stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches[start:start + per_call])
            state, _ = s["step"].steps(state, stacked)
    return jax.block_until_ready(state)


def looped(s: dict, epochs: int, with_plugins: bool, steps_per_call: int = 1) -> gm.TrainState:
    state = s["step"].init(s["variables"], jax.random.key(0))
    chosen: list[Any] = []
    if with_plugins:
        folder = tempfile.mkdtemp()
        chosen = [
            plugins.ProgressBar(file=open(os.devnull, "w")),  # noqa: SIM115
            plugins.Logger(os.path.join(folder, "log.csv")),
            s["validation"],
            plugins.Checkpoint(folder, every=On("step", step=each(1000))),
        ]
    loop = gm.Loop(s["step"], s["train"], epochs=epochs, plugins=chosen,
                   steps_per_call=steps_per_call)
    return jax.block_until_ready(loop.run(state))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run, to check it works")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    copies, epochs = (1, 2) if args.quick else (4, 25)  # 25 x 46 = 1150 steps
    repeats = args.repeats or (2 if args.quick else 9)
    s = setup(copies)
    variants: dict[str, Callable[[], Any]] = {
        "bare": lambda: bare(s, epochs, evaluate=False),
        "bare+eval": lambda: bare(s, epochs, evaluate=True),
        "bare+eval+ckpt": lambda: bare(s, epochs, evaluate=True, checkpoint=True),
        "loop": lambda: looped(s, epochs, with_plugins=False),
        "loop+plugins": lambda: looped(s, epochs, with_plugins=True),
        "loop k=50": lambda: looped(s, epochs, with_plugins=False, steps_per_call=50),
        "bare k=50": lambda: bare_fused(s, epochs),
    }
    for run in variants.values():  # compile everything first
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            begin = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - begin)
    medians = {name: statistics.median(t) for name, t in times.items()}
    steps = epochs * len(s["train"])
    rows = [
        ("loop (no plugin) / bare", medians["loop"] / medians["bare"]),
        ("loop+plugins / bare+eval", medians["loop+plugins"] / medians["bare+eval"]),
        ("loop+plugins / bare+eval+ckpt",
         medians["loop+plugins"] / medians["bare+eval+ckpt"]),
        ("loop k=50 / bare", medians["loop k=50"] / medians["bare"]),
        ("bare k=50 / bare (what fusing gains by itself)",
         medians["bare k=50"] / medians["bare"]),
        ("loop k=50 / bare k=50", medians["loop k=50"] / medians["bare k=50"]),
    ]
    lines = [f"{steps} steps ({epochs} epochs of {len(s['train'])}), {repeats} repeats, "
             f"{jax.devices()[0].platform}", "",
             "| variant | median run (s) | per step (µs) |", "|---|--:|--:|"]
    lines += [f"| {n} | {m:.3f} | {m / steps * 1e6:.0f} |" for n, m in medians.items()]
    lines += ["", "| ratio | value |", "|---|--:|"] + [f"| {n} | {v:.3f} |" for n, v in rows]
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        (HERE / "loop_results.md").write_text(table + "\n")
        (HERE / "loop_results.json").write_text(json.dumps(
            {"medians": medians, "ratios": dict(rows), "steps": steps}, indent=2) + "\n")
    return {"medians": medians, "ratios": dict(rows)}


if __name__ == "__main__":
    main()
