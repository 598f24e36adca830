"""Several processes, one program: ``jax.distributed`` for runs started with
``graphmod run --processes N SCRIPT``.

``graphmod run --processes N [--devices-per-process D] SCRIPT ARGS...`` starts N copies of
SCRIPT on this machine, each told its place in the run through the environment
(``GRAPHMOD_PROCESS_ID``, ``GRAPHMOD_NUM_PROCESSES`` and JAX's ``JAX_COORDINATOR_ADDRESS``,
a loopback port). The script calls :func:`initialize` before it uses JAX; each process then
holds its own devices of one global mesh (``jax.make_mesh`` over ``jax.devices()``), and a
program compiled with ``mesh=`` runs on all of them: every process runs the same code on
the same batches (each puts its own shard on its devices), and the results are those of
one process holding every device, to float rounding (the collectives differ).

Examples:
    >>> import graphmod as gm
    >>> gm.distributed.initialize()  # started alone (python SCRIPT): nothing to join
    False

Sharp edges
    :func:`initialize` must run before anything touches a device (JAX starts its backend
    once). On CPU the processes exchange data through Gloo. A ``Checkpoint`` saves in
    every process: each writes the pieces of the state its devices hold (nothing is
    gathered), and process 0 puts the checkpoint together once every piece is written; so
    every process must save at the same step: schedule saves on the ``step`` or ``epoch``
    timelines, not on wall-clock ``seconds``. A Ctrl-C (or a SIGTERM, as a cluster
    scheduler sends before preempting, or a signal opted in with ``GRAPHMOD_STOP_SIGNALS``)
    to any process, or to ``graphmod run``, which passes it on to every process as SIGTERM,
    stops every process of a ``graphmod.Loop`` at one step they agree on through JAX's
    preemption sync, and a ``Checkpoint`` saves it; ``graphmod run`` then exits with 128 +
    the signal (130 for Ctrl-C, 143 for SIGTERM), each process with 130. A second signal to
    ``graphmod run`` kills the processes at once. If ``graphmod run`` itself is killed, its
    processes notice within a second, stop the same way and end (without a save if they
    still run 60 s later). A process stopped by an error saves nothing (the others could
    not join) and ends at once; ``graphmod run`` then stops the others. Every process
    reads a checkpoint to resume, onto any mesh (and any number of processes).
    ``graphmod resume DIR`` starts the run's processes again (as many, with as many
    devices each, as its checkpoint records).
"""

from __future__ import annotations

import os

__all__ = ["initialize"]

PROCESS_ID = "GRAPHMOD_PROCESS_ID"
NUM_PROCESSES = "GRAPHMOD_NUM_PROCESSES"
COORDINATOR = "JAX_COORDINATOR_ADDRESS"
LAUNCHER_PID = "GRAPHMOD_LAUNCHER_PID"  # each process ends if this pid is no longer its parent
# XLA's flag giving a CPU process its virtual devices (graphmod run --devices-per-process).
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def initialize() -> bool:
    """Joins the multi-process run this process was started in by ``graphmod run
    --processes N``; does nothing in a process started alone. Returns whether it joined.

    Examples:
        >>> import graphmod as gm
        >>> gm.distributed.initialize()  # started alone: one process, nothing to join
        False
    """
    count = os.environ.get(NUM_PROCESSES)
    if count is None:
        return False
    try:
        process_id, count_value = int(os.environ[PROCESS_ID]), int(count)
        coordinator = os.environ[COORDINATOR]
    except (KeyError, ValueError) as error:
        raise RuntimeError(f"graphmod.distributed.initialize: {NUM_PROCESSES}={count!r} is "
                           f"set but {PROCESS_ID} or {COORDINATOR} is missing or not a "
                           f"number ({error}); start the script with 'graphmod run "
                           "--processes N SCRIPT', which sets all three") from None
    import jax  # here: the graphmod command reads this module's names and starts no JAX

    # Collectives between CPU processes (GPUs and TPUs bring their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=count_value,
                               process_id=process_id)
    return True
