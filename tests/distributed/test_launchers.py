"""Runs of several processes that cluster launchers start (``graphmod.distributed``):
two CPU processes on this machine given the environment Slurm's ``srun`` gives its tasks
(or explicit arguments, as a launcher of your own passes them) train, checkpoint, stop on
a SIGTERM to one of them and resume in place (``srun graphmod resume DIR``) bit for bit;
a half-set environment is refused before JAX starts; outside the allocation
``graphmod resume`` prints the command that submits the run again and starts nothing."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import graphmod as gm
from graphmod import distributed
from graphmod._cli import main
from graphmod._train._checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = "tests/distributed/launcher_run.py"
# The runs share one worker with tests/distributed/test_distributed.py (.ci/run's
# --dist loadgroup); the module-scoped runs below are made once.
pytestmark = pytest.mark.xdist_group("distributed")

# The variables of every launcher graphmod.distributed reads: none may leak into a test
# from the machine it runs on (a CI job inside a Slurm allocation, say).
LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "GRAPHMOD_", "JAX_COORDINATOR", "TPU_",
                   "MEGASCALE_", "KUBERNETES_", "JOB_COMPLETION_INDEX", "LAUNCHER_RUN_")


def _unlaunched() -> dict[str, str]:
    """The test's environment without any launcher's variables, for processes of 4 CPU
    devices (as ``graphmod run --devices-per-process 4`` gives)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES)}
    return {**env, "PYTHONPATH": str(ROOT),
            "XLA_FLAGS": f"{distributed.DEVICE_COUNT_FLAG}=4"}


def _slurm_job() -> int:
    """A Slurm job id whose coordinator port is free here: JAX's SlurmCluster listens on
    61440 + SLURM_JOB_ID % 4096 (a range outside Linux's ephemeral ports)."""
    start = os.getpid() % 4096
    for offset in range(4096):
        port = 61440 + (start + offset) % 4096
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 4096 * 100 + port - 61440
    raise AssertionError("no free port from 61440 to 65535")


def _srun_task(job: int, index: int, join: str) -> dict[str, str]:
    """What ``srun --ntasks=2`` on one node gives task ``index``, joining as ``join``
    (see ``launcher_run.py``)."""
    return {**_unlaunched(), "SLURM_JOB_ID": str(job), "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(index), "SLURM_LOCALID": str(index),
            "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "train",
            "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_PARTITION": "cpu",
            "LAUNCHER_RUN_JOIN": join}


def _explicit(port: int, index: int) -> dict[str, str]:
    """The values a launcher of your own passes to ``initialize`` in process ``index``."""
    return {**_unlaunched(), "LAUNCHER_RUN_JOIN": "explicit",
            "LAUNCHER_RUN_COORDINATOR": f"127.0.0.1:{port}", "LAUNCHER_RUN_PROCESSES": "2",
            "LAUNCHER_RUN_ID": str(index)}


class Tasks:
    """Two processes of one run, each in its own process group (killed whole if a test
    fails), standard error to a file each."""

    def __init__(self, argv: list[str], envs: list[dict[str, str]], logs: pathlib.Path):
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"stderr-{index}" for index in range(len(envs))]
        self.processes = [subprocess.Popen(argv, cwd=ROOT, env=env, stderr=log.open("w"),
                                           stdout=subprocess.DEVNULL, start_new_session=True)
                          for env, log in zip(envs, self.logs, strict=True)]

    def wait(self, timeout: float = 300) -> list[int]:
        """The exit statuses; kills them all if one still runs after ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(max(1.0, deadline - time.monotonic())) for p in self.processes]
        finally:
            for process in self.processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()

    def stderr(self) -> list[str]:
        return [log.read_text() for log in self.logs]


def _checked(tasks: Tasks) -> list[str]:
    """The standard errors of two processes that both ended well."""
    codes = tasks.wait()
    assert codes == [0, 0], "\n".join(err[-3000:] for err in tasks.stderr())
    return tasks.stderr()


@pytest.fixture(scope="module")
def explicit_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A run of two processes joined by ``initialize(coordinator_address=...,
    num_processes=2, process_id=...)``, checkpointed every epoch, uninterrupted."""
    folder = tmp_path_factory.mktemp("explicit")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tasks = Tasks([sys.executable, SCRIPT, str(folder / "out.npz"), str(folder / "run")],
                  [_explicit(port, index) for index in (0, 1)], folder)
    _checked(tasks)
    return folder


