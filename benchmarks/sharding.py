"""What sharding costs: graphmod's data-parallel train step on 1, 2, 4 and 8 devices.

The digits MLP (64-256-256-10, ReLU, Adam, batch 128 of random inputs and integer labels,
softmax cross-entropy, no managers) stepped by ``graphmod.optimize`` on meshes of 1, 2, 4
and 8 *virtual CPU devices* (``--xla_force_host_platform_device_count=8``, set before JAX
is imported), each against:

``graphmod, no mesh``
    the same program compiled without ``mesh=``: the one-device reference of every ratio
    in the *ratio to one-device graphmod* column.
``hand, no mesh`` / ``hand, mesh n``
    the step written in pure JAX over plain dicts (``train_step.py``'s hand-written step:
    ``jax.value_and_grad``, ``optax.adam``), jitted with donation; on a mesh with the
    shardings graphmod gives the same data-parallel program (parameters, Adam's moments,
    step and key replicated with ``NamedSharding(mesh, P())``, batches split with
    ``NamedSharding(mesh, P("data"))``, the state's ``out_shardings`` replicated). The
    *graphmod / hand* column divides each graphmod median by this one's (goal: ≤ 1.02).

``graphmod, mesh n`` is ``graphmod.compile(..., mesh=jax.make_mesh((n,), ("data",)),
**graphmod.sharding.data_parallel("data"))``. Batches are placed on each variant's mesh
before timing (``program.placement.put_batch``), so the times are the step's, not the
host-to-device copy's. Before timing, every variant runs the same steps from the same
initial weights and must give the same losses (to float rounding; it fails loudly
otherwise).

Timing: variants round-robin (in balanced orders), each repetition timing a block of steps
ended by ``block_until_ready`` on the train state, after one untimed step (so no variant is
charged for switching from another mesh's devices); medians over repetitions. The virtual
devices share the machine's cores (2 here), so more devices cannot be faster: the ratios
to one device measure the partitioned program's overhead (collectives, per-device
dispatch), not a speed-up. *XLA flops*, *bytes accessed* (per device) and *all-reduces*
come from the compiled step (``cost_analysis()`` and the optimized HLO).

Keep ``--block`` small: with 50 or more steps in flight on the 8-device mesh, XLA's CPU
collectives deadlocked on a 2-core machine (an all-reduce waits for a device that never
arrives; the process aborts after 40 s), hand-written JAX steps as well as graphmod's.

Run::

    python benchmarks/sharding.py            # 1-2 minutes on 2 CPU cores
    python benchmarks/sharding.py --quick    # smoke run, numbers meaningless

Writes ``benchmarks/sharding_results.md`` and ``.json`` (``--out``, ``--no-write``).
"""

from __future__ import annotations

import os
import sys

# Before JAX is imported: eight CPU devices to build meshes from, and no accelerator; with
# --gpu, the machine's GPUs (meshes of 1, 2, 4, 8 of them, as many as there are).
if "--gpu" not in sys.argv[1:]:
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()

import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from train_step import (
    BATCH,
    DIMS,
    LR,
    Variant,
    arguments,
    count_instructions,
    cross_entropy,
    environment,
    first_call,
    hand_step,
    initial_weights,
    interleave,
    percentile,
    write_results,
)

import graphmod

DEVICES = (1, 2, 4, 8)
ON_GPU = "--gpu" in sys.argv[1:]
SAFE_BLOCK = 40  # steps in flight on 8 CPU devices that ran without deadlocking
Batch = tuple[jax.Array, jax.Array]


def loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """The cost graphmod differentiates: softmax cross-entropy with integer labels."""
    return cross_entropy(model(x), y)


def stepper(name: str, step: Callable[..., Any], state: Any, placed: Sequence[Batch],
            loss_of: Callable[[Any], jax.Array]) -> Variant:
    """A :class:`Variant` whose ``call(i)`` steps ``state`` on its own placed batch ``i``
    and returns ``(state, loss)`` (what a block waits on); ``compiled()`` lowers the step
    inside a ``jax.jit`` and compiles it for XLA's cost analysis."""
    holder = [state]

    def call(i: int) -> tuple[Any, jax.Array]:
        holder[0], out = step(holder[0], *placed[i])
        return holder[0], loss_of(out)

    def compiled() -> Any:
        return jax.jit(lambda s, x, y: step(s, x, y)).lower(holder[0], *placed[0]).compile()

    return Variant(name, call, compiled)


