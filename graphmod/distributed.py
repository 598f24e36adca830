"""Several processes, one program: joining a multi-process ``jax.distributed`` run, however
it was started (``graphmod run --processes N``, Slurm, an MPI launcher, a TPU pod,
Kubernetes, or arguments of your own).

A script calls :func:`initialize` before it uses JAX. It reads the environment the process
was started with (nothing else: JAX has not started yet), finds the launcher that started
it, refuses a launcher's environment that is only half set (:class:`LaunchError`, naming
the variable) and joins the run through ``jax.distributed.initialize``. Each process then
holds its own devices of one global mesh (``jax.make_mesh`` over ``jax.devices()``), and a
program compiled with ``mesh=`` runs on all of them: every process runs the same code on
the same batches (each puts its own shard on its devices), and the results are those of
one process holding every device, to float rounding (the collectives differ).

The launchers, in the order they are looked for (:func:`detect` names the one found,
:attr:`Launch.launcher`):

``explicit``
    ``initialize(coordinator_address="host:port", num_processes=N, process_id=I)``: your
    own launcher's values (any of them alone completes or overrides a launcher's).
JAX's detection by name
    ``cluster_detection_method=`` or the variable ``GRAPHMOD_CLUSTER`` (``gcetpu``,
    ``gketpu``, ``slurm``, ``ompi``, ``mpi4py``): where the environment cannot say, e.g. a
    TPU VM pod started with ``gcloud compute tpus tpu-vm ssh ... --worker=all`` (JAX asks
    the VM's metadata server), or an MPI read through mpi4py. JAX reads everything.
``graphmod``, ``kubernetes``, ``environment``
    ``GRAPHMOD_NUM_PROCESSES``, ``GRAPHMOD_PROCESS_ID`` and ``JAX_COORDINATOR_ADDRESS``: set
    by ``graphmod run --processes N [--devices-per-process D] SCRIPT`` for the N copies of
    SCRIPT it starts on this machine (on a loopback port); by a Kubernetes manifest (in a
    pod, an Indexed Job's or JobSet's ``JOB_COMPLETION_INDEX`` may stand for the id); or
    by a launcher of your own.
``ompi``
    Open MPI's ``mpirun`` (``OMPI_MCA_orte_hnp_uri``, ``OMPI_COMM_WORLD_SIZE``,
    ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_LOCAL_RANK``); JAX finds the coordinator.
``slurm``
    the tasks of ``srun`` (``SLURM_JOB_ID``, ``SLURM_NTASKS``, ``SLURM_PROCID``,
    ``SLURM_LOCALID``, ``SLURM_STEP_NODELIST``); JAX puts the coordinator on the step's
    first node, port 61440 + ``SLURM_JOB_ID`` % 4096 (``JAX_COORDINATOR_PORT`` sets
    another); on GPUs each task sees the GPU of its ``SLURM_LOCALID``.
``mpi``
    MPI launchers JAX does not read (MPICH's and Intel MPI's ``mpiexec``: ``PMI_SIZE``,
    ``PMI_RANK``; Open MPI 5: ``OMPI_COMM_WORLD_SIZE`` without ``OMPI_MCA_orte_hnp_uri``):
    the count and id from them, the coordinator from ``coordinator_address=`` or
    ``JAX_COORDINATOR_ADDRESS`` (rank 0's host and a free port).
``gketpu``
    a TPU slice on GKE (``TPU_WORKER_HOSTNAMES`` or ``TPU_PROCESS_ADDRESSES``,
    ``TPU_WORKER_ID``, with ``MEGASCALE_NUM_SLICES`` and ``MEGASCALE_SLICE_ID`` over
    slices).

A process started alone joins nothing, and so does one process alone in its cluster (one
Slurm task: an ``salloc`` shell, ``srun -n 1``; an ``mpirun`` of one rank; a one-host TPU
slice): :func:`initialize` returns False, as ``python SCRIPT`` gets. A process that already
joined (your own ``jax.distributed.initialize()`` first) joins nothing more: it gets the
:class:`Launch` of that run.

Examples:
    >>> import graphmod as gm
    >>> gm.distributed.initialize()  # started alone (python SCRIPT): nothing to join
    False

Sharp edges
    :func:`initialize` must run before anything touches a device (JAX starts its backend
    once). A Slurm job's processes are ``srun``'s tasks: a script run directly in an
    ``salloc`` shell or a batch script of ``--ntasks=2`` is one process of the two the job
    asked for, refused (its ``SLURM_PROCID`` is missing). On CPU the processes exchange
    data through Gloo. A ``Checkpoint`` saves in every process: each writes the pieces of
    the state its devices hold (nothing is gathered), and process 0 puts the checkpoint
    together once every piece is written; so every process must save at the same step:
    schedule saves on the ``step`` or ``epoch`` timelines, not on wall-clock ``seconds``. A
    Ctrl-C (or a SIGTERM, as a cluster scheduler sends before preempting, or a signal opted
    in with ``GRAPHMOD_STOP_SIGNALS``, e.g. ``USR1`` for Slurm's ``--signal=USR1@60``) to
    any process, or to ``graphmod run``, which passes it on to every process as SIGTERM,
    stops every process of a ``graphmod.Loop`` at one step they agree on through JAX's
    preemption sync, and a ``Checkpoint`` saves it; ``graphmod run`` then exits with 128 +
    the signal (130 for Ctrl-C, 143 for SIGTERM), each process with 130 (143 for one that
    took an opted-in signal). A second signal to ``graphmod run`` kills the processes at
    once. If ``graphmod run`` itself is killed, its processes notice within a second, stop
    the same way and end (without a save if they still run 60 s later); no other launcher
    is watched so (a scheduler ends its tasks itself). A process stopped by an error saves
    nothing (the others could not join) and ends at once; ``graphmod run`` then stops the
    others. Every process reads a checkpoint to resume, onto any mesh (and any number of
    processes). ``graphmod resume DIR`` starts the processes of a ``graphmod run`` again
    (as many, with as many devices each, as its checkpoint records); a run another
    launcher started is resumed in that launcher (``srun graphmod resume DIR``: each
    process runs the script in place), and outside it ``graphmod resume`` prints the
    command that submits it again and starts nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from typing import Literal

__all__ = ["Launch", "LaunchError", "detect", "initialize", "joined"]

_log = logging.getLogger("graphmod.distributed")

PROCESS_ID = "GRAPHMOD_PROCESS_ID"
NUM_PROCESSES = "GRAPHMOD_NUM_PROCESSES"
COORDINATOR = "JAX_COORDINATOR_ADDRESS"
LAUNCHER_PID = "GRAPHMOD_LAUNCHER_PID"  # each process ends if this pid is no longer its parent
# "graphmod" in the processes `graphmod run --processes` starts (LAUNCHER_PID is not kept).
LAUNCHER = "GRAPHMOD_LAUNCHER"
CLUSTER = "GRAPHMOD_CLUSTER"  # JAX's cluster detection to use by name
# XLA's flag giving a CPU process its virtual devices (graphmod run --devices-per-process).
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The names jax.distributed.initialize(cluster_detection_method=...) knows (JAX 0.10).
JAX_CLUSTERS = ("ompi", "slurm", "mpi4py", "gketpu", "gcetpu")

_SLURM_FIX = ("start each task with srun (srun python SCRIPT, srun graphmod resume DIR): a "
              "script run directly in an salloc shell or a batch script is one process of "
              "the tasks the job asked for")
_MPI_FIX = "start every rank with the MPI launcher (mpirun -np N python SCRIPT)"
_OWN_FIX = ("start the script with 'graphmod run --processes N SCRIPT', which sets all three "
            "(on Kubernetes, or with a launcher of your own, set all three yourself)")


class LaunchError(RuntimeError):
    """A launcher's environment that is only half set (a count without an id, an id out of
    range, a value that is no number), refused before JAX starts; the message names the
    variable and the fix.

    Examples:
        >>> import os
        >>> from graphmod.distributed import LaunchError, detect
        >>> os.environ.update(SLURM_JOB_ID="7", SLURM_NTASKS="2")  # no SLURM_PROCID
        >>> try:
        ...     detect()
        ... except LaunchError as error:
        ...     print(str(error).split(";")[0])
        slurm: SLURM_PROCID is missing (SLURM_NTASKS='2')
        >>> for name in ("SLURM_JOB_ID", "SLURM_NTASKS"):
        ...     del os.environ[name]
    """


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process was launched as one of a run of several: what :func:`detect`
    finds and :func:`initialize` joins (and returns: a ``Launch`` is truthy, where a
    process started alone gets ``False``).

    Attributes:
        launcher: who started it (see :mod:`graphmod.distributed`): ``graphmod``,
            ``slurm``, ``ompi``, ``mpi``, ``gketpu``, ``kubernetes``, ``environment``,
            ``explicit``, or the name of JAX's detection (``gcetpu``, ``mpi4py``, ...).
        process_id: this process's index, from 0 (None: JAX finds it).
        num_processes: how many processes the run has (None: JAX finds it).
        coordinator: ``host:port`` of the coordinator, process 0 (None: JAX derives it).

    Examples:
        >>> from graphmod.distributed import Launch
        >>> launch = Launch("slurm", 0, 2, None)
        >>> bool(launch), launch.num_processes
        (True, 2)
    """

    launcher: str
    process_id: int | None
    num_processes: int | None
    coordinator: str | None

    def __bool__(self) -> bool:
        return True  # joined, where a process alone gets False


