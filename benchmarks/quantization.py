"""What stored quantized weights cost and save: ``managers.quantize`` (int8 per channel,
int4 per group) against float32 and against Qwix's PTQ, at inference.

Two models, every variant of one model timed in one process, round-robin:

MLP (``--dims``, ReLU, plain ``nnx.Linear`` layers, random weights, batch ``--batch``)
    ``float32`` (``graphmod.compile``), ``graphmod int8`` / ``graphmod int4 g128``
    (``managers.quantize`` with ``managers.Quantized("int8")`` / ``("int4", group=128)``),
    ``qwix int8`` / ``qwix int4 g128`` (``qwix.quantize_model`` with a ``PtqProvider`` of
    the same scheme, run by ``jax.jit`` over its ``nnx.split`` state). *error* is the
    largest difference of the logits from float32's.
character LM (``examples/char_lm.py``'s model, features 64, trained ``--steps`` Adam steps)
    ``float32``, ``graphmod int8``, ``graphmod int4`` (groups of 128, 64 or 32, the largest
    that divides each Linear's fan-in; the embedding stays float); *error* is the held-out
    loss (nats per character). Qwix's PTQ cannot rewrite graphmod's bricks (it sets a
    quantized parameter on the module inside its trace: Flax's ``TraceContextError``).

*bytes* are the variables' (``program.save`` writes these and its record); medians of
interleaved blocks, */ float32* their ratio to float32's.

Run::

    python benchmarks/quantization.py            # about two minutes on 2 CPU cores
    python benchmarks/quantization.py --quick    # smoke run, numbers meaningless

Writes ``benchmarks/quantization_results.md`` and ``.json`` (``--out``, ``--no-write``).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from train_step import Variant, arguments, environment, interleave, write_results

import graphmod as gm
import managers
from managers._quantize import stored_bytes

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "char_lm.py"


class MLP(nnx.Module):
    def __init__(self, dims: Sequence[int], seed: int) -> None:
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List(nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(dims))

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def _nbytes(tree: Any) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def mlp_variants(dims: Sequence[int], batch: int, seed: int
                 ) -> tuple[list[Variant], dict[str, tuple[int, float]]]:
    """The MLP's variants, and per variant (bytes, error against float32)."""
    model = MLP(dims, seed)
    x = jax.random.normal(jax.random.key(seed), (batch, dims[0]))
    program = gm.compile(lambda m, x: m(x), model)
    variables = program.init(x)
    reference = program.infer(variables, x)
    variants = [Variant("float32", lambda b: program.infer(variables, b))]
    facts = {"float32": (stored_bytes(variables), 0.0)}
    schemes = {"int8": managers.Quantized("int8"),
               "int4 g128": managers.Quantized("int4", group=128)}
    for label, quantized in schemes.items():
        served, stored = managers.quantize(program, variables, quantized)
        variants.append(Variant(f"graphmod {label}", _bound(served.infer, stored)))
        facts[f"graphmod {label}"] = (stored_bytes(stored), _error(served.infer(stored, x),
                                                                 reference))
    try:
        import qwix
    except ImportError:  # the comparison is optional: `pip install qwix` to run it
        return variants, facts
    for label, (qtype, tile) in {"int8": (jnp.int8, None), "int4 g128": (jnp.int4, 128)
                                 }.items():
        rule = qwix.QuantizationRule(module_path=".*", weight_qtype=qtype, tile_size=tile)
        theirs = qwix.quantize_model(model, qwix.PtqProvider([rule]), x)
        graphdef, state = nnx.split(theirs)
        forward = jax.jit(lambda state, b, graphdef=graphdef: nnx.merge(graphdef, state)(b))
        variants.append(Variant(f"qwix {label}", _bound(forward, state)))
        facts[f"qwix {label}"] = (_nbytes(state), _error(forward(state, x), reference))
    return variants, facts


