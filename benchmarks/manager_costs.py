"""Each manager's cost against the same rewrite written by hand in JAX.

For every built-in manager: one Adam train step of the digits MLP (64-256-256-10, ReLU,
batch 128) with the manager applied by ``graphmod.compile`` and stepped by
``graphmod.optimize``, against a ``jax.jit`` step over plain dicts with the same rewrite
written out by hand (same layers, same math; random streams differ). Variants run
round-robin in one process; the table gives each pair's median step times and their ratio
(graphmod / hand), a control (the hand-written step compiled a second time and timed with
the two: its ratio to the first shows how far the machine's noise alone moves a ratio),
and how the work of the two compiled steps compares (XLA's cost analysis: flops and bytes
accessed, graphmod / hand; 1.000 is the same work, so a time ratio away from 1 with both
at 1.000 is the machine's noise or the call's dispatch).

Run::

    python benchmarks/manager_costs.py            # a few minutes on 2 cores
    python benchmarks/manager_costs.py --quick    # smoke run, numbers meaningless

Writes ``benchmarks/managers_results.md`` and ``.json`` (``--out``, ``--no-write``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_step import (
    BATCH,
    DIMS,
    EPSILON,
    LR,
    MOMENTUM,
    Variant,
    arguments,
    compiler,
    cross_entropy,
    environment,
    functional,
    initial_weights,
    interleave,
    write_results,
)

import graphmod
import managers
from graphmod import roles

Hook = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Case:
    """A manager on the MLP (``make(mlp)``) and its rewrite by hand: hooks on every linear
    layer's input ``(x, key)``, weight ``(W, params, key)`` (with ``weight_params(W)`` of
    its own), affine map ``(x, W, b)`` and hidden output ``(h, params, stats, key) -> (h,
    stats)`` (with parameters and statistics per hidden width), a ``penalty(params)``
    added to the loss, and ``frozen_base`` (only the hooks' own parameters trained)."""

    name: str
    make: Callable[[Any], list[graphmod.Manager]]
    input: Hook | None = None
    weight: Hook | None = None
    weight_params: Callable[[jax.Array], dict] = lambda w: {}
    dense: Hook = lambda x, w, b: x @ w + b
    hidden: Hook | None = None
    hidden_params: Callable[[int], dict] = lambda n: {}
    hidden_stats: Callable[[int], dict] = lambda n: {}
    penalty: Callable[[dict], jax.Array] | None = None
    frozen_base: bool = False


def _dropout(x: jax.Array, key: jax.Array, rate: float = 0.2) -> jax.Array:
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x * (1 / (1 - rate)), 0)


