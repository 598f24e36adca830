"""The writer's lock of a run directory: one run writes into it at a time.

A run that writes checkpoints (``graphmod.plugins.Checkpoint``, from its setup to its
teardown; in a run of several processes, process 0) holds an exclusive ``fcntl.flock`` on
``graphmod.lock``, a file it creates in the run directory and writes its process id, host
and start time into, for the error a second writer gets. The lock belongs to the open file:
the OS releases it when the process ends in any way, killed included, so a lock file left
by a process that died never blocks (the next writer takes it and writes its own name).
The holder deletes the file when it lets go; a writer that took a lock on a file deleted
meanwhile tries again on the new one. Reading a run directory takes no lock.

Examples:
    >>> import tempfile
    >>> from graphmod._train._checkpoint._lock import RunLock
    >>> directory = tempfile.mkdtemp()
    >>> with RunLock(directory):
    ...     try:
    ...         RunLock(directory).acquire()
    ...     except ValueError as error:
    ...         print(error.reason.split(":")[0])
    another run writes into this directory
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import stat
import time
from types import TracebackType
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.experimental import multihost_utils

from graphmod._train._checkpoint._errors import CheckpointError

if TYPE_CHECKING:
    from graphmod.typing import JSON

LOCK_NAME = "graphmod.lock"
_ATTEMPTS = 20  # tries at a lock file its holders keep deleting (each try is immediate)
_HOLDER_WAIT_S = 2.0  # how long a refused writer waits for the holder to write its name


class RunLock:
    """The exclusive lock of the run directory ``directory``, created (with the directory)
    by :meth:`acquire` and deleted by :meth:`release` (the directory too, when the lock
    created it and nothing was written into it); a context manager."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.path = lock_path(self.directory)
        self._fd: int | None = None
        self._created: list[str] = []  # the folders acquire made, deepest first

    def acquire(self) -> None:
        """Takes the lock, or raises a :class:`CheckpointError` naming the process and host
        that hold it (and what to do), having changed nothing."""
        self._created = _missing_folders(self.directory)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise CheckpointError(self.directory, "is a file, not a run directory",
                                  "pass a directory for the run's checkpoints") from None
        try:
            self._fd = self._locked()
        except BaseException:
            self._remove_created()
            raise

    def _locked(self) -> int:
        """The descriptor of the lock file, locked and holding this process's name."""
        for _ in range(_ATTEMPTS):
            try:  # O_NOFOLLOW: a link in its place is not graphmod's lock file
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                             | os.O_NONBLOCK, 0o644)
            except OSError as error:
                raise self._not_a_lock(error) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise CheckpointError(
                    self.directory, f"another run writes into this directory: {holder} holds "
                    f"its lock ({LOCK_NAME})", "wait for that run to end (or stop it), or "
                    "write to another directory; reading (graphmod inspect, resuming it later) "
                    "needs no lock") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder deleted it as it let go: lock the one there now
        else:
            raise CheckpointError(self.path, "keeps being deleted as it is locked",
                                  "stop whatever deletes it, then start again")
        try:
            if not _held_by_graphmod(fd):
                raise CheckpointError(self.path, "holds something graphmod did not write "
                                      "(it was left as it is)", "move it out of the run "
                                      "directory, or write to another directory")
            _write_holder(fd)
        except BaseException:
            os.close(fd)  # the file is a stranger's: released, never deleted
            raise
        return fd

    def _not_a_lock(self, error: OSError) -> CheckpointError:
        what = "a symbolic link" if error.errno == errno.ELOOP else \
            "a folder" if error.errno == errno.EISDIR else None
        if what is not None:
            return CheckpointError(self.path, f"is {what}, not graphmod's lock file (it was "
                                   "left as it is)", "move it out of the run directory, or "
                                   "write to another directory")
        return CheckpointError(self.path, f"cannot be created or opened ({error.strerror})",
                               "check the run directory's permissions")

    def release(self) -> None:
        """Deletes the lock file (while still holding it) and lets go; the directory too
        when :meth:`acquire` made it and it stayed empty. Does nothing unless held."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass  # left for the next writer, which takes it over
        finally:
            os.close(fd)
        self._remove_created()

    def _remove_created(self) -> None:
        for folder in self._created:
            try:
                os.rmdir(folder)  # only if empty: a run that wrote keeps its directory
            except OSError:
                break
        self._created = []

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def run_lock(directory: str | os.PathLike) -> RunLock | None:
    """The taken lock of ``directory`` for a run's writer, or None in a process of a run of
    several that is not process 0 (which takes it for all). In such a run every process
    calls this together, and each raises if process 0 could not take it."""
    lock = RunLock(directory) if jax.process_index() == 0 else None
    failure: CheckpointError | None = None
    if lock is not None:
        try:
            lock.acquire()
        except CheckpointError as error:
            failure = error
    if jax.process_count() > 1:
        refused = int(multihost_utils.broadcast_one_to_all(np.int32(failure is not None)))
        if refused and lock is None:
            raise CheckpointError(lock_path(directory), "process 0 could not take the run "
                                  "directory's lock (its error says why)")
    if failure is not None:
        raise failure
    return lock


def lock_path(directory: str | os.PathLike) -> str:
    """Where the lock file of the run directory ``directory`` is."""
    return os.path.join(os.path.abspath(os.fspath(directory)), LOCK_NAME)


def _missing_folders(directory: str) -> list[str]:
    """``directory`` and those of its parents that do not exist, deepest first."""
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return missing


def _same_file(fd: int, path: str) -> bool:
    """Whether the open file ``fd`` is the file at ``path`` (not deleted or replaced)."""
    try:
        there = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 65536)


def _held_by_graphmod(fd: int) -> bool:
    """Whether the locked file ``fd`` is a lock file graphmod wrote (or a fresh, empty one)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return False
    data = _read(fd)
    return not data or _record(data) is not None


def _record(data: bytes) -> dict[str, JSON] | None:
    """The holder's record in a lock file's bytes, or None if they hold none."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("graphmod") == "lock" else None


def _write_holder(fd: int) -> None:
    """Writes this process's name into the lock file it holds."""
    record = {"graphmod": "lock", "pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(record).encode())
    os.fsync(fd)


def _holder(fd: int) -> str:
    """Who holds the lock of ``fd``, from what it wrote into it (waiting boundedly for a
    holder that has just taken it)."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        record = _record(_read(fd))
        if record is not None:
            return (f"process {record.get('pid')} on host {record.get('host')} (since "
                    f"{record.get('since')})")
        if time.monotonic() > deadline:
            return "a process that wrote no name into it"
        time.sleep(0.05)
