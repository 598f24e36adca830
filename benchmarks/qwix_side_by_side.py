"""graphmod's stored quantization (``managers.quantize``) side by side with Qwix's PTQ
(``qwix.quantize_model`` with a ``PtqProvider`` of the same scheme): accuracy against
float32, the bytes of the variables and the inference time, on three models.

digits MLP (64-256-256-10, ReLU, plain ``nnx.Linear``, trained ``--steps`` Adam steps on
    scikit-learn's digits by ``graphmod.optimize``): *quality* is the held-out accuracy.
a bonsai-style decoder (Flax's Gemma 3, ``examples/flax_nnx/gemma``, at a tiny size:
    2 layers, width 128, 4 query heads sharing one key-value head, vocabulary 512, random
    weights, 8 sequences of 64 tokens): *quality* is the share of positions whose arg-max
    token is float32's, *error* the largest logit difference from float32.
character LM (``examples/char_lm.py``'s model, features 64, trained ``--char-steps``
    steps): *quality* is the held-out loss; graphmod only: Qwix's PTQ cannot rewrite
    graphmod's bricks (it sets its quantized parameter on the brick inside its own trace,
    which Flax refuses: ``TraceContextError``).

Schemes: int8 per channel; int4 in groups of 32 (Qwix's ``tile_size=32``; for Gemma's
output projection, which contracts two axes, Qwix groups the last and takes the other
whole, graphmod groups the flattened fan-in). Qwix's model runs under ``jax.jit`` over its
``nnx.split`` state, graphmod's as ``program.infer``. *bytes* are the variables' (what a
saved model holds), medians of interleaved blocks, */ float32* their ratio to float32's.

Run::

    python benchmarks/qwix_side_by_side.py            # about two minutes on 2 CPU cores
    python benchmarks/qwix_side_by_side.py --quick    # smoke run, numbers meaningless

Writes ``benchmarks/qwix_side_by_side_results.md`` and ``.json`` (``--out``, ``--no-write``).
"""

from __future__ import annotations

import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from quantization import MLP, char_lm_variants
from train_step import Variant, arguments, environment, interleave, write_results

import graphmod as gm
import managers
from managers._quantize import stored_bytes

# Flax's Gemma lives in examples/ at the repository root (see flax_models.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.flax_nnx.gemma import transformer as gemma_lib

SCHEMES = {"int8": ("int8", None), "int4 g32": ("int4", 32)}  # label: (dtype, group)
Quality = Callable[[jax.Array], float]


