"""Start-up benchmark: what graphmod costs around the step, against hand-written JAX.

Four measurements on ReLU MLPs of width 32 (batch 16), each side by side with the same
work written by hand over plain dicts:

``trace``
    ``jax.make_jaxpr`` of one train step (loss and gradient of the training-mode forward,
    as ``graphmod.optimize``'s step traces it)
    at 10, 100 (and with ``--full`` 300) layers: graphmod without managers against the
    plain MLP, and with ``managers.BatchNorm`` (hidden outputs) and ``managers.Dropout``
    (inputs) against the MLP with batch norm and dropout written out. Every repetition
    traces a fresh program (JAX's caches would replay a second trace), after one round
    whose times, which include the one-time costs of the process's first traces (JAX's
    caches of jitted ``jnp`` functions, lazily imported modules), are reported apart.
``init``
    ``program.init`` (and bricks + ``compile`` + ``init``) against building the model as
    ``nnx.Linear`` layers and copying its arrays into a dict (plus the batch statistics by
    hand), with the XLA compiles counted during ``init``.
``memory``
    resident memory grown per build of a 30-layer MLP (compile + init + one train step),
    repeated in one process after a warm-up, against the hand-written build (``nnx`` model,
    ``jax.jit`` step, one step); freed memory is returned with ``malloc_trim`` first.
``dispatch``
    ``program.infer`` of a derived forward program against a bare ``jax.jit`` of the same
    forward pass on a tiny MLP (4-8-2, batch 8).

Timing: the variants run round-robin (the first rotating); the tables give medians and the
ratio to the hand-written median. The trace table has a control: the hand-written
regularized trace timed again as a variant of its own, whose ratio to the first shows how
far the machine's noise alone moves a ratio in that run. As ``timeit`` does, each timed
call runs with Python's garbage collector off, after a full collection: otherwise a
collection of the whole heap (100-150 ms at 200 layers, more than a quarter of a trace)
lands in whichever trace crosses the collector's threshold, graphmod's or the hand-written
one. Numbers are for the machine it ran on (CPU; see the environment in the JSON).

Run::

    python benchmarks/startup.py            # 10 and 100 layers: a few minutes on 2 cores
    python benchmarks/startup.py --full     # also 300 layers: much longer
    python benchmarks/startup.py --quick    # smoke run, numbers meaningless

Writes ``benchmarks/startup_results.md`` and ``.json`` (``--out``, ``--no-write``).
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from train_step import arguments, environment, write_results

import graphmod
import managers
from graphmod import roles

WIDTH, BATCH, RATE, EPSILON, MOMENTUM = 32, 16, 0.1, 1e-5, 0.99
_COMPILE = "/jax/core/compile/backend_compile_duration"


# -- graphmod ---------------------------------------------------------------------------------
def graphmod_program(layers: int, regularized: bool) -> graphmod.Program:
    mlp = graphmod.bricks.MLP([WIDTH] * (layers + 1), activation=jax.nn.relu,
                              rngs=nnx.Rngs(0))
    chosen = [managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[roles.OUTPUT]),
              managers.Dropout(RATE, bricks=mlp.linear_layers, roles=[roles.INPUT])]
    return graphmod.compile(lambda m, x: (m(x) ** 2).mean(), mlp,
                            managers=chosen if regularized else [])


def graphmod_step(program: graphmod.Program) -> Callable[..., Any]:
    # What graphmod.optimize's step traces: the training-mode function itself, not the
    # jitted program.train (a jit nested in the trace costs JAX's own partial evaluation).
    def step(variables: dict, x: jax.Array, key: jax.Array) -> Any:
        return jax.value_and_grad(
            lambda v: program._train_traced(v, key, (x,), {})[0])(variables)

    return step


# -- by hand ----------------------------------------------------------------------------------
def hand_init(layers: int, regularized: bool) -> dict:
    """The model built as ``nnx.Linear`` layers, its arrays copied into a dict."""
    linears = [nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(i)) for i in range(layers)]
    params = [{"W": jnp.array(linear.kernel[...], copy=True),
               "b": jnp.array(linear.bias[...], copy=True)} for linear in linears]
    stats = [{"mean": jnp.zeros(WIDTH), "var": jnp.ones(WIDTH), "scale": jnp.ones(WIDTH),
              "bias": jnp.zeros(WIDTH)} for _ in range(layers - 1)] if regularized else []
    return {"params": params, "stats": stats}


def hand_step(regularized: bool) -> Callable[..., Any]:
    """Loss and gradient of the MLP; regularized, with inverted dropout and batch norm whose
    running statistics are updated as the manager does (the same math)."""
    def loss(variables: dict, x: jax.Array, key: jax.Array) -> tuple[jax.Array, list]:
        params, stats, new_stats = variables["params"], variables["stats"], []
        for i, layer in enumerate(params):
            if regularized:
                keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - RATE, x.shape)
                x = jnp.where(keep, x / (1 - RATE), 0)
            x = x @ layer["W"] + layer["b"]
            if regularized and i < len(stats):
                mean, var = x.mean(0), x.var(0)
                new_stats.append({"mean": MOMENTUM * stats[i]["mean"] + (1 - MOMENTUM) * mean,
                                  "var": MOMENTUM * stats[i]["var"] + (1 - MOMENTUM) * var})
                x = (x - mean) / jnp.sqrt(var + EPSILON) * stats[i]["scale"] + stats[i]["bias"]
            if i < len(params) - 1:
                x = jax.nn.relu(x)
        return (x ** 2).mean(), new_stats

    return lambda variables, x, key: jax.value_and_grad(loss, has_aux=True)(variables, x, key)


# -- measurements -----------------------------------------------------------------------------
def round_robin(variants: dict[str, Callable[[], float]], repeats: int) -> dict[str, list]:
    """``repeats`` timings of every variant in turn (each call returns its own seconds)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in [*names[shift:], *names[:shift]]:
            times[name].append(variants[name]())
    return times


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn()`` until its result is ready, with the collector off (see above)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - start
    finally:
        gc.enable()


