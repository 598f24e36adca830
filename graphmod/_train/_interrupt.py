"""Ctrl-C during a run: the first asks the loop to stop at a safe point, a second aborts.

A ``KeyboardInterrupt`` raised wherever the main thread happens to be can land between a
buffer-donating step call and the assignment of its result (the loop's state then points at
deleted buffers and nothing can be saved) or inside orbax's save (whose writer threads may
then never be joined). So while :meth:`graphmod.Loop.run` runs in the main thread with
Python's default SIGINT handler, :class:`SigintGuard` replaces it by one that only sets a
flag, which the loop checks after each event; the loop then lets plugins save a finished
step and raises ``KeyboardInterrupt`` itself.

The first Ctrl-C also makes the next one abort at once: in a script SIGINT goes back to the
operating system's default, which ends the process even while it waits in a long XLA call
(exit status 130 in a shell; checkpoints already written stay intact, since orbax renames a
finished write into place); in an interactive session (a REPL, IPython, Jupyter) it raises
``KeyboardInterrupt`` as usual, so the session survives. Outside the main thread, or when
SIGINT was ignored or given another handler, nothing is changed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType, TracebackType


def stop_notice(saves: bool) -> str:
    """The line printed at a run's first Ctrl-C (``saves``: a plugin saves on it).

    Examples:
        >>> from graphmod._train._interrupt import stop_notice
        >>> stop_notice(True).split(";")[0]
        'graphmod: Ctrl-C: finishing the current step and saving it'
    """
    saving = " and saving it" if saves else ""
    return (f"graphmod: Ctrl-C: finishing the current step{saving}; press Ctrl-C again "
            "to abort at once (saving nothing more)")


def report_unsaved(step: int, *, state_taken: bool, saved: bool) -> None:
    """Says on standard error that a run interrupted at ``step`` saved nothing, and why,
    unless a plugin ``saved`` it (a Checkpoint says what it saved itself); ``state_taken``:
    the step call cut off had been given the state's buffers."""
    why = ("the step call it cut off had taken the state" if state_taken else
           None if saved else "no plugin saves on an interrupt: add graphmod.plugins.Checkpoint")
    if why is not None:
        print(f"graphmod: interrupted at step {step}; nothing was saved ({why})",
              file=sys.stderr)


def _interactive() -> bool:
    """Whether Python runs a REPL, IPython or a notebook kernel rather than a script."""
    main = sys.modules.get("__main__")
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or not hasattr(main, "__file__")


def _guard_of(handler: object) -> SigintGuard | None:
    """The guard whose bound ``_handle`` is ``handler``, if it is one."""
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, SigintGuard) else None


class SigintGuard:
    """While entered (in the main thread), the first Ctrl-C sets :attr:`requested` and
    prints ``notice``; a second aborts at once.

    Examples:
        >>> from graphmod._train._interrupt import SigintGuard
        >>> with SigintGuard("stopping") as guard:
        ...     pass
        >>> guard.requested
        False
    """

    def __init__(self, notice: str) -> None:
        self.requested = False
        self._notice = notice
        self._previous: object = None
        self._installed = False

    @property
    def installed(self) -> bool:
        """Whether the guard handles SIGINT (else Ctrl-C raises KeyboardInterrupt as usual)."""
        return self._installed

    def __enter__(self) -> SigintGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        current = signal.getsignal(signal.SIGINT)
        # Only Python's default or an outer loop's guard: a user's own handler, or SIGINT
        # ignored (a background job), stays as it is.
        if current is signal.default_int_handler or _guard_of(current) is not None:
            self._previous = current
            signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self._arm_abort()
        with contextlib.suppress(OSError):  # no usable stderr: the flag is what matters
            os.write(2, f"\n{self._notice}\n".encode())

    def _arm_abort(self) -> None:
        """Makes the next Ctrl-C abort at once."""
        abort = signal.default_int_handler if _interactive() else signal.SIG_DFL
        signal.signal(signal.SIGINT, abort)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if not self._installed:
            return
        self._installed = False
        signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
        outer = _guard_of(self._previous)
        if outer is not None and self.requested:
            outer.requested = True  # a loop running this one as a plugin stops too
            outer._arm_abort()
