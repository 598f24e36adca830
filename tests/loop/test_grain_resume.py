"""A run over a Grain pipeline with a worker process, killed with SIGKILL at a random step
mid-pass, resumes bitwise: the same batches in the same order, the same final variables."""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import signal
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("grain")

from tests.loop import grain_run as script

SCRIPT = pathlib.Path(script.__file__)
ROOT = pathlib.Path(__file__).parents[2]


def _run(cache: pathlib.Path, log: pathlib.Path, *args: str) -> int:
    """Runs the script to its end or its kill; its exit status. The script runs in a
    process group of its own, ended afterwards: a SIGKILL leaves its Grain worker orphaned
    (waiting to hand over a batch), and that group is what this test started."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           # The second run skips XLA's compiles (JAX's cache; the runs are one by one).
           "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, str(SCRIPT), *args], env=env, cwd=ROOT,
                                   stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    assert code in (0, -signal.SIGKILL), log.read_text()[-3000:]
    return code


def _steps(journal: pathlib.Path) -> dict[int, str]:
    """Each step's batch (its example indices) and loss, as the run wrote them."""
    lines = [line.split(" ", 2) for line in journal.read_text().splitlines()]
    return {int(step): rest for _, step, rest in lines}


@pytest.mark.slow
def test_a_grain_run_killed_mid_pass_resumes_on_the_same_batches(tmp_path: pathlib.Path
                                                                 ) -> None:
    # Between two saves (the step of a save kills before it), after the first.
    kill_at = random.Random(45).choice([step for step in range(script.SAVE_EVERY + 1,
                                                               script.STEPS)
                                        if step % script.SAVE_EVERY])
    directory, out = tmp_path / "run", tmp_path / "out.npz"
    args = [str(directory), str(tmp_path / "killed.journal"), str(out)]
    killed = _run(tmp_path / "cache", tmp_path / "killed.log", *args, "--kill-at", str(kill_at))
    assert killed == -signal.SIGKILL
    assert not out.exists()
    args[1] = str(tmp_path / "resumed.journal")
    assert _run(tmp_path / "cache", tmp_path / "resumed.log", *args, "--resume") == 0

    reference = script.train(str(tmp_path / "reference"), str(tmp_path / "reference.journal"))
    want = _steps(tmp_path / "reference.journal")
    killed, resumed = _steps(tmp_path / "killed.journal"), _steps(tmp_path / "resumed.journal")
    saved = kill_at // script.SAVE_EVERY * script.SAVE_EVERY  # the newest checkpoint
    assert sorted(killed) == list(range(1, kill_at + 1))
    assert sorted(resumed) == list(range(saved + 1, script.STEPS + 1))  # mid-pass, not anew
    assert len(set(want.values())) == script.STEPS  # each step its own batch
    for step, seen in [*killed.items(), *resumed.items()]:
        assert seen == want[step], f"step {step}: {seen} != {want[step]}"
    got, final = np.load(out), script.variables(reference)
    assert sorted(got.files) == sorted(final)
    for name, value in final.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
