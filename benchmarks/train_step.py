"""Side-by-side train-step benchmark: graphmod against hand-written JAX and Flax NNX.

One regularized train step of the digits MLP (64-256-256-10, ReLU, Adam, batch 128) written
five ways, timed in one process:

``hand (jax.jit, dicts)``
    the reference: pure JAX over plain dicts, jitted and donating, written out by hand,
    deriving its keys as graphmod does (the step key folded per layer, then split).
``hand, leanest``
    the same with the leanest randomness and statistics a JAX user would write: every
    dropout and noise key split from the step key in one batch, ``bernoulli`` + ``select``
    for the masks, batch variances as ``E[x²] - E[x]²``.
``graphmod``
    ``graphmod.compile`` with ``managers.Dropout`` (inputs of every linear layer),
    ``managers.WeightNoise`` (additive Gaussian noise on every ``W``) and
    ``managers.BatchNorm`` (outputs of the hidden linear layers, ``use_fast_variance=True``:
    the leanest step's statistics), stepped by ``graphmod.optimize``.
``flax nnx (jax.jit, split)``
    ``nnx.Linear``, ``nnx.Dropout``, ``nnx.BatchNorm`` and weight noise by hand, stepped by
    ``jax.jit`` over the ``nnx.split`` state of the model and its ``nnx.Optimizer``.
``flax nnx (nnx.jit)``
    the same model stepped by ``nnx.jit`` (modules passed straight in).

and a control, the leanest step compiled a second time: its ratio to the first is the
noise of the measurement (the same program, timed twice). Two more rows take graphmod's and
the leanest step jitted again over the lists of their states' leaves: the same programs,
without JAX flattening and rebuilding the states' nested dicts at each call, so their
ratio is the programs' alone, and each one's ratio to its step what its layout's dispatch
costs.

The math is the same in all of them (inverted dropout, ``W + std * N(0, 1)``, batch
statistics with biased variance and ``running = m * running + (1 - m) * batch``; the variance
as ``E[x²] - E[x]²`` in graphmod's and the leanest, ``E[(x - E[x])²]`` in the others); the
random streams differ. Before timing, the variants are built with dropout and noise off from the
same initial weights and checked to give the same losses and running statistics.

Timing: the variants run round-robin, each repetition timing a block of steps ended by
``block_until_ready``, in balanced orders (each variant as often right after each other);
the table gives each variant's median step time, its ratios to the hand-written and the
leanest steps' medians, the median of its paired ratios to the leanest step (each block
over the leanest step's block of the same round: the machine's slow stretches cancel), the
time of the first call (trace + compile + one step), the
tracing/lowering and XLA compile times of a fresh copy, and the instruction count of its
optimized HLO. A second table measures per-call dispatch on a tiny model, where the Python
and runtime overhead of a call dominates: ``graphmod.optimize``'s step and
``program.infer`` against a bare ``jax.jit`` over plain dicts, and over the same dicts
nested as graphmod's variables are (``{"model": {"linear_layers": {0: ...}}, "managers":
{}}``: JAX flattens every dict of the state at each call, so the layout alone costs).

Run::

    python benchmarks/train_step.py            # ~3 minutes on 2 CPU cores
    python benchmarks/train_step.py --quick    # seconds: a smoke run, numbers meaningless

Writes ``benchmarks/results.md`` and ``benchmarks/results.json`` (``--out`` to change the
directory, ``--no-write`` to only print).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import graphmod
import managers
from graphmod import roles

DIMS = (64, 256, 256, 10)
TINY_DIMS = (4, 8, 2)
BATCH = 128
TINY_BATCH = 8
LR = 1e-3
MOMENTUM = 0.99
EPSILON = 1e-5

Batch = tuple[jax.Array, jax.Array]
CONTROL = "control: the leanest again"


@dataclasses.dataclass(frozen=True)
class Rates:
    """The regularizers: dropout rate, weight-noise standard deviation (None: without it)
    and whether batch norm runs (``step_anatomy.py`` takes them one at a time)."""

    dropout: float | None = 0.2
    noise: float | None = 0.01
    batch_norm: bool = True
    # graphmod's BatchNorm computes E[x²] - E[x]², as the leanest step does (the other
    # variants' variance: E[(x - E[x])²])
    fast_variance: bool = True


def cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# -- graphmod ---------------------------------------------------------------------------------
def graphmod_step(dims: Sequence[int], rates: Rates | None, seed: int, batch: Batch
                  ) -> tuple[graphmod.TrainStep, Any, graphmod.Program]:
    """``graphmod.optimize``'s step, its first state and the program (no managers if
    ``rates`` is None)."""
    mlp = graphmod.bricks.MLP(list(dims), activation=jax.nn.relu, rngs=nnx.Rngs(seed))
    chosen: list[graphmod.Manager] = []
    if rates is not None:
        if rates.dropout is not None:
            chosen.append(managers.Dropout(rates.dropout, bricks=mlp.linear_layers,
                                           roles=[roles.INPUT]))
        if rates.noise is not None:
            chosen.append(managers.WeightNoise(rates.noise, roles=[roles.WEIGHT]))
        if rates.batch_norm:
            chosen.append(managers.BatchNorm(momentum=MOMENTUM, epsilon=EPSILON,
                                             use_fast_variance=rates.fast_variance,
                                             bricks=mlp.linear_layers[:-1],
                                             roles=[roles.OUTPUT]))
    program = graphmod.compile(lambda m, x, y: cross_entropy(m(x), y), mlp, managers=chosen)
    step = graphmod.optimize(program, optax.adam(LR))
    state = step.init(program.init(*batch), jax.random.key(seed))
    return step, state, program


def initial_weights(state: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(W, b)`` of each linear layer of a graphmod train state, as numpy arrays, in path
    order, wherever the layers sit (an MLP's ``linear_layers``, inside another brick, as a
    ``Residual``'s branch)."""
    layers: dict[tuple, dict] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.variables["model"]):
        *parent, name = (getattr(k, "key", getattr(k, "idx", k)) for k in path)
        layers.setdefault(tuple(parent), {})[name] = np.asarray(leaf)
    return [(layer["W"], layer["b"]) for layer in layers.values() if "W" in layer]


