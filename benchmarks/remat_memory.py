"""Memory against time of ``managers.Remat``: rematerialization on a deep MLP and a small
transformer, each compiled without it, with it, and with it under ``policy="dots_saveable"``.

Models (Adam 1e-3, loss ``mean(model(x) ** 2)``):

``deep MLP``
    ``graphmod.bricks.MLP`` of 24 tanh layers of width 512, batch 256; Remat wraps the
    whole stack (``bricks=[mlp]``), as the library test does.
``transformer``
    a ``graphmod.bricks.Sequence`` of 4 causal ``TransformerBlock`` (width 64, 4 heads,
    MLP 256), batch 16 of length 128; Remat wraps each block
    (``bricks=[TransformerBlock]``).

Memory, two views of the same gradient ``jax.grad`` of the program's train loss:

- **residuals**: what JAX keeps from the forward pass for the backward one, besides the
  arguments (``ad_checkpoint.saved_residuals``, what the library test counts). This is
  what remat asks for, whatever the backend does with it.
- **XLA temp**: ``memory_analysis().temp_size_in_bytes`` of the compiled gradient, the
  scratch XLA allocates on this backend (arguments and outputs are the same for every
  variant and given in the JSON, with the compiled train step's own numbers). XLA's
  scheduler and fusions decide this one, so it can move less than the residuals do.

Time: the train step (``graphmod.optimize``), variants interleaved round-robin in one
process, medians of blocks ended by ``block_until_ready``, ratios to the no-remat variant.
``XLA flops`` (the compiled step's cost analysis) shows whether the recomputation survived
compilation.

Run::

    python benchmarks/remat_memory.py            # about 2 minutes on 2 CPU cores
    python benchmarks/remat_memory.py --quick    # tiny models: a smoke run, numbers meaningless

Writes ``benchmarks/remat_results.md``, ``.json`` (``--out``, ``--no-write``) and the plot
``docs/remat_memory.png`` (``--plot``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import ad_checkpoint
from train_step import Variant, arguments, environment, functional, interleave, write_results

import graphmod as gm
import managers

MB = 2 ** 20
PLOT = Path(__file__).resolve().parent.parent / "docs" / "remat_memory.png"


@dataclasses.dataclass(frozen=True)
class Model:
    """A model to rematerialize: ``build()`` makes a fresh brick, ``target(brick)`` the
    bricks Remat wraps in it, ``shape`` the input batch."""

    name: str
    description: str
    build: Callable[[], gm.Brick]
    target: Callable[[gm.Brick], list]
    shape: tuple[int, ...]


def models(quick: bool) -> list[Model]:
    """The deep MLP and the transformer (tiny ones with ``quick``)."""
    depth, width, batch = (4, 32, 16) if quick else (24, 512, 256)
    blocks, features, heads, hidden, length, sequences = (
        (1, 16, 2, 32, 8, 2) if quick else (4, 64, 4, 256, 128, 16))

    def transformer() -> gm.Brick:
        rngs = nnx.Rngs(0)
        return gm.bricks.Sequence([gm.bricks.TransformerBlock(
            features, heads, hidden, causal=True, rngs=rngs) for _ in range(blocks)])

    return [
        Model("deep MLP", f"{depth} tanh layers of width {width}, batch {batch}",
              lambda: gm.bricks.MLP([width] * (depth + 1), activation=jnp.tanh,
                                    rngs=nnx.Rngs(0)),
              lambda mlp: [mlp], (batch, width)),
        Model("transformer", f"{blocks} causal blocks, width {features}, {heads} heads, "
              f"MLP {hidden}, batch {sequences} x {length}", transformer,
              lambda _: [gm.bricks.TransformerBlock], (sequences, length, features)),
    ]


VARIANTS: dict[str, Callable[[list], list[gm.Manager]]] = {
    "no remat": lambda target: [],
    "Remat": lambda target: [managers.Remat(bricks=target)],
    'Remat(policy="dots_saveable")':
        lambda target: [managers.Remat(bricks=target, policy="dots_saveable")],
}


def residual_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Bytes the backward pass of ``fn`` keeps from its forward pass, its arguments aside,
    from the lines ``jax.ad_checkpoint.print_saved_residuals`` prints (``f32[256,512] from
    ...``; this JAX has no public function returning them)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ad_checkpoint.print_saved_residuals(fn, *args)
    total = 0
    for line in out.getvalue().splitlines():
        found = re.match(r"[a-z]+(\d*)\S*?\[([\d,]*)\]", line)
        if found and "from the argument" not in line:
            bits, shape = found.groups()
            # A dtype without a width (bool, PRNG keys): count a byte per element.
            itemsize = int(bits) // 8 if bits else 1
            total += math.prod(int(n) for n in shape.split(",") if n) * itemsize
    return total


def analysis(compiled: Any) -> dict[str, float]:
    """XLA's memory (MB) and flops of a compiled computation."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older JAX: one dict per device
    return {"temp_mb": memory.temp_size_in_bytes / MB,
            "argument_mb": memory.argument_size_in_bytes / MB,
            "output_mb": memory.output_size_in_bytes / MB,
            "alias_mb": memory.alias_size_in_bytes / MB,
            "flops": float(cost.get("flops", float("nan")))}