def _error(launcher: str, what: str, fix: str) -> LaunchError:
    """The refusal of ``launcher``'s environment: what is wrong, then the fix."""
    return LaunchError(f"{launcher}: {what}; {fix}")


def _whole(name: str, launcher: str, fix: str) -> int | None:
    """The whole number a variable holds (None where it is not set)."""
    text = os.environ.get(name)
    if text is None:
        return None
    if not text.strip().isdigit():
        raise _error(launcher, f"{name}={text!r} is not a whole number", fix)
    return int(text)


def _member(launcher: str, count_name: str, id_name: str, fix: str, *,
            needs: Sequence[tuple[str, bool]] = (), coordinator: str | None = None,
            missing: str | None = None) -> Launch | None:
    """The launch a count variable and an id variable describe (None: one process); every
    variable of ``needs`` (name, whether a whole number) must be set where there are several.
    ``missing``: the text that stands for what is missing, where the launcher has its own."""
    count = _whole(count_name, launcher, fix)
    process = _whole(id_name, launcher, fix)
    if count is None:
        if process is None:
            return None  # the launcher's mark without a count: no task of several
        raise _error(launcher, f"{count_name} is missing ({id_name}={process})", fix)
    if count < 1:
        raise _error(launcher, f"{count_name}={count} is not a count of processes", fix)
    if process is not None and process >= count:
        raise _error(launcher, f"{id_name}={process} is out of range of {count_name}={count} "
                               f"(ids run from 0 to {count - 1})", fix)
    if count == 1:
        return None
    absent = [name for name, _ in needs if name not in os.environ]
    if process is None or absent:
        culprit = f"{id_name if process is None else absent[0]} is missing"
        raise _error(launcher, missing.format(culprit) if missing else
                     f"{culprit} ({count_name}={os.environ[count_name]!r})", fix)
    for name, whole in needs:
        if whole:
            _whole(name, launcher, fix)
    return Launch(launcher, process, count, coordinator)