def digits(steps: int, seed: int) -> tuple[nnx.Module, gm.Program, dict, jax.Array, Quality]:
    """The trained digits MLP, its predicting program and variables, the held-out inputs
    and their accuracy from logits."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (data.data / 16).astype(np.float32), data.target.astype(np.int32), test_size=0.25,
        stratify=data.target, random_state=seed)
    model = MLP([64, 256, 256, 10], seed)
    program = gm.compile(lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(
        m(x), y).mean(), model)
    step = gm.optimize(program, optax.adam(1e-3))
    state = step.init(program.init(x_train[:2], y_train[:2]), jax.random.key(seed))
    batches = np.random.default_rng(seed).integers(0, len(x_train), (steps, 128))
    for batch in batches:
        state, _ = step(state, x_train[batch], y_train[batch])
    predict = program.derive(lambda m, x: m(x))
    predict.init(x_test)
    predict.update_model(state.variables)  # the eager model Qwix reads: the trained one
    return (model, predict, state.variables, jnp.asarray(x_test),
            lambda logits: float(np.mean(np.argmax(logits, -1) == y_test)))


def decoder(seed: int) -> tuple[nnx.Module, gm.Program, dict, jax.Array, Quality]:
    """Flax's Gemma at a tiny size (as bonsai's decoders: GQA, gated MLP, RMS norms), its
    logits program and variables, 8 sequences of 64 tokens, and top-1 agreement."""
    config = gemma_lib.TransformerConfig.gemma3_270m(
        num_layers=2, num_embed=512, embed_dim=128, hidden_dim=512, num_heads=4,
        head_dim=32, num_kv_heads=1, sliding_window_size=32)
    with nnx.use_eager_sharding(False):  # its sharding annotations, without a mesh
        model = gemma_lib.Transformer(config, rngs=nnx.Rngs(seed))
    model.eval()
    tokens = jax.random.randint(jax.random.key(seed), (8, 64), 1, 512)
    positions = jnp.broadcast_to(jnp.arange(64), tokens.shape)
    mask = gemma_lib.make_causal_attn_mask(tokens > 0)
    forward = DecoderForward(positions, mask)
    program = gm.compile(forward, model)
    variables = program.init(tokens)
    reference = np.argmax(program.infer(variables, tokens), -1)
    return (model, program, variables, tokens,
            lambda logits: float(np.mean(np.argmax(logits, -1) == reference)))


class DecoderForward:
    """Gemma's logits for ``tokens`` at fixed positions and causal mask (as its sampler
    calls it, with no cache)."""

    def __init__(self, positions: jax.Array, mask: jax.Array) -> None:
        self.positions, self.mask = positions, mask

    def __call__(self, model: nnx.Module, tokens: jax.Array) -> jax.Array:
        return model(tokens, self.positions, None, self.mask)[0]


def side_by_side(name: str, model: nnx.Module, program: gm.Program, variables: dict,
                 x: jax.Array, quality: Quality, args: Any) -> list[dict[str, Any]]:
    """Rows for ``name``: float32, then each scheme by graphmod and by Qwix, timed
    round-robin in one process."""
    import qwix

    reference = program.infer(variables, x)
    variants = [Variant("float32", lambda b: program.infer(variables, b))]
    facts = {"float32": (stored_bytes(variables), quality(reference), 0.0)}
    for label, (dtype, group) in SCHEMES.items():
        quantized = managers.Quantized(dtype, group=group, bricks=[nnx.Linear, nnx.Einsum])
        served, stored = managers.quantize(program, variables, quantized)
        variants.append(Variant(f"graphmod {label}", _bound(served.infer, stored)))
        facts[f"graphmod {label}"] = _facts(stored, served.infer(stored, x), reference, quality)
        rule = qwix.QuantizationRule(module_path=".*", weight_qtype=dtype, tile_size=group)
        theirs = qwix.quantize_model(model, qwix.PtqProvider([rule]), *_call_args(program, x))
        graphdef, state = nnx.split(theirs)
        run = jax.jit(lambda state, b, graphdef=graphdef: program.fn(
            nnx.merge(graphdef, state), b))
        variants.append(Variant(f"qwix {label}", _bound(run, state)))
        facts[f"qwix {label}"] = _facts(state, run(state, x), reference, quality)
    return rows(name, variants, facts, x, args)


def _call_args(program: gm.Program, x: jax.Array) -> tuple:
    """What the eager model is called with for ``x`` (Qwix runs it to find its weights)."""
    fn = program.fn
    return (x, fn.positions, None, fn.mask) if isinstance(fn, DecoderForward) else (x,)


def _facts(variables: Any, out: jax.Array, reference: jax.Array, quality: Quality
           ) -> tuple[int, float, float]:
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(variables))
    return nbytes, quality(out), float(jnp.max(jnp.abs(out - reference)))


def _bound(infer: Callable[..., Any], variables: Any) -> Callable[[Any], Any]:
    return lambda batch: infer(variables, batch)


def rows(name: str, variants: Sequence[Variant], facts: dict[str, tuple],
         batch: Any, args: Any) -> list[dict[str, Any]]:
    interleave(variants, [batch], args.repeats, args.block)
    medians = {v.name: statistics.median(v.times) for v in variants}
    base_time, base_bytes = medians["float32"], facts["float32"][0]
    return [{"model": name, "variant": v.name, "median_us": medians[v.name] * 1e6,
             "time_over_float32": medians[v.name] / base_time, "bytes": facts[v.name][0],
             "bytes_over_float32": facts[v.name][0] / base_bytes,
             "quality": facts[v.name][1], "error": facts[v.name][2]} for v in variants]


def report(env: dict[str, Any], args: Any, table: Sequence[dict]) -> str:
    lines = ["# Stored quantization: graphmod against Qwix (PTQ, weights only)", "",
             f"{env['date']} · JAX {env['jax']} · qwix {args.qwix} · {env['platform']} "
             f"({env['device']}) · {env['cpu_count']} CPUs"
             + (" · **--quick: not meaningful**" if args.quick else ""), "",
             f"Quality: digits MLP held-out accuracy ({args.steps} Adam steps); decoder (Flax's "
             "Gemma 3, tiny) top-1 agreement with float32; char LM held-out loss (nats/char, "
             f"{args.char_steps} steps; Qwix cannot rewrite graphmod's bricks). Error: the "
             f"largest logit difference from float32. Medians of {args.repeats} interleaved "
             f"blocks of {args.block} calls.", "",
             "| model | variant | median call (µs) | / float32 | bytes | / float32 | quality "
             "| error |", "|---|---|--:|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['model']} | {r['variant']} | {r['median_us']:.0f} | "
              f"{r['time_over_float32']:.2f} | {r['bytes']:,} | {r['bytes_over_float32']:.3f} "
              f"| {r['quality']:.4f} | {_error(r)} |" for r in table]
    return "\n".join(lines) + "\n"


def _error(row: dict) -> str:
    return "" if row["error"] is None else f"{row['error']:.4f}"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the rows."""
    from importlib.metadata import version

    import qwix  # noqa: F401  (the comparison needs it: pip install qwix)

    parser = arguments(__doc__, "qwix_side_by_side_results")
    parser.add_argument("--steps", type=int, default=300, help="digits MLP training steps")
    parser.add_argument("--char-steps", type=int, default=200, help="char LM training steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.char_steps = 20, 5
    args.repeats = args.repeats or (3 if args.quick else 10)
    args.block = args.block or (2 if args.quick else 5)
    args.qwix = version("qwix")
    warnings.filterwarnings("ignore", r"'\.value' (access|setter)", DeprecationWarning)
    table = side_by_side("digits MLP", *digits(args.steps, args.seed), args)
    table += side_by_side("decoder (Gemma 3, tiny)", *decoder(args.seed), args)
    variants, facts, batch = char_lm_variants(args.char_steps, args.seed)
    table += rows("char LM", variants, {k: (b, loss, None) for k, (b, loss) in facts.items()},
                  batch, args)
    env = environment()
    write_results(args, "qwix_side_by_side_results", report(env, args, table),
                  {"environment": env, "qwix": args.qwix, "rows": table,
                   "steps": args.steps, "char_steps": args.char_steps})
    return table


if __name__ == "__main__":
    main()