# -- by hand over plain dicts -----------------------------------------------------------------
def hand_forward(params: dict, stats: dict, x: jax.Array, key: jax.Array | None,
                 rates: Rates | None, lean: bool = False) -> tuple[jax.Array, dict]:
    """The regularized MLP in pure JAX: ``(logits, new running statistics)``; ``key`` None
    is inference (no dropout or noise, running statistics).

    Keys as graphmod derives them (one ``fold_in`` per layer, then a split), or with
    ``lean`` as the leanest hand-written step would: every dropout and noise key split from
    the step key in one batch, and batch variances as ``E[x²] - E[x]²``."""
    layers = params["linear"]
    new_stats = []
    h = x
    keys = None if key is None or not lean else jax.random.split(key, 2 * len(layers))
    for i, layer in enumerate(layers):
        w = layer["W"]
        if key is not None and rates is not None:
            k_drop, k_noise = (keys[2 * i], keys[2 * i + 1]) if keys is not None else (
                jax.random.split(jax.random.fold_in(key, i)))
            if rates.dropout is not None:
                keep = 1.0 - rates.dropout
                mask = jax.random.bernoulli(k_drop, keep, h.shape)
                h = jax.lax.select(mask, h / keep, jnp.zeros_like(h))
            if rates.noise is not None:
                w = w + rates.noise * jax.random.normal(k_noise, w.shape, w.dtype)
        z = h @ w + layer["b"]
        if i == len(layers) - 1:
            return z, {"bn": new_stats}
        if rates is not None and rates.batch_norm:
            bn, running = params["bn"][i], stats["bn"][i]
            if key is not None:
                mean = z.mean(0)
                var = (jnp.mean(jnp.square(z), 0) - jnp.square(mean) if lean
                       else jnp.mean(jnp.square(z - mean), 0))
                new_stats.append({
                    "mean": MOMENTUM * running["mean"] + (1 - MOMENTUM) * mean,
                    "var": MOMENTUM * running["var"] + (1 - MOMENTUM) * var,
                })
            else:
                mean, var = running["mean"], running["var"]
            z = (z - mean) * jax.lax.rsqrt(var + EPSILON) * bn["scale"] + bn["bias"]
        h = jax.nn.relu(z)
    raise AssertionError("unreachable")


