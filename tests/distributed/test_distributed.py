"""Several processes as one run: ``graphmod run --processes N`` and
``graphmod.distributed.initialize`` (CPU processes on this machine, a loopback coordinator)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

import graphmod as gm
from graphmod import distributed
from graphmod._train._checkpoint import Checkpointer
from graphmod._train._checkpoint._parts import read_part, write_part
from tests.distributed import multiprocess_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
# One pytest-xdist worker runs this module (.ci/run's --dist loadgroup), so that the
# module-scoped run `whole` is made once, not once per worker.
pytestmark = pytest.mark.xdist_group("distributed")


def graphmod_command(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``graphmod ARGS`` in its own process group, killed whole if it runs past
    ``timeout`` (its processes would otherwise outlive the test)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen([sys.executable, "-m", "graphmod._cli", *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as command:
        try:
            out, err = command.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(command.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command.args, command.returncode, out, err)


TWO_BY_FOUR = ("run", "--processes", "2", "--devices-per-process", "4",
              "tests/distributed/multiprocess_run.py")


def run(*args: str) -> dict:
    """The final variables of ``multiprocess_run.py ARGS`` in 2 processes of 4 devices."""
    done = graphmod_command(*TWO_BY_FOUR, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(args[0])) if pathlib.Path(args[0]).exists() else {}


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The ``.npz`` file of the run in 2 processes of 4 devices, uninterrupted."""
    out = tmp_path_factory.mktemp("whole") / "whole.npz"
    run(str(out))
    return out


@pytest.fixture(scope="module")
def whole(whole_run: pathlib.Path) -> dict:
    """The final variables of the run in 2 processes of 4 devices, uninterrupted."""
    return dict(np.load(whole_run))