def graphmod_variant(mesh: Any, seed: int, batches: Sequence[Batch]
                     ) -> tuple[Variant, list, Any]:
    """graphmod's step (data parallel on ``mesh``; ``None``: no mesh), the initial
    ``(W, b)`` of its layers and the program's placement (``None`` without a mesh)."""
    mlp = graphmod.bricks.MLP(list(DIMS), activation=jax.nn.relu, rngs=nnx.Rngs(seed))
    sharding = {} if mesh is None else {"mesh": mesh, **graphmod.sharding.data_parallel("data")}
    program = graphmod.compile(loss, mlp, **sharding)
    step = graphmod.optimize(program, optax.adam(LR))
    state = step.init(program.init(*batches[0]), jax.random.key(seed))
    weights = initial_weights(state)  # before the first step donates the state
    placement = program.placement
    placed = batches if placement is None else [placement.put_batch(b) for b in batches]
    name = "graphmod, no mesh" if mesh is None else f"graphmod, mesh {mesh.size}"
    variant = stepper(name, step, state, placed, lambda metrics: metrics["loss"])
    return variant, weights, placement


def hand_variant(mesh: Any, weights: list, seed: int, batches: Sequence[Batch]) -> Variant:
    """The hand-written step from the same weights; on ``mesh``, jitted with graphmod's
    data-parallel shardings (state replicated, batches split along ``data``)."""
    step, state = hand_step(weights, None, seed)
    if mesh is None:
        return stepper("hand, no mesh", step, state, batches, lambda value: value)
    whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    sharded = jax.jit(step, in_shardings=(whole, split, split),
                      out_shardings=(whole, whole), donate_argnums=0)
    placed = [jax.device_put(b, split) for b in batches]
    return stepper(f"hand, mesh {mesh.size}", sharded, jax.device_put(state, whole), placed,
                   lambda value: value)


def build_variants(seed: int, batches: Sequence[Batch], sizes: Sequence[int]
                   ) -> list[tuple[int | None, Variant]]:
    """``(devices, variant)`` pairs: the no-mesh pair, then a graphmod and a hand-written
    step on a mesh of each of ``sizes`` (devices ``None``: no mesh)."""
    reference, weights, _ = graphmod_variant(None, seed, batches)
    pairs: list[tuple[int | None, Variant]] = [
        (None, reference), (None, hand_variant(None, weights, seed, batches))]
    for n in sizes:
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        ours, _, placement = graphmod_variant(mesh, seed, batches)
        pairs += [(n, ours), (n, hand_variant(placement.mesh, weights, seed, batches))]
    return pairs


def check_same_math(variants: Sequence[Variant], steps: int = 3) -> float:
    """Compiles every variant (its first call, timed) and runs ``steps`` more steps; all
    started from the same weights on the same batches, so their losses must agree.
    Returns the largest difference; raises if it is over 1e-4."""
    losses = []
    for variant in variants:
        first_call(variant, 0)
        losses.append([float(variant.call(i)[1]) for i in range(1, steps + 1)])
    spread = np.ptp(np.asarray(losses), axis=0)
    if spread.max() > 1e-4:
        raise AssertionError(f"the variants do not compute the same step: losses {losses}")
    return float(spread.max())


def analyze(variant: Variant) -> dict[str, Any]:
    """XLA's flops and bytes accessed (per device) and the all-reduces of the compiled
    step, and its HLO instruction count; ``{"analysis_error": ...}`` if the step cannot be
    lowered inside a ``jax.jit`` (the timings do not need it)."""
    try:
        compiled = variant.compiled()
    except Exception as error:  # an optional column: report it, keep the timings
        print(f"warning: no cost analysis of {variant.name!r}: {type(error).__name__}: {error}")
        return {"analysis_error": f"{type(error).__name__}: {error}"}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    return {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
            "all_reduces": len(re.findall(r"\ball-reduce(?:-start)?\(", text)),
            "hlo_instructions": count_instructions(text)}


def row(devices: int | None, variant: Variant, reference: float, hand: float | None,
        analysis: dict[str, Any]) -> dict[str, Any]:
    """One result: the variant's median step, spread, ratios and compiled-step numbers."""
    median = statistics.median(variant.times)
    return {"devices": devices, "variant": variant.name, "median_us": median * 1e6,
            "p10_us": percentile(variant.times, 10) * 1e6,
            "p90_us": percentile(variant.times, 90) * 1e6,
            "host_us": statistics.median(variant.host_times) * 1e6,
            "ratio_to_one_device_graphmod": median / reference,
            "graphmod_over_hand": None if hand is None else median / hand,
            "first_call_s": variant.first_call_s, **analysis}


