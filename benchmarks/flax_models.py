"""Managers on unmodified Flax models: graphmod against the same regularization by hand.

Two models from Flax's examples, imported unmodified from ``examples/flax_nnx``, each
regularized two ways and timed in one process:

``cnn``
    Flax's MNIST CNN (``examples/mnist``, NNX version: two ``nnx.Conv`` with
    ``nnx.BatchNorm``, its own ``nnx.Dropout(0.025)`` twice, two ``nnx.Linear``), random
    28x28x1 images, batch 128, cross-entropy. Dropout 0.1 on the inputs of both
    ``nnx.Linear``, weight noise 0.01 on every ``kernel`` (convolutions and linears).
``transformer_lm``
    Flax's lm1b ``TransformerLM`` (``examples/lm1b_nnx``: ``nnx.MultiHeadAttention``,
    ``nnx.Embed``, ``nnx.LayerNorm``, its own ``nnx.Dropout(0.1)`` and attention dropout 0.1),
    vocabulary 1000, embedding 128, 4 heads, MLP 512, 2 layers, random tokens, batch 16 of
    length 64, next-token cross-entropy. Dropout 0.1 on the inputs and weight noise 0.01 on
    the kernels of the attention projections (``query``, ``key``, ``value``, ``out``: the
    model's ``nnx.LinearGeneral`` layers).

The two ways, both with ``optax.adam(1e-3)``:

``graphmod``
    the unmodified model compiled with ``managers.Dropout(0.1, bricks=[...],
    roles=[INPUT])`` and ``managers.WeightNoise(0.01, ...)`` (CNN: ``bricks=[nnx.Linear]``
    and ``roles=[WEIGHT]``; TransformerLM: ``bricks=[nnx.LinearGeneral]`` for both),
    stepped by ``graphmod.optimize``. The model's own Dropout (and the CNN's BatchNorm)
    follow the program: masks from the step key, batch statistics in training.
``hand``
    the same in plain NNX: ``nnx.split`` once into parameters and batch statistics, a
    ``jax.jit`` step (donating) that ``nnx.merge``\\ s them, adds ``0.01 * N(0, 1)`` to each
    selected kernel, applies inverted dropout (masks drawn by hand from the step key) to the
    inputs of the selected layers — the CNN's forward written out, the TransformerLM's
    attention projections wrapped in the merged copy — passes an ``nnx.Rngs`` from the step
    key to the model's own dropout, and applies Adam to the ``nnx.Param`` leaves.

Before timing, both are built with every dropout and the noise off from the same initial
weights and checked to give the same losses and the same value of one variable (the CNN's
first running mean, the TransformerLM's first query kernel) for three steps.

Reported per model: the step-time ratio graphmod/hand (medians of interleaved blocks of
steps, ended by ``block_until_ready``) and the compile-time ratio (trace + lower + XLA
compile of the first step, from JAX's monitoring events, over several fresh builds,
interleaved), with the jaxpr equation and optimized-HLO instruction counts of each step to
show where a difference comes from.

Run::

    python benchmarks/flax_models.py                    # ~10 minutes on 2 CPU cores
    python benchmarks/flax_models.py --quick            # a smoke run, numbers meaningless
    python benchmarks/flax_models.py --models transformer_lm

Writes ``benchmarks/flax_results.md`` and ``benchmarks/flax_results.json`` (``--out`` to
change the directory, ``--no-write`` to only print).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_step import (
    Variant,
    arguments,
    count_instructions,
    environment,
    first_call,
    functional,
    interleave,
    percentile,
    write_results,
)

import graphmod
import managers
from graphmod import roles

# The Flax models live in examples/ at the repository root, which `python benchmarks/...`
# does not put on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.flax_nnx.lm1b import TransformerConfig, TransformerLM
from examples.flax_nnx.mnist import CNN

Args = tuple[jax.Array, ...]
LR = 1e-3
DROPOUT = 0.1
NOISE = 0.01


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def drop(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Inverted dropout, written by hand."""
    keep = 1.0 - rate
    return jnp.where(jax.random.bernoulli(key, keep, x.shape), x / keep, 0.0)


