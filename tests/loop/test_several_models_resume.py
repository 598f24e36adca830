"""Two models killed at random points resume bitwise: SIGKILL mid-step, between the two
models' steps and mid-save, each resumed with nothing given again, the last by
``graphmod resume``."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys

import numpy as np
import pytest

from graphmod._train._checkpoint import Checkpointer
from tests.loop import several_models_run as script

SCRIPT = pathlib.Path(script.__file__)
ROOT = pathlib.Path(__file__).parents[2]
ITERATIONS = script.EPOCHS * script.BATCHES


def kill_points(seed: int) -> list[tuple[str, int]]:
    """One point of each kind, drawn with ``seed``, in the order a run meets them: a
    save's iteration for mid_save (after the first save, so that a checkpoint is left), an
    iteration where gen steps for between (after disc's step, before gen's)."""
    rng = random.Random(seed)
    save = rng.choice(range(2 * script.SAVE_EVERY, ITERATIONS, script.SAVE_EVERY))
    between = rng.choice(range(script.GEN_EVERY, ITERATIONS, script.GEN_EVERY))
    return sorted([("mid_save", save), ("between", between),
                   ("mid_step", rng.randrange(2, ITERATIONS))], key=lambda point: point[1])


def saved_before(kind: str, iteration: int) -> int:
    """The newest checkpoint left by a run killed at ``(kind, iteration)`` (the script
    waits for the saves before its kill point; a save killed mid-write is not placed)."""
    if kind == "mid_save":
        return iteration - script.SAVE_EVERY
    return (iteration - 1) // script.SAVE_EVERY * script.SAVE_EVERY


def _run(cache: pathlib.Path, *args: str, kill: str | None = None, cli: bool = False) -> int:
    """Runs the script (or ``graphmod resume``) to its end or its kill: its exit status."""
    env = {k: v for k, v in os.environ.items() if k != script.KILL}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **({script.KILL: kill} if kill else {}))
    # One compilation cache for these runs, one after another (JAX's cache has no lock):
    # the runs after the first skip XLA's compiles (a quarter of each run's time).
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    command = [sys.executable, "-m", "graphmod._cli", "resume"] if cli else \
        [sys.executable, str(SCRIPT)]
    done = subprocess.run([*command, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode in (0, -signal.SIGKILL), done.stderr
    return done.returncode


def journal(path: pathlib.Path) -> tuple[list[list[str]], dict[int, set[str]]]:
    """The journal's lines other than steps, and each step's losses as every run saw them."""
    other, steps = [], {}
    for line in path.read_text().splitlines():
        words = line.split()
        if words[0] == "step":
            steps.setdefault(int(words[1]), set()).add(" ".join(words[2:]))
        else:
            other.append(words)
    return other, steps


@pytest.mark.slow
def test_two_models_killed_at_random_points_resume_bitwise(tmp_path: pathlib.Path) -> None:
    points = kill_points(seed=43)
    directory = tmp_path / "run"
    for kind, iteration in points:
        resume = ["--resume"] if Checkpointer(directory, keep=None).steps() else []
        code = _run(tmp_path / "cache", str(directory), str(tmp_path / "out.npz"), *resume,
                    kill=f"{kind}:{iteration}")
        assert code == -signal.SIGKILL, f"the run was not killed at {kind}:{iteration}"
    assert not (tmp_path / "out.npz").exists()
    assert _run(tmp_path / "cache", str(directory), cli=True) == 0  # the recorded command

    reference_dir = tmp_path / "reference"
    run = script.Run()
    record = script.Journal(f"{reference_dir}.journal")
    states = run.loop(record).run(run.first)
    want = script.outcome(record.loop, states)
    got = np.load(tmp_path / "out.npz")
    assert sorted(got.files) == sorted(want) and list(want["time"]) == [ITERATIONS, 3, 120]
    for name in want:  # both models' variables, optimizer states, step counts and keys
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    lines, seen = journal(pathlib.Path(f"{directory}.journal"))
    _, reference = journal(pathlib.Path(f"{reference_dir}.journal"))
    starts = [0, *(saved_before(kind, iteration) for kind, iteration in points)]
    assert [words for words in lines if words[0] == "start"] == [
        ["start", str(s), str(s // script.BATCHES), str(s % script.BATCHES)] for s in starts]
    assert [words for words in lines if words[0] == "killed"] == [
        ["killed", f"{kind}:{iteration}"] for kind, iteration in points]
    assert sorted(seen) == list(range(1, ITERATIONS + 1))
    for step, losses in seen.items():  # every step, also those run again, saw the same
        assert losses == reference[step], f"step {step}: {losses} != {reference[step]}"