def graphmod_layout(params: dict) -> dict:
    """Plain ``{"linear": [layer, ...]}`` parameters nested as graphmod's variables are."""
    return {"model": {"linear_layers": dict(enumerate(params["linear"]))}, "managers": {}}


def plain_layout(variables: dict) -> dict:
    """The inverse of :func:`graphmod_layout` (inside a traced function: free)."""
    return {"linear": list(variables["model"]["linear_layers"].values())}


def hand_step(weights: list[tuple[np.ndarray, np.ndarray]], rates: Rates | None, seed: int,
              nested: bool = False, lean: bool = False) -> tuple[Callable[..., Any], dict]:
    """A jitted, donating ``step(state, x, y) -> (state, loss)`` over plain dicts;
    ``nested`` (without managers): its parameters nested as graphmod's variables; ``lean``:
    keys and variances as the leanest hand-written step (:func:`hand_forward`)."""
    hidden = [w.shape[1] for w, _ in weights[:-1]]
    params: dict[str, Any] = {"linear": [{"W": jnp.asarray(w), "b": jnp.asarray(b)}
                                         for w, b in weights]}
    if nested:
        params = graphmod_layout(params)
    stats: dict[str, Any] = {"bn": []}
    if rates is not None and rates.batch_norm:
        params["bn"] = [{"scale": jnp.ones(n), "bias": jnp.zeros(n)} for n in hidden]
        stats["bn"] = [{"mean": jnp.zeros(n), "var": jnp.ones(n)} for n in hidden]
    tx = optax.adam(LR)
    state = {"params": params, "stats": stats, "opt": tx.init(params),
             "step": jnp.int32(0), "rng": jax.random.key_data(jax.random.key(seed))}

    def step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
        # Raw key data in the state (as graphmod's TrainState): typed keys dispatch slower.
        key = (jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
               if rates is not None else None)

        def loss(params: dict) -> tuple[jax.Array, dict]:
            logits, new_stats = hand_forward(plain_layout(params) if nested else params,
                                             state["stats"], x, key, rates, lean)
            return cross_entropy(logits, y), new_stats

        (value, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "stats": new_stats,
                "opt": opt, "step": state["step"] + 1, "rng": state["rng"]}, value

    return jax.jit(step, donate_argnums=0), state


def hand_infer(weights: list[tuple[np.ndarray, np.ndarray]], nested: bool = False
               ) -> tuple[Callable[..., Any], dict]:
    """A bare ``jax.jit`` forward pass over plain dicts (no managers); ``nested``: over
    them nested as graphmod's variables."""
    params = {"linear": [{"W": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in weights]}
    unpack = plain_layout if nested else (lambda p: p)
    forward = jax.jit(lambda p, x: hand_forward(unpack(p), {"bn": []}, x, None, None)[0])
    return forward, graphmod_layout(params) if nested else params


# -- Flax NNX ---------------------------------------------------------------------------------
class NNXMLP(nnx.Module):
    """The MLP with ``nnx.Linear``, ``nnx.Dropout``, ``nnx.BatchNorm`` and weight noise by
    hand (``deterministic`` is switched by ``train()``/``eval()`` like Dropout's)."""

    def __init__(self, dims: Sequence[int], rates: Rates | None, *, rngs: nnx.Rngs) -> None:
        pairs = list(itertools.pairwise(dims))
        self.linears = nnx.List(nnx.Linear(a, b, rngs=rngs) for a, b in pairs)
        self.regularized = rates is not None
        self.noise_std = rates.noise or 0.0 if rates is not None else 0.0
        self.deterministic = False
        if rates is not None:
            self.drops = nnx.List(nnx.Dropout(rates.dropout or 0.0, rngs=rngs) for _ in pairs)
            self.norms = nnx.List(
                nnx.BatchNorm(b, momentum=MOMENTUM, epsilon=EPSILON, use_fast_variance=False,
                              rngs=rngs) for _, b in pairs[:-1])
            self.noise = rngs["noise"].fork()

    def __call__(self, x: jax.Array) -> jax.Array:
        last = len(self.linears) - 1
        for i, linear in enumerate(self.linears):
            w = linear.kernel[...]
            if self.regularized:
                x = self.drops[i](x)
                if not self.deterministic:
                    w = w + self.noise_std * jax.random.normal(self.noise(), w.shape, w.dtype)
            x = x @ w + linear.bias[...]
            if i < last:
                x = jax.nn.relu(self.norms[i](x) if self.regularized else x)
        return x


def nnx_model(dims: Sequence[int], rates: Rates | None, seed: int,
              weights: list[tuple[np.ndarray, np.ndarray]]) -> tuple[NNXMLP, nnx.Optimizer]:
    """The NNX model (with ``weights`` copied in) and its Adam ``nnx.Optimizer``."""
    model = NNXMLP(dims, rates, rngs=nnx.Rngs(params=seed, dropout=seed + 1, noise=seed + 2))
    for linear, (w, b) in zip(model.linears, weights, strict=True):
        linear.kernel.value = jnp.asarray(w)
        linear.bias.value = jnp.asarray(b)
    model.train()
    return model, nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)


