"""Stop signals during a run: Ctrl-C, SIGTERM (and opted-in ones) stop it at a safe point, a
second signal aborts.

A ``KeyboardInterrupt`` raised wherever the main thread happens to be can land between a
buffer-donating step call and the assignment of its result (the loop's state then points at
deleted buffers and nothing can be saved) or inside orbax's save (whose writer threads may
then never be joined); a SIGTERM (what ``docker stop``, Kubernetes or a cluster's
preemption sends) ends a process at once by default, leaving a cut-off write. So while
:meth:`graphmod.Loop.run` runs in the main thread, :class:`SignalGuard` replaces the
default handlers of the stop signals by one that only sets a flag, which the loop checks
after each event; the loop then lets plugins save a finished step and raises the stop: a
``KeyboardInterrupt`` for Ctrl-C, a :class:`SignalInterrupt` (a ``KeyboardInterrupt`` too)
for another signal, which a script ends with as a shell reports that signal (143 for
SIGTERM); Ctrl-C's is CPython's own (130).

The stop signals (:func:`stop_signals`) are SIGINT, SIGTERM and those named in the
environment variable ``GRAPHMOD_STOP_SIGNALS`` (``STOP_SIGNALS_VARIABLE``), e.g.
``GRAPHMOD_STOP_SIGNALS=SIGUSR1`` for Slurm's ``--signal=USR1@60``, which warns a job a
minute before its time limit (SIGHUP, SIGUSR1 and SIGUSR2 may be added; a bad value is
refused before the run starts).

The first stop signal also makes the next one abort at once: in a script each goes back to
the operating system's default, which ends the process even while it waits in a long XLA
call or a checkpoint write (exit status 128 + the signal in a shell; checkpoints already
written stay intact, since a write is renamed into place once finished); in an interactive
session (a REPL, IPython, Jupyter) a second Ctrl-C raises ``KeyboardInterrupt`` as usual,
so the session survives. Outside the main thread, or when a signal was ignored or given
another handler, that signal is left as it is.

A script a stop ends exits promptly: its at-exit handlers run, but the interpreter's last
garbage collections, which walk the whole heap JAX builds (seconds on a loaded machine,
during which the saved run was already safe), are skipped (``gc.freeze``). It ends with the
stop's one line (``KeyboardInterrupt: interrupted at step 12``) under the notices that said
what was saved and how to continue, not with a traceback through the loop.

In a run of several processes (:mod:`graphmod.distributed`) the processes must stop at the
same step, since every one takes part in a save. There SIGTERM belongs to JAX's
coordination service, whose preemption notifier listens for it; a Ctrl-C or an opted-in
signal becomes such a notice (the guard sends its own process SIGTERM), and
:class:`StopAgreement` asks JAX's preemption sync after each step whether this is the step
all processes agreed on (``multihost_utils.reached_preemption_sync_point``: the furthest
step any process had reached, plus one).

This module imports JAX only where it asks JAX something: the ``graphmod`` command reads
its signal names at start-up.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable
from traceback import format_exception_only
from types import FrameType, TracebackType

STOP_SIGNALS_VARIABLE = "GRAPHMOD_STOP_SIGNALS"
_ALWAYS = ("SIGINT", "SIGTERM")
_OPT_IN = ("SIGHUP", "SIGUSR1", "SIGUSR2")  # the ones a scheduler or a terminal sends to stop
_Handler = Callable[[int, FrameType | None], object] | int


def stop_signals(setting: str | None = None) -> tuple[signal.Signals, ...]:
    """The signals that stop a run at a step: SIGINT, SIGTERM and those named in ``setting``
    (default: the environment variable ``GRAPHMOD_STOP_SIGNALS``), separated by commas or
    spaces, with or without ``SIG`` (``USR1`` as Slurm writes it). A name that is not one of
    SIGHUP, SIGUSR1, SIGUSR2 (or SIGINT, SIGTERM) is refused, naming it and the choices.

    Examples:
        >>> from graphmod._train._interrupt import stop_signals
        >>> [s.name for s in stop_signals("USR1, SIGUSR2")]
        ['SIGINT', 'SIGTERM', 'SIGUSR1', 'SIGUSR2']
        >>> try:
        ...     stop_signals("SIGKILL")
        ... except ValueError as error:
        ...     print(str(error).split(";")[0])
        GRAPHMOD_STOP_SIGNALS='SIGKILL': SIGKILL cannot be caught, so it cannot stop a run
    """
    text = os.environ.get(STOP_SIGNALS_VARIABLE, "") if setting is None else setting
    chosen = list(_ALWAYS)
    for word in text.replace(",", " ").split():
        name = word.upper() if word.upper().startswith("SIG") else f"SIG{word.upper()}"
        if word.isdigit():
            why = f"{word} is a number: name the signal instead (SIGUSR1, not 10)"
        elif name in ("SIGKILL", "SIGSTOP"):
            why = f"{name} cannot be caught, so it cannot stop a run"
        elif name in signal.Signals.__members__ and name not in (*_ALWAYS, *_OPT_IN):
            why = f"{name} is not a request to stop, so it does not stop a run"
        elif name not in signal.Signals.__members__:
            why = (f"{name} is not a signal of this platform" if name in _OPT_IN
                   else f"{word!r} is not a signal's name")
        else:
            chosen += [name] if name not in chosen else []
            continue
        raise ValueError(f"{STOP_SIGNALS_VARIABLE}={text!r}: {why}; name "
                         f"{', '.join(_OPT_IN[:-1])} or {_OPT_IN[-1]} (SIGINT and SIGTERM "
                         "always stop a run)")
    return tuple(signal.Signals[name] for name in chosen)


def stop_notice(signum: int, saves: bool) -> str:
    """The line printed at a run's first stop signal (``saves``: a plugin saves on it).

    Examples:
        >>> import signal
        >>> from graphmod._train._interrupt import stop_notice
        >>> stop_notice(signal.SIGINT, True).split(";")[0]
        'graphmod: Ctrl-C: finishing the current step and saving it'
        >>> stop_notice(signal.SIGTERM, False).split(";")[1]
        ' send SIGTERM again (or press Ctrl-C) to abort at once (saving nothing more)'
    """
    saving = " and saving it" if saves else ""
    again = ("press Ctrl-C again" if signum == signal.SIGINT else
             f"send {signal.Signals(signum).name} again (or press Ctrl-C)")
    what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    return (f"graphmod: {what}: finishing the current step{saving}; {again} to abort at "
            "once (saving nothing more)")


def write_now(line: str) -> None:
    """Writes ``line`` to standard error at once, unbuffered: safe in a signal handler or a
    thread; nothing where there is no usable standard error.

    Examples:
        >>> from graphmod._train._interrupt import write_now
        >>> write_now("graphmod: a line on standard error")
    """
    with contextlib.suppress(OSError):  # what matters (a flag, a signal) is done anyway
        os.write(2, f"{line}\n".encode())


def report_unsaved(step: int, *, state_taken: bool, saved: bool) -> None:
    """Says on standard error that a run interrupted at ``step`` saved nothing, and why,
    unless a plugin ``saved`` it (a Checkpoint says what it saved itself); ``state_taken``:
    the step call cut off had been given the state's buffers."""
    why = ("the step call it cut off had taken the state" if state_taken else
           None if saved else "no plugin saves on an interrupt: add graphmod.plugins.Checkpoint")
    if why is not None:
        print(f"graphmod: interrupted at step {step}; nothing was saved ({why})",
              file=sys.stderr)


