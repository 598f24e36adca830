"""``Checkpoint``: saves the run (asynchronously, atomically, verified, keeping its latest N)."""

from __future__ import annotations

import logging
import os
import shlex
import sys

import jax

from graphmod._core._number_checks import is_whole_number
from graphmod._train._checkpoint import Checkpointer, CheckpointError
from graphmod._train._checkpoint._lock import RunLock, run_lock
from graphmod._train._command import RESUME_VARIABLE
from graphmod._train._events import Event, On, Template
from graphmod._train._loop._models import Models, run_inputs, run_provenance
from graphmod._train._loop._resume import check_models, newest_meta
from graphmod._train._optimize import TrainStep
from graphmod._train._plugin import Plugin
from graphmod.typing import JSON, LoopLike

_log = logging.getLogger("graphmod.checkpoint")


class Checkpoint(Plugin):
    """Saves the train state and everything the loop needs to continue exactly.

    A checkpoint holds the variables, optimizer state, RNG, loop counters and timelines,
    data position, every plugin's ``state_dict()``, a checksum of every array, the run's id
    and, when the step is a :func:`graphmod.optimize` step, the run's provenance record (read
    it back with ``graphmod.provenance.read(directory)``; ``graphmod inspect DIR`` prints it
    and verifies each checkpoint). Writes are asynchronous (the arrays are copied to the host
    first, since the next step donates them) and atomic (orbax renames a finished write
    into place); the latest ``keep`` of this run are kept. By default it saves at the end
    of every epoch and of the run (``every=On("epoch_end") | On("end")``), so the last step
    of a run stopped by ``steps=`` or a ``terminate`` is saved too.

    A run never deletes or overwrites checkpoints it did not write: a new run whose
    ``directory`` holds another run's checkpoints stops before its first step, unless
    ``resume=True`` (continue that run from its newest checkpoint that verifies, skipping
    corrupted ones with a warning; ``graphmod resume DIR`` sets this too) or
    ``overwrite=True`` (delete that run's checkpoints that verify first, setting aside as
    ``<step>.unverified`` those that do not; leftovers and other files stay). Checkpoints
    are recognised by the marker graphmod writes into each, never by a folder's name: a run
    whose ``directory`` holds anything else named like one (a numbered folder, ``00095``,
    a link) stops at setup naming it, and never touches it. From setup to teardown the run
    holds the directory's lock (``graphmod.lock``): a second run writing into it stops at
    its setup, naming the first one's process and host. A run stopped by Ctrl-C or an
    error saves its last finished step (``on_interrupt``) and prints one line saying how to
    continue (in a run of several processes, where every process takes part in a save,
    Ctrl-C only: an error stops one process); stopped before any of its steps finished (an
    error in the first step's trace), it saves nothing, so the same run can start again in
    ``directory``.

    Examples:
        >>> import tempfile, graphmod as gm
        >>> from graphmod.plugins import Checkpoint
        >>> ckpt = Checkpoint(tempfile.mkdtemp(), every=gm.On("epoch_end"), keep=2)
        >>> ckpt.name
        'checkpoint'
    """

    def __init__(self, directory: str | os.PathLike, *, every: Template | None = None,
                 keep: int | None = 3, resume: bool = False, overwrite: bool = False,
                 on_interrupt: bool = True, asynchronous: bool = True,
                 name: str = "checkpoint") -> None:
        # By default at every epoch's end and at the run's (the last step of a run that
        # stops on steps= or a terminate is saved too; one save per step).
        super().__init__(name=name, every=every if every is not None
                         else On("epoch_end") | On("end"))
        self.directory = os.path.abspath(os.fspath(directory))
        if keep is not None and not is_whole_number(keep, least=1):
            raise ValueError(f"Checkpoint(keep={keep!r}): must be a positive int or None")
        if resume and overwrite:
            raise ValueError("Checkpoint(resume=True, overwrite=True): pick one; resume "
                             "continues the run saved in the directory, overwrite deletes "
                             "its checkpoints and starts anew")
        self.keep = keep
        self.resume = resume
        self.overwrite = overwrite
        self.save_on_interrupt = on_interrupt
        self.asynchronous = asynchronous
        self._writer: Checkpointer | None = None
        self._lock: RunLock | None = None  # held from setup to teardown
        self._run_id: str | None = None  # made by the first setup, or a resumed run's
        self._saved_step: int | None = None
        self._saved_epoch: int | None = None  # a step is saved again once its epoch ended
        self._first_step: int | None = None  # the step this run started from
        self._inputs: dict[str, object] | None = None  # the run's provenance inputs (first save)
        self.due: Event | None = None  # the event to save at, once it has settled

    def _wants_resume(self) -> bool:
        forced = os.environ.get(RESUME_VARIABLE)
        return self.resume or (forced is not None and os.path.abspath(forced) == self.directory)

    def setup(self, loop: LoopLike) -> None:
        # The directory is this run's to write until teardown: locked before anything is
        # read or written (in a run of several processes, by process 0 for all of them).
        self._lock = run_lock(self.directory)
        try:
            self._open(loop)
        except BaseException:
            self._close()
            raise
        self._first_step = loop.time.step  # a stop before any step of this run saves nothing

    def _open(self, loop: LoopLike) -> None:
        # A new run (no run id yet) must not meet another run's checkpoints; a run that
        # goes on keeps its id, so keep=N prunes only what it wrote.
        writer = Checkpointer(self.directory, keep=self.keep, asynchronous=self.asynchronous,
                              run_id=self._run_id)
        self._writer = writer
        foreign = writer.foreign()
        if foreign:
            raise CheckpointError(
                self.directory,
                f"Checkpoint {self.name!r}: the directory holds what graphmod did not write, "
                "named like its checkpoints: " + "; ".join(f"{name} ({why})" for name, why
                                                         in foreign.items())
                + "; a run would mix with it (nothing was read, moved or deleted)",
                "move those out of the directory, or write to another directory")
        if self._wants_resume() and writer.steps():
            check_models(newest_meta(writer), loop.step, f"Checkpoint {self.name!r}")
            state, meta = writer.restore(loop.state, loop=True)  # the newest that verifies
            loop.state = state
            loop.load_state_dict(meta)
            # The same run goes on (a graphmod 0.1 checkpoint has no id: a new one starts).
            run_id = meta.get("run_id")
            writer.run_id = self._run_id = run_id if isinstance(run_id, str) and run_id \
                else writer.run_id
            self._saved_step, self._saved_epoch = loop.time.step, loop.time.epoch
            return
        if self._run_id is not None:
            return  # the run goes on (Loop.resume, or this plugin's loop run again)
        self._run_id = writer.run_id
        others = writer.others()
        if others and self.overwrite:
            deleted, aside = writer.discard(others)
            _log.warning("Checkpoint(%s, overwrite=True): deleted the checkpoints of steps %s"
                         "%s", self.directory, deleted, f" and set aside {aside}, which fail "
                         "verification" if aside else "")
        elif others:
            raise CheckpointError(
                self.directory,
                f"Checkpoint {self.name!r}: the directory holds checkpoints this run did not "
                f"write (steps {', '.join(map(str, others))}); a new run would mix with them "
                "and prune them",
                "continue that run with Checkpoint(..., resume=True), write to a new "
                "directory, or pass Checkpoint(..., overwrite=True) to delete them first")

    def __call__(self, event: Event) -> None:
        # Saved once the event and every event it set off were delivered (the loop calls
        # settle): what a Validation then an EarlyStopping record at an epoch's end is in.
        self.due = event

    def settle(self, event: Event) -> None:
        """Saves at the ``due`` event, now delivered with all it set off."""
        self.due = None
        self.save(event)

    def on_interrupt(self, event: Event) -> None:
        """Saves the last finished step, waits for the write, and prints one line (to
        standard error) saying what was saved and how to continue."""
        loop = event.loop
        if not self.save_on_interrupt or loop.state is None or self._writer is None:
            return  # nothing to save, or not set up (its setup refused the directory)
        error = event.data.get("error")
        interrupted = error is None or isinstance(error, KeyboardInterrupt)
        cause = "interrupted" if interrupted else f"stopped by {type(error).__name__}"
        step, where = loop.time.step, shlex.quote(self.directory)
        if step == self._first_step and self._saved_step != step:
            # The state is the one the run started from: saving it would only leave a
            # checkpoint that a new run in this directory must first be told to replace.
            again = (f"continue with: graphmod resume {where}" if self._writer.steps()
                     else "run it again from the start")
            print(f"graphmod: {cause} at step {step}, before this run finished a step: "
                  f"nothing to save; {again}", file=sys.stderr)
            return
        if not interrupted and jax.process_count() > 1:
            # Every process takes part in a save; an error stopped this one alone.
            print(f"graphmod: {cause} at step {step} in process {jax.process_index()}; not "
                  "saved (a run of several processes saves at Ctrl-C, which stops them "
                  f"all); continue from the last checkpoint with: graphmod resume {where}",
                  file=sys.stderr)
            return
        try:
            if interrupted and step != self._first_step:  # saved again if it was just
                self._saved_step = None  # saved: the record says how the run stopped
            self.save(event)
            self.wait()
        except CheckpointError as failure:
            print(f"graphmod: {cause} at step {step}; the save failed: {failure}",
                  file=sys.stderr)
            raise
        if jax.process_index() == 0:  # one line for a run of several processes
            print(f"graphmod: {cause} - saved step {step} to {self.directory}; continue "
                  f"with: graphmod resume {where} (or graphmod.Loop.resume from Python)",
                  file=sys.stderr)

    def save(self, event: Event) -> None:
        """Saves the loop's current state now: once per step, and again at the end of the
        epoch a step ended (a step event's save, then the run's end: the record of the
        finished epoch, with what its end's plugins kept)."""
        loop = event.loop
        if loop.state is None or (self._saved_step, self._saved_epoch) == (
                loop.time.step, loop.time.epoch):
            return
        if self._writer is None:
            raise RuntimeError(f"Checkpoint {self.name!r}: save() runs only while its loop "
                               "runs (after setup)")
        self._writer.save(loop.time.step, loop.state, {**loop.state_dict(),
                                                       **self._provenance(loop)})
        self._saved_step, self._saved_epoch = loop.time.step, loop.time.epoch

    def _provenance(self, loop: LoopLike) -> dict[str, JSON]:
        """``{"provenance": record}`` for a graphmod.optimize step or several models (inputs
        kept from the first save: the data are hashed once); a failure is noted, never
        raised."""
        if not isinstance(loop.step, TrainStep | Models):
            return {}
        try:
            if self._inputs is None:
                self._inputs = run_inputs(loop)
            record = run_provenance(loop, self._inputs)
        except Exception as error:  # a checkpoint matters more than its record
            return {"provenance_error": f"{type(error).__name__}: {error}"}
        return {"provenance": record.to_dict()}

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        if self._writer is not None:
            self._writer.wait()

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        try:
            self._close()
        except CheckpointError as failure:
            raise CheckpointError(failure.path, f"Checkpoint {self.name!r} could not finish "
                                  f"its last save: {failure.reason}", failure.fix) from None

    def _close(self) -> None:
        """Finishes the last write (raising its error), closes the writer, and lets go of
        the directory's lock whatever happens."""
        writer, self._writer = self._writer, None
        lock, self._lock = self._lock, None
        self._inputs = None
        try:
            if writer is not None:
                writer.close()  # the last write completes (or raises) before the run ends
        finally:
            if lock is not None:
                lock.release()

    def state_dict(self) -> dict[str, JSON]:
        return {"directory": self.directory, "run_id": self._run_id}

    def load_state_dict(self, state: dict[str, JSON]) -> None:
        # Loop.resume restores this before setup: the resumed run keeps its run id.
        run_id = state.get("run_id")
        self._run_id = run_id if isinstance(run_id, str) else None