def rows_of(pairs: Sequence[tuple[int | None, Variant]], analyses: Sequence[dict]
            ) -> list[dict[str, Any]]:
    """The results, each graphmod variant divided by the hand-written one on its mesh."""
    reference = statistics.median(pairs[0][1].times)
    rows = []
    for i, ((devices, variant), analysis) in enumerate(zip(pairs, analyses, strict=True)):
        ours = variant.name.startswith("graphmod")
        hand = statistics.median(pairs[i + 1][1].times) if ours else None
        rows.append(row(devices, variant, reference, hand, analysis))
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of ``rows``."""
    lines = ["| devices | variant | median step (µs) | p10-p90 (µs) | ratio to one-device "
             "graphmod | graphmod / hand (same shardings) | host time per step (µs) | XLA "
             "flops | bytes accessed | all-reduces | first call (s) |",
             "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        pair = "—" if r["graphmod_over_hand"] is None else f"{r['graphmod_over_hand']:.3f}"
        flops = "—" if r.get("flops") is None else f"{r['flops']:.3g}"
        moved = "—" if r.get("bytes_accessed") is None else f"{r['bytes_accessed']:.3g}"
        collectives = r.get("all_reduces", "—")
        lines.append(
            f"| {r['devices'] or '1 (no mesh)'} | {r['variant']} | {r['median_us']:.0f} "
            f"| {r['p10_us']:.0f}-{r['p90_us']:.0f} | {r['ratio_to_one_device_graphmod']:.2f} "
            f"| {pair} | {r['host_us']:.0f} | {flops} | {moved} | {collectives} "
            f"| {r['first_call_s']:.2f} |")
    return "\n".join(lines)


def cpu_model() -> str:
    """The processor's name (``/proc/cpuinfo`` on Linux, else ``platform``)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report(env: dict[str, Any], quick: bool, repeats: int, block: int, rows: list[dict],
           difference: float, seconds: float) -> str:
    """The Markdown report."""
    where = f"{env['device']} GPUs" if ON_GPU else "virtual CPU devices"
    return "\n".join([
        f"# Sharding benchmark: data-parallel train step on {where}", "",
        f"{env['date']} · JAX {env['jax']} · graphmod {env['graphmod']} · {env['cpu']} · "
        f"{jax.device_count()} {where} on a {env['cpu_count']}-core machine"
        + (" · **--quick: not meaningful**" if quick else ""), "",
        f"Digits MLP {'-'.join(map(str, DIMS))}, ReLU, batch {BATCH}, Adam {LR}, softmax "
        f"cross-entropy, no managers; data parallel (`graphmod.sharding.data_parallel`). "
        f"Medians of {repeats} interleaved blocks of {block} steps. "
        + ("" if ON_GPU else "The devices share the cores, so a larger mesh is overhead, "
           "not speed-up; ")
        + "*graphmod / hand* compares each graphmod step with the hand-written step under "
        "the same shardings.", "",
        table(rows), "",
        "*Host time per step*: until a block's last call returned, before waiting for the "
        "device; equal to the step's time where dispatching, not the device, bounds the step.",
        "",
        *[f"No cost analysis of {r['variant']}: {r['analysis_error'].splitlines()[0]}\n"
          for r in rows if r.get("analysis_error")],
        f"Same-math check (3 steps from the same weights, every variant): largest loss "
        f"difference {difference:.1e}. Benchmark time {seconds:.0f} s.", ""])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the results."""
    parser = arguments(__doc__, "sharding_results")
    parser.add_argument("--gpu", action="store_true",
                        help="the machine's GPUs instead of 8 virtual CPU devices")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 100)
    block = args.block or (3 if args.quick else 20)
    sizes = [n for n in DEVICES if n <= jax.device_count()] if ON_GPU else DEVICES
    if jax.device_count() < max(sizes):
        raise RuntimeError(f"needs {max(DEVICES)} CPU devices, JAX sees {jax.devices()}: "
                           "XLA_FLAGS was set before this script could ask for them")
    if block > SAFE_BLOCK:
        print(f"warning: --block {block} > {SAFE_BLOCK}: XLA's CPU all-reduce may deadlock")
    data = np.random.default_rng(args.seed)
    batches = [(jnp.asarray(data.random((BATCH, DIMS[0]), np.float32)),
                jnp.asarray(data.integers(0, DIMS[-1], BATCH, dtype=np.int32)))
               for _ in range(4)]
    started = time.perf_counter()
    pairs = build_variants(args.seed, batches, sizes)
    variants = [variant for _, variant in pairs]
    difference = check_same_math(variants)
    interleave(variants, list(range(len(batches))), repeats, block, settle=True)
    analyses = [{} if args.quick else analyze(v) for v in variants]
    seconds = time.perf_counter() - started
    rows = rows_of(pairs, analyses)
    env = {**environment(), "cpu": cpu_model(), "virtual_devices": jax.device_count()}
    results = {"environment": env, "quick": args.quick, "repeats": repeats, "block": block,
               "rows": rows,
               "same_math_difference": difference, "seconds": seconds}
    write_results(args, "sharding_results", report(env, args.quick, repeats, block, rows,
                                                   difference, seconds), results)
    return results


if __name__ == "__main__":
    main()
