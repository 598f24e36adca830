"""Managers on an unmodified Flax model: graphmod against the same regularization by hand.

Flax's MNIST CNN exactly as published (``examples/mnist/train.py`` of google/flax, NNX
version: two ``nnx.Conv`` with ``nnx.BatchNorm``, its own ``nnx.Dropout(0.025)`` twice, two
``nnx.Linear``), random 28x28x1 inputs, batch 128, ``optax.adam(1e-3)``, regularized two ways:

``graphmod``
    the unmodified CNN compiled with ``managers.Dropout(0.1, bricks=[nnx.Linear],
    roles=[INPUT])`` and ``managers.WeightNoise(0.01, roles=[WEIGHT])`` (every conv and
    linear ``kernel``), stepped by ``graphmod.optimize``. The model's own Dropout and
    BatchNorm follow the program (mask from the step key, batch statistics in training).
``hand``
    the same in plain NNX: ``nnx.split`` once into parameters and batch statistics, a
    ``jax.jit`` step (donating) that ``nnx.merge``\\ s them, adds ``0.01 * N(0, 1)`` to each
    kernel, runs the CNN's forward with inverted dropout before each ``nnx.Linear`` (masks
    drawn by hand from the step key), passes an ``nnx.Rngs`` from the step key to the model's
    own Dropout, and applies Adam to the ``nnx.Param`` leaves.

Before timing, both are built with every dropout and the noise off from the same initial
weights and checked to give the same losses and running statistics for three steps.

Reported: the step-time ratio graphmod/hand (medians of interleaved blocks of steps, ended by
``block_until_ready``) and the compile-time ratio (trace + lower + XLA compile of the first
step, from JAX's monitoring events, over several fresh builds, interleaved), with the jaxpr
equation and optimized-HLO instruction counts of each step to show where a difference comes
from.

Run::

    python benchmarks/flax_models.py            # ~2-3 minutes on 2 CPU cores
    python benchmarks/flax_models.py --quick    # a smoke run, numbers meaningless

Writes ``benchmarks/flax_results.md`` and ``benchmarks/flax_results.json`` (``--out`` to
change the directory, ``--no-write`` to only print).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_step import (
    Batch,
    Variant,
    arguments,
    count_instructions,
    environment,
    first_call,
    functional,
    interleave,
    percentile,
)

import graphmod
import managers
from graphmod import roles

BATCH = 128
LR = 1e-3
DROPOUT = 0.1
NOISE = 0.01


# -- the model, unmodified --------------------------------------------------------------------
# From google/flax, examples/mnist/train.py (NNX version, commit 18f8f311c275), copied
# unmodified. Copyright 2024 The Flax Authors. Licensed under the Apache License, Version 2.0
# (http://www.apache.org/licenses/LICENSE-2.0).
class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x
# -- end of the Flax code ---------------------------------------------------------------------


NOISY = ("conv1", "conv2", "linear1", "linear2")  # the layers whose kernel is a WEIGHT


def cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def new_model(seed: int, model_dropout: bool) -> CNN:
    """The CNN from ``seed``; ``model_dropout=False`` sets its own Dropout rates to 0 (on the
    instance, for the same-math check)."""
    model = CNN(rngs=nnx.Rngs(seed))
    if not model_dropout:
        model.dropout1.rate = model.dropout2.rate = 0.0
    return model


# -- graphmod ---------------------------------------------------------------------------------
def graphmod_step(model: CNN, dropout: float, noise: float, seed: int, batch: Batch
                  ) -> tuple[graphmod.TrainStep, Any]:
    """``graphmod.optimize``'s step over the unmodified CNN and its first state. The model's
    ``rngs`` argument is None: its Dropout draws from the program's step key."""
    chosen = [managers.Dropout(dropout, bricks=[nnx.Linear], roles=[roles.INPUT]),
              managers.WeightNoise(noise, roles=[roles.WEIGHT])]
    program = graphmod.compile(lambda m, x, y: cross_entropy(m(x, None), y), model,
                               managers=chosen)
    step = graphmod.optimize(program, optax.adam(LR))
    return step, step.init(program.init(*batch), jax.random.key(seed))


