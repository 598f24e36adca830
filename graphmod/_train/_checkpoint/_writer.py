"""Writing checkpoints: asynchronous, atomic saves that prune only their own run's steps."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from graphmod._train._checkpoint._errors import (
    CheckpointError,
    failure_reason,
    log,
    settle_orbax_threads,
)
from graphmod._train._checkpoint._format import FORMAT, array_entries, leaf_specs, storable
from graphmod._train._checkpoint._reader import SET_ASIDE, TMP_SUFFIX, CheckpointReader


class Checkpointer(CheckpointReader):
    """Writes, verifies and restores the checkpoints of one directory.

    ``save`` copies the state to the host and returns; the checksums and the write happen in
    a background thread (``asynchronous=False``: before ``save`` returns). Reading is
    :class:`CheckpointReader`'s. ``keep`` prunes only the checkpoints of this writer's
    ``run_id`` (set it before the first save to continue a run). A directory is created only
    by a save. In a multi-process run every process saves (the state's parts are gathered)
    and process 0 alone writes.

    Examples:
        >>> import tempfile, jax, jax.numpy as jnp
        >>> from graphmod._train._checkpoint import Checkpointer
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=2)
        >>> state = {"w": jnp.ones(2), "rng": jax.random.key(1)}
        >>> ckpt.save(3, state, {"note": "hi"})
        >>> ckpt.wait()
        >>> restored, meta = ckpt.restore(state)
        >>> meta["note"], meta["step"], bool((restored["w"] == 1).all()), ckpt.verify(3)
        ('hi', 3, True, None)
        >>> ckpt.close()
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3,
                 asynchronous: bool = True, run_id: str | None = None) -> None:
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool)
                                 or keep < 1):
            raise ValueError(f"keep={keep!r}: must be a positive int or None (keep all)")
        super().__init__(directory)
        self.keep = keep
        self.asynchronous = asynchronous
        self.run_id = run_id or uuid.uuid4().hex
        self._own: list[int] | None = None  # this run's steps, oldest write first
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def others(self) -> list[int]:
        """The steps this writer's run did not write (unreadable ones included)."""
        return [s for s in self.steps() if self.run_of(s) != self.run_id]

    @property
    def writes(self) -> bool:
        """Whether this process writes: in a multi-process run (:mod:`graphmod.distributed`)
        only process 0 does; the others take part in gathering the state."""
        return jax.process_index() == 0

    def discard(self, steps: list[int]) -> None:
        """Deletes ``steps``' checkpoints and every leftover (see :meth:`leftovers`)."""
        self.wait()
        if not self.writes:
            return
        for name in [str(s) for s in steps] + list(self.leftovers()):
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        self._own = None

    def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
        """Starts writing ``state`` and ``meta`` for ``step``: copies the arrays to the host
        and returns (the previous write is waited for first, and its error raised)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r}: a checkpoint's step must be an int >= 0")
        tree = leaf_specs(state)
        arrays = storable(state)  # in every process: a split state is gathered from all
        if not self.writes:
            return
        self.wait()
        record = {**meta, "format": FORMAT, "run_id": self.run_id, "step": step, "tree": tree}
        if not self.asynchronous:
            self._write(step, list(tree), arrays, record)
            return

        def work() -> None:
            try:
                self._write(step, list(tree), arrays, record)
            except BaseException as error:  # raised by the next wait()
                self._failure = error

        self._thread = threading.Thread(target=work, name=f"graphmod-checkpoint-{step}",
                                        daemon=True)  # a second Ctrl-C must not wait for it
        self._thread.start()

    def _write(self, step: int, paths: list[str], arrays: list[np.ndarray],
               record: dict[str, Any]) -> None:
        """Checksums, writes and prunes (in the writer thread when asynchronous)."""
        record["arrays"] = array_entries(paths, arrays)
        own = self._owned()
        target = self._path(step)
        if os.path.exists(target):
            self._make_room(step, own)
        ocp = self._ocp
        items = {"meta": ocp.args.JsonSave(record)}
        stored = [a for a in arrays if a.size]  # orbax writes no empty array: meta has them
        if stored:
            items["state"] = ocp.args.StandardSave(stored)
        before = set(threading.enumerate())
        try:
            os.makedirs(self.directory, exist_ok=True)
            with self._lock:
                self._orbax.save(target, args=ocp.args.Composite(**items))
        except Exception as error:
            self._write_failed(step, own, before, error)
        own.append(step)
        while self.keep is not None and len(own) > self.keep:
            shutil.rmtree(self._path(own.pop(0)), ignore_errors=True)

    def _write_failed(self, step: int, own: list[int], before: set[threading.Thread],
                      error: Exception) -> None:
        """Cleans up after a failed write of ``step`` and raises a CheckpointError saying
        why and which checkpoint of this run is intact."""
        target = self._path(step)
        log.debug("writing %s failed", target, exc_info=error)
        settle_orbax_threads(before)  # orbax's threads of this write may still be writing
        for name in self._names():
            if name.startswith(f"{step}{TMP_SUFFIX}"):  # this write's own leftover
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        older = [s for s in own if s != step]
        intact = f"the checkpoint of step {older[-1]} is intact" if older else \
            "no earlier checkpoint of this run exists"
        reason = failure_reason(error)
        fix = "free space, then resume" if reason.startswith("disk full") else \
            "see the 'graphmod.checkpoint' debug log for orbax's traceback"
        raise CheckpointError(target, f"could not write the checkpoint of step {step}: "
                              f"{reason}; {intact}", fix) from None

    def _make_room(self, step: int, own: list[int]) -> None:
        """Clears the way for a new write of ``step``: this run's own older write is
        replaced; a checkpoint that fails verification (a resumed run skipped it) is set
        aside as ``<step>.unverified``; another run's checkpoint is never touched."""
        target = self._path(step)
        if step in own:
            shutil.rmtree(target)
            own.remove(step)
            return
        why = self.verify(step)
        if why is None:
            raise CheckpointError(
                target, "holds a checkpoint another run wrote",
                "write to another directory, or move it away (nothing was overwritten)")
        aside, count = target + SET_ASIDE, 1
        while os.path.exists(aside):
            count += 1
            aside = f"{target}{SET_ASIDE}-{count}"
        os.rename(target, aside)
        log.warning("%s fails verification (%s): set aside as %s", target, why, aside)

    def _owned(self) -> list[int]:
        """This run's steps in the directory, oldest write first (read once per writer)."""
        if self._own is None:
            self._own = [s for s in self.steps() if self.run_of(s) == self.run_id]
        return self._own

    def wait(self) -> None:
        """Blocks until the started write is on disk; raises its error (a CheckpointError
        naming the path and the reason) if it failed."""
        if self._thread is not None:
            self._thread.join()  # a Ctrl-C here leaves the thread to finish on its own
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Waits for the started write (raising its error), then releases orbax."""
        try:
            self.wait()
        finally:
            super().close()