def _bf16_dense(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    low = jnp.bfloat16
    return (x.astype(low) @ w.astype(low) + b.astype(low)).astype(x.dtype)


def _squares(params: dict) -> jax.Array:
    return sum(jnp.sum(layer["W"] ** 2) for layer in params["linear"])


def _batch_norm(h: jax.Array, params: dict, stats: dict) -> tuple[jax.Array, dict]:
    mean, var = h.mean(0), jnp.mean(jnp.square(h - h.mean(0)), 0)
    new = {"mean": MOMENTUM * stats["mean"] + (1 - MOMENTUM) * mean,
           "var": MOMENTUM * stats["var"] + (1 - MOMENTUM) * var}
    return (h - mean) * jax.lax.rsqrt(var + EPSILON) * params["scale"] + params["bias"], new


CASES = [
    Case("Dropout(0.2) on inputs",
         lambda mlp: [managers.Dropout(0.2, bricks=mlp.linear_layers, roles=[roles.INPUT])],
         input=_dropout),
    Case("WeightNoise(0.01)", lambda mlp: [managers.WeightNoise(0.01, roles=[roles.WEIGHT])],
         weight=lambda w, p, key: w + 0.01 * jax.random.normal(key, w.shape)),
    Case("GaussianNoise(0.1) on hidden outputs",
         lambda mlp: [managers.GaussianNoise(0.1, bricks=mlp.linear_layers[:-1],
                                             roles=[roles.OUTPUT])],
         hidden=lambda h, p, s, key: (h + 0.1 * jax.random.normal(key, h.shape), s)),
    Case("BatchNorm on hidden outputs",
         lambda mlp: [managers.BatchNorm(momentum=MOMENTUM, epsilon=EPSILON,
                                         bricks=mlp.linear_layers[:-1],
                                         roles=[roles.OUTPUT])],
         hidden=lambda h, p, s, key: _batch_norm(h, p, s),
         hidden_params=lambda n: {"scale": jnp.ones(n), "bias": jnp.zeros(n)},
         hidden_stats=lambda n: {"mean": jnp.zeros(n), "var": jnp.ones(n)}),
    Case("MaxNorm(1.0) on W", lambda mlp: [managers.MaxNorm(1.0, roles=[roles.WEIGHT])],
         weight=lambda w, p, key: w * jnp.minimum(1, 1.0 / jnp.maximum(
             jnp.linalg.norm(w, axis=0, keepdims=True), 1e-12))),
    Case("WeightStandardization on W",
         lambda mlp: [managers.WeightStandardization(roles=[roles.WEIGHT])],
         weight=lambda w, p, key: (w - w.mean(0)) * jax.lax.rsqrt(w.var(0) + 1e-5)),
    Case("FakeQuant(8) on W", lambda mlp: [managers.FakeQuant(8, roles=[roles.WEIGHT])],
         weight=lambda w, p, key: w + jax.lax.stop_gradient(
             jnp.clip(jnp.round(w / (s := jnp.abs(w).max(0) / 127)), -127, 127) * s - w)),
    Case("WeightNorm on W", lambda mlp: [managers.WeightNorm(roles=[roles.WEIGHT])],
         weight=lambda w, p, key: w * (p["g"] / jnp.linalg.norm(w, axis=0)),
         weight_params=lambda w: {"g": jnp.linalg.norm(w, axis=0)}),
    Case("LoRA(4) on W, base frozen", lambda mlp: [managers.LoRA(4, roles=[roles.WEIGHT])],
         weight=lambda w, p, key: w + (1.0 / 4) * (p["a"] @ p["b"]),
         weight_params=lambda w: {"a": jax.random.normal(jax.random.key(0), (w.shape[0], 4))
                                  / np.sqrt(w.shape[0]), "b": jnp.zeros((4, w.shape[1]))},
         frozen_base=True),
    Case("L2(1e-4) on W", lambda mlp: [managers.L2(1e-4, roles=[roles.WEIGHT])],
         penalty=lambda params: 1e-4 * _squares(params)),
    Case("WeightDecay(1e-4) on W", lambda mlp: [managers.WeightDecay(1e-4, roles=[roles.WEIGHT])],
         penalty=lambda params: 0.5e-4 * _squares(params)),
    Case("Precision(bfloat16)", lambda mlp: [managers.Precision("bfloat16",
                                                                bricks=mlp.linear_layers)],
         dense=_bf16_dense),
    Case("Remat on each layer", lambda mlp: [managers.Remat(bricks=mlp.linear_layers)],
         dense=jax.checkpoint(lambda x, w, b: x @ w + b)),
    Case("StopGradient on inputs",
         lambda mlp: [managers.StopGradient(bricks=mlp.linear_layers, roles=[roles.INPUT])],
         input=lambda x, key: jax.lax.stop_gradient(x)),
]


# -- the two steps ----------------------------------------------------------------------------
def graphmod_variant(case: Case, seed: int, batch: tuple, dims: Sequence[int] = DIMS
                     ) -> tuple[Variant, list]:
    """graphmod's step of the MLP ``dims`` with ``case``'s managers, and its initial
    ``(W, b)`` per layer (the hand-written step starts from them)."""
    mlp = graphmod.bricks.MLP(list(dims), activation=jax.nn.relu, rngs=nnx.Rngs(seed))
    program = graphmod.compile(lambda m, x, y: cross_entropy(m(x), y), mlp,
                               managers=case.make(mlp))
    chosen = program.managers
    trainable = {"trainable": list(chosen)} if case.frozen_base else {}
    step = graphmod.optimize(program, optax.adam(LR), **trainable)
    state = step.init(program.init(*batch), jax.random.key(seed))
    weights = initial_weights(state)  # read before the first step donates the state
    call, holder = functional(step, state)
    return Variant("graphmod", call, compiler(step, holder, batch)), weights


def work(variant: Variant) -> tuple[float, float]:
    """XLA's flops and bytes accessed of ``variant``'s compiled step."""
    analysis = variant.compiled().cost_analysis()
    return analysis.get("flops", 0.0), analysis.get("bytes accessed", 0.0)


def hand_forward(case: Case, params: dict, stats: list, x: jax.Array, key: jax.Array
                 ) -> tuple[jax.Array, list]:
    layers, new_stats = params["linear"], []
    for i, layer in enumerate(layers):
        keys = jax.random.split(jax.random.fold_in(key, i), 3)
        x = case.input(x, keys[0]) if case.input else x
        w = case.weight(layer["W"], params["weight"][i], keys[1]) if case.weight \
            else layer["W"]
        x = case.dense(x, w, layer["b"])
        if i < len(layers) - 1:
            if case.hidden:
                x, new = case.hidden(x, params["hidden"][i], stats[i], keys[2])
                new_stats.append(new)
            x = jax.nn.relu(x)
    return x, new_stats


def hand_variant(case: Case, weights: list, seed: int, batch: tuple) -> Variant:
    """The same step written in JAX over plain dicts, from ``weights``."""
    widths = [w.shape[1] for w, _ in weights[:-1]]
    linear = [{"W": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in weights]
    params = {"linear": linear, "hidden": [case.hidden_params(n) for n in widths],
              "weight": [case.weight_params(layer["W"]) for layer in linear]}
    trained = ("weight",) if case.frozen_base else tuple(params)
    tx = optax.adam(LR)
    state = {"params": params, "stats": [case.hidden_stats(n) for n in widths],
             "opt": tx.init({k: params[k] for k in trained}), "step": jnp.int32(0),
             "rng": jax.random.key_data(jax.random.key(seed))}

    def step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        fixed = {k: v for k, v in state["params"].items() if k not in trained}

        def loss(train: dict) -> tuple[jax.Array, list]:
            params = {**fixed, **train}
            logits, stats = hand_forward(case, params, state["stats"], x, key)
            value = cross_entropy(logits, y)
            return value + (case.penalty(params) if case.penalty else 0.0), stats

        train = {k: state["params"][k] for k in trained}
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(train)
        updates, opt = tx.update(grads, state["opt"], train)
        return {**state, "params": {**fixed, **optax.apply_updates(train, updates)},
                "stats": stats or state["stats"], "opt": opt, "step": state["step"] + 1}, value

    jitted = jax.jit(step, donate_argnums=0)
    call, holder = functional(jitted, state)
    return Variant("hand", call, compiler(jitted, holder, batch))


# -- report -----------------------------------------------------------------------------------
def measure(case: Case, batches: Sequence[tuple], seed: int, repeats: int, block: int,
            analyse: bool = True) -> dict[str, Any]:
    """The pair's median step times, their ratio and the control's (the hand-written step
    compiled a second time, interleaved with the two: its ratio to the first is the noise
    of the measurement), and, with ``analyse``, the ratios of XLA's flops and bytes
    accessed of the compiled steps (1.000: the same work)."""
    ours, weights = graphmod_variant(case, seed, batches[0])
    hand = hand_variant(case, weights, seed, batches[0])
    again = dataclasses.replace(hand_variant(case, weights, seed, batches[0]), name="again")
    interleave([hand, ours, again], batches, repeats, block)
    h, g, a = (statistics.median(v.times) for v in (hand, ours, again))
    row = {"manager": case.name, "hand_us": h * 1e6, "graphmod_us": g * 1e6, "ratio": g / h,
           "control": a / h}
    if analyse:
        (hand_flops, hand_bytes), (flops, bytes_) = work(hand), work(ours)
        row.update(flops_ratio=flops / hand_flops, bytes_ratio=bytes_ / hand_bytes)
    return row


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = arguments(__doc__, "managers_results").parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 40)
    block = args.block or (3 if args.quick else 20)
    rng = np.random.default_rng(args.seed)
    batches = [(jnp.asarray(rng.standard_normal((BATCH, DIMS[0])), jnp.float32),
                jnp.asarray(rng.integers(0, DIMS[-1], BATCH))) for _ in range(4)]
    # One more XLA compile of each step: not worth it in a smoke run.
    rows = [measure(case, batches, args.seed, repeats, block, analyse=not args.quick)
            for case in CASES]
    lines = [f"Digits MLP {'-'.join(map(str, DIMS))}, batch {BATCH}, Adam; medians of "
             f"{repeats} interleaved blocks of {block} steps. XLA flops and bytes accessed: "
             "of the compiled steps (XLA's cost analysis), graphmod / hand. Control: the "
             "hand-written step compiled again and interleaved with the two, against the "
             "first (the measurement's noise).", "",
             "| manager | hand (µs) | graphmod (µs) | ratio | control | XLA flops | XLA bytes |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['manager']} | {r['hand_us']:.0f} | {r['graphmod_us']:.0f} "
              f"| {r['ratio']:.2f} | {r['control']:.2f} | {r.get('flops_ratio', math.nan):.3f} "
              f"| {r.get('bytes_ratio', math.nan):.3f} |" for r in rows]
    write_results(args, "managers_results", "# Manager cost against hand-written JAX\n\n"
                  + "\n".join(lines) + "\n", {"environment": environment(), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
