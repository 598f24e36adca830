"""Where graphmod's regularized step and the leanest hand-written one differ: their jaxprs
and optimized HLO side by side, for each regularizer alone and for all three together.

The steps are ``train_step.py``'s (digits MLP 64-256-256-10, batch 128, Adam):
``graphmod.optimize`` over ``managers.Dropout`` on the linear inputs, ``managers.WeightNoise``
on every ``W`` and ``managers.BatchNorm`` on the hidden outputs, against the leanest step a
JAX user would write (every key split from the step key in one batch, ``bernoulli`` +
``select`` for the masks, batch variances as ``E[x²] - E[x]²``, as graphmod's BatchNorm
computes them with ``use_fast_variance=True``; "two passes": its default,
``E[(x - E[x])²]``). For each, the table gives the
jaxpr's equations (nested jaxprs counted), the optimized HLO's instructions and XLA's flops,
and the primitives and HLO opcodes whose counts differ most: a count, not a timing, so it is
the same on any machine.

Run::

    python benchmarks/step_anatomy.py      # ~1-2 minutes on 2 CPU cores

Writes ``benchmarks/anatomy.md`` and ``benchmarks/anatomy.json`` (``--out``, ``--no-write``).
"""

from __future__ import annotations

import argparse
import collections
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import train_step  # beside this file: `python benchmarks/...` puts it on the path
from jax.extend import core as jax_core

CASES = {
    "dropout": train_step.Rates(noise=None, batch_norm=False),
    "weight noise": train_step.Rates(dropout=None, batch_norm=False),
    "batch norm": train_step.Rates(dropout=None, noise=None),
    "batch norm, two passes": train_step.Rates(dropout=None, noise=None, fast_variance=False),
    "all three": train_step.Rates(),
}


def primitives(jaxpr: jax_core.Jaxpr, counts: collections.Counter[str]) -> collections.Counter[str]:
    """``counts`` of each primitive of ``jaxpr``, its nested jaxprs' included."""
    for equation in jaxpr.eqns:
        counts[equation.primitive.name] += 1
        for value in equation.params.values():
            for inner in value if isinstance(value, list | tuple) else [value]:
                if isinstance(inner, jax_core.ClosedJaxpr):
                    primitives(inner.jaxpr, counts)
                elif isinstance(inner, jax_core.Jaxpr):
                    primitives(inner, counts)
    return counts


def opcodes(hlo: str) -> collections.Counter[str]:
    """Each opcode's instructions in an optimized HLO module's text (fusions' bodies too)."""
    found = (re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\S+\s+([\w\-]+)\(", line)
             for line in hlo.splitlines())
    return collections.Counter(match.group(1) for match in found if match)


def anatomy(step: Callable[..., object], state: object, batch: train_step.Batch) -> dict:
    """The jaxpr's primitives, the optimized HLO's opcodes and XLA's flops of ``step``."""
    def called(state: object, x: jax.Array, y: jax.Array) -> object:
        return step(state, x, y)

    jaxpr = jax.make_jaxpr(called)(state, *batch)
    compiled = jax.jit(called).lower(state, *batch).compile()
    return {"primitives": primitives(jaxpr.jaxpr, collections.Counter()),
            "opcodes": opcodes(compiled.as_text()),
            "flops": compiled.cost_analysis().get("flops")}


def differences(mine: collections.Counter[str], theirs: collections.Counter[str],
                most: int = 6) -> str:
    """The ``most`` counts that differ most, as ``name +n``."""
    changed = {k: mine[k] - theirs[k] for k in mine.keys() | theirs.keys()
               if mine[k] != theirs[k]}
    ranked = sorted(changed.items(), key=lambda item: (-abs(item[1]), item[0]))[:most]
    return ", ".join(f"`{name}` {count:+d}" for name, count in ranked) or "none"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    data = np.random.default_rng(args.seed)
    batch = (jnp.asarray(data.random((train_step.BATCH, train_step.DIMS[0]), np.float32)),
             jnp.asarray(data.integers(0, train_step.DIMS[-1], train_step.BATCH,
                                       dtype=np.int32)))
    rows, lines = [], [
        "| regularizers | variant | jaxpr equations | HLO instructions | XLA flops "
        "| primitives against leanest | HLO opcodes against leanest |",
        "|---|---|--:|--:|--:|---|---|"]
    for case, rates in CASES.items():
        step, state, _ = train_step.graphmod_step(train_step.DIMS, rates, args.seed, batch)
        weights = train_step.initial_weights(state)
        lean, lean_state = train_step.hand_step(weights, rates, args.seed, lean=True)
        leanest = anatomy(lean, lean_state, batch)
        for name, found in (("leanest", leanest), ("graphmod", anatomy(step, state, batch))):
            row = {"case": case, "variant": name,
                   "equations": sum(found["primitives"].values()),
                   "instructions": sum(found["opcodes"].values()), "flops": found["flops"],
                   "primitives": dict(found["primitives"]), "opcodes": dict(found["opcodes"])}
            rows.append(row)
            flops = f"{found['flops']:.4g} ({found['flops'] / leanest['flops']:.4f})"
            lines.append(
                f"| {case} | {name} | {row['equations']} | {row['instructions']} | {flops} "
                f"| {differences(found['primitives'], leanest['primitives'])} "
                f"| {differences(found['opcodes'], leanest['opcodes'])} |")
    report = "\n".join(["# Step anatomy: graphmod against the leanest hand-written step", "",
                        *lines, ""])
    train_step.write_results(args, "anatomy", report, {"rows": rows})
    return {"rows": rows}


if __name__ == "__main__":
    main()
