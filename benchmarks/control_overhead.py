"""Control overhead: graphmod.Loop with the Control plugin listening (nothing sent) against
the same loop without it.

Same jitted train step as ``loop_overhead.py`` (the digits MLP with Dropout + BatchNorm,
Adam, batch 128), same data, variants interleaved round-robin in one process; each
repetition runs a whole training run from the same initial state and blocks on the result.
Reported: the median wall time and CPU time (all the process's threads: the steadier where
other processes load the machine) of each variant, their ratios to the loop without a
plugin, and the time Control's step handler takes a call, from the loop's dispatch trace.

Variants:
- ``loop``: ``graphmod.Loop`` with no plugin (the loop then makes no event at all).
- ``loop+noop``: one plugin with an ``on_step`` that does nothing: what any per-step plugin
  costs (an event made and dispatched each step).
- ``loop+control``: ``plugins.Control`` serving on a Unix socket in a temporary run
  directory, nothing sent (its step handler: one truthiness check of its command queue).

The goal is ``loop+control / loop`` <= 1.01.

Usage: ``python benchmarks/control_overhead.py [--quick] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

import graphmod as gm
from graphmod import plugins

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from loop_overhead import setup  # the same step and data


class Noop(gm.Plugin):
    """A step plugin doing nothing: the cost of the event and its dispatch."""

    def on_step(self, event: gm.Event) -> None:
        pass


def looped(s: dict, epochs: int, chosen: list[Any]) -> gm.Loop:
    state = s["step"].init(s["variables"], jax.random.key(0))
    loop = gm.Loop(s["step"], s["train"], epochs=epochs, plugins=chosen)
    jax.block_until_ready(loop.run(state))
    return loop


def interleaved_medians(variants: dict[str, Callable[[], Any]], repeats: int
                        ) -> dict[str, tuple[float, float]]:
    """The median (wall, CPU) seconds of each variant over ``repeats`` rounds, each round
    running every variant once, a different one first each round. The CPU time (all the
    process's threads) is the steadier on a machine other processes load."""
    order = collections.deque(variants)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name in order:
            wall, cpu = time.perf_counter(), time.process_time()
            variants[name]()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        order.rotate(-1)
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
            for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="rounds of the three runs")
    parser.add_argument("--quick", action="store_true", help="two tiny rounds, to check it runs")
    args = parser.parse_args(argv)
    # 25 epochs x 46 batches = 1150 steps a run.
    copies, epochs, repeats = (1, 2, 2) if args.quick else (4, 25, args.repeats)
    s = setup(copies)
    folder = tempfile.mkdtemp()
    variants: dict[str, Callable[[], Any]] = {
        "loop": lambda: looped(s, epochs, []),
        "loop+noop": lambda: looped(s, epochs, [Noop()]),
        "loop+control": lambda: looped(s, epochs, [plugins.Control(folder)]),
    }
    for run in variants.values():  # compile everything first
        run()
    medians = interleaved_medians(variants, repeats)
    steps = epochs * len(s["train"])
    wall, cpu = medians["loop"]
    print(f"{steps} steps ({epochs} epochs of {len(s['train'])}), {repeats} repeats, "
          f"{jax.devices()[0].platform}\n\n| variant | median run (s) | per step (µs) | "
          "ratio to loop | CPU s | CPU ratio to loop |\n|---|--:|--:|--:|--:|--:|")
    for name, (w, c) in medians.items():
        print(f"| {name} | {w:.3f} | {w / steps * 1e6:.0f} | {w / wall:.3f} | {c:.3f} | "
              f"{c / cpu:.3f} |")
    calls = [d.seconds for d in variants["loop+control"]().trace if d.plugin == "control"]
    print(f"\nControl's step handler, from loop.trace: {statistics.mean(calls) * 1e6:.2f} µs "
          f"a call (median {statistics.median(calls) * 1e6:.2f} µs, {len(calls)} calls)")
    return {"medians": medians, "control_ratio": medians["loop+control"][0] / wall}


if __name__ == "__main__":
    main()