class SignalInterrupt(KeyboardInterrupt):
    """A run stopped by SIGTERM or an opted-in signal: a ``KeyboardInterrupt``, as Ctrl-C's
    stop is, so ``except KeyboardInterrupt`` catches both. A script it ends exits with
    :attr:`status`, 128 + the signal's number, as a shell reports a process that signal
    ended (143 for SIGTERM).

    Examples:
        >>> import signal
        >>> from graphmod._train._interrupt import SignalInterrupt
        >>> stop = SignalInterrupt(signal.SIGTERM, "stopped by SIGTERM at step 3")
        >>> isinstance(stop, KeyboardInterrupt), stop.status, str(stop)
        (True, 143, 'stopped by SIGTERM at step 3')
    """

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signal = signal.Signals(signum)

    @property
    def status(self) -> int:
        """The exit status of a script this stop ends."""
        return 128 + self.signal


def _interactive() -> bool:
    """Whether Python runs a REPL, IPython or a notebook kernel rather than a script."""
    main = sys.modules.get("__main__")
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or not hasattr(main, "__file__")


def _default(signum: int) -> _Handler:
    """Python's own handler of ``signum`` in a script: the one a guard may replace."""
    return signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL


def take_stop_signals(signals: tuple[signal.Signals, ...],
                      handler: Callable[[int, FrameType | None], object]
                      ) -> dict[signal.Signals, _Handler]:
    """Makes ``handler`` the handler of each of ``signals`` whose handler is Python's
    default or a loop's guard's (in the main thread); returns the handlers it replaced. A
    user's own handler, or a signal ignored (SIGINT in a background job, SIGHUP under
    nohup), stays as it is.

    Examples:
        >>> import signal
        >>> from graphmod._train._interrupt import take_stop_signals
        >>> taken = take_stop_signals((signal.SIGTERM,), lambda signum, frame: None)
        >>> list(taken) == [signal.SIGTERM] and taken[signal.SIGTERM] == signal.SIG_DFL
        True
        >>> _ = signal.signal(signal.SIGTERM, taken[signal.SIGTERM])  # given back
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    taken = {}
    for signum in signals:
        current = signal.getsignal(signum)
        if current is _default(signum) or _guard_of(current) is not None:
            taken[signum] = current
            signal.signal(signum, handler)
    return taken


def _jax_takes_sigterm() -> bool:
    """Whether JAX's preemption notifier handles SIGTERM (a joined run of several processes
    with the preemption service on): it is set in C, so ``signal.getsignal`` cannot see it,
    and replacing it would take the notices away from the coordination service."""
    import jax  # see the module docstring

    # JAX's options are attributes it sets at runtime, which its stub does not declare.
    return jax.distributed.is_initialized() and bool(
        jax.config.jax_enable_preemption_service)  # pyright: ignore[reportAttributeAccessIssue]


def _guard_of(handler: object) -> SignalGuard | None:
    """The guard whose bound ``_handle`` is ``handler``, if it is one."""
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, SignalGuard) else None


def _report_uncaught(kind: type[BaseException], error: BaseException,
                     traceback: TracebackType | None, *,
                     previous: Callable[..., object]) -> None:
    """``sys.excepthook`` of a script a stop ended: for the stop, its last line only, then,
    for a :class:`SignalInterrupt`, the exit with its status (Python would exit with 1; a
    ``KeyboardInterrupt`` still ends by SIGINT, 130 in a shell); anything else as
    ``previous`` reports it."""
    if not getattr(error, _STOPPED_RUN, False):
        previous(kind, error, traceback)
        return
    sys.stderr.write("".join(format_exception_only(kind, error)))
    sys.stderr.flush()
    if isinstance(error, SignalInterrupt):
        raise SystemExit(error.status)  # Python exits with it, at-exit handlers run


_STOPPED_RUN = "_graphmod_stopped_run"  # set on the stop a loop raised: reported in a line


def _exit_promptly(stop: KeyboardInterrupt) -> None:
    """Prepares a script for the end ``stop`` is likely to bring: its status, and no last
    walk of JAX's heap (see the module docstring); harmless if the script goes on."""
    atexit.unregister(gc.freeze)  # registered once, however many runs stop
    atexit.register(gc.freeze)  # the newest runs first: later handlers still collect
    setattr(stop, _STOPPED_RUN, True)  # a mark, not a reference: the hook keeps no frames
    hook = sys.excepthook
    if not (isinstance(hook, functools.partial) and hook.func is _report_uncaught):
        sys.excepthook = functools.partial(_report_uncaught, previous=hook)


