"""The graphmod command: run, resume, inspect."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from graphmod._cli import inspect_run, main

SCRIPT = pathlib.Path(__file__).with_name("resumable_run.py")
ROOT = pathlib.Path(__file__).parents[2]


def _graphmod(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "graphmod._cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_run_stop_resume_and_inspect(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "run"
    stopped = _graphmod("run", str(SCRIPT), str(directory), str(tmp_path / "early.npz"),
                        "--until", "10")
    assert stopped.returncode == 0, stopped.stderr
    report = inspect_run(str(directory))
    assert "checkpoints: 8, 10" in report and "step=10" in report
    assert "resumable_run.py" in report and "--until 10" in report
    resumed = _graphmod("resume", str(directory))
    assert resumed.returncode == 0, resumed.stderr
    full = _graphmod("run", str(SCRIPT), str(tmp_path / "full"), str(tmp_path / "full.npz"))
    assert full.returncode == 0, full.stderr
    a, b = np.load(tmp_path / "full.npz"), np.load(tmp_path / "early.npz")
    assert int(a["step"]) == int(b["step"]) == 24
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    inspected = _graphmod("inspect", str(directory))
    assert "checkpoints: 20, 24" in inspected.stdout and "step=24" in inspected.stdout


def test_inspect_and_resume_of_a_missing_directory(capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", "/nonexistent/run"]) == 2
    captured = capsys.readouterr()
    assert "no run directory at /nonexistent/run" in captured.err and captured.out == ""
    assert main(["resume", "/nonexistent/run"]) == 2
    assert "no run directory at /nonexistent/run" in capsys.readouterr().err
    assert main(["run", "/nonexistent/script.py"]) == 2
    assert "no script file at /nonexistent/script.py" in capsys.readouterr().err


def test_python_dash_m_graphmod_is_the_command() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "graphmod", "inspect", "/nonexistent/run"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert "graphmod inspect: no run directory at /nonexistent/run" in done.stderr
    usage = subprocess.run([sys.executable, "-m", "graphmod", "--help"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: graphmod ")
