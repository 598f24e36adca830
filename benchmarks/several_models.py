"""Several models in one Loop against the same interlacing written by hand.

A GAN-shaped pair: a discriminator MLP (2 → width → width → 1) and a generator MLP
(noise 8 → width → width → 2), each with its own program and Adam step; the
discriminator's cost reads the generator's current variables (to draw fakes) and the
generator's cost reads the discriminator's (to be judged). The discriminator steps at every
iteration, the generator every other one (``schedules={"gen": each(2)}``), the
discriminator first. Variants, interleaved round-robin in one process; each repetition runs
a whole training run from the same initial states and blocks on the result:

- ``by hand``: ``for t, (x, z) in enumerate(batches, 1)``: ``d_state, _ = d_step(d_state,
  x, z, gen=g_state.variables)``, then every other ``t`` the same for the generator, with
  the loop's metric bookkeeping left out (it would cost the hand-written loop too);
- ``Loop``: ``graphmod.Loop({"disc": d_step, "gen": g_step}, source, schedules=...,
  reads=...)`` with no plugin.

Reported: each variant's median run and the ratio ``Loop / by hand`` (goal ≤ 1.03), at two
widths: 16 (a step that costs its dispatch: the Loop's per-iteration Python is most
visible) and 256.

Usage: ``python benchmarks/several_models.py [--quick] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import graphmod as gm
from graphmod.data import ArraySource

HERE = pathlib.Path(__file__).parent
NOISE = 8


def setup(width: int, examples: int) -> dict[str, Any]:
    """The two programs, their steps, their first states' variables and the data."""
    rng = np.random.default_rng(0)
    angles = rng.integers(0, 8, examples) * (np.pi / 4)
    x = np.stack([2 * np.cos(angles), 2 * np.sin(angles)], 1).astype(np.float32)
    x += rng.normal(scale=0.02, size=x.shape).astype(np.float32)
    z = rng.normal(size=(examples, NOISE)).astype(np.float32)
    disc = gm.bricks.MLP([2, width, width, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    gen = gm.bricks.MLP([NOISE, width, width, 2], activation=jax.nn.relu, rngs=nnx.Rngs(1))
    judge = gm.compile(lambda m, x: m(x), disc)
    draw = gm.compile(lambda m, z: m(z), gen)

    def d_cost(m: gm.Brick, x: jax.Array, z: jax.Array, gen: dict) -> jax.Array:
        fake = jax.lax.stop_gradient(draw.infer(gen, z))
        return (optax.sigmoid_binary_cross_entropy(m(x), 1.0).mean()
                + optax.sigmoid_binary_cross_entropy(m(fake), 0.0).mean())

    def g_cost(m: gm.Brick, x: jax.Array, z: jax.Array, disc: dict) -> jax.Array:
        return optax.sigmoid_binary_cross_entropy(judge.infer(disc, m(z)), 1.0).mean()

    d_program, g_program = gm.compile(d_cost, disc), gm.compile(g_cost, gen)
    d_vars, g_vars = judge.init(x[:2]), draw.init(z[:2])
    return {
        "d_step": gm.optimize(d_program, optax.adam(1e-3)),
        "g_step": gm.optimize(g_program, optax.adam(1e-3)),
        "d_vars": d_program.init(x[:2], z[:2], gen=g_vars),
        "g_vars": g_program.init(x[:2], z[:2], disc=d_vars),
        "source": ArraySource((x, z), batch_size=128, shuffle=True, seed=0),
    }


def states(s: dict[str, Any]) -> dict[str, gm.TrainState]:
    return {"disc": s["d_step"].init(s["d_vars"], jax.random.key(0)),
            "gen": s["g_step"].init(s["g_vars"], jax.random.key(1))}


def by_hand(s: dict[str, Any], epochs: int) -> Any:
    d_step, g_step = s["d_step"], s["g_step"]
    start = states(s)
    d_state, g_state = start["disc"], start["gen"]
    t = 0
    for epoch in range(epochs):
        for x, z in s["source"].iter_epoch(epoch):
            t += 1
            d_state, _ = d_step(d_state, x, z, gen=g_state.variables)
            if t % 2 == 0:
                g_state, _ = g_step(g_state, x, z, disc=d_state.variables)
    return jax.block_until_ready((d_state, g_state))


def looped(s: dict[str, Any], epochs: int) -> Any:
    loop = gm.Loop({"disc": s["d_step"], "gen": s["g_step"]}, s["source"], epochs=epochs,
                   schedules={"gen": gm.each(2)}, reads={"gen": ["disc"], "disc": ["gen"]})
    return jax.block_until_ready(loop.run(states(s)))


def measure(width: int, examples: int, epochs: int, repeats: int) -> dict[str, Any]:
    s = setup(width, examples)
    variants: dict[str, Callable[[], Any]] = {"by hand": lambda: by_hand(s, epochs),
                                              "Loop": lambda: looped(s, epochs)}
    results = {name: run() for name, run in variants.items()}  # compiles both steps
    for a, b in zip(jax.tree.leaves(results["by hand"]),
                    jax.tree.leaves((results["Loop"]["disc"], results["Loop"]["gen"])),
                    strict=True):
        np.testing.assert_array_equal(a, b)  # the same run, or the ratio means nothing
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % 2:] + names[:r % 2]:
            begin = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - begin)
    medians = {name: statistics.median(t) for name, t in times.items()}
    iterations = epochs * len(s["source"])
    return {"width": width, "iterations": iterations, "medians": medians,
            "ratio": medians["Loop"] / medians["by hand"]}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run, to check it works")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    examples, epochs = (1024, 2) if args.quick else (16384, 20)  # 20 x 128 iterations
    repeats = args.repeats or (2 if args.quick else 15)
    results = [measure(width, examples, epochs, repeats) for width in (16, 256)]
    lines = [f"{results[0]['iterations']} iterations (disc every one, gen every other), "
             f"{repeats} repeats, {jax.devices()[0].platform}", "",
             "| width | by hand (s) | Loop (s) | per iteration, by hand (µs) | Loop / by hand |",
             "|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['width']} | {r['medians']['by hand']:.3f} | {r['medians']['Loop']:.3f} | "
              f"{r['medians']['by hand'] / r['iterations'] * 1e6:.0f} | {r['ratio']:.3f} |"
              for r in results]
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        (HERE / "several_models_results.md").write_text(table + "\n")
        (HERE / "several_models_results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