def trace_variants(layers: int) -> dict[str, Callable[[], float]]:
    x, key = jnp.ones((BATCH, WIDTH)), jax.random.key(0)

    def ours(regularized: bool) -> Callable[[], float]:
        def run() -> float:
            program = graphmod_program(layers, regularized)
            variables = program.init(x)
            return timed(lambda: jax.make_jaxpr(graphmod_step(program))(variables, x, key))
        return run

    def hand(regularized: bool) -> Callable[[], float]:
        variables = hand_init(layers, regularized)
        return lambda: timed(lambda: jax.make_jaxpr(hand_step(regularized))(variables, x, key))

    return {"hand": hand(False), "graphmod": ours(False),
            "hand (batch norm + dropout)": hand(True),
            "graphmod (BatchNorm + Dropout)": ours(True),
            "control: hand (batch norm + dropout) again": hand(True)}


def init_variants(layers: int) -> dict[str, Callable[[], float]]:
    x = jnp.ones((BATCH, WIDTH))

    def ours_init(regularized: bool) -> float:
        program = graphmod_program(layers, regularized)
        return timed(lambda: program.init(x))

    return {
        "hand: nnx model + copy": lambda: timed(lambda: hand_init(layers, False)),
        "graphmod: init": lambda: ours_init(False),
        "graphmod: bricks + compile + init": lambda: timed(
            lambda: graphmod_program(layers, False).init(x)),
        "hand: nnx model + copy + statistics": lambda: timed(lambda: hand_init(layers, True)),
        "graphmod (BatchNorm + Dropout): init": lambda: ours_init(True),
    }


def init_compiles(layers: int) -> int:
    """XLA compiles during ``init`` of a fresh regularized program (after one warm-up)."""
    x = jnp.ones((BATCH, WIDTH))
    graphmod_program(layers, True).init(x)
    program = graphmod_program(layers, True)
    events: list[str] = []
    listen = lambda event, seconds, **_: events.append(event) if event == _COMPILE else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(program.init(x))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(events)


def rss_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def memory_per_build(builds: int, layers: int = 30) -> dict[str, float]:
    x, key = jnp.ones((BATCH, WIDTH)), jax.random.key(0)

    def ours() -> None:
        program = graphmod_program(layers, True)
        jax.block_until_ready(program.train(program.init(x), x, rng=key))

    def hand() -> None:
        jax.block_until_ready(jax.jit(hand_step(True))(hand_init(layers, True), x, key))

    out = {}
    for name, build in (("hand", hand), ("graphmod (BatchNorm + Dropout)", ours)):
        for _ in range(3):
            build()
        gc.collect()
        before = rss_mb()
        for _ in range(builds):
            build()
        gc.collect()
        out[name] = (rss_mb() - before) / builds
    return out


