"""The ``graphmod`` command: run a training script, resume a run, inspect a run directory.

``graphmod run SCRIPT [ARGS...]`` runs a script. ``graphmod resume DIR`` runs the command
recorded in DIR's latest checkpoint again, with its ``Checkpoint(DIR)`` plugins continuing
from that checkpoint. ``graphmod inspect DIR`` prints what a run directory holds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import runpy
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from graphmod.plugins._checkpoint import RESUME_VARIABLE


def _run(args: argparse.Namespace) -> int:
    script = pathlib.Path(args.script)
    if not script.is_file():
        print(f"graphmod run: no script at {script}", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _checkpointer(directory: str) -> Any:
    from graphmod._checkpoint import Checkpointer

    if not pathlib.Path(directory).is_dir():
        raise FileNotFoundError(f"no run directory at {directory}")
    return Checkpointer(directory, keep=None)


def _resume(args: argparse.Namespace) -> int:
    reader = _checkpointer(args.directory)
    try:
        meta = reader.meta()
    finally:
        reader.close()
    command = meta.get("command") or {}
    argv = command.get("argv") or []
    if not argv or not str(argv[0]).endswith(".py"):
        print(f"graphmod resume: {args.directory} records no script to run again "
              f"(recorded: {argv!r}); call graphmod.Loop.resume(...) from Python instead",
              file=sys.stderr)
        return 2
    env = {**os.environ, RESUME_VARIABLE: os.path.abspath(args.directory)}
    return subprocess.call([sys.executable, *argv], cwd=command.get("cwd"), env=env)


def describe_run(directory: str) -> str:
    """What a run directory holds: checkpoints, counters, timelines, plugins, metrics, and
    a summary of the provenance record (model, managers, optimizer, data, seeds,
    fingerprint, versions)."""
    reader = _checkpointer(directory)
    try:
        steps = reader.steps()
        meta = reader.meta() if steps else {}
    finally:
        reader.close()
    lines = [f"run directory: {os.path.abspath(directory)}",
             f"checkpoints: {', '.join(map(str, steps)) if steps else 'none'}"]
    if meta.get("time"):
        time = meta["time"]
        lines.append("latest: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in time.items()))
        lines.append(f"loop: {json.dumps(meta['loop'])}; position in epoch: {meta['position']}")
    if meta:
        tree = meta.get("tree", {})
        size = sum(_count(shape) for shape, _ in tree.values())
        lines.append(f"state: {len(tree)} arrays, {size:,} numbers")
        for name, state in meta.get("plugins", {}).items():
            lines.append(f"plugin {name}: {json.dumps(state)}")
        if meta.get("command"):
            lines.append(f"command: {' '.join(map(str, meta['command'].get('argv', [])))}")
        lines += _provenance_lines(meta)
    for log in sorted(pathlib.Path(directory).glob("*.jsonl")):
        rows = log.read_text().splitlines()
        if rows:
            lines.append(f"metrics ({log.name}, {len(rows)} rows), last: {rows[-1]}")
    return "\n".join(lines)


def _provenance_lines(meta: dict[str, Any]) -> list[str]:
    if "provenance" not in meta:
        error = meta.get("provenance_error")
        return [f"provenance: not recorded ({error})"] if error else []
    from graphmod.provenance._record import Provenance

    try:
        record = Provenance.from_dict(meta["provenance"])
    except (TypeError, ValueError) as error:
        return [f"provenance: unreadable ({error})"]
    summary = record.summary()
    width = max(len(k) for k, _ in summary)
    return ["provenance:"] + [f"  {k.ljust(width)}  {v}" for k, v in summary]


def _count(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _inspect(args: argparse.Namespace) -> int:
    print(describe_run(args.directory))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``graphmod`` command.

    Examples:
        >>> from graphmod._cli import main
        >>> main(["inspect", "/nonexistent"])
        graphmod: no run directory at /nonexistent
        2
    """
    parser = argparse.ArgumentParser(prog="graphmod", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a training script")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    run.set_defaults(handler=_run)
    resume = commands.add_parser("resume", help="continue the run saved in a directory")
    resume.add_argument("directory")
    resume.set_defaults(handler=_resume)
    inspect = commands.add_parser("inspect", help="print what a run directory holds")
    inspect.add_argument("directory")
    inspect.set_defaults(handler=_inspect)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except FileNotFoundError as error:
        print(f"graphmod: {error}", file=sys.stdout)
        return 2


if __name__ == "__main__":
    sys.exit(main())
