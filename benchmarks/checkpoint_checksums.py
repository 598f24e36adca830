"""Checkpoint checksums: what verifying every array costs a save and a restore of ~100 MB.

One train-state-like tree (25 float32 arrays of 1024 x 1024, random, plus a PRNG key:
100 MiB), saved and restored by graphmod's Checkpointer in one process, variants
interleaved round-robin (the first one rotating), each repetition into a fresh directory.
Per variant, the median over repetitions of:

- *save blocking*: the time ``save`` holds the caller (the training thread): the host copy;
- *save total*: ``save`` until the write is on disk (``wait``): copy, checksums, write;
- *restore*: ``restore`` of the whole state onto the device, verification included.

Variants (only the checksum function differs; verification runs with the same function):

- ``no checksums``: graphmod's Checkpointer with the checksum replaced by a constant;
- ``crc32``: graphmod as shipped (``zlib.crc32``);
- ``sha256``, ``blake2b``: the same with ``hashlib`` digests, to show why crc32;
- ``orbax alone``: ``orbax.checkpoint.CheckpointManager`` async save of the same host
  arrays and restore, what graphmod did before checkpoints were verified.

Reported: the medians; each checksum's extra time over ``no checksums`` as a share of that
variant's save total (the aim: under 10% for crc32); and, since that difference of two
disk-bound times is noisy on a shared machine, the checksums alone (every array of the
host copy, as a save computes them: in threads when the state is large; interleaved the
same way) as a share of the ``no checksums`` save total.

Not a timed test: nothing fails because a number moved. Usage:
``python benchmarks/checkpoint_checksums.py [--quick] [--repeats N] [--no-write]``; writes
checkpoint_results.md and checkpoint_results.json here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import pathlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

import graphmod._train._checkpoint._format as checkpoint_module
from graphmod._train._checkpoint import Checkpointer

HERE = pathlib.Path(__file__).parent
CHECKSUMS: dict[str, Callable[[np.ndarray], str]] = {
    "no checksums": lambda array: "00000000",
    "crc32": checkpoint_module.checksum,
    "sha256": lambda a: hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    .hexdigest(),
    "blake2b": lambda a: hashlib.blake2b(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                                         digest_size=16).hexdigest(),
}


def make_state(arrays: int, side: int) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(0), arrays)
    state = {f"w{i}": jax.random.normal(k, (side, side)) for i, k in enumerate(keys)}
    return jax.block_until_ready({**state, "rng": jax.random.key(1)})


@contextlib.contextmanager
def checksum_as(function: Callable[[np.ndarray], str]) -> Iterator[None]:
    """Swaps the Checkpointer's checksum function (save and verification alike)."""
    original = checkpoint_module.checksum
    checkpoint_module.checksum = function
    try:
        yield
    finally:
        checkpoint_module.checksum = original


def graphmod_round(state: Any, checksum: Callable[[np.ndarray], str]) -> tuple[float, ...]:
    directory = tempfile.mkdtemp()
    try:
        with checksum_as(checksum):
            writer = Checkpointer(directory, keep=None)
            begin = time.perf_counter()
            writer.save(1, state, {})
            blocked = time.perf_counter() - begin
            writer.wait()
            saved = time.perf_counter() - begin
            begin = time.perf_counter()
            restored, _ = writer.restore(state)
            jax.block_until_ready(restored)
            loaded = time.perf_counter() - begin
            writer.close()
        return blocked, saved, loaded
    finally:
        shutil.rmtree(directory)


def orbax_round(state: Any) -> tuple[float, ...]:
    directory = tempfile.mkdtemp()
    try:
        manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True))
        begin = time.perf_counter()
        host = checkpoint_module.storable(state)  # what graphmod copies to the host
        manager.save(1, args=ocp.args.StandardSave(host))
        blocked = time.perf_counter() - begin
        manager.wait_until_finished()
        saved = time.perf_counter() - begin
        begin = time.perf_counter()
        abstract = [np.zeros(a.shape, a.dtype) for a in host]
        got = manager.restore(1, args=ocp.args.StandardRestore(abstract))
        jax.block_until_ready(jax.device_put(got))
        loaded = time.perf_counter() - begin
        manager.close()
        return blocked, saved, loaded
    finally:
        shutil.rmtree(directory)


def checksums_alone(host: list[np.ndarray], repeats: int) -> dict[str, float]:
    """The median time of each checksum over every array of the host copy, interleaved."""
    names = [name for name in CHECKSUMS if name != "no checksums"]
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with checksum_as(CHECKSUMS[name]):  # as a save computes them (threads, if many)
                begin = time.perf_counter()
                checkpoint_module.checksums(host)
                times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run, to check it works")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    arrays, side = (4, 256) if args.quick else (25, 1024)
    repeats = args.repeats or (2 if args.quick else 9)
    state = make_state(arrays, side)
    megabytes = sum(np.asarray(a).nbytes for a in checkpoint_module.storable(state)) / 2**20
    variants: dict[str, Callable[[], tuple[float, ...]]] = {
        name: (lambda f=f: graphmod_round(state, f)) for name, f in CHECKSUMS.items()}
    variants["orbax alone"] = lambda: orbax_round(state)
    for run in variants.values():  # warm up: imports, first compiles, file system caches
        run()
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(variants[name]())
    medians = {name: [statistics.median(t[i] for t in rows) for i in range(3)]
               for name, rows in times.items()}
    base = medians["no checksums"]
    alone = checksums_alone(checkpoint_module.storable(state), repeats)
    shares = {name: {"save": (m[1] - base[1]) / m[1], "restore": (m[2] - base[2]) / m[2],
                     "alone": alone[name], "alone / save": alone[name] / base[1]}
              for name, m in medians.items() if name in CHECKSUMS and name != "no checksums"}
    lines = [f"{megabytes:.0f} MiB in {arrays + 1} arrays, {repeats} repeats (medians), "
             f"{jax.devices()[0].platform}", "",
             "| variant | save blocking (s) | save total (s) | restore (s) |", "|---|--:|--:|--:|"]
    lines += [f"| {n} | {m[0]:.3f} | {m[1]:.3f} | {m[2]:.3f} |" for n, m in medians.items()]
    lines += ["", "| checksum | extra save / save total | extra restore / restore | "
              "checksums alone (s) | alone / save total without |", "|---|--:|--:|--:|--:|"]
    lines += [f"| {n} | {s['save']:.1%} | {s['restore']:.1%} | {s['alone']:.3f} | "
              f"{s['alone / save']:.1%} |" for n, s in shares.items()]
    table = "\n".join(lines)
    print(table)
    if not args.quick and not args.no_write:
        (HERE / "checkpoint_results.md").write_text(table + "\n")
        (HERE / "checkpoint_results.json").write_text(json.dumps(
            {"megabytes": megabytes, "repeats": repeats, "medians": medians,
             "columns": ["save blocking", "save total", "restore"], "shares": shares},
            indent=2) + "\n")
    return {"medians": medians, "shares": shares}


if __name__ == "__main__":
    main()