def _own_variables() -> Launch | None:
    """``GRAPHMOD_*``: graphmod run's processes, a Kubernetes manifest's, or yours."""
    env = os.environ
    name = ("graphmod" if env.get(LAUNCHER) == "graphmod" else
            "kubernetes" if "KUBERNETES_SERVICE_HOST" in env else "environment")
    index = PROCESS_ID if PROCESS_ID in env or name != "kubernetes" else "JOB_COMPLETION_INDEX"
    named = PROCESS_ID if index == PROCESS_ID else f"{PROCESS_ID} (or an Indexed Job's {index})"
    return _member(name, NUM_PROCESSES, index, _OWN_FIX, needs=[(COORDINATOR, False)],
                   coordinator=env.get(COORDINATOR),
                   missing=(f"{NUM_PROCESSES}={env[NUM_PROCESSES]!r} is set but {named} or "
                            f"{COORDINATOR} is missing or not a number ({{}})"))


def _slurm() -> Launch | None:
    """srun's tasks (JAX derives the coordinator's port from the job id unless told one)."""
    port_known = "JAX_COORDINATOR_PORT" in os.environ or COORDINATOR in os.environ
    return _member("slurm", "SLURM_NTASKS", "SLURM_PROCID", _SLURM_FIX,
                   needs=[("SLURM_LOCALID", True), ("SLURM_STEP_NODELIST", False),
                          *([] if port_known else [("SLURM_JOB_ID", True)])],
                   coordinator=os.environ.get(COORDINATOR))


