"""Fitted transforms inside the inference program against the same arithmetic by hand.

The digits-sized MLP (``--dims``, default 64-256-256-10, ReLU; batch ``--batch``) predicting
on raw features, three ways in one process, interleaved round-robin:

``fitted transforms``
    ``graphmod.compile(lambda m, x: m(x), mlp, transforms=Transforms({"x":
    Standardize()}).fit(train))``: the program standardizes ``x`` with the fitted mean and
    std before the model runs;
``by hand in the model``
    the same program without transforms, the function written ``m((x - mean) *
    (1 / max(std, eps)))`` with the same fitted numbers (NumPy constants in the closure:
    ``Standardize``'s own arithmetic, a multiplication by the reciprocal);
``no scaling``
    the model on ``x`` as it comes (what the scaling costs at all).

Reported: each median call of the jitted ``infer``, the ratio *transforms / by hand* (goal
≤ 1.00 within noise: the fitted numbers are constants of the jaxpr, as the hand-written
ones are), and the instruction count of each optimized HLO module (equal when XLA sees the
same computation). The two scaled variants are checked to predict the same before timing.

Run::

    python benchmarks/transforms_in_program.py            # well under a minute on 2 CPUs
    python benchmarks/transforms_in_program.py --quick    # smoke run, numbers meaningless

Writes ``benchmarks/transforms_in_program_results.md`` and ``.json`` (``--out``,
``--no-write``).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from train_step import (
    Variant,
    arguments,
    count_instructions,
    environment,
    interleave,
    write_results,
)

import graphmod as gm
from graphmod.data import ArraySource, Standardize, Transforms


def variants(dims: Sequence[int], batch: int, seed: int
             ) -> tuple[list[Variant], list[tuple[np.ndarray]], bool]:
    """The three inference calls (with their optimized HLO's size), raw batches to time
    on, and whether the two scaled variants' optimized HLO has the same operations."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.5, 20.0, dims[0]).astype(np.float32)
    raw = (rng.normal(size=(4096, dims[0])) * scale + 3.0 * scale).astype(np.float32)
    fitted = Transforms({"x": Standardize()}).fit(ArraySource({"x": raw}, batch))
    mean = np.asarray(fitted.metadata["x"].mean, np.float32)
    inverse = (1.0 / np.maximum(np.asarray(fitted.metadata["x"].std), 1e-8)).astype(np.float32)
    mlp = gm.bricks.MLP(list(dims), activation=jax.nn.relu, rngs=nnx.Rngs(seed))
    programs = {
        "fitted transforms": gm.compile(lambda m, x: m(x), mlp, transforms=fitted),
        "by hand in the model": gm.compile(lambda m, x: m((x - mean) * inverse), mlp),
        "no scaling": gm.compile(lambda m, x: m(x), mlp),
    }
    batches = [(raw[i * batch:(i + 1) * batch],) for i in range(4)]
    out, opcodes = [], {}
    for name, program in programs.items():
        variables = program.init(batches[0][0])
        infer = program.infer
        variant = Variant(name, lambda b, infer=infer, v=variables: infer(v, b[0]))
        hlo = infer.lower(variables, batches[0][0]).compile().as_text()
        variant.hlo_instructions = count_instructions(hlo)
        opcodes[name] = _opcodes(hlo)
        out.append(variant)
    first = [np.asarray(v.call(batches[0])) for v in out[:2]]
    np.testing.assert_allclose(first[0], first[1], rtol=1e-5, atol=1e-5)
    return out, batches, opcodes["fitted transforms"] == opcodes["by hand in the model"]


def _opcodes(hlo: str) -> list[str]:
    """The HLO module's operations in order (names, shapes and metadata left out)."""
    return re.findall(r"=\s*\S+\s+([a-z][\w-]*)\(", hlo)


def report(env: dict[str, Any], dims: Sequence[int], batch: int, repeats: int, block: int,
           rows: Sequence[dict[str, Any]], same: bool, quick: bool) -> str:
    """The Markdown report."""
    lines = ["# Fitted transforms in the inference program against the same arithmetic by "
             "hand", "",
             f"{env['date']} · JAX {env['jax']} · {env['platform']} ({env['device']}) · "
             f"{env['cpu_count']} CPUs" + (" · **--quick: not meaningful**" if quick else ""),
             "", f"MLP {'-'.join(map(str, dims))}, ReLU, batch {batch}, `program.infer` on "
             f"raw features; medians of {repeats} interleaved blocks of {block} calls.", "",
             f"The optimized HLO of the two scaled variants holds the same operations in the "
             f"same order: **{same}**.", "",
             "| variant | median call (µs) | / by hand | optimized HLO instructions |",
             "|---|--:|--:|--:|"]
    lines += [f"| {r['variant']} | {r['median_us']:.1f} | {r['over_hand']:.3f} "
              f"| {r['hlo_instructions']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the rows."""
    parser = arguments(__doc__, "transforms_in_program_results")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256, 256, 10])
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 40)
    block = args.block or (5 if args.quick else 200)
    timed, batches, same = variants(args.dims, args.batch, args.seed)
    interleave(timed, batches, repeats, block)
    medians = [statistics.median(v.times) for v in timed]
    rows = [{"variant": v.name, "median_us": m * 1e6, "over_hand": m / medians[1],
             "hlo_instructions": v.hlo_instructions} for v, m in zip(timed, medians, strict=True)]
    env = environment()
    text = report(env, args.dims, args.batch, repeats, block, rows, same, args.quick)
    write_results(args, "transforms_in_program_results", text, {
        "environment": env, "dims": args.dims, "batch": args.batch, "repeats": repeats,
        "block": block, "quick": args.quick, "rows": rows, "same_hlo_operations": same,
        "times_s": {v.name: v.times for v in timed}})
    return rows


if __name__ == "__main__":
    main()
