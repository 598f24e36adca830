"""The Weights & Biases backend of ``Logger`` (``Logger(..., wandb=True)``).

One W&B run per logger run: opened at its first row (``wandb.init``, the run's
provenance record as its config under ``"provenance"``, files under the log's directory),
fed the rows the logger writes (``run.log(..., step=row["step"])``), given the run's final
provenance and, with ``log_checkpoints=True``, this run's checkpoints (those a
``Checkpoint`` of the loop kept) as versions of one ``model`` artifact, then finished at
teardown. Its id is in the logger's state, so a run resumed from a checkpoint continues the
same W&B run (``resume="allow"``); W&B keeps the rows it had, and drops re-logged steps
below its latest. ``wandb`` is imported when the first run opens: ``WANDB_MODE=offline``
(or ``wandb={"mode": "offline"}``) writes everything to disk, for ``wandb sync`` later.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

from graphmod._train._checkpoint import CheckpointReader
from graphmod._train._loop._models import run_inputs, run_provenance
from graphmod.plugins._checkpoint import Checkpoint
from graphmod.plugins._common import registered
from graphmod.typing import JSON, LoopLike

if TYPE_CHECKING:  # wandb is optional: imported when a run opens
    from wandb import Run

LogRow: TypeAlias = Mapping[str, float | str]
"""A logged row: the event's type, its time on every timeline, its scalar metrics."""

# wandb.init's arguments Logger sets itself.
_OWN = {"config": "the run's provenance goes there (config['provenance'])",
        "id": "the W&B run's id is kept in the logger's state (its checkpoints)",
        "resume": "a resumed run continues its W&B run by the id in the checkpoint"}


class WandbRun:
    """A logger's W&B side: ``settings`` are ``wandb.init`` keyword arguments."""

    def __init__(self, settings: Mapping[str, Any],  # wandb.init's, passed on as they are
                 log_checkpoints: bool) -> None:
        if importlib.util.find_spec("wandb") is None:
            raise ImportError("Logger(wandb=...) needs the wandb package: pip install "
                              "'graphmod[wandb]' (or pip install wandb), or leave wandb off")
        for key in settings:
            if key in _OWN:
                raise ValueError(f"Logger(wandb={{{key!r}: ...}}): set by the Logger: "
                                 f"{_OWN[key]}; leave it out")
        self.settings = dict(settings)
        self.log_checkpoints = bool(log_checkpoints)
        self.id: str | None = None  # the W&B run's, kept in the logger's state
        self._run: Run | None = None
        self._where: tuple[str, LoopLike] | None = None  # the directory and loop of a run
        self._logged: set[str] = set()  # checkpoint folders already given as artifacts
        self._inputs: dict[str, object] | None = None  # the run's provenance inputs (hashed once)

    def start(self, directory: str, loop: LoopLike) -> None:
        """Makes ready to open the run in ``directory`` at the first row: after every
        plugin's setup, so a run a ``Checkpoint`` resumes knows its W&B id by then."""
        self._where = (directory, loop)

    def _open(self) -> Run:
        import wandb

        assert self._where is not None, "start() comes first (the logger's setup)"
        directory, loop = self._where
        os.makedirs(directory, exist_ok=True)
        settings = {"dir": directory, **self.settings}
        run = wandb.init(config={"provenance": self._provenance(loop)}, id=self.id,
                         resume="allow", **settings)
        self._run, self.id = run, run.id
        return run

    def log(self, row: LogRow) -> None:
        run = self._run if self._run is not None else self._open()
        run.log({k: v for k, v in row.items() if k not in ("event", "step")},
                step=int(row["step"]))

    def close(self, loop: LoopLike) -> None:
        """Records the final provenance (and the checkpoints) and finishes the run."""
        run, self._run, self._where = self._run, None, None
        if run is None:
            return
        try:
            run.config.update({"provenance": self._provenance(loop)}, allow_val_change=True)
            if self.log_checkpoints:
                self._artifacts(run, loop)
        finally:
            run.finish()

    def _provenance(self, loop: LoopLike) -> dict[str, JSON]:
        """The run's provenance record as a dict; for a step not made by graphmod.optimize
        (no record), what says so: the metrics matter more than their record."""
        try:
            if self._inputs is None:
                self._inputs = run_inputs(loop)
            return run_provenance(loop, self._inputs).to_dict()
        except TypeError as error:
            return {"unrecorded": str(error)}

    def _artifacts(self, run: Run, loop: LoopLike) -> None:
        """This run's kept checkpoints, oldest first, each a version of ``<run>-checkpoint``
        aliased ``step-N`` (the newest also ``latest``, as W&B aliases a new version)."""
        import wandb

        for plugin in registered(loop):
            if not isinstance(plugin, Checkpoint):
                continue
            plugin.wait()  # the last save is on disk
            run_id = plugin.state_dict()["run_id"]
            reader = CheckpointReader(plugin.directory)
            try:
                steps = [s for s in reader.steps() if reader.run_of(s) == run_id]
            finally:
                reader.close()
            for step in steps:
                folder = os.path.join(plugin.directory, str(step))
                if folder in self._logged:
                    continue
                artifact = wandb.Artifact(f"{run.id}-{plugin.name}", type="model",
                                          metadata={"step": step, "graphmod_run": run_id})
                artifact.add_dir(folder)
                run.log_artifact(artifact, aliases=[f"step-{step}"])
                self._logged.add(folder)