def dispatch_variants() -> dict[str, Callable[[], float]]:
    mlp = graphmod.bricks.MLP([4, 8, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = graphmod.compile(lambda m, x: m(x).sum(), mlp)
    x = jnp.ones((8, 4))
    variables = program.init(x)
    predict = program.derive(lambda m, x: m(x))
    layers = variables["model"]["linear_layers"]
    math = lambda p, x: jax.nn.relu(x @ p[0]["W"] + p[0]["b"]) @ p[1]["W"] + p[1]["b"]
    forward = jax.jit(math)
    # The same math over the same argument as program.infer (the variables dict, whose
    # nesting jax.jit flattens at every call): what graphmod adds beyond its data layout.
    same_tree = jax.jit(lambda v, x: math(v["model"]["linear_layers"], x))
    calls = 200

    def per_call(fn: Callable[[], Any]) -> Callable[[], float]:
        jax.block_until_ready(fn())
        return lambda: timed(lambda: [fn() for _ in range(calls)][-1]) / calls

    return {"jax.jit (dicts)": per_call(lambda: forward(layers, x)),
            "jax.jit (the variables dict)": per_call(lambda: same_tree(variables, x)),
            "program.infer": per_call(lambda: predict.infer(variables, x))}


# -- report -----------------------------------------------------------------------------------
def table(title: str, times: dict[str, list[float]], unit: float, label: str,
          pairs: Sequence[tuple[str, str]]) -> tuple[str, list[dict]]:
    """Medians of ``times`` (in ``label`` units) and each variant's ratio to the reference
    ``pairs`` names for it (``(variant, reference)``)."""
    reference = dict(pairs)
    lines = [f"| {title} | median ({label}) | ratio to hand |", "|---|--:|--:|"]
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        ratio = median / statistics.median(times[reference[name]]) if name in reference else 1
        rows.append({"variant": name, "median": median, "ratio": ratio})
        lines.append(f"| {name} | {median / unit:.3g} | {ratio:.2f} |")
    return "\n".join(lines), rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints the Markdown report, writes it; returns the results."""
    parser = arguments(__doc__, "startup_results")
    parser.add_argument("--full", action="store_true", help="also 300 layers (long)")
    args = parser.parse_args(argv)
    depths = [10] if args.quick else [10, 100, 300] if args.full else [10, 100]
    repeats = args.repeats or (2 if args.quick else 9)
    report, results = [], {"environment": environment(), "trace": {}, "init": {}}
    for layers in depths:
        variants = trace_variants(layers)
        first = {name: seconds for name, [seconds] in round_robin(variants, 1).items()}
        times = round_robin(variants, repeats)
        text, rows = table(f"trace, {layers} layers", times, 1, "s", [
            ("graphmod", "hand"),
            ("graphmod (BatchNorm + Dropout)", "hand (batch norm + dropout)"),
            ("control: hand (batch norm + dropout) again", "hand (batch norm + dropout)")])
        report.append(text + "\n\nThe first round, not in the medians: " + ", ".join(
            f"{name} {seconds * 1e3:.0f} ms" for name, seconds in first.items()))
        results["trace"][layers] = {"rows": rows, "first_round_s": first}
        times = round_robin(init_variants(layers), repeats)
        text, rows = table(f"init, {layers} layers", times, 1, "s", [
            ("graphmod: init", "hand: nnx model + copy"),
            ("graphmod: bricks + compile + init", "hand: nnx model + copy"),
            ("graphmod (BatchNorm + Dropout): init", "hand: nnx model + copy + statistics")])
        count = init_compiles(layers)
        report.append(text + f"\n\nXLA compiles in one init of a fresh program: {count}")
        results["init"][layers] = {"rows": rows, "xla_compiles": count}
    memory = memory_per_build(3 if args.quick else 10)
    results["memory_mb_per_build"] = memory
    report.append("| memory per build, 30 layers | MB |\n|---|--:|\n" + "\n".join(
        f"| {name} | {mb:.2f} |" for name, mb in memory.items()))
    times = round_robin(dispatch_variants(), args.repeats or (3 if args.quick else 50))
    text, rows = table("dispatch, tiny MLP", times, 1e-6, "µs",
                       [("program.infer", "jax.jit (dicts)")])
    report.append(text.replace("ratio to hand", "ratio to jax.jit"))
    results["dispatch"] = rows
    write_results(args, "startup_results",
                  "# Start-up benchmark (CPU)\n\n" + "\n\n".join(report) + "\n", results)
    return results


if __name__ == "__main__":
    main()
