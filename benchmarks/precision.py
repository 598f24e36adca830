"""What ``managers.Precision("bfloat16")`` buys: the train step in bfloat16 against float32.

An MLP (``--dims``, ReLU, Adam, softmax cross-entropy on random inputs and labels, batch
``--batch``) stepped four ways in one process, round-robin:

``graphmod f32`` / ``graphmod bf16``
    ``graphmod.compile`` without managers, and with ``managers.Precision("bfloat16")`` on
    every linear layer (inputs and weights cast down for the matrix product, outputs cast
    back; stored weights, gradients and Adam's moments stay float32).
``hand f32`` / ``hand bf16``
    the same two steps written in JAX over plain dicts (``manager_costs.py``'s hand-written
    step), from the same initial weights.

The table gives each median step, *bf16 / f32* (the speed-up, per writer) and *graphmod /
hand* (per precision). On a CPU, XLA often runs bfloat16 matrix products no faster than
float32 ones (or slower: they are converted); on a GPU with tensor cores bfloat16 is where
the speed is. JAX's default float32 matrix precision is the platform's (TF32 on NVIDIA
GPUs since Ampere).

Run::

    python benchmarks/precision.py                 # a minute on 2 CPU cores
    python benchmarks/precision.py --quick         # smoke run, numbers meaningless
    python benchmarks/precision.py --dims 1024 8192 8192 10 --batch 8192   # a GPU

Writes ``benchmarks/precision_results.md`` and ``.json`` (``--out``, ``--no-write``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from manager_costs import CASES, Case, graphmod_variant, hand_variant
from train_step import arguments, environment, interleave, write_results

FLOAT32 = Case("float32", lambda mlp: [])
BFLOAT16 = next(case for case in CASES if case.name.startswith("Precision"))


def measure(dims: Sequence[int], batches: Sequence[tuple], seed: int, repeats: int,
            block: int) -> list[dict[str, Any]]:
    """Median step of every variant, interleaved; one row per (writer, precision)."""
    variants = []
    for case in (FLOAT32, BFLOAT16):
        ours, weights = graphmod_variant(case, seed, batches[0], dims)
        variants += [ours, hand_variant(case, weights, seed, batches[0])]
    interleave(variants, batches, repeats, block)
    medians = [statistics.median(v.times) for v in variants]
    rows = []
    for i, variant in enumerate(variants):
        precision, writer = ("f32", "bf16")[i // 2], variant.name
        rows.append({"variant": f"{writer} {precision}", "median_us": medians[i] * 1e6,
                     "bf16_over_f32": medians[2 + i % 2] / medians[i % 2],
                     "graphmod_over_hand": medians[i - i % 2] / medians[i - i % 2 + 1]})
    return rows


def report(env: dict[str, Any], dims: Sequence[int], batch: int, repeats: int, block: int,
           rows: Sequence[dict[str, Any]], quick: bool) -> str:
    """The Markdown report."""
    lines = ["# bfloat16 against float32 (managers.Precision)", "",
             f"{env['date']} · JAX {env['jax']} · {env['platform']} ({env['device']}) · "
             f"{env['cpu_count']} CPUs" + (" · **--quick: not meaningful**" if quick else ""),
             "", f"MLP {'-'.join(map(str, dims))}, ReLU, batch {batch}, Adam; medians of "
             f"{repeats} interleaved blocks of {block} steps.", "",
             "| variant | median step (µs) | bf16 / f32 (same writer) | graphmod / hand "
             "(same precision) |", "|---|--:|--:|--:|"]
    lines += [f"| {r['variant']} | {r['median_us']:.0f} | {r['bf16_over_f32']:.2f} "
              f"| {r['graphmod_over_hand']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the rows."""
    parser = arguments(__doc__, "precision_results")
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1024, 1024, 10],
                        help="layer widths, input first")
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 30)
    block = args.block or (2 if args.quick else 5)
    rng = np.random.default_rng(args.seed)
    batches = [(jnp.asarray(rng.standard_normal((args.batch, args.dims[0])), jnp.float32),
                jnp.asarray(rng.integers(0, args.dims[-1], args.batch))) for _ in range(2)]
    rows = measure(args.dims, batches, args.seed, repeats, block)
    env = environment()
    write_results(args, "precision_results",
                  report(env, args.dims, args.batch, repeats, block, rows, args.quick),
                  {"environment": env, "dims": args.dims, "batch": args.batch,
                   "repeats": repeats, "block": block, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
