"""Failures of checkpoint I/O made readable: ``CheckpointError``, plain reasons, orbax's noise.

Orbax reports a failed write or read with long tracebacks, log records and tensorstore specs.
graphmod raises one :class:`CheckpointError` naming the path and a short reason
(:func:`failure_reason`), and sends orbax's own records to the ``graphmod.checkpoint`` logger
at debug level (:func:`quiet_orbax`), where they stay available.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
import threading
import time

log = logging.getLogger("graphmod.checkpoint")
_ORBAX_READ = re.compile(r"OCDBT|tensorstore|orbax")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, read or verified; names its path and the reason.

    Attributes ``path`` and ``reason`` hold the two parts of the message.

    Examples:
        >>> from graphmod import CheckpointError
        >>> error = CheckpointError("/runs/a/15", "no meta record", "delete the directory")
        >>> str(error), error.reason
        ('/runs/a/15: no meta record; delete the directory', 'no meta record')
    """

    def __init__(self, path: str | os.PathLike, reason: str, fix: str = "") -> None:
        self.path, self.reason, self.fix = os.fspath(path), reason, fix
        super().__init__(f"{self.path}: {reason}" + (f"; {fix}" if fix else ""))


def failure_reason(error: BaseException) -> str:
    """A short, plain reason for a failed write or read (disk full, permission, ...)."""
    seen: BaseException | None = error
    for _ in range(8):  # the error and its causes
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"disk full ({seen.strerror or seen})"
        if isinstance(seen, PermissionError):
            return f"permission denied ({seen})"
        seen = seen.__cause__ or seen.__context__
    text = str(error).strip().splitlines()
    first = text[0].split(" [tensorstore_spec")[0] if text else ""  # the spec is a page long
    return f"{type(error).__name__}: {first}".rstrip(": ")


class _OrbaxToDebug(logging.Filter):
    """Sends orbax's log records (warnings, tracebacks) to graphmod's debug log, and
    asyncio's reports of orbax reads whose errors no one retrieved (a failed restore stops
    waiting for the other arrays' reads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname and not (
                record.name == "asyncio" and "never retrieved" in str(record.msg)
                and _ORBAX_READ.search(record.getMessage())):
            return True
        log.debug("orbax: %s", record.getMessage(), exc_info=record.exc_info)
        return False


def quiet_orbax() -> None:
    """Keeps orbax's internals out of the terminal (once per process): its log records go
    to the debug log, and so do the errors of tensorstore reads that finish after a failed
    restore has closed orbax's event loop."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OrbaxToDebug) for f in logger.filters):
            logger.addFilter(_OrbaxToDebug())
    previous = sys.unraisablehook
    if getattr(previous, "graphmod_quiet", False):
        return

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            log.debug("orbax: a read finished after its restore failed", exc_info=error)
            return
        previous(unraisable)

    hook.graphmod_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def settle_orbax_threads(before: set[threading.Thread], timeout: float = 30.0) -> None:
    """Waits (boundedly) for orbax's threads started since ``before`` (its own, and its
    event loops' executors) to end; they re-raise their errors when joined: those go to
    the debug log."""
    deadline = time.monotonic() + timeout
    for thread in set(threading.enumerate()) - before - {threading.current_thread()}:
        if not (type(thread).__module__.startswith("orbax")
                or thread.name.startswith("asyncio_")):
            continue  # another part of the program's thread
        try:
            thread.join(max(0.0, deadline - time.monotonic()))
        except Exception:
            log.debug("an orbax thread of a failed write ended with an error", exc_info=True)