class SignalGuard:
    """While entered (in the main thread), the first stop signal (:func:`stop_signals`)
    sets :attr:`requested` and :attr:`signal` and prints a notice (``saves``: saying that
    the step is saved); a second aborts. SIGTERM is left to JAX where its preemption
    notifier listens (a run of several processes).

    Examples:
        >>> from graphmod._train._interrupt import SignalGuard
        >>> with SignalGuard() as guard:
        ...     pass
        >>> guard.requested, guard.signal
        (False, None)
    """

    def __init__(self, saves: bool = False) -> None:
        self.requested = False
        self.signal: signal.Signals | None = None  # the first stop signal this guard took
        self.notify_peers = False  # a signal becomes a preemption notice (StopAgreement)
        self._signals = stop_signals()  # a bad GRAPHMOD_STOP_SIGNALS: refused here, first
        self._saves = saves
        self._previous: dict[signal.Signals, _Handler] = {}  # the handlers replaced

    def __enter__(self) -> SignalGuard:
        signals = self._signals
        if _jax_takes_sigterm():
            signals = tuple(s for s in signals if s != signal.SIGTERM)
        self._previous = take_stop_signals(signals, self._handle)
        outer = self._outer()  # a loop run as a plugin stops where its outer one does
        self.notify_peers = outer is not None and outer.notify_peers
        return self

    def _outer(self) -> SignalGuard | None:
        """The guard of the loop this one's loop runs in, if any."""
        return next((g for g in map(_guard_of, self._previous.values()) if g is not None),
                    None)

    @property
    def outermost(self) -> bool:
        """Whether the guard is installed and no other loop's guard is around it."""
        return bool(self._previous) and self._outer() is None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.notify_peers:  # JAX's notifier takes it; StopAgreement stops the loop
            signal.raise_signal(signal.SIGTERM)
        else:
            self.requested = True
        self.signal = self.signal or signal.Signals(signum)
        self._arm_abort()
        write_now(f"\n{stop_notice(signum, self._saves)}")

    def _arm_abort(self) -> None:
        """Makes the next stop signal abort at once."""
        for signum in self._previous:
            interrupt = signum == signal.SIGINT and _interactive()
            signal.signal(signum, signal.default_int_handler if interrupt else signal.SIG_DFL)

    def stop(self, step: int, *, ended: bool = False) -> KeyboardInterrupt:
        """The error the loop raises for the stop this guard took, at ``step`` (``ended``:
        after the run ended there, in its last teardowns)."""
        when = f"after the run ended at step {step}" if ended else f"at step {step}"
        if self.signal is None or self.signal == signal.SIGINT:
            return KeyboardInterrupt(f"interrupted {when}")
        return SignalInterrupt(self.signal, f"stopped by {self.signal.name} {when}")

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if not self._previous:
            return
        outer = self._outer()
        signalled = self.signal is not None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        if outer is not None and signalled:
            outer.requested |= self.requested  # a loop running this one as a plugin stops
            outer.signal = outer.signal or self.signal
            outer._arm_abort()  # (or, notifying its peers, is stopped by its agreement)
        elif outer is None and isinstance(error, KeyboardInterrupt) and not _interactive():
            _exit_promptly(error)


