"""What a bfloat16 precision policy buys: the train step under ``managers.MixedPrecision``
against the float32 step and against the same policy written by hand.

An MLP (``--dims``, ReLU, Adam, softmax cross-entropy on random inputs and labels, batch
``--batch``) stepped six ways in one process, round-robin:

``float32``
    ``graphmod.compile`` without managers / the step in JAX over plain dicts
    (``manager_costs.py``'s hand-written step), from the same initial weights.
``policy on each layer``
    ``MixedPrecision(bricks=mlp.linear_layers)``: each linear layer's input and weights cast
    to bfloat16 for the product, its output cast back to float32 (the ReLUs in float32), as
    ``Precision`` did; by hand, ``(x.bf16 @ W.bf16 + b.bf16).f32`` per layer.
``policy on the MLP``
    ``MixedPrecision(bricks=[mlp], output=None)``: one region for the whole MLP, every layer
    and ReLU in bfloat16, the logits left in bfloat16 for the cost; by hand, the input cast
    once and every layer's weights cast.

Stored weights, gradients and Adam's moments stay float32 in all of them. The table gives
each median step, *over float32* (same writer) and *graphmod / hand* (same precision). On
a CPU, XLA often runs bfloat16 matrix products no faster than float32 ones (or slower: they
are converted); on a GPU with tensor cores bfloat16 is where the speed is.

Run::

    python benchmarks/precision.py                 # about a minute on 2 CPU cores
    python benchmarks/precision.py --quick         # smoke run, numbers meaningless
    python benchmarks/precision.py --dims 1024 8192 8192 10 --batch 8192   # a GPU

Writes ``benchmarks/precision_results.md`` and ``.json`` (``--out``, ``--no-write``).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from manager_costs import Case, graphmod_variant, hand_variant
from train_step import arguments, environment, interleave, write_results

import managers

LOW = jnp.bfloat16


def _each_layer(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return (x.astype(LOW) @ w.astype(LOW) + b.astype(LOW)).astype(x.dtype)


CASES = (
    Case("float32", lambda mlp: []),
    Case("policy on each layer", lambda mlp: [managers.MixedPrecision(
        bricks=mlp.linear_layers)], dense=_each_layer),
    Case("policy on the MLP", lambda mlp: [managers.MixedPrecision(bricks=[mlp], output=None)],
         input=lambda x, key: x.astype(LOW),
         dense=lambda x, w, b: x @ w.astype(LOW) + b.astype(LOW)),
)


def measure(dims: Sequence[int], batches: Sequence[tuple], seed: int, repeats: int,
            block: int) -> list[dict[str, Any]]:
    """Median step of every variant, interleaved; one row per (case, writer)."""
    variants = []
    for case in CASES:
        ours, weights = graphmod_variant(case, seed, batches[0], dims)
        variants += [ours, hand_variant(case, weights, seed, batches[0])]
    interleave(variants, batches, repeats, block)
    medians = [statistics.median(v.times) for v in variants]
    rows = []
    for i, variant in enumerate(variants):
        case, writer = CASES[i // 2].name, variant.name
        rows.append({"variant": f"{case} ({writer})", "median_us": medians[i] * 1e6,
                     "over_float32": medians[i] / medians[i % 2],
                     "graphmod_over_hand": medians[i - i % 2] / medians[i - i % 2 + 1]})
    return rows


def report(env: dict[str, Any], dims: Sequence[int], batch: int, repeats: int, block: int,
           rows: Sequence[dict[str, Any]], quick: bool, load: float) -> str:
    """The Markdown report."""
    lines = ["# bfloat16 policy against float32 (managers.MixedPrecision)", "",
             f"{env['date']} · JAX {env['jax']} · {env['platform']} ({env['device']}) · "
             f"{env['cpu_count']} CPUs" + (" · **--quick: not meaningful**" if quick else ""),
             "", f"MLP {'-'.join(map(str, dims))}, ReLU, batch {batch}, Adam; medians of "
             f"{repeats} interleaved blocks of {block} steps; load average {load:.1f} at the "
             "start" + (" (above the CPU count: other processes share the cores)."
                        if load > (env["cpu_count"] or 1) else " (a quiet machine)."), "",
             "| variant | median step (µs) | over float32 (same writer) | graphmod / hand "
             "(same policy) |", "|---|--:|--:|--:|"]
    lines += [f"| {r['variant']} | {r['median_us']:.0f} | {r['over_float32']:.2f} "
              f"| {r['graphmod_over_hand']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the rows."""
    parser = arguments(__doc__, "precision_results")
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1024, 1024, 10],
                        help="layer widths, input first")
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 20)
    block = args.block or (2 if args.quick else 5)
    load = os.getloadavg()[0]
    rng = np.random.default_rng(args.seed)
    batches = [(jnp.asarray(rng.standard_normal((args.batch, args.dims[0])), jnp.float32),
                jnp.asarray(rng.integers(0, args.dims[-1], args.batch))) for _ in range(2)]
    rows = measure(args.dims, batches, args.seed, repeats, block)
    env = environment()
    write_results(args, "precision_results",
                  report(env, args.dims, args.batch, repeats, block, rows, args.quick, load),
                  {"environment": env, "dims": args.dims, "batch": args.batch,
                   "repeats": repeats, "block": block, "load_average": load, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