@pytest.fixture(scope="module")
def slurm_stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list]:
    """A run of two Slurm tasks joined by the user's own ``jax.distributed.initialize()``,
    checkpointed every epoch and pausing 0.3 s a step, stopped by a SIGTERM to task 1 once
    its first checkpoint is written; ``(folder, exit statuses)``. ``folder/stopped`` is a
    copy of its run directory as the stop left it."""
    folder = tmp_path_factory.mktemp("slurm")
    run_dir, job = folder / "run", _slurm_job()
    tasks = Tasks([sys.executable, SCRIPT, str(folder / "out.npz"), str(run_dir), "0.3"],
                  [_srun_task(job, index, "jax") for index in (0, 1)], folder / "first")
    deadline = time.monotonic() + 200
    while not (run_dir / "2").is_dir() and time.monotonic() < deadline:
        assert all(p.poll() is None for p in tasks.processes), tasks.stderr()
        time.sleep(0.05)
    tasks.processes[1].send_signal(signal.SIGTERM)  # as a scheduler preempting one node
    codes = tasks.wait()
    shutil.copytree(run_dir, folder / "stopped")
    return folder, codes


@pytest.fixture(scope="module")
def slurm_resumed(slurm_stopped: tuple[pathlib.Path, list]) -> tuple[pathlib.Path, list]:
    """The stopped run resumed by ``srun graphmod resume DIR`` in a new job of two tasks,
    which join through ``graphmod.distributed.initialize()``; ``(folder, stderrs)``."""
    folder, _ = slurm_stopped
    job = _slurm_job()
    tasks = Tasks([sys.executable, "-m", "graphmod._cli", "resume", str(folder / "run")],
                  [_srun_task(job, index, "graphmod") for index in (0, 1)], folder / "again")
    return folder, _checked(tasks)


def test_explicit_arguments_join_two_processes_into_one_mesh_saved_by_both(
        explicit_run: pathlib.Path) -> None:
    joined = [json.loads((explicit_run / f"out.npz.joined-{i}").read_text()) for i in (0, 1)]
    port = joined[0]["coordinator"].rsplit(":", 1)[1]
    assert joined == [{"launcher": "explicit", "process_id": i, "num_processes": 2,
                       "coordinator": f"127.0.0.1:{port}"} for i in (0, 1)]
    checkpoints = Checkpointer(str(explicit_run / "run"), keep=None)
    assert checkpoints.steps()[-1] == 8 and checkpoints.verify(8) is None
    meta = checkpoints.meta(8)
    assert meta["parts"] == 2  # written by both processes
    writers = {name: sorted({part for part, *_ in chunks})
               for name, _, _, chunks in meta["arrays"]}
    # One mesh over both processes' devices: each holds a half of an FSDP-split weight
    # (two runs of 4 devices each would hold it whole), as `graphmod run --processes 2`'s
    # processes do (tests/distributed/test_distributed.py, which compares them with one
    # process of 8 devices; the Slurm run below equals this one bit for bit).
    assert writers[".variables['model']['linear_layers'][0]['W']"] == [0, 1]
    assert (meta["command"]["launcher"], meta["command"]["processes"]) == ("explicit", 2)