def char_lm_variants(steps: int, seed: int
                     ) -> tuple[list[Variant], dict[str, tuple[int, float]], np.ndarray]:
    """The character LM's variants, per variant (bytes, held-out loss), and its batch."""
    spec = importlib.util.spec_from_file_location("graphmod_bench_char_lm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ids = module.corpus("a", "m", 100_000)
    data = module.windows(ids[:90_000], 2048, 64, seed)
    held_out = module.windows(ids[90_000:], 256, 64, seed + 1)
    model = module.CharLM(len(module.VOCABULARY) + 1, 64, 64, 4, 2, rngs=nnx.Rngs(seed))
    program = gm.compile(module.cost, model)
    state = module.train(program, program.init(data[:2]), data,
                         argparse.Namespace(steps=steps, lr=3e-3, seed=seed))
    variables = state.variables
    schemes = {"float32": None, "graphmod int8": managers.Quantized("int8"),
               "graphmod int4": managers.Quantized("int4", group=(128, 64, 32),
                                                   bricks=[gm.bricks.Linear])}
    variants, facts = [], {}
    for label, quantized in schemes.items():
        served, stored = (program, variables) if quantized is None else managers.quantize(
            program, variables, quantized)
        variants.append(Variant(label, _bound(served.infer, stored)))
        facts[label] = (stored_bytes(stored),
                        module.validation_loss(served, stored, held_out))
    sys.modules.pop(spec.name, None)
    return variants, facts, held_out[:64]


def _bound(infer: Callable[..., Any], variables: Any) -> Callable[[Any], Any]:
    return lambda batch: infer(variables, batch)


def _error(out: jax.Array, reference: jax.Array) -> float:
    return float(jnp.max(jnp.abs(out - reference)))


def rows(name: str, variants: Sequence[Variant], facts: dict[str, tuple[int, float]],
         batch: Any, repeats: int, block: int) -> list[dict[str, Any]]:
    interleave(variants, [batch], repeats, block)
    medians = {v.name: statistics.median(v.times) for v in variants}
    base_time, base_bytes = medians["float32"], facts["float32"][0]
    return [{"model": name, "variant": v.name, "median_us": medians[v.name] * 1e6,
             "time_over_float32": medians[v.name] / base_time, "bytes": facts[v.name][0],
             "bytes_over_float32": facts[v.name][0] / base_bytes, "error": facts[v.name][1]}
            for v in variants]


def report(env: dict[str, Any], args: argparse.Namespace, table: Sequence[dict]) -> str:
    lines = ["# Stored quantized weights at inference (managers.quantize)", "",
             f"{env['date']} · JAX {env['jax']} · {env['platform']} ({env['device']}) · "
             f"{env['cpu_count']} CPUs" + (" · **--quick: not meaningful**" if args.quick
                                            else ""),
             "", f"MLP {'-'.join(map(str, args.dims))} batch {args.batch} (error: largest "
             "logit difference from float32); character LM features 64, 2 blocks, "
             f"{args.steps} training steps, batch 64 windows of 64 (error: held-out loss). "
             f"Medians of {args.repeats} interleaved blocks of {args.block} calls.", "",
             "| model | variant | median call (µs) | / float32 | bytes | / float32 | error |",
             "|---|---|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['model']} | {r['variant']} | {r['median_us']:.0f} | "
              f"{r['time_over_float32']:.2f} | {r['bytes']:,} | {r['bytes_over_float32']:.3f} "
              f"| {r['error']:.4f} |" for r in table]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the rows."""
    parser = arguments(__doc__, "quantization_results")
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 1024, 1024, 10])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150, help="char LM training steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.dims, args.batch, args.steps = [256, 256, 10], 8, 5
    args.repeats = args.repeats or (3 if args.quick else 10)
    args.block = args.block or (2 if args.quick else 10)
    variants, facts = mlp_variants(args.dims, args.batch, args.seed)
    x = jax.random.normal(jax.random.key(args.seed + 1), (args.batch, args.dims[0]))
    table = rows("MLP", variants, facts, x, args.repeats, args.block)
    variants, facts, batch = char_lm_variants(args.steps, args.seed)
    table += rows("char LM", variants, facts, batch, args.repeats, args.block)
    env = environment()
    write_results(args, "quantization_results", report(env, args, table),
                  {"environment": env, "rows": table, "dims": args.dims,
                   "batch": args.batch, "steps": args.steps})
    return table


if __name__ == "__main__":
    main()
