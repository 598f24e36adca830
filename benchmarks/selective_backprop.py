"""Selective Backprop's step time against the plain step, in one process.

``managers.SelectiveBackprop(0.5)`` adds a forward pass over the whole batch in inference
mode (the ranking) and runs the step's forward and backward passes over half of it. On
each model the plain Adam step (``graphmod.optimize``), the Selective Backprop step
(always on: no ``lax.cond``), the same with a schedule (``interrupt=2``: a ``lax.cond``
choosing each step, here every other step plain) and a control (the plain step compiled a
second time, timed with the others: its ratio to the first is the machine's noise) run
round-robin; the table gives their median step times and the ratios to the plain step's.

Models: the digits MLP of ``train_step.py`` (64-256-256-10, ReLU, batch 128), whose step
is bound by its dispatch on CPU, and the character LM of ``examples/char_lm.py``
(2 causal transformer blocks of width 64, context 64, batch 32), bound by its compute.

Run::

    python benchmarks/selective_backprop.py            # about a minute on 2 cores
    python benchmarks/selective_backprop.py --quick    # smoke run, numbers meaningless

Writes ``benchmarks/selective_backprop_results.md`` and ``.json`` (``--out``,
``--no-write``).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_step import (
    BATCH,
    DIMS,
    LR,
    Variant,
    arguments,
    environment,
    functional,
    interleave,
    write_results,
)

import graphmod
import managers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.char_lm import VOCABULARY, CharLM
from examples.char_lm import cost as lm_cost

LM_BATCH, CONTEXT = 32, 64


def mlp_cost(model: graphmod.bricks.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def digits() -> tuple[Callable[[], Any], Callable[..., Any], list[tuple]]:
    """The digits MLP (a fresh one per call), its cost and four random batches."""
    rng = np.random.default_rng(0)
    batches = [(jnp.asarray(rng.standard_normal((BATCH, DIMS[0])), jnp.float32),
                jnp.asarray(rng.integers(0, DIMS[-1], BATCH))) for _ in range(4)]
    model = lambda: graphmod.bricks.MLP(list(DIMS), activation=jax.nn.relu,
                                        rngs=nnx.Rngs(0))
    return model, mlp_cost, batches


def char_lm() -> tuple[Callable[[], Any], Callable[..., Any], list[tuple]]:
    """The character LM (a fresh one per call), its cost and four batches of windows."""
    rng = np.random.default_rng(0)
    batches = [(jnp.asarray(rng.integers(0, len(VOCABULARY), (LM_BATCH, CONTEXT + 1))),)
               for _ in range(4)]
    model = lambda: CharLM(len(VOCABULARY) + 1, CONTEXT, 64, 4, 2,
                           rngs=nnx.Rngs(0))
    return model, lm_cost, batches


def variant(name: str, model: Callable[[], Any], cost: Callable[..., Any], batch: tuple,
            chosen: Sequence[graphmod.Manager]) -> Variant:
    """An Adam step of ``cost`` on a fresh model with ``chosen`` managers."""
    program = graphmod.compile(cost, model(), managers=list(chosen))
    step = graphmod.optimize(program, optax.adam(LR))
    call, _ = functional(step, step.init(program.init(*batch), jax.random.key(0)))
    return Variant(name, call)


def measure(label: str, setup: Callable[[], tuple], repeats: int, block: int
            ) -> list[dict[str, Any]]:
    model, cost, batches = setup()
    variants = [variant("plain", model, cost, batches[0], []),
                variant("SelectiveBackprop(0.5)", model, cost, batches[0],
                        [managers.SelectiveBackprop(0.5)]),
                variant("SelectiveBackprop(0.5, interrupt=2)", model, cost, batches[0],
                        [managers.SelectiveBackprop(0.5, interrupt=2)]),
                variant("control (plain again)", model, cost, batches[0], [])]
    interleave(variants, batches, repeats, block)
    plain = statistics.median(variants[0].times)
    return [{"model": label, "step": v.name, "us": statistics.median(v.times) * 1e6,
             "ratio": statistics.median(v.times) / plain} for v in variants]


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = arguments(__doc__, "selective_backprop_results").parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 30)
    block = args.block or (3 if args.quick else 20)
    rows = [*measure(f"digits MLP {'-'.join(map(str, DIMS))}, batch {BATCH}", digits,
                     repeats, block),
            *measure(f"char LM (2 blocks, width 64), batch {LM_BATCH}x{CONTEXT}", char_lm,
                     repeats, max(1, block // 4))]
    env = environment()
    lines = [f"Adam steps on {env['device']} ({env['cpu_count']} CPUs), jax {env['jax']}; "
             f"medians of {repeats} interleaved blocks. Ratio: to the plain step's median "
             "(the control is the plain step compiled again: the noise).", "",
             "| model | step | median (µs) | ratio |", "|---|---|--:|--:|"]
    lines += [f"| {r['model']} | {r['step']} | {r['us']:.0f} | {r['ratio']:.2f} |"
              for r in rows]
    write_results(args, "selective_backprop_results",
                  "# Selective Backprop against the plain step\n\n" + "\n".join(lines) + "\n",
                  {"environment": env, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