@dataclasses.dataclass(frozen=True)
class Model:
    """One model of the benchmark and the same regularization written both ways.

    ``new(seed, model_dropout)`` builds it unmodified (``model_dropout=False`` sets its own
    dropout rates to 0, for the same-math check); ``managers(dropout, noise)`` are
    graphmod's; ``cost(model, *args)`` is graphmod's cost (the model's own dropout gets no
    ``rngs``: it draws from the program's key). By hand: ``kernels(model)`` are the
    variables the noise is added to, and ``hand_loss(model, key, dropout, *args)`` runs the
    forward with dropout on the selected inputs. ``probe`` names a variable compared after
    the same-math check, under the hand state's ``collection``.
    """

    name: str
    summary: str
    new: Callable[[int, bool], nnx.Module]
    managers: Callable[[float, float], list[graphmod.Manager]]
    cost: Callable[..., jax.Array]
    kernels: Callable[[Any], list[nnx.Variable]]
    hand_loss: Callable[..., jax.Array]
    batches: Callable[[np.random.Generator], list[Args]]
    collection: str
    probe: tuple[str, ...]


# -- Flax's MNIST CNN -------------------------------------------------------------------------
CNN_BATCH = 128
CNN_NOISY = ("conv1", "conv2", "linear1", "linear2")  # the layers whose kernel is a WEIGHT


def new_cnn(seed: int, model_dropout: bool) -> CNN:
    model = CNN(rngs=nnx.Rngs(seed))
    if not model_dropout:
        model.dropout1.rate = model.dropout2.rate = 0.0
    return model