def nnx_loss(model: NNXMLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return cross_entropy(model(x), y)


def nnx_split_step(model: NNXMLP, optimizer: nnx.Optimizer) -> tuple[Callable[..., Any], Any]:
    """``jax.jit`` over the ``nnx.split`` state of (model, optimizer), donating it."""
    graphdef, state = nnx.split((model, optimizer))

    def step(state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(nnx_loss)(model, x, y)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return jax.jit(step, donate_argnums=0), state


@nnx.jit
def nnx_jit_step(model: NNXMLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array
                 ) -> jax.Array:
    loss, grads = nnx.value_and_grad(nnx_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


# -- the runners ------------------------------------------------------------------------------
@dataclasses.dataclass
class Variant:
    """A step under test: ``call(batch)`` runs one step in place and returns what to wait
    on; ``compiled()`` compiles it again ahead of time (for its HLO text and XLA's cost
    analysis)."""

    name: str
    call: Callable[[Batch], Any]
    compiled: Callable[[], Any] | None = None
    first_call_s: float = float("nan")
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)
    hlo_instructions: int | None = None
    flops: float | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    # Per block, the time until its last call returned (before the wait), per step: near
    # ``times`` when the host's dispatch, not the device, bounds the step.
    host_times: list[float] = dataclasses.field(default_factory=list)


def functional(step: Callable[..., Any], state: Any) -> tuple[Callable[[Batch], Any], list]:
    """Adapts ``step(state, *batch) -> (state, out)`` to a stateful ``call(batch)``; also
    returns the one-element list holding the current state."""
    holder = [state]

    def call(batch: Batch) -> Any:
        holder[0], out = step(holder[0], *batch)
        return out

    return call, holder


def on_leaves(step: Callable[..., Any], state: Any) -> Callable[[Batch], Any]:
    """``step`` jitted again over the list of ``state``'s leaves (and donating them): the
    same XLA program, without JAX flattening the state's dicts at each call. Its time
    against ``step``'s is what the state's layout costs a call (on a 2-core machine, the
    host's flattening takes the step's own cores)."""
    leaves, tree = jax.tree.flatten(state)

    def flat(leaves: list, x: jax.Array, y: jax.Array) -> tuple[list, list]:
        new, out = step(jax.tree.unflatten(tree, leaves), x, y)
        return jax.tree.leaves(new), jax.tree.leaves(out)

    return functional(jax.jit(flat, donate_argnums=0), jax.tree.map(jnp.copy, leaves))[0]


def compiler(step: Callable[..., Any], holder: list, batch: Batch, wrap: bool = True
             ) -> Callable[[], Any]:
    """Compiles ``step`` again ahead of time for the current state in ``holder`` (for its
    HLO and XLA's cost analysis); with ``wrap``, inside a ``jax.jit``, as a user's code
    calls it, else through ``step``'s own ``lower``."""
    jitted = jax.jit(lambda state, x, y: step(state, x, y)) if wrap else step
    return lambda: jitted.lower(holder[0], *batch).compile()


def build_variants(seed: int, batch: Batch, rates: Rates) -> list[Variant]:
    """The five regularized digits-MLP steps, sharing their initial weights; the control:
    the leanest step compiled a second time (its ratio to the first is the noise of the
    measurement); and graphmod's and the leanest step over their states' leaves
    (:func:`on_leaves`: the same programs without the per-call flattening of the states'
    dicts)."""
    step, state, _ = graphmod_step(DIMS, rates, seed, batch)
    weights = initial_weights(state)
    hand, hand_state = hand_step(weights, rates, seed)
    lean, lean_state = hand_step(weights, rates, seed, lean=True)
    again, again_state = hand_step(weights, rates, seed, lean=True)
    split, split_state = nnx_split_step(*nnx_model(DIMS, rates, seed, weights))
    jit_model, jit_optimizer = nnx_model(DIMS, rates, seed, weights)

    variants = []
    for name, fn, first, wrap in [("hand (jax.jit, dicts)", hand, hand_state, False),
                                  ("hand, leanest (one key split, E[x²]-E[x]²)", lean,
                                   lean_state, False),
                                  ("graphmod", step, state, True),
                                  (CONTROL, again, again_state, False),
                                  ("flax nnx (jax.jit, split)", split, split_state, False)]:
        call, holder = functional(fn, first)
        # graphmod's step is called through its public API: lowered inside a jax.jit.
        variants.append(Variant(name, call, compiler(fn, holder, batch, wrap=wrap)))
    # The same two programs over their states' leaves: the layouts' dispatch set apart.
    variants += [Variant("graphmod, on the state's leaves", on_leaves(step, state)),
                 Variant("hand, leanest, on the state's leaves", on_leaves(lean, lean_state))]
    variants.append(Variant(
        "flax nnx (nnx.jit)", lambda b: nnx_jit_step(jit_model, jit_optimizer, *b),
        lambda: nnx_jit_step.lower(jit_model, jit_optimizer, *batch).compile()))
    return variants


def write_results(args: argparse.Namespace, stem: str, report: str, results: dict) -> None:
    """Prints ``report`` and, unless ``--no-write``, writes it and ``results`` to
    ``<--out>/<stem>.md`` and ``<stem>.json``."""
    print(report)
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{stem}.md").write_text(report)
        (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")


def count_instructions(hlo: str) -> int:
    """Instruction lines of an HLO module's text (every computation, fusions included)."""
    return sum(1 for line in hlo.splitlines()
               if re.match(r"\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*\S", line))


_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


def first_call(variant: Variant, batch: Batch) -> None:
    """Times the first call (trace + lower + compile + one step) and, from JAX's
    monitoring events, the time spent tracing, lowering and compiling in it."""
    durations: dict[str, float] = dict.fromkeys(_COMPILE_EVENTS.values(), 0.0)

    def listen(event: str, seconds: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            durations[_COMPILE_EVENTS[event]] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        start = time.perf_counter()
        jax.block_until_ready(variant.call(batch))
        variant.first_call_s = time.perf_counter() - start
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    variant.compile_s = durations


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design: orders of ``range(n)`` in which every variant runs right after
    every other equally often (``n`` orders for an even ``n``, ``2n`` for an odd one), so no
    variant is always timed after the same one (its caches, its threads' wake-ups).

    Examples:
        >>> balanced_orders(3)
        [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]]
    """
    first = [0]
    for j in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    orders = [[(v + i) % n for v in first] for i in range(n)]
    return orders + ([order[::-1] for order in orders] if n % 2 else [])


def interleave(variants: Sequence[Variant], batches: Sequence[Batch], repeats: int,
               block: int, settle: bool = False) -> None:
    """Round-robin: each repetition times ``block`` calls of every variant in turn, in the
    orders of :func:`balanced_orders` (each variant as often right after each other one).
    With ``settle``, one untimed call (waited for) precedes each timed block: a variant run
    after one on other devices is not charged for the switch (their threads waking, caches
    refilling)."""
    for variant in variants:
        if not variant.compile_s:
            first_call(variant, batches[0])
        for i in range(3):
            jax.block_until_ready(variant.call(batches[i % len(batches)]))
    orders = balanced_orders(len(variants))
    for repeat in range(repeats):
        for variant in (variants[i] for i in orders[repeat % len(orders)]):
            if settle:
                jax.block_until_ready(variant.call(batches[-1]))
            start = time.perf_counter()
            out = None
            for i in range(block):
                out = variant.call(batches[i % len(batches)])
            dispatched = time.perf_counter()
            jax.block_until_ready(out)
            variant.times.append((time.perf_counter() - start) / block)
            variant.host_times.append((dispatched - start) / block)


def check_same_math(seed: int, batch: Batch, steps: int = 3) -> float:
    """With dropout and noise off, the four step bodies agree from the same weights.

    Returns the largest absolute difference of the losses and running means after
    ``steps`` steps; raises if one is off by more than 1e-4.
    """
    off = Rates(dropout=0.0, noise=0.0)
    step, state, _ = graphmod_step(DIMS, off, seed, batch)
    weights = initial_weights(state)
    hand, hand_state = hand_step(weights, off, seed)
    lean, lean_state = hand_step(weights, off, seed, lean=True)
    model, optimizer = nnx_model(DIMS, off, seed, weights)
    split, split_state = nnx_split_step(model, optimizer)
    worst = 0.0
    for _ in range(steps):
        state, metrics = step(state, *batch)
        hand_state, hand_loss = hand(hand_state, *batch)
        lean_state, lean_loss = lean(lean_state, *batch)
        split_state, split_loss = split(split_state, *batch)
        losses = [float(metrics["loss"]), float(hand_loss), float(lean_loss),
                  float(split_loss)]
        worst = max(worst, max(losses) - min(losses))
    bn = state.variables["managers"]["batch_norm"]
    graphmod_mean = np.asarray(bn["/linear_layers/0"]["apply"]["output.mean"])
    hand_mean = np.asarray(hand_state["stats"]["bn"][0]["mean"])
    nnx.update((model, optimizer), split_state)
    nnx_mean = np.asarray(model.norms[0].mean[...])
    worst = max(worst, float(np.max(np.abs(graphmod_mean - hand_mean))),
                float(np.max(np.abs(nnx_mean - hand_mean))))
    if worst > 1e-4:
        raise AssertionError(f"the variants do not compute the same step: difference {worst}")
    return worst


# -- dispatch ---------------------------------------------------------------------------------
def dispatch_variants(seed: int, batch: Batch) -> list[tuple[str, list[Variant]]]:
    """Tiny model, no managers: graphmod's step and infer against bare ``jax.jit``."""
    step, state, program = graphmod_step(TINY_DIMS, None, seed, batch)
    weights = initial_weights(state)
    hand, hand_state = hand_step(weights, None, seed)
    nested, nested_state = hand_step(weights, None, seed, nested=True)
    forward, params = hand_infer(weights)
    nested_forward, nested_params = hand_infer(weights, nested=True)
    variables = jax.tree.map(jnp.copy, state.variables)
    predict = program.derive(lambda m, x: m(x))
    model, optimizer = nnx_model(TINY_DIMS, None, seed, weights)
    return [
        ("train step (Adam)", [
            Variant("jax.jit (dicts)", functional(hand, hand_state)[0]),
            Variant("jax.jit (dicts nested as graphmod's)", functional(nested, nested_state)[0]),
            Variant("graphmod.optimize", functional(step, state)[0]),
            Variant("nnx.jit", lambda b: nnx_jit_step(model, optimizer, *b)),
        ]),
        ("infer", [
            Variant("jax.jit (dicts)", lambda b: forward(params, b[0])),
            Variant("jax.jit (dicts nested as graphmod's)",
                    lambda b: nested_forward(nested_params, b[0])),
            Variant("program.infer", lambda b: predict.infer(variables, b[0])),
        ]),
    ]


# -- report -----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def paired_ratios(variant: Variant, reference: Variant) -> list[float]:
    """Per repetition, ``variant``'s block time over ``reference``'s block of the same
    repetition: the machine's slow and fast stretches, common to blocks a few hundred
    milliseconds apart, cancel in each ratio (the medians' ratio keeps them as noise).

    Examples:
        >>> paired_ratios(Variant("a", print, times=[2.0, 4.0]),
        ...               Variant("b", print, times=[1.0, 4.0]))
        [2.0, 1.0]
    """
    return [a / b for a, b in zip(variant.times, reference.times, strict=True)]


def step_table(variants: Sequence[Variant]) -> tuple[str, list[dict]]:
    """Each variant against the first (hand-written, keys as graphmod derives them) and the
    second (the leanest hand-written step): median step time, the ratio of medians and the
    median of paired ratios to the leanest (:func:`paired_ratios`), and XLA flops."""
    hand, leanest = variants[0], variants[1]
    reference, lean = (statistics.median(v.times) for v in (hand, leanest))
    rows = []
    lines = [
        "| variant | median step (µs) | p10-p90 (µs) | ratio to hand | ratio to leanest "
        "| paired ratio to leanest: median (p25-p75) "
        "| first call (s) | trace / lower / XLA compile (s) | HLO instructions "
        "| XLA flops (ratio to leanest) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for v in variants:
        median = statistics.median(v.times)
        paired = paired_ratios(v, leanest)
        row = {
            "variant": v.name, "median_us": median * 1e6,
            "p10_us": percentile(v.times, 10) * 1e6, "p90_us": percentile(v.times, 90) * 1e6,
            "ratio": median / reference, "ratio_leanest": median / lean,
            "paired_leanest": statistics.median(paired),
            "paired_leanest_p25": percentile(paired, 25),
            "paired_leanest_p75": percentile(paired, 75),
            "first_call_s": v.first_call_s,
            **{f"{stage}_s": seconds for stage, seconds in v.compile_s.items()},
            "hlo_instructions": v.hlo_instructions, "flops": v.flops,
        }
        rows.append(row)
        stages = " / ".join(f"{v.compile_s[k]:.2f}" for k in ("trace", "lower", "compile"))
        count = "—" if v.hlo_instructions is None else str(v.hlo_instructions)
        flops = "—" if not v.flops or not leanest.flops else (
            f"{v.flops:.3g} ({v.flops / leanest.flops:.3f})")
        lines.append(
            f"| {v.name} | {row['median_us']:.0f} | {row['p10_us']:.0f}-{row['p90_us']:.0f} "
            f"| {row['ratio']:.2f} | {row['ratio_leanest']:.3f} "
            f"| {row['paired_leanest']:.3f} ({row['paired_leanest_p25']:.3f}-"
            f"{row['paired_leanest_p75']:.3f}) | {v.first_call_s:.2f} "
            f"| {stages} | {count} | {flops} |")
    return "\n".join(lines), rows


def dispatch_table(groups: Sequence[tuple[str, list[Variant]]]) -> tuple[str, list[dict]]:
    """Each group's first variant is ``jax.jit`` over plain dicts, its second the same
    over graphmod's layout: a ratio to each."""
    rows = []
    lines = ["| call | variant | median per call (µs) | ratio to jax.jit | ratio to jax.jit, "
             "graphmod's layout |", "|---|---|--:|--:|--:|"]
    for label, variants in groups:
        reference, nested = (statistics.median(v.times) for v in variants[:2])
        for v in variants:
            median = statistics.median(v.times)
            rows.append({"call": label, "variant": v.name, "median_us": median * 1e6,
                         "ratio": median / reference, "ratio_same_layout": median / nested})
            lines.append(f"| {label} | {v.name} | {median * 1e6:.1f} | "
                         f"{median / reference:.2f} | {median / nested:.2f} |")
    return "\n".join(lines), rows


def environment() -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
        "graphmod": graphmod.__version__, "python": platform.python_version(),
        "platform": device.platform, "device": device.device_kind,
        "cpu_count": os.cpu_count(), "machine": platform.machine(),
    }


def arguments(doc: str, results: str) -> argparse.ArgumentParser:
    """The command line of a step benchmark documented by ``doc`` that writes
    ``<results>.md`` and ``<results>.json`` (flax_models.py adds to it)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions: smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="round-robin repetitions")
    parser.add_argument("--block", type=int, default=None, help="steps timed per repetition")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help=f"directory for {results}.md and {results}.json")
    parser.add_argument("--no-write", action="store_true", help="print only")
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return arguments(__doc__, "results").parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the results."""
    args = parse_args(argv)
    # Many short blocks: each paired ratio spans a round of ~0.2 s, which a slow stretch of
    # the machine rarely splits (100 blocks of 50: the control's paired ratio 0.98-1.01).
    repeats = args.repeats or (3 if args.quick else 500)
    block = args.block or (5 if args.quick else 10)
    dispatch_repeats = 3 if args.quick else 100
    dispatch_block = 20 if args.quick else 200
    rates = Rates()

    data = np.random.default_rng(args.seed)
    batches = [(jnp.asarray(data.random((BATCH, DIMS[0]), np.float32)),
                jnp.asarray(data.integers(0, DIMS[-1], BATCH, dtype=np.int32)))
               for _ in range(8)]
    tiny = [(jnp.asarray(data.random((TINY_BATCH, TINY_DIMS[0]), np.float32)),
             jnp.asarray(data.integers(0, TINY_DIMS[-1], TINY_BATCH, dtype=np.int32)))
            for _ in range(8)]

    started = time.perf_counter()
    difference = check_same_math(args.seed, batches[0])
    variants = build_variants(args.seed, batches[0], rates)
    interleave(variants, batches, repeats, block)
    if not args.quick:  # one more XLA compile of each: not worth it in a smoke run
        for variant in variants:
            if variant.compiled is not None:
                compiled = variant.compiled()
                variant.hlo_instructions = count_instructions(compiled.as_text())
                variant.flops = compiled.cost_analysis().get("flops")
    groups = dispatch_variants(args.seed, tiny[0])
    for _, group in groups:
        interleave(group, tiny, dispatch_repeats, dispatch_block)
    seconds = time.perf_counter() - started

    env = environment()
    steps_md, step_rows = step_table(variants)
    dispatch_md, dispatch_rows = dispatch_table(groups)
    report = "\n".join([
        "# Train-step benchmark",
        "",
        f"{env['date']} · JAX {env['jax']} ({env['platform']}, {env['device']}, "
        f"{env['cpu_count']} CPUs) · Flax {env['flax']} · graphmod {env['graphmod']}"
        + (" · **--quick: not meaningful**" if args.quick else ""),
        "",
        f"Digits MLP {'-'.join(map(str, DIMS))}, batch {BATCH}, Adam; dropout "
        f"{rates.dropout} on linear inputs, weight noise {rates.noise} on W, batch norm on "
        f"hidden outputs. Medians of {repeats} interleaved blocks of {block} steps; ratios "
        "are of medians, to the hand-written and the leanest steps' medians; paired ratios "
        "are each block's over the leanest step's block of the same round, their median "
        "and quartiles.",
        "",
        steps_md,
        "",
        f"Per-call dispatch, tiny MLP {'-'.join(map(str, TINY_DIMS))}, batch {TINY_BATCH}, "
        f"no managers: medians of {dispatch_repeats} interleaved blocks of "
        f"{dispatch_block} calls.",
        "",
        dispatch_md,
        "",
        f"Same-math check (dropout and noise off, 3 steps): largest difference "
        f"{difference:.1e}. Benchmark time {seconds:.0f} s.",
        "",
    ])
    results = {"environment": env, "quick": args.quick, "repeats": repeats, "block": block,
               "rates": dataclasses.asdict(rates), "train_step": step_rows,
               "dispatch": dispatch_rows, "same_math_difference": difference,
               "seconds": seconds}
    write_results(args, "results", report, results)
    return results


if __name__ == "__main__":
    main()