def test_two_processes_of_four_devices_train_as_one_process_of_eight(
        tmp_path, whole, whole_run) -> None:
    here = multiprocess_run.flat(multiprocess_run.train())  # 8 devices (tests/conftest.py)
    assert sorted(whole) == sorted(here)
    chex.assert_trees_all_close(whole, here, rtol=1e-5, atol=1e-6)
    # The loop's batches after the first are put on the mesh without an all-gather across
    # the processes (jax.device_put's check that they passed the same value), 7 steps here.
    compared = [pathlib.Path(f"{whole_run}.compared-{index}").read_text() for index in (0, 1)]
    assert compared == ["0", "0"]
    # Checkpointed by every process (each writes the pieces its devices hold), stopped after
    # epoch 2, resumed by `graphmod resume` in as many processes of as many devices.
    run_dir = str(tmp_path / "run")
    first = str(tmp_path / "first.npz")
    run(first, run_dir, "2")
    checkpoints = Checkpointer(run_dir, keep=None)
    assert checkpoints.steps() == [2, 4] and not checkpoints.leftovers()
    meta = checkpoints.meta(4)
    assert (meta["command"]["processes"], meta["command"]["devices_per_process"]) == (2, 4)
    assert (meta["format"], meta["parts"]) == (3, 2)
    writers = {name: sorted({part for part, *_ in chunks})
               for name, _, _, chunks in meta["arrays"]}
    assert writers[".variables['model']['linear_layers'][0]['W']"] == [0, 1]  # FSDP halves
    assert writers[".variables['model']['linear_layers'][0]['b']"] == [0]  # replicated
    assert checkpoints.verify(4) is None
    # Resumed on the same mesh, process 1 reads its own part for the FSDP halves it holds,
    # never process 0's: a corrupted chunk there is found by process 1 alone, and both
    # processes go back to step 2 (alone, process 0 would restore step 4 and the two would
    # train apart); the run (stopping after epoch 2, as recorded) writes step 4 again.
    part = pathlib.Path(run_dir) / "4" / "part-1.npz"
    listed, pieces = read_part(str(part))
    write_part(str(part), [pieces[0] ^ np.uint8(1), *pieces[1:]], listed)
    done = graphmod_command("resume", run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 4: process [1] cannot read or verify its chunks of it" in done.stderr
    assert "fails its checksum" in done.stderr  # process 1's own reason, in its warning
    assert checkpoints.steps() == [2, 4] and checkpoints.verify(4) is None
    done = graphmod_command("resume", run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--processes 2 --devices-per-process 4" in done.stderr
    assert Checkpointer(run_dir, keep=None).steps()[-1] == 8
    resumed = dict(np.load(first))
    jax.tree.map(np.testing.assert_array_equal, resumed, whole)  # bit for bit
    # ... and the checkpoint of two processes resumes in one process of eight devices
    chex.assert_trees_all_close(multiprocess_run.flat(multiprocess_run.train(run_dir)), here,
                                rtol=1e-5, atol=1e-6)
    # A part that is corrupted or missing is named; the checkpoint is not read.
    part = pathlib.Path(run_dir) / "8" / "part-1.npz"
    data = bytearray(part.read_bytes())
    data[-400:-200] = bytes(200)  # inside the last chunk's bytes or the archive's index
    part.write_bytes(bytes(data))
    assert re.search(r"part-1\.npz\) cannot be read|written by process 1\) fails its checksum",
                     checkpoints.verify(8) or "")
    part.unlink()
    assert checkpoints.verify(8) == "the part process 1 wrote (part-1.npz) is missing"


def _process(parent: int, index: int) -> int:
    """The pid of process ``index`` among the children ``graphmod run`` (``parent``) made."""
    for child in pathlib.Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        environ = pathlib.Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"{distributed.PROCESS_ID}={index}".encode() in environ:
            return int(child)
    raise AssertionError(f"no process {index} under {parent}")


def _start_interruptible(run_dir: pathlib.Path, out: str) -> subprocess.Popen:
    """``graphmod run`` of 2 processes pausing 0.5 s a step, in its own process group, once
    its first checkpoint is written (the loops run)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = subprocess.Popen([sys.executable, "-m", "graphmod._cli", *TWO_BY_FOUR, out,
                                str(run_dir), "-", "0.5"], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    deadline = time.monotonic() + 200
    while not (run_dir / "2").is_dir() and time.monotonic() < deadline:
        assert command.poll() is None, command.communicate()[1][-3000:]
        time.sleep(0.05)
    return command


@pytest.mark.parametrize("target", ["the terminal", "process 1 alone", "graphmod run: SIGINT",
                                    "graphmod run: SIGTERM"])
def test_a_stop_signal_stops_every_process_at_one_step_saved_and_resumed_bit_for_bit(
        tmp_path, whole, target: str) -> None:
    # A Ctrl-C reaches every process (the terminal) or one; graphmod run passes a Ctrl-C or
    # a SIGTERM it gets (kill, a scheduler) on to every process (it passed on nothing: they
    # trained to the end, or on after it died). Either way they agree on a step through
    # JAX's preemption sync, save it together, and the run resumes from it.
    run_dir, out = tmp_path / "run", str(tmp_path / "out.npz")
    signum = signal.SIGTERM if target.endswith("SIGTERM") else signal.SIGINT
    command = _start_interruptible(run_dir, out)
    try:
        if target == "the terminal":
            os.killpg(command.pid, signal.SIGINT)
        elif target == "process 1 alone":
            os.kill(_process(command.pid, 1), signal.SIGINT)
        else:
            os.kill(command.pid, signum)
        _, err = command.communicate(timeout=200)  # it waits for both processes
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
    assert command.returncode == 128 + signum, err[-3000:]
    checkpoints = Checkpointer(run_dir, keep=None)
    stopped = checkpoints.latest()
    assert 2 < stopped < 8 and checkpoints.verify(stopped) is None
    assert checkpoints.meta(stopped)["parts"] == 2 and not checkpoints.leftovers()
    assert checkpoints.meta(stopped)["stopped"]["step"] == stopped
    assert err.count(f"saved step {stopped} to {run_dir}") == 1  # said once, by process 0
    if target != "process 1 alone":
        what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        assert f"graphmod run: {what}: the processes stop at one step and save it" in err
    done = graphmod_command("resume", str(run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    jax.tree.map(np.testing.assert_array_equal, dict(np.load(out)), whole)  # bit for bit


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie no one reaps has)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_processes_of_a_killed_graphmod_run_stop_save_and_end(tmp_path) -> None:
    # SIGKILL of graphmod run (the OOM killer, kill -9) left its processes training on,
    # unsupervised; now each sees its launcher gone, stops at the step they agree on, saves
    # it and ends.
    run_dir, out = tmp_path / "run", str(tmp_path / "out.npz")
    command = _start_interruptible(run_dir, out)
    try:
        processes = [_process(command.pid, index) for index in (0, 1)]
        os.kill(command.pid, signal.SIGKILL)
        command.communicate(timeout=60)
        deadline = time.monotonic() + 200  # generous: 2 loaded cores
        while not all(map(_gone, processes)):
            assert time.monotonic() < deadline, "the processes still run 200 s after"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what is left of its group, if any
            os.killpg(command.pid, signal.SIGKILL)
    checkpoints = Checkpointer(run_dir, keep=None)
    stopped = checkpoints.latest()
    assert 2 < stopped < 8 and checkpoints.verify(stopped) is None
    assert checkpoints.meta(stopped)["stopped"]["step"] == stopped


def test_an_error_in_one_process_stops_the_run_without_a_save_that_would_wait(
        tmp_path) -> None:
    # Every process takes part in a save: one stopped by an error alone must not start one
    # (the others would never join it); its checkpoints so far stay whole, also when process
    # 0 (a loaded machine) assembles step 2 later than the others' stop would end it.
    script = tmp_path / "fails_at_step_3.py"
    script.write_text(
        "import sys, time\nimport graphmod as gm\ngm.distributed.initialize()\n"
        "import jax, optax\nfrom graphmod import On, at\n"
        "from graphmod.data import ArraySource\nfrom graphmod.plugins import Checkpoint\n"
        "from graphmod._cli import STOP_GRACE_S\n"
        "from graphmod._train._checkpoint._writer import Checkpointer\n"
        "from tests.test_sharding import X, Y, mlp, squared_error\n"
        "assemble = Checkpointer._assemble\n"
        "def late(self, step, *args):\n"
        "    time.sleep(STOP_GRACE_S + 2 if step == 2 else 0)\n"
        "    return assemble(self, step, *args)\n"
        "Checkpointer._assemble = late\n"
        "mesh = jax.make_mesh((jax.device_count(),), ('data',))\n"
        "program = gm.compile(squared_error, mlp(), mesh=mesh, **gm.sharding.fsdp())\n"
        "step = gm.optimize(program, optax.sgd(0.1))\n"
        "loop = gm.Loop(step, ArraySource((X, Y), batch_size=16), epochs=4,\n"
        "               plugins=[Checkpoint(sys.argv[1])])\n"
        "def fail(event):\n"
        "    if jax.process_index() == 1:\n        raise RuntimeError('process 1 fails')\n"
        "loop.on(On('step', step=at(3)), fail)\n"
        "loop.run(step.init(program.init(X[:8], Y[:8]), jax.random.key(0)))\n")
    run_dir = tmp_path / "run"
    done = graphmod_command("run", "--processes", "2", "--devices-per-process", "4",
                            str(script), str(run_dir), timeout=120)
    assert done.returncode != 0
    assert "RuntimeError: process 1 fails" in done.stderr
    assert "at step 3 in process 1; not saved" in done.stderr
    checkpoints = Checkpointer(run_dir, keep=None)
    assert checkpoints.steps() == [2] and checkpoints.verify(2) is None


def test_a_failing_process_stops_the_run_with_its_status(tmp_path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['GRAPHMOD_PROCESS_ID'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(60)\n")
    done = graphmod_command("run", "--processes", "2", str(script), timeout=50)
    assert done.returncode == 3


def test_bad_process_counts_are_usage_errors() -> None:
    done = graphmod_command("run", "--processes", "0", "tests/distributed/multiprocess_run.py")
    assert done.returncode == 2
    assert "--processes: expected a whole number >= 1, got '0'" in done.stderr


def test_initialize_alone_joins_nothing_and_names_a_half_set_environment(monkeypatch) -> None:
    monkeypatch.delenv(distributed.NUM_PROCESSES, raising=False)
    assert gm.distributed.initialize() is False
    monkeypatch.setenv(distributed.NUM_PROCESSES, "2")
    monkeypatch.delenv(distributed.PROCESS_ID, raising=False)
    with pytest.raises(RuntimeError, match=r"GRAPHMOD_PROCESS_ID or JAX_COORDINATOR_ADDRESS "
                                           r"is missing.*graphmod run --processes N"):
        gm.distributed.initialize()
