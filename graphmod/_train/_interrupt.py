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

In a run of several processes (:mod:`graphmod.distributed`) the processes must stop at the
same step, since every one takes part in a save. A Ctrl-C there becomes a preemption notice
(the SIGTERM JAX's coordination service listens for, as a cluster scheduler sends it), and
:class:`StopAgreement` asks JAX's preemption sync after each step whether this is the step
all processes agreed on (``multihost_utils.reached_preemption_sync_point``: the furthest
step any process had reached, plus one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType, TracebackType

import jax
from jax.experimental import multihost_utils


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
        self.notify_peers = False  # a Ctrl-C becomes a preemption notice (StopAgreement)
        self._signalled = False
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
            outer = _guard_of(current)  # a loop run as a plugin stops where its outer one does
            self.notify_peers = outer is not None and outer.notify_peers
        return self

    @property
    def outermost(self) -> bool:
        """Whether the guard is installed and no other loop's guard is around it."""
        return self._installed and _guard_of(self._previous) is None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.notify_peers:  # JAX's notifier takes it; StopAgreement stops the loop
            signal.raise_signal(signal.SIGTERM)
        else:
            self.requested = True
        self._signalled = True
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
        if outer is not None and self._signalled:
            outer.requested |= self.requested  # a loop running this one as a plugin stops
            outer._arm_abort()  # (or, notifying its peers, is stopped by its agreement)


class StopAgreement:
    """The step at which every process of a run stops after a preemption notice (SIGTERM
    to any of them, or a Ctrl-C: see :class:`SigintGuard`), through JAX's preemption sync;
    :meth:`start` gives None where there is no such sync (one process, or the service off).

    Examples:
        >>> from graphmod._train._interrupt import StopAgreement
        >>> StopAgreement.start(0) is None  # one process: nothing to agree on
        True
    """

    def __init__(self, step: int, due: bool = False) -> None:
        self._last = step  # the last step id told to the sync: they must grow one by one
        self._due = due  # the notice came before the run, which stops where it starts

    @classmethod
    def start(cls, step: int) -> StopAgreement | None:
        """An agreement from ``step`` (the step the run starts at, the same in every
        process), or None."""
        if jax.process_count() < 2:
            return None
        try:
            due = multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # jax_enable_preemption_service is off
            return None
        return cls(step, due)

    def reached(self, step: int) -> bool:
        """Whether every process stops at ``step`` (told each step id since the last)."""
        if self._due:
            return True
        while self._last < step:
            self._last += 1
            if multihost_utils.reached_preemption_sync_point(self._last):
                return True
        return False
