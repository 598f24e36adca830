"""``multiprocess_run.py``'s run in a process a cluster launcher started, for
``tests/distributed/test_launchers.py``: ``LAUNCHER_RUN_JOIN`` says how it joins the run,
``jax`` (the user's own ``jax.distributed.initialize()``, which reads Slurm's variables),
``graphmod`` (``graphmod.distributed.initialize()``, the default) or ``explicit``
(``initialize(coordinator_address=, num_processes=, process_id=)`` with the values of
``LAUNCHER_RUN_COORDINATOR``, ``LAUNCHER_RUN_PROCESSES`` and ``LAUNCHER_RUN_ID``, as a
launcher of your own passes them). Arguments: ``OUT [DIR [SECONDS]]``: process 0 writes the
final variables to ``OUT`` (``.npz``), each process first writes the
``graphmod.distributed.Launch`` it joined to ``OUT.joined-<process index>`` (JSON); with
DIR the run checkpoints there every epoch and resumes from it; with SECONDS it pauses that
long after each step, so that a test can stop it."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

import graphmod as gm

if __name__ == "__main__":
    how = os.environ.get("LAUNCHER_RUN_JOIN", "graphmod")
    if how == "jax":
        import jax

        jax.distributed.initialize()
    given = {} if how != "explicit" else {
        "coordinator_address": os.environ["LAUNCHER_RUN_COORDINATOR"],
        "num_processes": int(os.environ["LAUNCHER_RUN_PROCESSES"]),
        "process_id": int(os.environ["LAUNCHER_RUN_ID"])}
    launch = gm.distributed.initialize(**given)  # after jax's own: the run it joined

import jax
import numpy as np

from tests.distributed.multiprocess_run import flat, train

if __name__ == "__main__":
    out, *rest = sys.argv[1:]
    pathlib.Path(f"{out}.joined-{jax.process_index()}").write_text(
        json.dumps(dataclasses.asdict(launch)))
    variables = train(rest[0] if rest else None, pause=float(rest[1]) if len(rest) > 1 else 0)
    if jax.process_index() == 0:
        np.savez(out, **flat(variables))