def build(model: Model, variant: str, x: jax.Array) -> tuple[Variant, dict[str, Any]]:
    """Compiles one variant; returns its timed train step and its memory measurements."""
    brick = model.build()
    program = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), brick,
                         managers=VARIANTS[variant](model.target(brick)))
    variables = program.init(x)
    key = jax.random.key(0)
    loss = lambda v, x: program._train_traced(v, key, (x,), {})[0]
    grad = analysis(jax.jit(jax.grad(loss)).lower(variables, x).compile())
    step = gm.optimize(program, optax.adam(1e-3))
    state = step.init(variables, jax.random.key(0))
    # The public step, lowered inside a jax.jit as train_step.py does, before it donates.
    train = analysis(jax.jit(lambda s, x: step(s, x)).lower(state, x).compile())
    call, _ = functional(step, state)
    return Variant(variant, call), {
        "model": model.name, "variant": variant,
        "residual_mb": residual_bytes(loss, variables, x) / MB,
        "grad": grad, "train_step": train}


def measure(model: Model, repeats: int, block: int) -> list[dict[str, Any]]:
    """All variants of ``model``, timed interleaved; rows with ratios to no remat."""
    x = jax.random.normal(jax.random.key(1), model.shape)
    built = [build(model, name, x) for name in VARIANTS]
    timed = [variant for variant, _ in built]
    interleave(timed, [(x,)], repeats, block)
    rows = [row | {"median_ms": statistics.median(v.times) * 1e3,
                   "p10_ms": float(np.percentile(v.times, 10)) * 1e3,
                   "p90_ms": float(np.percentile(v.times, 90)) * 1e3,
                   "first_call_s": v.first_call_s} for v, row in built]
    base = rows[0]
    for row in rows:
        row["residual_ratio"] = ratio(row["residual_mb"], base["residual_mb"])
        row["temp_ratio"] = ratio(row["grad"]["temp_mb"], base["grad"]["temp_mb"])
        row["time_ratio"] = ratio(row["median_ms"], base["median_ms"])
        row["flops_ratio"] = ratio(row["train_step"]["flops"], base["train_step"]["flops"])
    return rows


def ratio(value: float, reference: float) -> float:
    """``value / reference``, NaN when the reference is 0 (XLA may need no scratch)."""
    return value / reference if reference else float("nan")


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of every model's variants."""
    lines = ["| model | variant | residuals (MB) | ratio | XLA temp (MB) | ratio "
             "| median step (ms) | p10-p90 (ms) | ratio | XLA flops ratio |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['model']} | {r['variant']} | {r['residual_mb']:.2f} "
              f"| {r['residual_ratio']:.2f} | {r['grad']['temp_mb']:.2f} "
              f"| {r['temp_ratio']:.2f} | {r['median_ms']:.1f} "
              f"| {r['p10_ms']:.0f}-{r['p90_ms']:.0f} | {r['time_ratio']:.2f} "
              f"| {r['flops_ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Memory (x) against median step time (y), one panel per model: filled markers for
    XLA's temp memory, hollow ones for JAX's residuals, one colour per variant."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    colours = dict(zip(VARIANTS, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for ax, name in zip(axes[0], names, strict=True):
        mine = [r for r in rows if r["model"] == name]
        for r in mine:
            colour, y = colours[r["variant"]], r["median_ms"]
            ax.scatter(r["grad"]["temp_mb"], y, color=colour, marker="o", s=60,
                       label=f"{r['variant']}: XLA temp")
            ax.scatter(r["residual_mb"], y, facecolors="none", edgecolors=colour,
                       marker="s", s=60, label=f"{r['variant']}: residuals")
            ax.annotate(r["variant"], (r["residual_mb"], y), textcoords="offset points",
                        xytext=(6, 4), fontsize=7, color=colour)
        ax.set(title=name, xlabel="memory of the gradient (MB)",
               ylabel="median train step (ms)")
        # From zero, so a 10% difference looks like one; room for the labels.
        ax.set_ylim(0, 1.25 * max(r["median_ms"] for r in mine))
        widest = max(max(r["residual_mb"], r["grad"]["temp_mb"]) for r in mine)
        ax.set_xlim(-0.03 * widest, 1.3 * widest)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle("managers.Remat: memory against time (" + jax.devices()[0].platform + ")")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


READ = """\
How to read it: *residuals* is what each variant asks of autodiff, the same on every
backend. *XLA temp* is what this backend's compiler made of it: an *XLA flops ratio* of
1.00 under Remat means XLA merged the recomputation back into the forward pass, and a temp
ratio near 1.00 with more flops means it scheduled the recomputation early, so the
activations are live at the same time anyway. XLA may also keep activations in the
gradient's output buffers (the MLP's weight gradients are larger than its activations),
which hides them from *temp*; arguments and outputs are in the JSON. Step times on a
shared machine move by about 10% between runs.
"""


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = arguments(__doc__, "remat_results")
    parser.add_argument("--plot", type=Path, default=PLOT, help="where to write the PNG")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 10)
    block = args.block or (2 if args.quick else 5)
    chosen = models(args.quick)
    rows = [row for model in chosen for row in measure(model, repeats, block)]
    header = "\n".join(f"- **{m.name}**: {m.description}" for m in chosen)
    report = (f"# managers.Remat: memory against time\n\n{header}\n\nAdam 1e-3, "
              f"{jax.devices()[0].platform}; medians of {repeats} interleaved blocks of "
              f"{block} train steps; ratios to no remat. *residuals*: what JAX keeps for "
              "the backward pass of the gradient; *XLA temp*: the compiled gradient's "
              "scratch memory.\n\n" + table(rows) + "\n\n" + READ)
    write_results(args, "remat_results", report,
                  {"environment": environment(), "repeats": repeats, "block": block,
                   "rows": rows})
    if not args.no_write:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
