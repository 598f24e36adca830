"""What a run says on a terminal: a status line while the first step compiles, Ctrl-C ending
with the stop's notices and one line (no traceback, exit status 130), and one epoch count in
the bar, Print, ``graphmod inspect`` and ``graphmod resume``."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import optax
from flax import nnx

import graphmod as gm
from graphmod import plugins
from graphmod._cli import main as graphmod_main
from graphmod.data import ArraySource

SCRIPT = pathlib.Path(__file__).with_name("terminal_run.py")
ROOT = pathlib.Path(__file__).parents[2]


class Terminal(io.StringIO):
    """Standard error as a terminal: tqdm draws with carriage returns."""

    def isatty(self) -> bool:
        return True


def tiny_loop(**kwargs: object) -> tuple[gm.Loop, object]:
    program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(),
                         gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
    x, y = np.ones((16, 2), np.float32), np.zeros((16, 1), np.float32)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
    return gm.Loop(step, ArraySource((x, y), batch_size=8), **kwargs), state


def test_a_status_line_counts_the_seconds_of_the_first_compile_on_a_terminal(
        monkeypatch) -> None:
    monkeypatch.setattr("graphmod.plugins._progress.STATUS_EVERY_S", 0.01)
    screen = Terminal()
    loop, state = tiny_loop(epochs=1, plugins=[plugins.ProgressBar(file=screen)])
    loop.run(state)
    shown = screen.getvalue()
    assert re.search(r"compiling the train step… \d+ s", shown)
    assert shown.rindex("compiling") < shown.index("0/1 epochs")  # gone once a step ran
    quiet = io.StringIO()  # not a terminal (a log file): no status line
    loop, state = tiny_loop(epochs=1, plugins=[plugins.ProgressBar(file=quiet)])
    loop.run(state)
    assert "compiling" not in quiet.getvalue() and "1/1 epochs" in quiet.getvalue()


def test_the_bar_print_and_inspect_count_epochs_alike(tmp_path) -> None:
    screen, lines = io.StringIO(), io.StringIO()
    loop, state = tiny_loop(epochs=2, plugins=[
        plugins.Checkpoint(tmp_path, every=gm.On("epoch_end")),
        plugins.ProgressBar(file=screen),
        plugins.Print(every=gm.On("epoch_end"), file=lines)])
    loop.run(state)
    printed = lines.getvalue().splitlines()
    assert [line.split("  ")[:3] for line in printed] == [
        ["epoch_end", "step 2", "epoch 1"], ["epoch_end", "step 4", "epoch 2"]]
    assert "2/2 epochs" in screen.getvalue().splitlines()[-1]  # the bar's last drawing
    assert "latest: step=4, epoch=2," in gm.inspect_run(tmp_path)


def _environment(tmp_path: pathlib.Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache")}


def test_ctrl_c_ends_with_its_notices_and_one_line_exit_130_and_resume_agrees(
        tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    script = tmp_path / "terminal_run.py"  # inside the directory resume runs from
    script.write_text(SCRIPT.read_text())
    command = f"{shlex.quote(sys.executable)} {script} {run} --interrupt-at 3; echo status=$?"
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_environment(tmp_path),
                          capture_output=True, text=True, timeout=240)
    err = done.stderr
    assert done.stdout.strip() == "status=130", err  # what a shell reports for Ctrl-C
    assert "Traceback" not in err and 'File "' not in err, err
    assert "press Ctrl-C again to abort" in err
    assert err.strip().splitlines()[-1] == "KeyboardInterrupt: interrupted at step 3"
    assert "saved step 3 to" in err
    assert "1/4 epochs: interrupted (at step 3)" in err  # 1 epoch done, in the second
    assert "latest: step=3, epoch=1," in gm.inspect_run(run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "execve", lambda *args: None)  # the script is not run again
    resumed = io.StringIO()
    monkeypatch.setattr(sys, "stderr", resumed)
    assert graphmod_main(["resume", str(run)]) == 0
    assert f"resuming {run} at step 3 (epoch 1)" in resumed.getvalue()


def test_the_bar_names_the_signal_that_stopped_a_run() -> None:
    import signal

    from graphmod._train._interrupt import SignalInterrupt

    def preempted(event: gm.Event) -> None:
        raise SignalInterrupt(signal.SIGTERM, "stopped by SIGTERM at step 2")

    bar = plugins.ProgressBar(file=io.StringIO())
    loop, state = tiny_loop(epochs=1, plugins=[bar])
    loop.on(gm.On("step", step=gm.at(2)), preempted)
    with contextlib.suppress(SignalInterrupt):
        loop.run(state)
    assert bar.stopped == "stopped by SIGTERM (at step 2)"