def _tpu_slice() -> Launch | None:
    """A TPU slice (or slices) on GKE, whose hosts GKE lists in the environment."""
    env, fix = os.environ, "GKE sets these for every host of a TPU slice: run on one"
    hosts = env.get("TPU_PROCESS_ADDRESSES", env.get("TPU_WORKER_HOSTNAMES", "")).split(",")
    slices = _whole("MEGASCALE_NUM_SLICES", "gketpu", fix) or 1
    slice_id = _whole("MEGASCALE_SLICE_ID", "gketpu", fix) or 0
    worker = _whole("TPU_WORKER_ID", "gketpu", fix)
    if slice_id >= slices:
        raise _error("gketpu", f"MEGASCALE_SLICE_ID={slice_id} is out of range of "
                               f"MEGASCALE_NUM_SLICES={slices}", fix)
    if worker is not None and worker >= len(hosts):
        raise _error("gketpu", f"TPU_WORKER_ID={worker} is out of range of the "
                               f"{len(hosts)} hosts TPU_WORKER_HOSTNAMES lists", fix)
    count = len(hosts) * slices
    if count == 1:
        return None
    if worker is None:
        raise _error("gketpu", f"TPU_WORKER_ID is missing ({len(hosts)} hosts listed)", fix)
    return Launch("gketpu", worker + slice_id * len(hosts), count, None)


def _from_environment() -> Launch | None:
    """The launch the environment describes (the order JAX looks in), or None."""
    env = os.environ
    if NUM_PROCESSES in env:
        return _own_variables()
    if "OMPI_MCA_orte_hnp_uri" in env:
        return _member("ompi", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", _MPI_FIX,
                       needs=[("OMPI_COMM_WORLD_LOCAL_RANK", True)],
                       coordinator=env.get(COORDINATOR))
    if "SLURM_JOB_ID" in env:
        return _slurm()
    for size, rank in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                       ("PMI_SIZE", "PMI_RANK")):
        if size in env:
            return _member("mpi", size, rank, _MPI_FIX, coordinator=env.get(COORDINATOR))
    if "TPU_PROCESS_ADDRESSES" in env or "TPU_WORKER_HOSTNAMES" in env:
        return _tpu_slice()
    return None


def _check_arguments(coordinator_address: str | None, num_processes: int | None,
                     process_id: int | None, method: str | None, source: str) -> None:
    """Refuses arguments of the wrong type or range, naming the argument."""
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
        if value is not None and (type(value) is not int or value < (name == "num_processes")):
            raise ValueError(f"graphmod.distributed.initialize: {name}={value!r} is not a "
                             f"whole number{' >= 1' if name == 'num_processes' else ''}")
    if coordinator_address is not None:
        host, _, port = str(coordinator_address).rpartition(":")
        if not isinstance(coordinator_address, str) or not host or not port.isdigit():
            raise ValueError(f"graphmod.distributed.initialize: coordinator_address="
                             f"{coordinator_address!r} is not 'host:port' (process 0's host "
                             "and a port free there)")
    if method is not None and method not in JAX_CLUSTERS:
        raise ValueError(f"graphmod.distributed.initialize: {source}={method!r} is not one of "
                         f"JAX's cluster detections ({', '.join(JAX_CLUSTERS)})")


