"""A population as one vmapped step against the same members stepped one after another.

The digits MLP (64-256-256-10, Dropout 0.2 with a dynamic rate + BatchNorm, Adam with an
injected learning rate, batch 128), 8 members with their own weights, keys, learning rates
and dropout rates:

- ``vmapped``: ``graphmod.population(step, members=8)``: one jitted, donating call runs all
  8 members on the shared batch;
- ``sequential``: the same 8 members as 8 separate train states of the one
  ``graphmod.optimize`` step, called one after another on the same batch (8 dispatches).

Both do the same arithmetic (the script checks that the members' losses agree after the
warm-up steps). Variants interleaved round-robin in one process; each repetition times a
block of steps ended by ``block_until_ready``. Reported: the median time per population
step (all 8 members) of each and their ratio.

Usage: ``python benchmarks/population.py [--quick] [--repeats N] [--block N] [--members N]
[--out DIR]`` (CPU or GPU: it runs on JAX's default device).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import runpy
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import graphmod as gm
import managers

HERE = pathlib.Path(__file__).parent
# The digits example's data and model builder (examples/ is not a package: read from its file).
digits = SimpleNamespace(**runpy.run_path(str(HERE.parent / "examples" / "digits.py")))


def setup(members: int) -> dict[str, Any]:
    x, _, y, _ = digits.load_data(0)
    _, program = digits.build(0, gm.dynamic(0.2))  # Dropout 0.2 (a dynamic rate) + BatchNorm
    dropout = next(m for m in program.managers if isinstance(m, managers.Dropout))
    step = gm.optimize(program, optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))
    shared = program.init(x[:2], y[:2])
    variables = [{**shared, "model": nnx.to_pure_dict(nnx.state(gm.bricks.MLP(
        list(digits.DIMS), activation=jax.nn.relu, rngs=nnx.Rngs(i))))} for i in range(members)]
    keys = jax.random.split(jax.random.key(0), members)
    lrs = np.geomspace(3e-4, 3e-3, members).tolist()
    rates = np.linspace(0.1, 0.4, members).tolist()
    population = gm.population(step, members=members)
    rng = np.random.default_rng(0)
    batches = [(x[i], y[i]) for i in (rng.integers(0, len(x), 128) for _ in range(16))]
    hparams = {"learning_rate": lrs, dropout.hparam("rate"): rates}
    stacked = population.init(variables, keys, hparams=hparams)
    separate = [population.member(stacked, i) for i in range(members)]
    return {"step": step, "population": population, "stacked": stacked,
            "separate": separate, "batches": batches}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run, to check it works")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--block", type=int, default=None, help="steps per timed block")
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--out", type=pathlib.Path, default=HERE,
                        help="where population_results.{md,json} go (default: benchmarks/)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 31)
    block = args.block or (5 if args.quick else 50)
    s = setup(args.members)
    step, population, batches = s["step"], s["population"], s["batches"]
    state = {"vmapped": s["stacked"], "sequential": s["separate"]}
    losses: dict[str, Any] = {}  # the last step's, per member

    def vmapped(count: int) -> None:
        current = state["vmapped"]
        for i in range(count):
            current, metrics = population(current, *batches[i % len(batches)])
        state["vmapped"] = jax.block_until_ready(current)
        losses["vmapped"] = metrics["loss"]

    def sequential(count: int) -> None:
        current = state["sequential"]
        for i in range(count):
            batch = batches[i % len(batches)]
            stepped = [step(member, *batch) for member in current]
            current = [member for member, _ in stepped]
        state["sequential"] = jax.block_until_ready(current)
        losses["sequential"] = [metrics["loss"] for _, metrics in stepped]

    variants: dict[str, Callable[[int], None]] = {"vmapped": vmapped, "sequential": sequential}
    first = {}
    for name, run in variants.items():  # compile, and check the two compute the same
        begin = time.perf_counter()
        run(1)
        first[name] = time.perf_counter() - begin
        run(len(batches) - 1)
    np.testing.assert_allclose(np.asarray(losses["vmapped"]),
                               np.asarray(losses["sequential"]), rtol=1e-4)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            begin = time.perf_counter()
            variants[name](block)
            times[name].append((time.perf_counter() - begin) / block)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["vmapped"] / medians["sequential"]
    device = jax.devices()[0]
    lines = [f"{args.members} members, digits MLP {'-'.join(map(str, digits.DIMS))} (Dropout + "
             f"BatchNorm, Adam), batch 128; {repeats} repeats of {block} steps, "
             f"{device.platform} ({device.device_kind})", "",
             "| variant | median population step (µs) | per member (µs) | first call (s) |",
             "|---|--:|--:|--:|"]
    lines += [f"| {name} | {m * 1e6:.0f} | {m * 1e6 / args.members:.0f} | "
              f"{first[name]:.2f} |" for name, m in medians.items()]
    lines += ["", "| ratio | value |", "|---|--:|",
              f"| vmapped / sequential | {ratio:.3f} |"]
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "population_results.md").write_text(table + "\n")
        (args.out / "population_results.json").write_text(json.dumps(
            {"medians": medians, "ratio": ratio, "first_call": first,
             "members": args.members, "repeats": repeats, "block": block,
             "platform": device.platform, "device": device.device_kind,
             "jax": jax.__version__}, indent=2) + "\n")
    return {"medians": medians, "ratio": ratio}


if __name__ == "__main__":
    main()
