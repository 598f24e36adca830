"""Writing checkpoints: asynchronous, atomic saves that prune only their own run's steps."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.experimental import multihost_utils

from graphmod._core._number_checks import is_whole_number
from graphmod._train._checkpoint._errors import (
    CheckpointError,
    failure_reason,
    log,
    settle_orbax_threads,
)
from graphmod._train._checkpoint._format import (
    CHUNKED_FORMAT,
    FORMAT,
    MARKER,
    Chunk,
    array_entries,
    checksums,
    is_run_id,
    leaf_specs,
    marker_record,
    owned_chunks,
    storable,
    stored_specs,
)
from graphmod._train._checkpoint._parts import read_part, write_part
from graphmod._train._checkpoint._reader import (
    PART_SUFFIX,
    SET_ASIDE,
    TMP_SUFFIX,
    CheckpointReader,
)
from graphmod.typing import JSON, PyTree

if TYPE_CHECKING:
    from orbax.checkpoint import args as ocp_args

PART_TIMEOUT_S = 1800  # how long process 0 waits for the others' parts of a checkpoint
RUN_ID_BYTES = 256  # the longest run id a run of several processes agrees on


class Checkpointer(CheckpointReader):
    """Writes, verifies and restores the checkpoints of one directory.

    ``save`` copies the state to the host and returns; the checksums and the write happen in
    a background thread (``asynchronous=False``: before ``save`` returns). Reading is
    :class:`CheckpointReader`'s. ``keep`` prunes only the checkpoints of this writer's
    ``run_id`` (set it before the first save to continue a run). A directory is created only
    by a save. In a run of several processes every process saves at the same step and
    writes the pieces of the state its devices hold (its part); process 0, once every part
    is written, writes the meta record, puts the parts beside it and renames the whole to
    ``<step>`` (see :mod:`graphmod._train._checkpoint`). No process gathers the state.

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
        if keep is not None and not is_whole_number(keep, least=1):
            raise ValueError(f"keep={keep!r}: must be a positive int or None (keep all)")
        if run_id is not None and not is_run_id(run_id):
            raise ValueError(f"run_id={run_id!r}: a run id is 1 to 256 letters, digits, '_' "
                             "or '-' (it names the run's files)")
        super().__init__(directory)
        self.keep = keep
        self.asynchronous = asynchronous
        self.run_id = run_id or uuid.uuid4().hex
        self._own: list[int] | None = None  # this run's steps, oldest write first
        self._fresh: set[int] = set()  # the steps this writer wrote (verified as written)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._saves = 0  # saves started in a run of several processes: names their barrier

    def others(self) -> list[int]:
        """The steps whose checkpoints another run wrote (verified or not)."""
        return [s for s in self.steps() if self.run_of(s) != self.run_id]

    @property
    def writes(self) -> bool:
        """Whether this process writes checkpoints whole and deletes them: in a run of
        several processes (:mod:`graphmod.distributed`) only process 0 does; the others
        write their parts of each checkpoint."""
        return jax.process_index() == 0

    def discard(self, steps: list[int]) -> tuple[list[int], list[str]]:
        """Deletes those of ``steps``' checkpoints (another run's) that verify, sets the
        others aside as ``<step>.unverified``, and returns ``(steps deleted, names set
        aside)``; nothing else is touched (leftovers and what graphmod did not write stay)."""
        self.wait()
        deleted: list[int] = []
        aside: list[str] = []
        if not self.writes:
            return deleted, aside
        for step in steps:
            if self._examine(str(step))[0] is not None:
                continue  # not graphmod's (any more): left alone
            why = self.verify(step)
            if why is None:
                shutil.rmtree(self._path(step))
                deleted.append(step)
            else:
                aside.append(self._set_aside(step, why))
        self._own = None
        return deleted, aside

    def save(self, step: int, state: PyTree, meta: Mapping[str, JSON]) -> None:
        """Starts writing ``state`` and ``meta`` for ``step``: copies the arrays to the host
        and returns (the previous write is waited for first, and its error raised). In a
        run of several processes every process must call it, at the same step."""
        if not is_whole_number(step, least=0):
            raise ValueError(f"step={step!r}: a checkpoint's step must be an int >= 0")
        tree = leaf_specs(state)
        self.wait()  # a failure raised here leaves the count of saves (below) unchanged
        if jax.process_count() > 1 and not self._saves:
            self.run_id = _agreed(self.run_id)  # process 0's: each process made its own
        record: dict[str, JSON] = {**meta, "format": FORMAT, "run_id": self.run_id,
                                   "step": step, "tree": tree}
        if jax.process_count() > 1:
            chunks = owned_chunks(state)  # this process's pieces, copied before it goes on
            record.update(format=CHUNKED_FORMAT, parts=jax.process_count())
            self._saves += 1  # the same count in every process: it names the barrier
            self._start(step, functools.partial(
                self._write_part, step, list(tree), stored_specs(state), chunks, record,
                f"graphmod-checkpoint-{self.run_id}-{self._saves}"))
            return
        arrays = storable(state)
        self._start(step, functools.partial(self._write, step, list(tree), arrays, record))

    def _start(self, step: int, write: Callable[[], None]) -> None:
        """Runs ``write`` (:meth:`save` waited for the previous write): in a thread when
        asynchronous (its error raised by the next :meth:`wait`), else now."""
        if not self.asynchronous:
            write()
            return

        def work() -> None:
            try:
                write()
            except BaseException as error:  # raised by the next wait()
                self._failure = error

        self._thread = threading.Thread(target=work, name=f"graphmod-checkpoint-{step}",
                                        daemon=True)  # a second Ctrl-C must not wait for it
        self._thread.start()

    def _write(self, step: int, paths: list[str], arrays: list[np.ndarray],
               record: dict[str, JSON]) -> None:
        """Checksums, writes and prunes (in the writer thread when asynchronous)."""
        record["arrays"] = array_entries(paths, arrays)
        own = self._owned()
        if os.path.lexists(self._path(step)) and step not in own:
            self._make_room(step, own)  # before writing: nothing is written in vain
        before = set(threading.enumerate())
        staged = self._staged(step)
        try:
            self._remove_leftovers(step)  # of a cut-off attempt of this run's
            self._orbax_save(staged, record, arrays)
            self._place(staged, step, own)
        except CheckpointError:
            self._remove_leftovers(step)
            raise
        except Exception as error:
            self._write_failed(step, own, before, error)
        self._written(step, own)

    def _staged(self, step: int, suffix: str = "") -> str:
        """Where this run writes ``step``'s checkpoint before it is put in place (a leftover
        by its name if the run is cut off)."""
        return f"{self._path(step)}{TMP_SUFFIX}-{self.run_id}{suffix}"

    def _place(self, written: str, step: int, own: list[int]) -> None:
        """Marks the complete checkpoint ``written`` as this run's of ``step`` (its last
        file) and renames it to ``<step>``: in place of this run's earlier checkpoint of
        that step if it verifies (one this writer wrote does: a step saved again, once the
        run ended on it), which stays whole until the new one is, two renames apart; else
        clearing the way (:meth:`_make_room`)."""
        write_marker(written, self.run_id, step)
        target = self._path(step)
        if os.path.lexists(target):
            if step in own and (step in self._fresh or self.verify(step) is None):
                # A name _remove_leftovers never takes: a failed rename below keeps it.
                replaced = f"{target}{TMP_SUFFIX}-replaced-{self.run_id}"
                os.rename(target, replaced)
                os.rename(written, target)
                shutil.rmtree(replaced)
                own.remove(step)
                return
            self._make_room(step, own)  # sets aside one of this run's that fails to verify
            if step in own:
                own.remove(step)
        os.rename(written, target)  # never replaces a folder that holds anything

    def _orbax_save(self, path: str, record: dict[str, JSON], arrays: list[np.ndarray]
                    ) -> None:
        """Orbax's write of ``record`` as the ``meta`` item and the non-empty ``arrays`` as
        the ``state`` item (orbax writes no empty array: the record has them)."""
        ocp = self._ocp
        items: dict[str, ocp_args.CheckpointArgs] = {"meta": ocp.args.JsonSave(record)}
        stored = [a for a in arrays if a.size]
        if stored:
            items["state"] = ocp.args.StandardSave(stored)
        os.makedirs(self.directory, exist_ok=True)
        with self._lock:
            self._orbax.save(path, args=ocp.args.Composite(**items))

    def _written(self, step: int, own: list[int]) -> None:
        """Counts ``step`` as this run's newest checkpoint, and prunes beyond ``keep`` what
        is still this run's checkpoint by its marker."""
        own.append(step)
        self._fresh.add(step)
        while self.keep is not None and len(own) > self.keep:
            oldest = own.pop(0)
            if self.run_of(oldest) == self.run_id:
                shutil.rmtree(self._path(oldest), ignore_errors=True)

    # -- several processes: each writes its part, process 0 assembles the checkpoint -------
    def _part_path(self, step: int, process: int | None = None) -> str:
        """Where a part of ``step`` waits for the others (``process`` None: the checkpoint
        being assembled); a leftover by its name if the run is cut off."""
        name = f"{step}{PART_SUFFIX}-{self.run_id}"
        return self._path(f"{name}-whole" if process is None else f"{name}-{process}.npz")

    def _write_part(self, step: int, paths: list[str], specs: list[tuple[list[int], str]],
                    chunks: list[Chunk], record: dict[str, JSON], barrier: str) -> None:
        """Writes this process's ``chunks`` of ``step`` as its part, waits until every
        process has written its own, then (process 0) assembles the checkpoint, which every
        process waits for."""
        process, part = jax.process_index(), self._part_path(step, jax.process_index())
        own = self._owned()
        before = set(threading.enumerate())
        failure = None
        try:
            pieces = [piece for _, _, piece in chunks]
            listed = [[leaf, start, list(piece.shape), crc]
                      for (leaf, start, piece), crc in zip(chunks, checksums(pieces),
                                                             strict=True)]
            os.makedirs(self.directory, exist_ok=True)
            write_part(part, pieces, listed)  # replaces a cut-off attempt of this run
        except Exception as error:
            failure = error
        try:  # also after a failure: process 0 waits for every process's word
            self._barrier()(key=barrier, timeout_ms=PART_TIMEOUT_S * 1000)
        except Exception as error:
            raise CheckpointError(self._path(step), "the processes did not all finish their "
                                  f"parts within {PART_TIMEOUT_S} s ({failure_reason(error)})",
                                  "resume from the last checkpoint") from None
        try:
            if failure is not None:  # process 0 clears every part: nothing will assemble them
                self._write_failed(step, own, before, failure,
                                   os.path.basename(part) if process else None)
            if process == 0:
                try:
                    self._assemble(step, paths, specs, record, own)
                except CheckpointError:
                    self._remove_leftovers(step)
                    raise
                except Exception as error:
                    self._write_failed(step, own, before, error)
                self._written(step, own)
        finally:
            self._assembled(barrier)

    def _assembled(self, barrier: str) -> None:
        """Waits, in every process, until process 0 has put the checkpoint in place (or given
        up): a process stopped by an error of its own ends only then, so the stop of the
        others it causes never cuts off an assembly under way."""
        with contextlib.suppress(Exception):  # a process gone: its own error says what is left
            self._barrier()(key=f"{barrier}-assembled", timeout_ms=PART_TIMEOUT_S * 1000)

    def _assemble(self, step: int, paths: list[str], specs: list[tuple[list[int], str]],
                  record: dict[str, JSON], own: list[int]) -> None:
        """Process 0, once every process's part of ``step`` is written: the meta record
        listing every chunk, the parts moved beside it, all renamed to ``<step>`` at once."""
        parts = [self._part_path(step, p) for p in range(jax.process_count())]  # its "parts"
        missing = [str(p) for p, where in enumerate(parts) if not os.path.isfile(where)]
        if missing:
            raise CheckpointError(self._path(step), f"process {', '.join(missing)} wrote no "
                                  f"part of step {step} (its own error says why)",
                                  "resume from the last checkpoint")
        chunks: list[list[JSON]] = [[] for _ in paths]
        for p, where in enumerate(parts):
            for leaf, start, shape, crc in read_part(where, pieces=False)[0]:
                chunks[leaf].append([p, start, shape, crc])
        record["arrays"] = [[path, [*shape], dtype, listed] for path, (shape, dtype), listed
                            in zip(paths, specs, chunks, strict=True)]
        whole = self._part_path(step)
        _delete(whole)
        self._orbax_save(whole, record, [])
        for p, where in enumerate(parts):
            os.rename(where, os.path.join(whole, f"part-{p}.npz"))
        self._place(whole, step, own)

    def _barrier(self) -> Callable[..., None]:
        """Orbax's barrier over every process (JAX's coordination service, safe from a
        thread)."""
        return self._ocp.multihost.get_barrier_sync_fn()

    def _write_failed(self, step: int, own: list[int], before: set[threading.Thread],
                      error: Exception, leftover: str | None = None) -> None:
        """Cleans up after a failed write of ``step`` (:meth:`_remove_leftovers` with
        ``leftover``) and raises a CheckpointError saying why and which checkpoint of this
        run is intact."""
        target = self._path(step)
        log.debug("writing %s failed", target, exc_info=error)
        settle_orbax_threads(before)  # orbax's threads of this write may still be writing
        self._remove_leftovers(step, leftover)
        older = [s for s in own if s != step]
        intact = f"the checkpoint of step {older[-1]} is intact" if older else \
            "no earlier checkpoint of this run exists"
        reason = failure_reason(error)
        fix = "free space, then resume" if reason.startswith("disk full") else \
            "see the 'graphmod.checkpoint' debug log for orbax's traceback"
        raise CheckpointError(target, f"could not write the checkpoint of step {step}: "
                              f"{reason}; {intact}", fix) from None

    def _remove_leftovers(self, step: int, prefix: str | None = None) -> None:
        """Deletes the temporary directories of this run's write of ``step`` (those whose
        names start with ``prefix``, by default all of them)."""
        prefixes = (prefix,) if prefix else (os.path.basename(self._staged(step)),
                                             f"{step}{PART_SUFFIX}-{self.run_id}")
        for name in self._names():
            if name.startswith(prefixes):
                _delete(os.path.join(self.directory, name))

    def _make_room(self, step: int, own: list[int]) -> None:
        """Clears the way for a new write of ``step`` (not this run's own that verifies:
        :meth:`_place` replaces that): a checkpoint that fails verification (a resumed run
        skipped it) is set aside as ``<step>.unverified``; another run's checkpoint, and
        anything graphmod did not write, is never touched."""
        target = self._path(step)
        foreign = self._examine(str(step))[0]
        if foreign is not None:
            raise CheckpointError(
                target, f"is in the way of step {step}'s checkpoint, and graphmod did not "
                f"write it ({foreign})", "move it out of the run directory (it was left "
                "alone), or write to another directory")
        why = self.verify(step)
        if why is None:
            raise CheckpointError(
                target, "holds a checkpoint another run wrote",
                "write to another directory, or move it away (nothing was overwritten)")
        self._set_aside(step, why)

    def _set_aside(self, step: int, why: str) -> str:
        """Renames ``step``'s checkpoint, which fails verification for ``why``, to
        ``<step>.unverified`` (or ``-2``, ...), and returns that name."""
        target = self._path(step)
        aside, count = target + SET_ASIDE, 1
        while os.path.lexists(aside):
            count += 1
            aside = f"{target}{SET_ASIDE}-{count}"
        os.rename(target, aside)
        log.warning("%s fails verification (%s): set aside as %s", target, why, aside)
        return os.path.basename(aside)

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


def write_marker(folder: str, run_id: str, step: int) -> None:
    """Writes graphmod's marker of ``step``'s checkpoint by ``run_id`` into ``folder``."""
    fd = os.open(os.path.join(folder, MARKER),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as file:
        json.dump(marker_record(run_id, step), file)
        file.flush()
        os.fsync(file.fileno())


def _delete(path: str) -> None:
    """Deletes a directory tree or a file (a part) of this run's, if it is there; a link in
    its place is left alone (graphmod writes none)."""
    if os.path.islink(path):
        return
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _agreed(run_id: str) -> str:
    """Process 0's ``run_id``, in every process of a run (each must call this together)."""
    data = run_id.encode()
    if len(data) > RUN_ID_BYTES:
        raise ValueError(f"run_id={run_id!r}: at most {RUN_ID_BYTES} bytes in a run of "
                         "several processes")
    shared = multihost_utils.broadcast_one_to_all(
        np.frombuffer(data.ljust(RUN_ID_BYTES, b"\0"), np.uint8))
    return np.asarray(shared, np.uint8).tobytes().rstrip(b"\0").decode()
