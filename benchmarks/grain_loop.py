"""Grain in the loop: ``graphmod.Loop`` over a Grain pipeline against the same pipeline
iterated by hand, and against ``ArraySource`` on the same arrays.

Same jitted train step (the digits MLP 64-256-256-10 with Dropout, Adam, batch 128), variants
interleaved round-robin in one process; each repetition runs a whole training run from the
same initial state and blocks on the result. Reported: each variant's median wall time and
the ratios of the medians.

Variants:
- ``hand``: ``for batch in pipeline: state, _ = step(state, **batch)``, a fresh iterator of
  the pipeline each epoch (``grain.MapDataset.source(rows).shuffle(seed).batch(128)``,
  Grain's thread prefetch, no worker process).
- ``loop``: ``graphmod.Loop(step, pipeline)``: a ``GrainSource``, which asks the iterator for
  its state before each batch (what a checkpoint needs to resume exactly).
- ``arrays``: ``graphmod.Loop`` over ``ArraySource`` of the same arrays, shuffled.

Usage: ``python benchmarks/grain_loop.py [--quick] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import grain
import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import graphmod as gm
import managers
from graphmod import roles
from graphmod.data import ArraySource

HERE = pathlib.Path(__file__).parent
BATCH = 128


def cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def setup(copies: int) -> dict[str, Any]:
    digits = load_digits()
    x = np.tile((digits.data / 16.0).astype(np.float32), (copies, 1))
    y = np.tile(digits.target.astype(np.int32), copies)
    mlp = gm.bricks.MLP([64, 256, 256, 10], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(cost, mlp, managers=[
        managers.Dropout(0.2, bricks=mlp.linear_layers, roles=[roles.INPUT])])
    step = gm.optimize(program, optax.adam(1e-3))
    rows = [{"x": x[i], "y": y[i]} for i in range(len(x))]
    pipeline = grain.MapDataset.source(rows).shuffle(seed=0).batch(BATCH, drop_remainder=True)
    return {"step": step, "variables": program.init(x[:2], y[:2]), "pipeline": pipeline,
            "arrays": ArraySource({"x": x, "y": y}, BATCH, shuffle=True, seed=0)}


def start(s: dict) -> gm.TrainState:
    return s["step"].init(s["variables"], jax.random.key(0))


def hand(s: dict, epochs: int) -> gm.TrainState:
    state = start(s)
    for _ in range(epochs):
        for batch in s["pipeline"]:
            state, _ = s["step"](state, **batch)
    return jax.block_until_ready(state)


def looped(s: dict, epochs: int, data: str) -> gm.TrainState:
    return jax.block_until_ready(gm.Loop(s["step"], s[data], epochs=epochs).run(start(s)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run, to check it works")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    copies, epochs = (1, 1) if args.quick else (2, 6)  # 6 x 28 = 168 steps
    repeats = args.repeats or (2 if args.quick else 9)
    s = setup(copies)
    variants: dict[str, Callable[[], Any]] = {
        "hand": lambda: hand(s, epochs),
        "loop": lambda: looped(s, epochs, "pipeline"),
        "arrays": lambda: looped(s, epochs, "arrays"),
    }
    finals = {name: run() for name, run in variants.items()}  # compile everything first
    for a, b in zip(jax.tree.leaves(finals["hand"].variables),
                    jax.tree.leaves(finals["loop"].variables), strict=True):
        np.testing.assert_array_equal(a, b)  # the loop trains exactly as the hand loop
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            begin = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - begin)
    medians = {name: statistics.median(t) for name, t in times.items()}
    steps = epochs * (len(s["arrays"]))
    rows = [("loop over Grain / Grain by hand", medians["loop"] / medians["hand"]),
            ("loop over Grain / loop over ArraySource", medians["loop"] / medians["arrays"])]
    lines = [f"{steps} steps ({epochs} epochs of {len(s['arrays'])}), {repeats} repeats, "
             f"{jax.devices()[0].platform}, grain {grain.__version__}", "",
             "| variant | median run (s) | per step (µs) |", "|---|--:|--:|"]
    lines += [f"| {n} | {m:.3f} | {m / steps * 1e6:.0f} |" for n, m in medians.items()]
    lines += ["", "| ratio | value |", "|---|--:|"] + [f"| {n} | {v:.3f} |" for n, v in rows]
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        (HERE / "grain_loop_results.md").write_text(table + "\n")
        (HERE / "grain_loop_results.json").write_text(json.dumps(
            {"medians": medians, "ratios": dict(rows), "steps": steps,
             "times": times}, indent=2) + "\n")
    return {"medians": medians, "ratios": dict(rows)}


if __name__ == "__main__":
    main()
