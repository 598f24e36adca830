"""Each manager's cost against the same rewrite written by hand in JAX.

For every built-in manager (but ``Sharding``: on one device there is nothing to place,
see ``sharding.py``): one Adam train step of the digits MLP (64-256-256-10, ReLU,
batch 128) with the manager applied by ``graphmod.compile`` and stepped by
``graphmod.optimize``, against a ``jax.jit`` step over plain dicts with the same rewrite
written out by hand (same layers, same math: three steps' losses must agree wherever no
random numbers are drawn; random streams differ). Variants run
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
    its own; with ``weight_stats(W)``, state of its own: ``(W, params, key, stats) -> (W,
    stats)``), affine map ``(x, W, b)``, output ``measure(y) -> metrics`` (returned by the
    step) and hidden output ``(h, params, stats, key) -> (h, stats)`` (with parameters and
    statistics per hidden width), a ``penalty(params)`` added to the loss, and
    ``frozen_base`` (only the hooks' own parameters trained); ``same_math`` False where the
    two steps draw different random numbers (or start LoRA's ``A`` from different draws),
    else their losses (and measurements) must agree. With ``branch(y, key)``, the
    middle layer is a residual branch (``graphmod.bricks.Residual``): ``x + branch(y)``;
    with ``targets(x, probabilities, key) -> (x, probabilities)``, the cost is
    ``graphmod.bricks.SoftmaxCrossEntropy`` in a :class:`Classifier` taking ``(x, y)``."""

    name: str
    make: Callable[[Any], list[graphmod.Manager]]
    input: Hook | None = None
    weight: Hook | None = None
    weight_params: Callable[[jax.Array], dict] = lambda w: {}
    weight_stats: Callable[[jax.Array], dict] | None = None
    dense: Hook = lambda x, w, b: x @ w + b
    hidden: Hook | None = None
    hidden_params: Callable[[int], dict] = lambda n: {}
    hidden_stats: Callable[[int], dict] = lambda n: {}
    measure: Callable[[jax.Array], dict] | None = None
    branch: Hook | None = None
    targets: Hook | None = None
    penalty: Callable[[dict], jax.Array] | None = None
    frozen_base: bool = False
    same_math: bool = True


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


def _spectral_norm(w: jax.Array, p: dict, key: jax.Array, s: dict) -> tuple[jax.Array, dict]:
    normalize = lambda v: v * jax.lax.rsqrt(jnp.sum(v * v) + 1e-12)
    left = normalize(s["u"] @ w.T)
    u = jax.lax.stop_gradient(normalize(left @ w))
    left = jax.lax.stop_gradient(left)
    sigma = (left @ w @ u.T)[0, 0]
    return w / jnp.where(sigma != 0, sigma, 1), {"u": u, "sigma": jax.lax.stop_gradient(sigma)}


def _stochastic_depth(y: jax.Array, key: jax.Array, rate: float = 0.2) -> jax.Array:
    kept = jax.random.bernoulli(key, 1 - rate, (y.shape[0], 1))
    return jnp.where(kept, y / (1 - rate), 0)


def _mixup(x: jax.Array, y: jax.Array, key: jax.Array, alpha: float = 0.4
           ) -> tuple[jax.Array, jax.Array]:
    weight_key, order_key = jax.random.split(key)
    lam = jax.random.beta(weight_key, alpha, alpha)
    perm = jax.random.permutation(order_key, x.shape[0])
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]


def _activation_stats(y: jax.Array) -> dict:
    y = jax.lax.stop_gradient(y)
    return {"mean": y.mean(), "std": y.std(), "zeros": jnp.mean(y == 0),
            "max_abs": jnp.max(jnp.abs(y))}


class Classifier(graphmod.Brick):
    """The MLP and its cost in one application taking the examples and their targets
    (what ``managers.Mixup`` selects)."""

    def __init__(self, mlp: graphmod.bricks.MLP) -> None:
        self.mlp = mlp
        self.cost = graphmod.bricks.SoftmaxCrossEntropy()

    @graphmod.application(inputs=["x"], targets=["y"], outputs=["cost"])
    def apply(self, x: jax.Array, y: jax.Array) -> jax.Array:
        return self.cost(self.mlp(x), y)