# -- by hand in plain NNX ---------------------------------------------------------------------
def drop(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    keep = 1.0 - rate
    return jnp.where(jax.random.bernoulli(key, keep, x.shape), x / keep, 0.0)


def hand_forward(m: CNN, x: jax.Array, key: jax.Array, dropout: float) -> jax.Array:
    """``CNN.__call__`` written out with inverted dropout before each ``nnx.Linear``."""
    k_model, k_1, k_2 = jax.random.split(key, 3)
    rngs = nnx.Rngs(dropout=k_model)
    x = m.avg_pool(nnx.relu(m.batch_norm1(m.dropout1(m.conv1(x), rngs=rngs))))
    x = m.avg_pool(nnx.relu(m.batch_norm2(m.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(m.dropout2(m.linear1(drop(x, dropout, k_1)), rngs=rngs))
    return m.linear2(drop(x, dropout, k_2))


def hand_step(model: CNN, dropout: float, noise: float, seed: int
              ) -> tuple[Callable[..., Any], dict]:
    """A jitted, donating ``step(state, x, y) -> (state, loss)`` over the split CNN."""
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    tx = optax.adam(LR)
    state = {"params": params, "stats": stats, "opt": tx.init(params), "step": jnp.int32(0),
             "rng": jax.random.key(seed)}

    def step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
        key = jax.random.fold_in(state["rng"], state["step"])
        k_noise, k_forward = jax.random.split(key)

        def loss(params: Any, stats: Any) -> tuple[jax.Array, Any]:
            # Copies of the statistics made in this trace: NNX writes a Variable only in the
            # trace it was made in.
            m = nnx.merge(graphdef, params, jax.tree.map(jnp.asarray, stats))
            for i, name in enumerate(NOISY):
                kernel = getattr(m, name).kernel
                kernel[...] = kernel[...] + noise * jax.random.normal(
                    jax.random.fold_in(k_noise, i), kernel.shape, kernel.dtype)
            value = cross_entropy(hand_forward(m, x, k_forward, dropout), y)
            return value, nnx.state(m, nnx.BatchStat)

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(state["params"],
                                                                      state["stats"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "stats": stats,
                "opt": opt, "step": state["step"] + 1, "rng": state["rng"]}, value

    return jax.jit(step, donate_argnums=0), state


# -- the runs ---------------------------------------------------------------------------------
def build(name: str, seed: int, batch: Batch) -> tuple[Variant, Callable[[], Any]]:
    """A fresh, uncompiled step of variant ``name`` and the jitted function its HLO and
    jaxpr come from, with the current state bound."""
    model = new_model(seed, model_dropout=True)
    if name == "graphmod":
        fn, state = graphmod_step(model, DROPOUT, NOISE, seed, batch)
        # Called through its public API: lower it inside a jax.jit, as train_step.py does.
        jitted = jax.jit(lambda s, x, y: fn(s, x, y))
    else:
        fn, state = hand_step(model, DROPOUT, NOISE, seed)
        jitted = fn
    call, holder = functional(fn, state)
    return Variant(name, call), lambda: (jitted, holder[0])


def check_same_math(seed: int, batch: Batch, steps: int = 3) -> float:
    """With every dropout and the noise off, both steps agree from the same weights.

    Returns the largest absolute difference of the losses and of batch_norm1's running mean
    after ``steps`` steps; raises if it is over 1e-4.
    """
    step, state = graphmod_step(new_model(seed, False), 0.0, 0.0, seed, batch)
    hand, hand_state = hand_step(new_model(seed, False), 0.0, 0.0, seed)
    worst = 0.0
    for _ in range(steps):
        state, metrics = step(state, *batch)
        hand_state, hand_loss = hand(hand_state, *batch)
        worst = max(worst, abs(float(metrics["loss"]) - float(hand_loss)))
    ours = np.asarray(state.variables["model"]["batch_norm1"]["mean"])
    theirs = np.asarray(hand_state["stats"]["batch_norm1"]["mean"][...])
    worst = max(worst, float(np.max(np.abs(ours - theirs))))
    if worst > 1e-4:
        raise AssertionError(f"the variants do not compute the same step: difference {worst}")
    return worst


def compile_times(seed: int, batch: Batch, builds: int) -> dict[str, list[dict[str, float]]]:
    """Trace / lower / XLA compile seconds and first-call seconds of ``builds`` fresh builds
    of each variant, alternating which goes first."""
    names = ["graphmod", "hand"]
    out: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for b in range(builds):
        for name in names[b % 2:] + names[:b % 2]:
            variant, _ = build(name, seed, batch)
            first_call(variant, batch)
            out[name].append({**variant.compile_s, "first_call": variant.first_call_s})
    return out


RANDOM = {"random_bits", "random_seed", "random_wrap", "random_unwrap", "threefry2x32",
          "random_fold_in", "random_split"}


def primitives(jaxpr: Any) -> Counter[str]:
    """How often each primitive occurs in a (closed) jaxpr, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    counts: Counter[str] = Counter()
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    counts += primitives(sub)
    return counts


def profile(jitted: Callable[[], Any], batch: Batch, hlo: bool) -> dict[str, Any]:
    """The step's jaxpr equations (all, and random ones) by primitive and, if ``hlo``, the
    instruction count of its optimized HLO."""
    fn, state = jitted()
    counts = primitives(jax.make_jaxpr(fn)(state, *batch))
    return {"jaxpr_equations": sum(counts.values()),
            "random_equations": sum(n for name, n in counts.items() if name in RANDOM),
            "primitives": dict(sorted(counts.items())),
            "hlo_instructions": count_instructions(fn.lower(state, *batch).compile().as_text())
            if hlo else None}


# -- report -----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__, "flax_results")
    parser.add_argument("--builds", type=int, default=None, help="fresh builds compiled")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the results."""
    args = parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 30)
    block = args.block or (2 if args.quick else 5)
    builds = args.builds or (1 if args.quick else 7)
    data = np.random.default_rng(args.seed)
    batches = [(jnp.asarray(data.random((BATCH, 28, 28, 1), np.float32)),
                jnp.asarray(data.integers(0, 10, BATCH, dtype=np.int32))) for _ in range(4)]

    started = time.perf_counter()
    difference = check_same_math(args.seed, batches[0])
    compiles = compile_times(args.seed, batches[0], builds)
    built = [build(name, args.seed, batches[0]) for name in ("graphmod", "hand")]
    variants = [variant for variant, _ in built]
    interleave(variants, batches, repeats, block)
    profiles = {v.name: profile(jitted, batches[0], hlo=not args.quick) for v, jitted in built}
    seconds = time.perf_counter() - started

    env = environment()
    rows = []
    for v in variants:
        stages = compiles[v.name]
        rows.append({
            "variant": v.name, "median_ms": statistics.median(v.times) * 1e3,
            "p10_ms": percentile(v.times, 10) * 1e3, "p90_ms": percentile(v.times, 90) * 1e3,
            **{f"{k}_s": statistics.median(s[k] for s in stages)
               for k in ("trace", "lower", "compile", "first_call")},
            "compile_total_s": statistics.median(
                s["trace"] + s["lower"] + s["compile"] for s in stages),
            "trace_lower_s": statistics.median(s["trace"] + s["lower"] for s in stages),
            **profiles[v.name],
        })
    ours, hand = rows
    step_ratio = ours["median_ms"] / hand["median_ms"]
    compile_ratio = ours["compile_total_s"] / hand["compile_total_s"]
    first_ratio = ours["first_call_s"] / hand["first_call_s"]
    python_ratio = ours["trace_lower_s"] / hand["trace_lower_s"]
    lines = [
        "| variant | median step (ms) | p10-p90 (ms) | trace / lower / XLA compile (s) "
        "| compile total (s) | first call (s) | jaxpr equations (random) | HLO instructions |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        hlo = "—" if r["hlo_instructions"] is None else str(r["hlo_instructions"])
        lines.append(
            f"| {r['variant']} | {r['median_ms']:.1f} | {r['p10_ms']:.1f}-{r['p90_ms']:.1f} "
            f"| {r['trace_s']:.2f} / {r['lower_s']:.2f} / {r['compile_s']:.2f} "
            f"| {r['compile_total_s']:.2f} | {r['first_call_s']:.2f} "
            f"| {r['jaxpr_equations']} ({r['random_equations']}) | {hlo} |")
    report = "\n".join([
        "# Managers on an unmodified Flax model",
        "",
        f"{env['date']} · JAX {env['jax']} ({env['platform']}, {env['device']}, "
        f"{env['cpu_count']} CPUs, shared with other processes) · Flax {env['flax']} · "
        f"graphmod {env['graphmod']}" + (" · **--quick: not meaningful**" if args.quick else ""),
        "",
        f"Flax's MNIST CNN (examples/mnist, unmodified, with its own BatchNorm and Dropout), "
        f"batch {BATCH}, Adam; dropout {DROPOUT} on the inputs of the nnx.Linear layers, weight "
        f"noise {NOISE} on every kernel. Step: medians of {repeats} interleaved blocks of "
        f"{block} steps. Compile: medians over {builds} fresh builds of each, interleaved.",
        "",
        "\n".join(lines),
        "",
        "| ratio graphmod / hand | value | target |",
        "|---|--:|--:|",
        f"| step time | {step_ratio:.3f} | ≤ 1.03 |",
        f"| compile (trace + lower + XLA) | {compile_ratio:.3f} | ≤ 1.2 |",
        f"| first call (compile + one step) | {first_ratio:.3f} | — |",
        f"| trace + lower alone (graphmod's own part) | {python_ratio:.3f} | — |",
        "",
        f"Same-math check (every dropout and the noise off, 3 steps): largest difference "
        f"{difference:.1e}. Benchmark time {seconds:.0f} s.",
        "",
    ])
    print(report)
    results = {"environment": env, "quick": args.quick, "repeats": repeats, "block": block,
               "builds": builds, "rows": rows, "compile_runs": compiles,
               "step_ratio": step_ratio, "compile_ratio": compile_ratio,
               "first_call_ratio": first_ratio, "trace_lower_ratio": python_ratio,
               "same_math_difference": difference,
               "seconds": seconds}
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "flax_results.md").write_text(report)
        (args.out / "flax_results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
