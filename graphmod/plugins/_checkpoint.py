"""``Checkpoint``: saves the run (asynchronously, atomically, keeping the latest N)."""

from __future__ import annotations

import os
from typing import Any

from graphmod._checkpoint import Checkpointer
from graphmod._events import Event, On, Template
from graphmod._plugin import Plugin

RESUME_VARIABLE = "GRAPHMOD_RESUME"


class Checkpoint(Plugin):
    """Saves the train state and everything the loop needs to continue exactly.

    A checkpoint holds the variables, optimizer state, RNG, loop counters and timelines,
    data position, every plugin's ``state_dict()`` and, when the step is a
    :func:`graphmod.optimize` step, the run's provenance record (read it back with
    ``graphmod.provenance.read(directory)``; ``graphmod inspect DIR`` prints it). Writes
    are asynchronous (the arrays are copied to the host first, since the next step donates
    them) and atomic (orbax renames a finished write into place); the latest ``keep`` are
    kept. The run is also saved when it stops on an error or a KeyboardInterrupt. With
    ``resume=True`` (or when ``graphmod resume DIR`` runs the script) a run continues from
    the latest checkpoint in ``directory`` if there is one.

    Examples:
        >>> import tempfile, graphmod as gm
        >>> from graphmod.plugins import Checkpoint
        >>> ckpt = Checkpoint(tempfile.mkdtemp(), every=gm.On("epoch_end"), keep=2)
        >>> ckpt.name
        'checkpoint'
    """

    def __init__(self, directory: str | os.PathLike, *, every: Template | None = None,
                 keep: int | None = 3, resume: bool = False, on_interrupt: bool = True,
                 asynchronous: bool = True, name: str = "checkpoint") -> None:
        super().__init__(name=name, every=every if every is not None else On("epoch_end"))
        self.directory = os.path.abspath(os.fspath(directory))
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Checkpoint(keep={keep!r}): must be a positive int or None")
        self.keep = keep
        self.resume = resume
        self.save_on_interrupt = on_interrupt
        self.asynchronous = asynchronous
        self._writer: Checkpointer | None = None
        self._saved_step: int | None = None
        self._inputs: Any = None  # the run's provenance inputs, assembled at the first save

    def _wants_resume(self) -> bool:
        forced = os.environ.get(RESUME_VARIABLE)
        return self.resume or (forced is not None and os.path.abspath(forced) == self.directory)

    def _open(self) -> Checkpointer:
        # Opened on first use: a run that never saves pays nothing for orbax.
        if self._writer is None:
            self._writer = Checkpointer(self.directory, keep=self.keep,
                                        asynchronous=self.asynchronous)
        return self._writer

    def setup(self, loop: Any) -> None:
        if self._wants_resume() and self._open().latest() is not None:
            assert self._writer is not None
            state, meta = self._writer.restore(loop.state)
            loop.state = state
            loop.load_state_dict(meta)
            self._saved_step = loop.time.step

    def __call__(self, event: Event) -> None:
        self.save(event)

    def on_interrupt(self, event: Event) -> None:
        if self.save_on_interrupt:
            self.save(event)
            self.wait()

    def save(self, event: Event) -> None:
        """Saves the loop's current state now (once per step)."""
        loop = event.loop
        if loop.state is None or self._saved_step == loop.time.step:
            return
        self._open().save(loop.time.step, loop.state, {**loop.state_dict(),
                                                       **self._provenance(loop)})
        self._saved_step = loop.time.step

    def _provenance(self, loop: Any) -> dict[str, Any]:
        """``{"provenance": record}`` for a graphmod.optimize step (inputs kept from the
        first save: the data are hashed once); a failure is noted, never raised."""
        from graphmod._optimize import TrainStep
        from graphmod.provenance._collect import training_inputs, training_provenance

        if not isinstance(loop.step, TrainStep):
            return {}
        try:
            if self._inputs is None:
                self._inputs = training_inputs(loop.step, loop)
            record = training_provenance(loop.step, loop, self._inputs)
        except Exception as error:  # a checkpoint matters more than its record
            return {"provenance_error": f"{type(error).__name__}: {error}"}
        return {"provenance": record.to_dict()}

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        if self._writer is not None:
            self._writer.wait()

    def teardown(self, loop: Any, error: BaseException | None) -> None:
        if self._writer is not None:
            self._writer.wait()
            self._writer.close()
            self._writer = None
        self._inputs = None

    def state_dict(self) -> dict[str, Any]:
        return {"directory": self.directory}