CASES = [
    Case("Dropout(0.2) on inputs",
         lambda mlp: [managers.Dropout(0.2, bricks=mlp.linear_layers, roles=[roles.INPUT])],
         input=_dropout, same_math=False),
    Case("WeightNoise(0.01)", lambda mlp: [managers.WeightNoise(0.01, roles=[roles.WEIGHT])],
         weight=lambda w, p, key: w + 0.01 * jax.random.normal(key, w.shape), same_math=False),
    Case("GaussianNoise(0.1) on hidden outputs",
         lambda mlp: [managers.GaussianNoise(0.1, bricks=mlp.linear_layers[:-1],
                                             roles=[roles.OUTPUT])],
         hidden=lambda h, p, s, key: (h + 0.1 * jax.random.normal(key, h.shape), s),
         same_math=False),
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
         frozen_base=True, same_math=False),
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
    Case("SpectralNorm on W", lambda mlp: [managers.SpectralNorm(roles=[roles.WEIGHT])],
         weight=_spectral_norm,
         weight_stats=lambda w: {"u": jnp.full((1, w.shape[1]), w.shape[1] ** -0.5),
                                 "sigma": jnp.ones(())}),
    Case("EMA(0.99) on W", lambda mlp: [managers.EMA(0.99, roles=[roles.WEIGHT])],
         weight=lambda w, p, key, s: (w, {
             "average": 0.99 * s["average"] + 0.01 * jax.lax.stop_gradient(w),
             "weight": 0.99 * s["weight"] + 0.01}),
         weight_stats=lambda w: {"average": jnp.zeros_like(w), "weight": jnp.zeros(())}),
    Case("StochasticDepth(0.2), middle layer residual",
         lambda mlp: [managers.StochasticDepth(0.2)], branch=_stochastic_depth,
         same_math=False),
    Case("LabelSmoothing(0.1)", lambda mlp: [managers.LabelSmoothing(0.1, num_classes=10)],
         targets=lambda x, y, key: (x, 0.9 * y + 0.1 / y.shape[-1])),
    Case("Mixup(0.4)", lambda mlp: [managers.Mixup(0.4, num_classes=10, bricks=[Classifier])],
         targets=_mixup, same_math=False),
    Case("ActivationStats on outputs",
         lambda mlp: [managers.ActivationStats(bricks=mlp.linear_layers,
                                               roles=[roles.OUTPUT])],
         measure=_activation_stats),
]


# -- the two steps ----------------------------------------------------------------------------
def graphmod_variant(case: Case, seed: int, batch: tuple, dims: Sequence[int] = DIMS
                     ) -> tuple[Variant, list]:
    """graphmod's step of the MLP ``dims`` with ``case``'s managers, and its initial
    ``(W, b)`` per layer (the hand-written step starts from them)."""
    mlp = graphmod.bricks.MLP(list(dims), activation=jax.nn.relu, rngs=nnx.Rngs(seed))
    if case.branch:
        mlp.linear_layers[1] = graphmod.bricks.Residual(mlp.linear_layers[1])
    model, cost = (Classifier(mlp), lambda m, x, y: m(x, y)) if case.targets \
        else (mlp, lambda m, x, y: cross_entropy(m(x), y))
    program = graphmod.compile(cost, model, managers=case.make(mlp))
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


def hand_forward(case: Case, params: dict, state: dict, x: jax.Array, key: jax.Array
                 ) -> tuple[jax.Array, dict]:
    """The logits and what the step keeps: new ``stats`` and ``weight_stats``, and the
    ``metrics`` of ``case.measure``."""
    layers, new = params["linear"], {"stats": [], "weight_stats": [], "metrics": {}}
    for i, layer in enumerate(layers):
        keys = jax.random.split(jax.random.fold_in(key, i), 3)
        x = case.input(x, keys[0]) if case.input else x
        w = layer["W"]
        if case.weight_stats:
            w, stats = case.weight(w, params["weight"][i], keys[1], state["weight_stats"][i])
            new["weight_stats"].append(stats)
        elif case.weight:
            w = case.weight(w, params["weight"][i], keys[1])
        y = case.dense(x, w, layer["b"])
        if case.measure:
            new["metrics"].update({f"{i}.{k}": v for k, v in case.measure(y).items()})
        x = x + case.branch(y, keys[2]) if case.branch and i == 1 else y
        if i < len(layers) - 1:
            if case.hidden:
                x, stats = case.hidden(x, params["hidden"][i], state["stats"][i], keys[2])
                new["stats"].append(stats)
            x = jax.nn.relu(x)
    return x, new