def test_graphmod_run_trains_the_same_run_as_a_launch_of_your_own(
        explicit_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # The same script under graphmod's own launcher (its processes join through
    # initialize() with no argument): the final variables equal the explicit launch's.
    done = subprocess.run(
        [sys.executable, "-m", "graphmod._cli", "run", "--processes", "2",
         "--devices-per-process", "4", SCRIPT, str(tmp_path / "out.npz"), str(tmp_path / "run")],
        cwd=ROOT, env={**_unlaunched(), "LAUNCHER_RUN_JOIN": "graphmod"}, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    joined = json.loads((tmp_path / "out.npz.joined-1").read_text())
    assert (joined["launcher"], joined["process_id"], joined["num_processes"]) == (
        "graphmod", 1, 2)
    ours, theirs = dict(np.load(tmp_path / "out.npz")), dict(np.load(explicit_run / "out.npz"))
    assert sorted(ours) == sorted(theirs)
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)  # bit for bit


def test_slurm_tasks_stop_at_one_step_on_a_sigterm_to_one_and_save_it(
        slurm_stopped: tuple[pathlib.Path, list]) -> None:
    folder, codes = slurm_stopped
    # Task 1's SIGTERM went to JAX's preemption notifier: both tasks stopped at the step
    # they agreed on, as after a Ctrl-C (Python's exit by SIGINT).
    assert codes == [-signal.SIGINT, -signal.SIGINT]
    joined = [json.loads((folder / f"out.npz.joined-{i}").read_text()) for i in (0, 1)]
    assert [(j["launcher"], j["process_id"], j["num_processes"]) for j in joined] == [
        ("slurm", 0, 2), ("slurm", 1, 2)]
    checkpoints = Checkpointer(str(folder / "stopped"), keep=None)
    stopped = checkpoints.latest()
    assert 2 < stopped < 8 and checkpoints.verify(stopped) is None
    meta = checkpoints.meta(stopped)
    assert meta["stopped"]["step"] == stopped and meta["parts"] == 2
    command = meta["command"]
    assert (command["launcher"], command["processes"]) == ("slurm", 2)
    assert command["job"]["job_name"] == "train" and command["job"]["nodes"] == "1"


def test_srun_graphmod_resume_goes_on_in_place_bit_for_bit(
        slurm_resumed: tuple[pathlib.Path, list], explicit_run: pathlib.Path) -> None:
    folder, stderrs = slurm_resumed
    assert "in place: process 0 of 2 that slurm launched" in stderrs[0]
    assert "graphmod resume:" not in stderrs[1]  # said once
    assert "--processes" not in stderrs[0]  # no local processes started
    resumed, whole = dict(np.load(folder / "out.npz")), dict(np.load(explicit_run / "out.npz"))
    assert sorted(resumed) == sorted(whole)
    jax.tree.map(np.testing.assert_array_equal, resumed, whole)  # bit for bit
    meta = Checkpointer(str(folder / "run"), keep=None).meta(8)
    assert meta["command"]["launcher"] == "slurm" and meta["parts"] == 2


@pytest.fixture
def unlaunched(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This process's environment without any launcher's variables."""
    for name in [n for n in os.environ if n.startswith(LAUNCH_PREFIXES)]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_graphmod_resume_outside_the_allocation_prints_the_resubmit_command_and_starts_nothing(
        slurm_stopped: tuple[pathlib.Path, list], unlaunched: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    folder, _ = slurm_stopped
    run_dir = str(folder / "stopped")
    started: list[tuple] = []
    unlaunched.setattr(os, "execve", lambda *args: started.append(args))
    unlaunched.setattr(subprocess, "Popen", lambda *args, **kw: started.append(args))
    unlaunched.chdir(ROOT)  # where the recorded script lies: it is checked first
    assert main(["resume", run_dir]) == 2
    out, err = capsys.readouterr()
    assert started == []
    assert out == shlex.join(["sbatch", "--job-name=train", "--partition=cpu", "--nodes=1",
                              "--ntasks=2", f"--chdir={ROOT}",
                              f"--wrap=srun graphmod resume {shlex.quote(run_dir)}"]) + "\n"
    assert len(err.splitlines()) == 1 and err.startswith(f"graphmod resume: {run_dir} was "
                                                         "started by Slurm (slurm: 2 processes")
    assert "submit it again with: sbatch" in err
    report = gm.inspect_run(run_dir)
    assert "launched: slurm: 2 processes (job_id " in report
    assert "job_name train, partition cpu, nodes 1" in report


def _refused(**variables: str) -> dict[str, str]:
    return variables


HALF_SET = {  # name: (environment, the words the refusal must hold)
    "slurm: a count, no id": (_refused(SLURM_JOB_ID="7", SLURM_NTASKS="2"),
                              r"slurm: SLURM_PROCID is missing \(SLURM_NTASKS='2'\); start "
                              r"each task with srun"),
    "slurm: an id out of range": (_refused(SLURM_JOB_ID="7", SLURM_NTASKS="2",
                                           SLURM_PROCID="2"),
                                  "SLURM_PROCID=2 is out of range of SLURM_NTASKS=2"),
    "slurm: a count that is no number": (_refused(SLURM_JOB_ID="7", SLURM_NTASKS="two",
                                                  SLURM_PROCID="0"),
                                         "SLURM_NTASKS='two' is not a whole number"),
    "slurm: an id, no count": (_refused(SLURM_JOB_ID="7", SLURM_PROCID="1"),
                               r"SLURM_NTASKS is missing \(SLURM_PROCID=1\)"),
    "slurm: no node list": (_refused(SLURM_JOB_ID="7", SLURM_NTASKS="2", SLURM_PROCID="1",
                                     SLURM_LOCALID="1"), "SLURM_STEP_NODELIST is missing"),
    "open mpi: no rank": (_refused(OMPI_MCA_orte_hnp_uri="1.0;tcp://10.0.0.1:4000",
                                   OMPI_COMM_WORLD_SIZE="4"),
                          "ompi: OMPI_COMM_WORLD_RANK is missing"),
    "mpich: no coordinator": (_refused(PMI_SIZE="2", PMI_RANK="1"),
                              "mpi: JAX_COORDINATOR_ADDRESS is missing.*coordinator_address="),
    "gke tpu: no worker id": (_refused(TPU_WORKER_HOSTNAMES="h0,h1"),
                              r"gketpu: TPU_WORKER_ID is missing \(2 hosts listed\)"),
    "graphmod: an id out of range": (_refused(GRAPHMOD_NUM_PROCESSES="2",
                                              GRAPHMOD_PROCESS_ID="5",
                                              JAX_COORDINATOR_ADDRESS="127.0.0.1:1"),
                                     "GRAPHMOD_PROCESS_ID=5 is out of range"),
    "kubernetes: no index": (_refused(GRAPHMOD_NUM_PROCESSES="2", KUBERNETES_SERVICE_HOST="k",
                                      JAX_COORDINATOR_ADDRESS="w-0.w:1234"),
                             r"kubernetes: .*GRAPHMOD_PROCESS_ID \(or an Indexed Job's "
                             r"JOB_COMPLETION_INDEX\) or JAX_COORDINATOR_ADDRESS is missing"),
}


@pytest.mark.parametrize("case", HALF_SET, ids=list(HALF_SET))
def test_a_half_set_environment_is_refused_before_jax_starts_naming_the_variable(
        case: str, unlaunched: pytest.MonkeyPatch) -> None:
    variables, words = HALF_SET[case]
    for name, value in variables.items():
        unlaunched.setenv(name, value)
    started = jax._src.xla_bridge.backends_are_initialized()
    joins: list[dict] = []
    unlaunched.setattr(jax.distributed, "initialize", lambda **kw: joins.append(kw))
    with pytest.raises(distributed.LaunchError, match=words):
        gm.distributed.initialize()
    assert joins == [] and not jax.distributed.is_initialized()
    assert jax._src.xla_bridge.backends_are_initialized() == started  # started nothing


@pytest.mark.parametrize("variables", [
    {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"},  # an salloc shell of one task
    {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
     "SLURM_STEP_NODELIST": "n1"},  # srun -n 1
    {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1"},  # an allocation without a task count
    {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:4000", "OMPI_COMM_WORLD_SIZE": "1",
     "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
    {"TPU_WORKER_HOSTNAMES": "h0", "TPU_WORKER_ID": "0"},
    {"KUBERNETES_SERVICE_HOST": "k", "JOB_COMPLETION_INDEX": "3"},  # a pod of its own
], ids=["salloc", "srun -n 1", "no count", "mpirun -np 1", "one tpu host", "a pod"])
def test_a_process_alone_in_its_cluster_joins_nothing(
        variables: dict[str, str], unlaunched: pytest.MonkeyPatch) -> None:
    for name, value in variables.items():
        unlaunched.setenv(name, value)
    unlaunched.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("joined"))
    assert gm.distributed.initialize() is False


@pytest.mark.parametrize(("variables", "arguments", "expected"), [
    ({"GRAPHMOD_NUM_PROCESSES": "4", "KUBERNETES_SERVICE_HOST": "k",
      "JOB_COMPLETION_INDEX": "3", "JAX_COORDINATOR_ADDRESS": "w-0.w:1234"}, {},
     ("kubernetes", 3, 4, "w-0.w:1234")),
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:4000", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, {},
     ("ompi", 2, 4, None)),
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, {"coordinator_address": "n0:1234"},
     ("mpi", 1, 2, "n0:1234")),
    ({"TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "1", "MEGASCALE_NUM_SLICES": "2",
      "MEGASCALE_SLICE_ID": "1"}, {}, ("gketpu", 3, 4, None)),
    ({"GRAPHMOD_CLUSTER": "gcetpu"}, {}, ("gcetpu", None, None, None)),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"},  # explicit values win over a half-set one
     {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1},
     ("explicit", 1, 2, "h:1")),
], ids=["kubernetes", "open mpi", "mpich", "gke tpu slices", "by name", "explicit"])
def test_detect_names_the_launcher_and_the_place_of_the_process(
        variables: dict[str, str], arguments: dict, expected: tuple,
        unlaunched: pytest.MonkeyPatch) -> None:
    for name, value in variables.items():
        unlaunched.setenv(name, value)
    assert distributed.detect(**arguments) == distributed.Launch(*expected)


@pytest.mark.parametrize(("arguments", "words"), [
    ({"num_processes": 2}, "num_processes given, but no launcher"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2},
     "process_id=2 is out of range of num_processes=2"),
    ({"coordinator_address": "h", "num_processes": 2, "process_id": 0},
     "coordinator_address='h' is not 'host:port'"),
    ({"num_processes": True}, "num_processes=True is not a whole number >= 1"),
    ({"cluster_detection_method": "k8s"}, "cluster_detection_method='k8s' is not one of"),
])
def test_bad_arguments_are_refused_naming_them(arguments: dict, words: str,
                                               unlaunched: pytest.MonkeyPatch) -> None:
    unlaunched.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("joined"))
    with pytest.raises(ValueError, match=words):
        gm.distributed.initialize(**arguments)


def test_graphmod_run_processes_inside_a_launch_of_several_is_refused(
        unlaunched: pytest.MonkeyPatch, tmp_path: pathlib.Path,
        capsys: pytest.CaptureFixture) -> None:
    for name, value in _srun_task(7, 1, "graphmod").items():
        if name.startswith("SLURM_"):
            unlaunched.setenv(name, value)
    script = tmp_path / "train.py"
    script.write_text("")
    unlaunched.setattr(subprocess, "Popen", lambda *args, **kw: pytest.fail("started"))
    assert main(["run", "--processes", "2", str(script)]) == 2
    assert ("--processes 2: this process is one of 2 processes slurm launched, each of which "
            "would start its own run") in capsys.readouterr().err