def detect(*, coordinator_address: str | None = None, num_processes: int | None = None,
           process_id: int | None = None,
           cluster_detection_method: str | None = None) -> Launch | None:
    """The run of several processes this process belongs to, read from the environment
    (and the arguments :func:`initialize` passes on), without starting JAX; None for a
    process alone (see :mod:`graphmod.distributed` for the launchers and the order).

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator.
        num_processes: the run's number of processes.
        process_id: this process's index, from 0. Given with the two above, the launch is
            ``explicit``; alone, each completes or overrides the launcher's.
        cluster_detection_method: JAX's detection to use by name (default: the variable
            ``GRAPHMOD_CLUSTER``); JAX then reads everything itself.

    Raises:
        LaunchError: a launcher's environment is half set (the message names the variable).
        ValueError: an argument of the wrong type or range, or arguments that do not
            complete a launch (naming them).

    Examples:
        >>> import os
        >>> from graphmod.distributed import detect
        >>> detect() is None  # started alone
        True
        >>> env = dict(SLURM_JOB_ID="7", SLURM_NTASKS="2", SLURM_PROCID="1",
        ...            SLURM_LOCALID="1", SLURM_STEP_NODELIST="node[01-02]")
        >>> os.environ.update(env)
        >>> detect()
        Launch(launcher='slurm', process_id=1, num_processes=2, coordinator=None)
        >>> os.environ["SLURM_NTASKS"] = "1"  # one task (srun -n 1, an salloc shell)
        >>> os.environ["SLURM_PROCID"] = "0"
        >>> detect() is None
        True
        >>> for name in env:
        ...     del os.environ[name]
        >>> detect(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0)
        Launch(launcher='explicit', process_id=0, num_processes=2, coordinator='10.0.0.1:1234')
    """
    method = cluster_detection_method or os.environ.get(CLUSTER) or None
    _check_arguments(coordinator_address, num_processes, process_id, method,
                     "cluster_detection_method" if cluster_detection_method else CLUSTER)
    given = {"coordinator": coordinator_address, "num_processes": num_processes,
             "process_id": process_id}
    if None not in given.values():
        found: Launch | None = Launch("explicit", process_id, num_processes,
                                      coordinator_address)
    elif method is not None:
        return Launch(method, process_id, num_processes, coordinator_address)
    else:
        found = _from_environment()
        if found is None:
            passed = [name for name, value in given.items() if value is not None]
            if passed:
                raise ValueError(
                    f"graphmod.distributed.initialize: {', '.join(passed)} given, but no "
                    "launcher in the environment gives the rest: pass coordinator_address=, "
                    "num_processes= and process_id= together")
            return None
        found = dataclasses.replace(found, **{k: v for k, v in given.items() if v is not None})
    count, index = found.num_processes, found.process_id
    if count is not None and index is not None and not index < count:
        raise ValueError(f"graphmod.distributed.initialize: process_id={index} is out of "
                         f"range of num_processes={count} (ids run from 0 to {count - 1})")
    if found.launcher == "mpi" and found.coordinator is None:
        raise _error("mpi", f"{COORDINATOR} is missing, and JAX cannot find the coordinator "
                            "of this MPI launcher", "pass coordinator_address='HOST:PORT' "
                            f"(rank 0's host and a port free there) or set {COORDINATOR}")
    return None if count == 1 else found


def joined() -> Launch | None:
    """The run of several processes this process joined (by :func:`initialize` or by
    ``jax.distributed.initialize`` itself), read from JAX's state; None before it joined
    one (or where JAX was never imported). Its launcher is the one the environment names
    (``explicit`` where none does).

    Examples:
        >>> from graphmod.distributed import joined
        >>> joined() is None  # a process alone
        True
    """
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return None
    state = jax._src.distributed.global_state  # what JAX joined: no public accessor
    try:
        named = detect()
    except (LaunchError, ValueError):  # joined by arguments of its own, despite it
        named = None
    return Launch(named.launcher if named else "explicit", state.process_id,
                  state.num_processes, state.coordinator_address)


def initialize(*, coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
               cluster_detection_method: str | None = None) -> Launch | Literal[False]:
    """Joins the run of several processes this process was started in, however it was
    started (:func:`detect`); does nothing in a process started alone, or alone in its
    cluster. Call it before anything touches a device.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator (JAX's argument).
        num_processes: the run's number of processes.
        process_id: this process's index, from 0.
        local_device_ids: the local devices this process uses (JAX's argument; default:
            JAX's choice, e.g. one GPU per Slurm task).
        cluster_detection_method: JAX's cluster detection to use by name (default: the
            variable ``GRAPHMOD_CLUSTER``), where the environment cannot say.

    Returns:
        The :class:`Launch` it joined (truthy; logged in one line), the one already joined
        where JAX joined a run before, or False for a process alone.

    Raises:
        LaunchError: a launcher's environment is half set, before JAX starts.
        ValueError: an argument of the wrong type or range.

    Examples:
        >>> import graphmod as gm
        >>> gm.distributed.initialize()  # started alone: one process, nothing to join
        False
    """
    already = joined()
    if already is not None:
        return already
    launch = detect(coordinator_address=coordinator_address, num_processes=num_processes,
                    process_id=process_id, cluster_detection_method=cluster_detection_method)
    if launch is None:
        return False
    import jax  # here: the graphmod command reads this module's names and starts no JAX
    from jax._src import distributed as jax_distributed

    # Collectives between CPU processes (GPUs and TPUs bring their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=launch.coordinator, num_processes=launch.num_processes,
        process_id=launch.process_id, local_device_ids=local_device_ids,
        cluster_detection_method=launch.launcher if launch.launcher in JAX_CLUSTERS else None)
    state = jax_distributed.global_state  # what JAX found where graphmod did not
    launch = Launch(launch.launcher, state.process_id, state.num_processes,
                    state.coordinator_address)
    _log.info("joined a run of %d processes started by %s as process %d (coordinator %s)",
              launch.num_processes, launch.launcher, launch.process_id, launch.coordinator)
    return launch