def hand_variant(case: Case, weights: list, seed: int, batch: tuple) -> Variant:
    """The same step written in JAX over plain dicts, from ``weights``."""
    widths = [w.shape[1] for w, _ in weights[:-1]]
    linear = [{"W": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in weights]
    params = {"linear": linear, "hidden": [case.hidden_params(n) for n in widths],
              "weight": [case.weight_params(layer["W"]) for layer in linear]}
    trained = ("weight",) if case.frozen_base else tuple(params)
    tx = optax.adam(LR)
    weight_stats = [case.weight_stats(layer["W"]) for layer in linear] \
        if case.weight_stats else []
    state = {"params": params, "stats": [case.hidden_stats(n) for n in widths],
             "weight_stats": weight_stats,
             "opt": tx.init({k: params[k] for k in trained}), "step": jnp.int32(0),
             "rng": jax.random.key_data(jax.random.key(seed))}

    def step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, Any]:
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        fixed = {k: v for k, v in state["params"].items() if k not in trained}
        cost = lambda logits: cross_entropy(logits, y)
        if case.targets:
            x, probabilities = case.targets(x, jax.nn.one_hot(y, DIMS[-1]),
                                            jax.random.fold_in(key, len(linear)))
            cost = lambda logits: optax.softmax_cross_entropy(logits, probabilities).mean()

        def loss(train: dict) -> tuple[jax.Array, dict]:
            params = {**fixed, **train}
            logits, new = hand_forward(case, params, state, x, key)
            return cost(logits) + (case.penalty(params) if case.penalty else 0.0), new

        train = {k: state["params"][k] for k in trained}
        (value, new), grads = jax.value_and_grad(loss, has_aux=True)(train)
        updates, opt = tx.update(grads, state["opt"], train)
        return {**state, "params": {**fixed, **optax.apply_updates(train, updates)},
                "stats": new["stats"] or state["stats"], "weight_stats": new["weight_stats"],
                "opt": opt, "step": state["step"] + 1}, \
            {"loss": value, **new["metrics"]} if case.measure else value

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
    if case.same_math:
        check_same_math(case, hand, ours, batches)
    interleave([hand, ours, again], batches, repeats, block)
    h, g, a = (statistics.median(v.times) for v in (hand, ours, again))
    row = {"manager": case.name, "hand_us": h * 1e6, "graphmod_us": g * 1e6, "ratio": g / h,
           "control": a / h}
    if analyse:
        (hand_flops, hand_bytes), (flops, bytes_) = work(hand), work(ours)
        row.update(flops_ratio=flops / hand_flops, bytes_ratio=bytes_ / hand_bytes)
    return row


def check_same_math(case: Case, hand: Variant, ours: Variant, batches: Sequence[tuple]
                    ) -> None:
    """Fails loudly unless three steps of the two give the same losses (and, with
    ``case.measure``, statistics; graphmod's other metrics, e.g. ``l2``, are not compared)."""
    for batch in batches[:3]:
        mine, theirs = ours.call(batch), hand.call(batch)
        theirs = theirs if isinstance(theirs, dict) else {"loss": theirs}
        got = [mine[k] for k in sorted(mine) if case.measure or k == "loss"]
        np.testing.assert_allclose(np.array(got), np.array([theirs[k] for k in sorted(theirs)]),
                                   rtol=1e-4, atol=1e-6, err_msg=f"{case.name}: not the "
                                   "same math as the hand-written step")


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