def cnn_forward(m: CNN, x: jax.Array, key: jax.Array, dropout: float) -> jax.Array:
    """``CNN.__call__`` written out with inverted dropout before each ``nnx.Linear``."""
    k_model, k_1, k_2 = jax.random.split(key, 3)
    rngs = nnx.Rngs(dropout=k_model)
    x = m.avg_pool(nnx.relu(m.batch_norm1(m.dropout1(m.conv1(x), rngs=rngs))))
    x = m.avg_pool(nnx.relu(m.batch_norm2(m.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(m.dropout2(m.linear1(drop(x, dropout, k_1)), rngs=rngs))
    return m.linear2(drop(x, dropout, k_2))


def cnn_batches(data: np.random.Generator) -> list[Args]:
    return [(jnp.asarray(data.random((CNN_BATCH, 28, 28, 1), np.float32)),
             jnp.asarray(data.integers(0, 10, CNN_BATCH, dtype=np.int32))) for _ in range(4)]


MNIST_CNN = Model(
    name="cnn",
    summary=(f"Flax's MNIST CNN (examples/mnist, unmodified, with its own BatchNorm and "
             f"Dropout), 28x28x1 images, batch {CNN_BATCH}, Adam; dropout {DROPOUT} on the "
             f"inputs of the nnx.Linear layers, weight noise {NOISE} on every kernel."),
    new=new_cnn,
    managers=lambda dropout, noise: [
        managers.Dropout(dropout, bricks=[nnx.Linear], roles=[roles.INPUT]),
        managers.WeightNoise(noise, roles=[roles.WEIGHT])],
    cost=lambda m, x, y: cross_entropy(m(x, None), y),
    kernels=lambda m: [getattr(m, name).kernel for name in CNN_NOISY],
    hand_loss=lambda m, key, dropout, x, y: cross_entropy(cnn_forward(m, x, key, dropout), y),
    batches=cnn_batches,
    collection="stats",
    probe=("batch_norm1", "mean"),
)


# -- Flax's lm1b TransformerLM ----------------------------------------------------------------
LM_BATCH, LM_LENGTH, LM_VOCAB = 16, 64, 1000
PROJECTIONS = ("query", "key", "value", "out")  # MultiHeadAttention's nnx.LinearGeneral


def new_lm(seed: int, model_dropout: bool) -> TransformerLM:
    rate = 0.1 if model_dropout else 0.0
    config = TransformerConfig(
        vocab_size=LM_VOCAB, output_vocab_size=LM_VOCAB, emb_dim=128, num_heads=4,
        num_layers=2, qkv_dim=128, mlp_dim=512, max_len=LM_LENGTH, dropout_rate=rate,
        attention_dropout_rate=rate)
    # Its parameters carry sharding annotations; without a mesh, Flax must not apply them.
    with nnx.use_eager_sharding(False):
        model = TransformerLM(config, rngs=nnx.Rngs(seed))
    model.set_attributes(deterministic=False, decode=False)  # lm1b's training configuration
    return model


def attention(m: TransformerLM) -> list[nnx.MultiHeadAttention]:
    return [getattr(m.decoder, f"encoderdecoderblock_{i}").attention
            for i in range(m.config.num_layers)]


class DropInput(nnx.Module):
    """``layer`` with inverted dropout on its input: the hand-written rewrite of one
    projection (it takes the projection's place in the merged copy of the model)."""

    def __init__(self, layer: nnx.Module, rate: float, key: jax.Array) -> None:
        self.layer, self.rate, self.key = layer, rate, key

    def __call__(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        return self.layer(drop(x, self.rate, self.key), **kwargs)


def lm_loss(m: TransformerLM, key: jax.Array, dropout: float, tokens: jax.Array) -> jax.Array:
    """The TransformerLM's loss with dropout on the input of each attention projection."""
    k_model, k_drop = jax.random.split(key)
    for i, layer in enumerate(attention(m)):
        for j, name in enumerate(PROJECTIONS):
            key_ij = jax.random.fold_in(k_drop, i * len(PROJECTIONS) + j)
            setattr(layer, name, DropInput(getattr(layer, name), dropout, key_ij))
    return cross_entropy(m(tokens, rngs=nnx.Rngs(dropout=k_model)), tokens)


def lm_batches(data: np.random.Generator) -> list[Args]:
    # Token 0 is lm1b's padding; the model shifts its inputs right, so the labels are them.
    return [(jnp.asarray(data.integers(1, LM_VOCAB, (LM_BATCH, LM_LENGTH), dtype=np.int32)),)
            for _ in range(4)]


TRANSFORMER_LM = Model(
    name="transformer_lm",
    summary=(f"Flax's lm1b TransformerLM (examples/lm1b_nnx, unmodified, with its own "
             f"Dropout and attention dropout 0.1): vocabulary {LM_VOCAB}, embedding 128, "
             f"4 heads, MLP 512, 2 layers, batch {LM_BATCH} of {LM_LENGTH} tokens, Adam; "
             f"dropout {DROPOUT} on the inputs and weight noise {NOISE} on the kernels of the "
             f"attention projections (query, key, value, out: nnx.LinearGeneral)."),
    new=new_lm,
    managers=lambda dropout, noise: [
        managers.Dropout(dropout, bricks=[nnx.LinearGeneral], roles=[roles.INPUT]),
        managers.WeightNoise(noise, bricks=[nnx.LinearGeneral], roles=[roles.WEIGHT])],
    cost=lambda m, tokens: cross_entropy(m(tokens), tokens),
    kernels=lambda m: [getattr(layer, name).kernel
                       for layer in attention(m) for name in PROJECTIONS],
    hand_loss=lm_loss,
    batches=lm_batches,
    collection="params",
    probe=("decoder", "encoderdecoderblock_0", "attention", "query", "kernel"),
)

MODELS = {model.name: model for model in (MNIST_CNN, TRANSFORMER_LM)}


# -- graphmod ---------------------------------------------------------------------------------
def graphmod_step(spec: Model, model: nnx.Module, dropout: float, noise: float, seed: int,
                  args: Args) -> tuple[graphmod.TrainStep, Any]:
    """``graphmod.optimize``'s step over the unmodified model and its first state."""
    program = graphmod.compile(spec.cost, model, managers=spec.managers(dropout, noise))
    step = graphmod.optimize(program, optax.adam(LR))
    return step, step.init(program.init(*args), jax.random.key(seed))


# -- by hand in plain NNX ---------------------------------------------------------------------
def hand_step(spec: Model, model: nnx.Module, dropout: float, noise: float, seed: int
              ) -> tuple[Callable[..., Any], dict]:
    """A jitted, donating ``step(state, *args) -> (state, loss)`` over the split model."""
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    tx = optax.adam(LR)
    state = {"params": params, "stats": stats, "opt": tx.init(params), "step": jnp.int32(0),
             "rng": jax.random.key(seed)}

    def step(state: dict, *args: jax.Array) -> tuple[dict, jax.Array]:
        key = jax.random.fold_in(state["rng"], state["step"])
        k_noise, k_forward = jax.random.split(key)

        def loss(params: Any, stats: Any) -> tuple[jax.Array, Any]:
            # Copies of the statistics made in this trace: NNX writes a Variable only in the
            # trace it was made in.
            m = nnx.merge(graphdef, params, jax.tree.map(jnp.asarray, stats))
            for i, kernel in enumerate(spec.kernels(m)):
                kernel[...] = kernel[...] + noise * jax.random.normal(
                    jax.random.fold_in(k_noise, i), kernel.shape, kernel.dtype)
            value = spec.hand_loss(m, k_forward, dropout, *args)
            return value, nnx.state(m, nnx.BatchStat)

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(state["params"],
                                                                      state["stats"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "stats": stats,
                "opt": opt, "step": state["step"] + 1, "rng": state["rng"]}, value

    return jax.jit(step, donate_argnums=0), state


# -- the runs ---------------------------------------------------------------------------------
def build(spec: Model, name: str, seed: int, args: Args
          ) -> tuple[Variant, Callable[[], Any]]:
    """A fresh, uncompiled step of variant ``name`` and the jitted function its HLO and
    jaxpr come from, with the current state bound."""
    model = spec.new(seed, True)
    if name == "graphmod":
        fn, state = graphmod_step(spec, model, DROPOUT, NOISE, seed, args)
        # Called through its public API: lower it inside a jax.jit, as train_step.py does.
        jitted = jax.jit(lambda s, *a: fn(s, *a))
    else:
        fn, state = hand_step(spec, model, DROPOUT, NOISE, seed)
        jitted = fn
    call, holder = functional(fn, state)
    return Variant(name, call), lambda: (jitted, holder[0])


def lookup(tree: Any, path: Sequence[str]) -> np.ndarray:
    for key in path:
        tree = tree[key]
    return np.asarray(tree[...] if isinstance(tree, nnx.Variable) else tree)


def check_same_math(spec: Model, seed: int, args: Args, steps: int = 3) -> float:
    """With every dropout and the noise off, both steps agree from the same weights.

    Returns the largest absolute difference of the losses and of ``spec.probe`` after
    ``steps`` steps; raises if it is over 1e-4.
    """
    step, state = graphmod_step(spec, spec.new(seed, False), 0.0, 0.0, seed, args)
    hand, hand_state = hand_step(spec, spec.new(seed, False), 0.0, 0.0, seed)
    worst = 0.0
    for _ in range(steps):
        state, metrics = step(state, *args)
        hand_state, hand_loss = hand(hand_state, *args)
        worst = max(worst, abs(float(metrics["loss"]) - float(hand_loss)))
    ours = lookup(state.variables["model"], spec.probe)
    theirs = lookup(hand_state[spec.collection], spec.probe)
    worst = max(worst, float(np.max(np.abs(ours - theirs))))
    if worst > 1e-4:
        raise AssertionError(
            f"{spec.name}: the variants do not compute the same step: difference {worst}")
    return worst


def compile_times(spec: Model, seed: int, args: Args, builds: int
                  ) -> dict[str, list[dict[str, float]]]:
    """Trace / lower / XLA compile seconds and first-call seconds of ``builds`` fresh builds
    of each variant, alternating which goes first."""
    names = ["graphmod", "hand"]
    out: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for b in range(builds):
        for name in names[b % 2:] + names[:b % 2]:
            variant, _ = build(spec, name, seed, args)
            first_call(variant, args)
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


def profile(jitted: Callable[[], Any], args: Args, hlo: bool) -> dict[str, Any]:
    """The step's jaxpr equations (all, and random ones) by primitive and, if ``hlo``, the
    instruction count of its optimized HLO."""
    fn, state = jitted()
    counts = primitives(jax.make_jaxpr(fn)(state, *args))
    return {"jaxpr_equations": sum(counts.values()),
            "random_equations": sum(n for name, n in counts.items() if name in RANDOM),
            "primitives": dict(sorted(counts.items())),
            "hlo_instructions": count_instructions(fn.lower(state, *args).compile().as_text())
            if hlo else None}


def run(spec: Model, seed: int, repeats: int, block: int, builds: int, hlo: bool
        ) -> dict[str, Any]:
    """Every measurement of one model: the same-math check, compile times, interleaved
    step times and the profiles; returns its results."""
    started = time.perf_counter()
    batches = spec.batches(np.random.default_rng(seed))
    difference = check_same_math(spec, seed, batches[0])
    compiles = compile_times(spec, seed, batches[0], builds)
    built = [build(spec, name, seed, batches[0]) for name in ("graphmod", "hand")]
    variants = [variant for variant, _ in built]
    interleave(variants, batches, repeats, block)
    profiles = {v.name: profile(jitted, batches[0], hlo) for v, jitted in built}
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
    return {"rows": rows, "compile_runs": compiles,
            "step_ratio": ours["median_ms"] / hand["median_ms"],
            "compile_ratio": ours["compile_total_s"] / hand["compile_total_s"],
            "first_call_ratio": ours["first_call_s"] / hand["first_call_s"],
            "trace_lower_ratio": ours["trace_lower_s"] / hand["trace_lower_s"],
            "same_math_difference": difference, "seconds": time.perf_counter() - started}


# -- report -----------------------------------------------------------------------------------
def section(spec: Model, result: dict[str, Any]) -> list[str]:
    """The Markdown tables of one model."""
    lines = [
        f"## {spec.name}", "", spec.summary, "",
        "| variant | median step (ms) | p10-p90 (ms) | trace / lower / XLA compile (s) "
        "| compile total (s) | first call (s) | jaxpr equations (random) | HLO instructions |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in result["rows"]:
        hlo = "—" if r["hlo_instructions"] is None else str(r["hlo_instructions"])
        lines.append(
            f"| {r['variant']} | {r['median_ms']:.1f} | {r['p10_ms']:.1f}-{r['p90_ms']:.1f} "
            f"| {r['trace_s']:.2f} / {r['lower_s']:.2f} / {r['compile_s']:.2f} "
            f"| {r['compile_total_s']:.2f} | {r['first_call_s']:.2f} "
            f"| {r['jaxpr_equations']} ({r['random_equations']}) | {hlo} |")
    return [*lines, "",
            "| ratio graphmod / hand | value | target |",
            "|---|--:|--:|",
            f"| step time | {result['step_ratio']:.3f} | ≤ 1.03 |",
            f"| compile (trace + lower + XLA) | {result['compile_ratio']:.3f} | ≤ 1.2 |",
            f"| first call (compile + one step) | {result['first_call_ratio']:.3f} | — |",
            f"| trace + lower alone (graphmod's own part) | {result['trace_lower_ratio']:.3f} "
            f"| — |",
            "",
            f"Same-math check (every dropout and the noise off, 3 steps): largest difference "
            f"{result['same_math_difference']:.1e}. Time {result['seconds']:.0f} s.",
            ""]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = arguments(__doc__, "flax_results")
    parser.add_argument("--builds", type=int, default=None, help="fresh builds compiled")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="the models to run (default: all)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the results."""
    args = parse_args(argv)
    # Blocks of one step vary by about 5% on a shared 2-core machine, XLA compile times by
    # 20%: the medians need this many.
    repeats = args.repeats or (3 if args.quick else 60)
    block = args.block or (2 if args.quick else 10)
    builds = args.builds or (1 if args.quick else 9)
    results = {name: run(MODELS[name], args.seed, repeats, block, builds, not args.quick)
               for name in args.models}

    env = environment()
    report = "\n".join([
        "# Managers on unmodified Flax models",
        "",
        f"{env['date']} · JAX {env['jax']} ({env['platform']}, {env['device']}, "
        f"{env['cpu_count']} CPUs, shared with other processes) · Flax {env['flax']} · "
        f"graphmod {env['graphmod']}" + (" · **--quick: not meaningful**" if args.quick else ""),
        "",
        f"Step: medians of {repeats} interleaved blocks of {block} steps. Compile: medians "
        f"over {builds} fresh builds of each variant, interleaved.",
        "",
        *(line for name, result in results.items() for line in section(MODELS[name], result)),
    ])
    out = {"environment": env, "quick": args.quick, "repeats": repeats, "block": block,
           "builds": builds, "models": results}
    write_results(args, "flax_results", report, out)
    return out


if __name__ == "__main__":
    main()