class StopAgreement:
    """The step at which every process of a run stops after a preemption notice (SIGTERM
    to any of them, or another stop signal: see :class:`SignalGuard`), through JAX's
    preemption sync; :meth:`start` gives None where there is no such sync (one process, or
    the service off).

    Examples:
        >>> from graphmod._train._interrupt import StopAgreement
        >>> StopAgreement.start(0) is None  # one process: nothing to agree on
        True
    """

    def __init__(self, step: int, sync: Callable[[int], bool], due: bool = False) -> None:
        self._last = step  # the last step id told to the sync: they must grow one by one
        self._sync = sync
        self._due = due  # the notice came before the run, which stops where it starts

    @classmethod
    def start(cls, step: int) -> StopAgreement | None:
        """An agreement from ``step`` (the step the run starts at, the same in every
        process), or None."""
        import jax  # see the module docstring
        from jax.experimental import multihost_utils

        if jax.process_count() < 2:
            return None
        sync = multihost_utils.reached_preemption_sync_point
        try:
            due = sync(step)
        except RuntimeError:  # jax_enable_preemption_service is off
            return None
        return cls(step, sync, due)

    def reached(self, step: int) -> bool:
        """Whether every process stops at ``step`` (told each step id since the last)."""
        if self._due:
            return True
        while self._last < step:
            self._last += 1
            if self._sync(self._last):
                return True
        return False
