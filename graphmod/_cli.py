"""The graphmod command: run a training script, resume a run, inspect a run directory, control
a running one.

``graphmod run SCRIPT [ARGS...]`` runs a script as ``python SCRIPT ARGS...`` would;
``--processes N`` starts N of them as one multi-process run (:mod:`graphmod.distributed`).
``graphmod resume DIR`` runs the script recorded in DIR's latest checkpoint again (in as
many processes as the run had), with its ``Checkpoint(DIR)`` plugins continuing from that
checkpoint: it prints the script, its sha256 and the command, then replaces itself with it
(signals and the exit status are the script's own). It re-runs only a recorded script file
inside the directory it runs from whose hash is the recorded one, or the script named with
``--script PATH``, and refuses every other record (see :mod:`graphmod._train._command`).
``graphmod inspect DIR`` prints what a run directory holds; ``graphmod control DIR COMMAND``
asks the run training there (its ``plugins.Control``) for its status, to pause, save, stop,
set a hyperparameter or fire an event. Errors go to standard error with
exit status 2; an interrupted command exits with status 130. Everything printed from a record
or a checkpoint goes through :func:`terminal_safe`, so a crafted one cannot drive the terminal.

Start-up: this module imports only the standard library and the command records
(:mod:`graphmod._train._command`, standard library only); the checkpoint reader and the
provenance record, which import JAX, are imported inside the functions of the commands that
need them (the only function-local imports of graphmod's own modules), so ``graphmod --help``
and a usage error answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from graphmod import distributed
from graphmod._train._command import (
    CLI,
    RESUME_VARIABLE,
    ResubmitRequiredError,
    ResumeRefusedError,
    command_text,
    launch_text,
    resume_command,
)
from graphmod._train._control import (
    COMMANDS as CONTROL_COMMANDS,
)
from graphmod._train._control import (
    NotRunning,
    answer_lines,
    command_request,
    send_command,
)
from graphmod._train._interrupt import (
    SignalInterrupt,
    stop_signals,
    take_stop_signals,
    write_now,
)

if TYPE_CHECKING:  # graphmod.typing imports JAX: the command answers --help without it
    from graphmod.typing import PathLike

_log = logging.getLogger(__name__)
STOP_GRACE_S = 10  # how long the other processes of a failed run get to end on SIGTERM
ORPHAN_GRACE_S = 60  # how long a process whose launcher is gone gets to stop and save

_COMMANDS = {  # name: (summary, description), in plain words for --help
    "run": ("run a training script",
            "Run SCRIPT with ARGS as 'python SCRIPT ARGS...' would. A run started this way "
            "records SCRIPT and ARGS in its checkpoints, so 'graphmod resume DIR' can start "
            "it again. With --processes N, start N copies on this machine as one "
            "multi-process JAX run: the script calls graphmod.distributed.initialize() "
            "first."),
    "resume": ("continue the run saved in a directory",
               "Run the script recorded in DIR's latest checkpoint again, with the same "
               "arguments, working directory and number of processes; its Checkpoint(DIR) "
               "plugins continue from that checkpoint. The script, its sha256 and the "
               "command are printed before it runs. Only a script file inside the directory "
               "graphmod resume runs from, with the content it had when the run started, is "
               "re-run; name any other with --script PATH. No file of a Python installation "
               "is run. A run started with 'python -c', 'python -m', in Jupyter or in an "
               "interactive shell is refused; continue it from Python with "
               "graphmod.Loop.resume(...)."),
    "inspect": ("print what a run directory holds",
                "Print DIR's checkpoints, loop counters, plugin states, the command that "
                "started the run, its provenance summary and the latest metrics."),
}


class _Failure(Exception):
    """A command that cannot go on; its message is printed to standard error (status 2)."""


# C0 controls (newline included: the CLI puts its own), DEL and C1 controls: what a terminal
# acts on (a title, a cleared screen, a cursor move) where text should only be shown.
_CONTROLS = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}


def terminal_safe(text: str) -> str:
    r"""``text`` with every control character shown as a visible escape (``\x1b``), as every
    printer of ``graphmod inspect`` and ``graphmod resume`` passes what a record holds.

    Examples:
        >>> from graphmod._cli import terminal_safe
        >>> print(terminal_safe("loss\x1b]0;owned\x07 \x9b2J\nmore"))
        loss\x1b]0;owned\x07 \x9b2J\x0amore
    """
    return text.translate(_CONTROLS)


def _run(args: argparse.Namespace) -> int:
    script = pathlib.Path(args.script)
    if not script.is_file():
        raise _Failure(f"no script file at {script} (check the path)")
    try:
        stop_signals()  # a bad GRAPHMOD_STOP_SIGNALS is refused before anything runs
    except ValueError as error:
        raise _Failure(str(error)) from None
    if args.processes > 1:
        return _run_processes(args)
    launcher = os.environ.get(distributed.LAUNCHER_PID)
    if launcher is not None:
        if not launcher.isdigit():
            raise _Failure(f"{distributed.LAUNCHER_PID}={launcher!r} is not a process id: "
                           "'graphmod run --processes N' sets it for the processes it starts; "
                           "unset it")
        del os.environ[distributed.LAUNCHER_PID]  # not for the processes the script starts
        _watch_launcher(int(launcher))
    path = os.path.abspath(script)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(path))  # as python does: the script's folder first
    try:
        runpy.run_path(path, run_name="__main__")
    except SignalInterrupt as stop:  # SIGTERM (or an opted-in signal) stopped a loop: saved
        print(f"graphmod run: {stop}", file=sys.stderr)
        return stop.status
    except (Exception, SystemExit) as error:
        several = distributed.PROCESS_ID in os.environ or distributed.joined() is not None
        if not several or (isinstance(error, SystemExit) and not error.code):
            raise
        _end_failed_process(error)
    return 0


def _watch_launcher(launcher: int) -> None:
    """Stops this process of a run of several once ``launcher``, the ``graphmod run
    --processes`` that started it, is gone (killed, say), rather than letting it train on
    unsupervised: it sends itself SIGTERM, its run's stop notice (every process stops at one
    step and a ``Checkpoint`` saves it), and ends without saving if it still runs
    ``ORPHAN_GRACE_S`` later. Polled (once a second) in a daemon thread: portable."""
    def watch() -> None:
        while os.getppid() == launcher:  # else this process was handed to another parent
            time.sleep(1.0)
        write_now(f"graphmod run: process {os.getpid()}: its launcher (pid {launcher}) is "
                  "gone; stopping at the next step and saving it")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        write_now(f"graphmod run: process {os.getpid()}: still running {ORPHAN_GRACE_S} s "
                  "after its launcher was gone; ending it (saving nothing more)")
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="graphmod-launcher-watch", daemon=True).start()


def _end_failed_process(error: BaseException) -> None:
    """Ends a failed process of a run of several now, with its status: exiting as usual
    would wait in JAX's shutdown for the other processes, which wait for this one (in a
    collective or a checkpoint), so ``graphmod run`` would never see it fail."""
    if isinstance(error, SystemExit):
        code = error.code if isinstance(error.code, int) else 1
        if not isinstance(error.code, int):
            print(error.code, file=sys.stderr)
    else:
        code = 1
        traceback.print_exception(error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_processes(args: argparse.Namespace) -> int:
    """Runs ``args.processes`` copies of the script, each told its place in the run (see
    :mod:`graphmod.distributed`) and this command's pid (each ends if it is gone:
    :func:`_watch_launcher`); the first failure stops the others and is the status. A stop
    signal (:func:`stop_signals`) is passed on to every process as SIGTERM, the run's stop
    notice: they stop at one step and save it, and the status is 128 + that signal; a
    second one kills them."""
    try:  # inside a launch of several (srun -n 2), each of its processes would start N more
        outer = distributed.detect()
    except (distributed.LaunchError, ValueError):  # half set: an salloc shell, say
        outer = None
    if outer is not None and outer.launcher != "graphmod":
        raise _Failure(f"--processes {args.processes}: this process is one of "
                       f"{outer.num_processes or 'several'} processes {outer.launcher} "
                       "launched, each of which would start its own run; let the launcher "
                       f"start the processes (drop --processes), or start one launcher task")
    with socket.socket() as probe:  # a free loopback port for JAX's coordinator
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = {**os.environ, distributed.NUM_PROCESSES: str(args.processes),
            distributed.COORDINATOR: f"127.0.0.1:{port}",
            distributed.LAUNCHER_PID: str(os.getpid()), distributed.LAUNCHER: "graphmod"}
    if args.devices_per_process:  # replaces a device count set for this process
        flag = distributed.DEVICE_COUNT_FLAG
        flags = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
        base["XLA_FLAGS"] = " ".join([*flags, f"{flag}={args.devices_per_process}"])
    children: list[subprocess.Popen] = []
    stops: list[int] = []  # the stop signals this command got; the wait below passes them on

    def stop(signum: int, frame: object) -> None:
        stops.append(signum)
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = "press Ctrl-C again" if signum == signal.SIGINT else \
            f"send {what} again (or press Ctrl-C)"
        if len(stops) == 1:
            write_now(f"graphmod run: {what}: the processes stop at one step and save it; "
                      f"{again} to stop them at once")
        else:
            write_now(f"graphmod run: {what}: stopping the processes at once (saving nothing "
                      "more)")

    previous = take_stop_signals(stop_signals(), stop)
    try:
        for i in range(args.processes):
            if stops:
                break
            children.append(subprocess.Popen(
                [*CLI, "run", "--", args.script, *args.args],
                env={**base, distributed.PROCESS_ID: str(i)}))
        told: set[int] = set()
        while any(c.poll() is None for c in children):  # poll(): None while running
            if not stops and any(c.poll() for c in children):
                break  # a failure: the others are stopped below
            for child in children if stops else []:
                if child.poll() is None and (len(stops) > 1 or child.pid not in told):
                    child.send_signal(signal.SIGTERM if len(stops) == 1 else signal.SIGKILL)
                    told.add(child.pid)
            time.sleep(0.1)
        status = _status([c.returncode for c in children], stops)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for child in children:  # a failed process leaves the others waiting for it
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()  # JAX took SIGTERM as a preemption notice and goes on waiting
                child.wait()
    return status


def _status(codes: list[int | None], stops: list[int]) -> int:
    """The status of a run of processes that ended with ``codes``: the first failure's;
    else, stopped by ``stops``, 128 + the first (as a shell reports a process it ended)."""
    shell = [128 - c if c < 0 else c for c in codes if c is not None]  # ended by signal N
    stopped = {0, *(128 + s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL, *stops))}
    failed = next((c for c in shell if c not in (stopped if stops else {0})), 0)
    return failed or (128 + stops[0] if stops else 0)


def _reader(directory: PathLike) -> Any:  # a CheckpointReader: its meta read as JSON
    """A reader of an existing run directory (it creates nothing)."""
    from graphmod._train._checkpoint import CheckpointReader  # loads JAX: see the module docstring

    if not pathlib.Path(directory).is_dir():
        raise _Failure(f"no run directory at {directory} (check the path)")
    return CheckpointReader(directory)


def _latest_meta(reader: Any, directory: str) -> tuple[int, dict[str, Any]]:
    """The newest checkpoint's step and meta that can be read; each unreadable one is
    named on standard error (orbax's errors go to the debug log)."""
    from graphmod._train._checkpoint import CheckpointError  # loads JAX: see the module docstring

    if not reader.steps():
        raise _Failure(f"{directory} holds no checkpoint (a run saves them with "
                       "graphmod.plugins.Checkpoint)")

    def skipped(why: str) -> None:
        print(terminal_safe(f"graphmod resume: skipping the checkpoint of {why} in {directory}"),
              file=sys.stderr)

    try:
        meta = reader.meta(skipped=skipped)
    except CheckpointError:
        raise _Failure(f"no readable checkpoint in {directory} (steps {reader.steps()}); "
                       "remove or move the directories that are not checkpoints") from None
    return meta["step"], meta


def _resume(args: argparse.Namespace) -> int:
    directory = os.path.abspath(args.directory)
    try:  # one of a launch of several (srun graphmod resume DIR): the script runs in place
        here = distributed.detect()
    except (distributed.LaunchError, ValueError) as error:
        raise _Failure(str(error)) from None
    reader = _reader(directory)
    try:
        step, meta = _latest_meta(reader, directory)
    finally:
        reader.close()
    if "command" not in meta:
        raise _Failure(f"{directory}'s checkpoint of step {step} records no command; "
                       f"continue it from Python: graphmod.Loop.resume({directory!r}, ...)")
    try:
        command = resume_command(meta["command"], directory, script=args.script,
                                 in_place=here is not None)
    except ResubmitRequiredError as error:
        if error.command:  # on standard output, to copy; the reason goes to standard error
            print(terminal_safe(error.command))
        raise
    time = meta.get("time")
    epoch = f" (epoch {time['epoch']})" if isinstance(time, dict) and "epoch" in time else ""
    ended = _ended(meta)
    lines = [f"resuming {directory} at step {step}{epoch}, from its newest checkpoint",
             *([f"that checkpoint ends the run it was saved by ({ended}): the script stops "
                "at once unless it now asks for more epochs or steps"] if ended else []),
             f"script {command.script} (sha256 {command.sha256})",
             *([f"in place: process {here.process_id} of {here.num_processes} that "
                f"{here.launcher} launched"] if here is not None else []),
             f"running in {command.cwd}: {shlex.join(command.argv)}"]
    if here is None or not here.process_id:  # said once in a launch of several
        print("\n".join(f"graphmod resume: {terminal_safe(line)}" for line in lines),
              file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(command.cwd)
    # The script replaces this process: Ctrl-C and the exit status are its own.
    os.execve(command.argv[0], command.argv, {**os.environ, RESUME_VARIABLE: directory})
    return 0  # reached only where os.execve is replaced (tests)


def _ended(meta: Mapping[str, object]) -> str | None:
    """Which of its loop's limits a checkpoint's run had reached ("epoch 3 of 3"), if any
    (the meta read from disk: anything not an int reads as no limit)."""
    time, loop = meta.get("time"), meta.get("loop")
    if not (isinstance(time, dict) and isinstance(loop, dict)):
        return None
    for counter, limit in (("epoch", "epochs"), ("step", "steps")):
        done, most = time.get(counter), loop.get(limit)
        if isinstance(done, int) and isinstance(most, int) and done >= most:
            return f"{counter} {done} of {most}"
    return None


def _stopped(meta: Mapping[str, object]) -> str | None:
    """How a checkpoint's run was stopped before its end, if it was ("by SIGTERM at step
    12"): the record a stopped loop's save adds (the meta read from disk: anything else
    reads as not stopped)."""
    stopped = meta.get("stopped")
    if not (isinstance(stopped, dict) and isinstance(stopped.get("step"), int)):
        return None
    by = stopped.get("signal")
    who = f"by {by}" if isinstance(by, str) else "by a stop notice to a process of the run"
    return f"{who} at step {stopped['step']}"


def inspect_run(directory: str | os.PathLike) -> str:
    """What a run directory holds, as ``graphmod inspect DIR`` prints it: checkpoints (each
    verified), counters, timelines, plugins, metrics, the resumes on other data or with
    other settings, and a summary of the provenance record (model, managers, optimizer,
    data, seeds, fingerprint, versions). What it quotes from the records is escaped for the
    terminal (:func:`terminal_safe`): a crafted name cannot set a title or clear a screen.

    Examples:
        >>> import tempfile, graphmod as gm
        >>> print(gm.inspect_run(tempfile.mkdtemp()).splitlines()[1])
        checkpoints: none
    """
    reader = _reader(directory)
    try:
        steps = reader.steps()
        failures = {step: reader.verify(step) for step in steps}  # None: verified
        verified = [step for step in steps if failures[step] is None]
        meta = reader.meta(verified[-1]) if verified else {}
        leftovers, foreign = reader.leftovers(), reader.foreign()
    finally:
        reader.close()
    lines = [f"run directory: {os.path.abspath(directory)}",
             f"checkpoints: {', '.join(map(str, steps)) if steps else 'none'}"]
    lines += [f"checkpoint {step}: " + ("verified" if failures[step] is None
                                        else f"FAILS verification: {failures[step]}")
              for step in steps]
    lines += [f"leftover {name}: {what}" for name, what in leftovers.items()]
    lines += [f"not graphmod's {name}: {why}; never read or deleted"
              for name, why in foreign.items()]
    if meta.get("time"):
        time = meta["time"]
        lines.append("latest: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in time.items()))
        lines.append(f"loop: {json.dumps(meta['loop'])}; position in epoch: {meta['position']}")
        lines += [f"model {model['name']}: {'stepping' if model['steps'] else 'frozen'}"
                  + (f", at {model['schedule']}" if model["schedule"] else "")
                  + (f", reads {', '.join(model['reads'])}" if model["reads"] else "")
                  for model in meta.get("models", [])]  # escaped below, as every line
        if stopped := _stopped(meta):  # the newest verified checkpoint is the stop's save
            lines.append(f"stopped {stopped}; continue with: graphmod resume "
                         f"{shlex.quote(os.path.abspath(directory))}")
    if meta:
        tree = meta.get("tree", {})
        size = sum(_count(shape) for shape, _ in tree.values())
        lines.append(f"state: {len(tree)} arrays, {size:,} numbers")
        if meta.get("metrics"):
            lines.append(f"metrics at step {meta['time']['step']}: " + ", ".join(
                f"{name}={value:.6g}" if isinstance(value, float) else f"{name}={value!r}"
                for name, value in dict(meta["metrics"]).items()))
        for name, state in meta.get("plugins", {}).items():
            text = json.dumps(state)  # a long history cut: the checkpoint holds it all
            lines.append(f"plugin {name}: {text if len(text) <= 300 else text[:299] + '…'}")
        if meta.get("command"):
            lines.append(f"command: {command_text(meta['command'])}")
            lines.append(f"launched: {launch_text(meta['command'])}")
        lines += [f"resumed on other data at step {change['step']}: "
                  f"{', '.join(change['fields'])}" for change in meta.get("data_changes", [])]
        lines += [f"resumed with other settings at step {change['step']}: "
                  f"{', '.join(change['settings'])} (the checkpoint records those before)"
                  for change in meta.get("setting_changes", [])]
        lines += _provenance_lines(meta)
    for log in sorted(pathlib.Path(directory).glob("*.jsonl")):
        rows = log.read_text().splitlines()
        if rows:
            lines.append(f"metrics ({log.name}, {len(rows)} rows), last: {rows[-1]}")
    lines = [terminal_safe(line) for line in lines]  # a record's text is shown, never acted on
    return "\n".join(line if len(line) <= 100 else textwrap.fill(  # 100 columns, nothing cut
        line, 100, subsequent_indent="    ", break_on_hyphens=False) for line in lines)


def _provenance_lines(meta: dict[str, Any]) -> list[str]:
    if "provenance" not in meta:
        error = meta.get("provenance_error")
        return [f"provenance: not recorded ({error})"] if error else []
    from graphmod._records._record import Provenance  # loads JAX: see the module docstring

    try:
        record = Provenance.from_dict(meta["provenance"])
    except (TypeError, ValueError) as error:
        return [f"provenance: unreadable ({error})"]
    summary = record.summary()
    width = max(len(k) for k, _ in summary)
    return (["provenance:"] + [f"  {k.ljust(width)}  {v}" for k, v in summary]
            + _data_lines(meta["provenance"].get("inputs") or {}))


def _data_lines(inputs: dict[str, Any]) -> list[str]:
    """The fitted transforms and the training data's metadata a record holds, as tables."""
    from graphmod.data import FittedTransforms, Metadata  # loads JAX, as the record does

    fitted, described = inputs.get("transforms"), (inputs.get("data") or {}).get("metadata")
    try:
        if fitted is not None:
            transforms = FittedTransforms.from_record(fitted)
            return (["fitted transforms:", *_indented(repr(transforms)),
                     "training data:", *_indented(repr(transforms.metadata))])
        if described is not None:
            return ["training data:", *_indented(repr(Metadata.from_dict(described)))]
    except (KeyError, TypeError, ValueError) as error:  # shown, never acted on
        return [f"transforms: unreadable ({error})"]
    return []


def _indented(text: str) -> list[str]:
    return [f"  {line}" for line in text.splitlines()]


def _count(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _inspect(args: argparse.Namespace) -> int:
    try:
        report = inspect_run(args.directory)
    except _Failure:
        raise
    except Exception as error:  # orbax raises many kinds; the user needs the path
        _log.debug("inspecting %s", args.directory, exc_info=True)
        raise _Failure(f"cannot read the checkpoints in {args.directory} "
                       f"({type(error).__name__}: {error})") from error
    print(report)
    return 0


def _positive(text: str) -> int:
    """An argument that must be a whole number >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    """The command line's parser: one sub-command each for run, resume and inspect."""
    parser = argparse.ArgumentParser(
        prog="graphmod",
        description="Run a training script, resume a saved run, or inspect a run directory.",
        epilog="Run 'graphmod COMMAND --help' for a command's arguments.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    handlers = {"run": _run, "resume": _resume, "inspect": _inspect}
    for name, (summary, description) in _COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=description)
        sub.set_defaults(handler=handlers[name], parser=sub)
        if name == "run":
            sub.add_argument("--processes", type=_positive, default=1, metavar="N",
                             help="start N processes of SCRIPT on this machine, joined into "
                                  "one run by graphmod.distributed.initialize() (default 1)")
            sub.add_argument("--devices-per-process", type=_positive, metavar="D",
                             help="with --processes on CPU: give each process D virtual "
                                  "devices")
            sub.add_argument("script", nargs="?", metavar="SCRIPT",
                             help="the Python script to run")
            sub.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                             help="the script's own arguments, passed on unchanged")
        else:
            sub.add_argument("directory", metavar="DIR",
                             help="the run directory (the one given to Checkpoint)")
        if name == "resume":
            sub.add_argument("--script", metavar="PATH",
                             help="run this script, once you have read it: the recorded one "
                                  "(outside this directory, or changed since the run "
                                  "started) or the same file moved (default: the recorded "
                                  "script, if it lies in this directory and is unchanged)")
    _add_control(commands)
    return parser


def _add_control(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``graphmod control DIR COMMAND [ARG]`` (see :func:`_control`)."""
    sub = commands.add_parser(
        "control", help="send a command to a running loop",
        description="Send COMMAND to the loop running with graphmod.plugins.Control whose "
                    "run directory is DIR, and print its answer: status, pause, resume, "
                    "stop (saves first; --no-save: not), save, set NAME=VALUE (a dynamic "
                    "hyperparameter: manager/hparam such as dropout/rate, or lr), event NAME "
                    "(fires a command event plugins match with On('command', name=NAME)). "
                    "A run that is not running, or gone, is one line of error and exit "
                    "status 1.")
    sub.set_defaults(handler=_control, parser=sub)
    sub.add_argument("directory", metavar="DIR", help="the run directory")
    sub.add_argument("action", choices=CONTROL_COMMANDS, metavar="COMMAND",
                     help=", ".join(CONTROL_COMMANDS))
    sub.add_argument("argument", nargs="?", metavar="ARG",
                     help="set: NAME=VALUE; event: NAME")
    sub.add_argument("--no-save", action="store_true", help="stop: end without saving")
    sub.add_argument("--wait", type=float, default=5.0, metavar="S",
                     help="seconds to wait for the loop to apply the command (default 5; "
                          "then it is left queued)")
    sub.add_argument("--json", action="store_true", help="print the answer as JSON")


def _control(args: argparse.Namespace) -> int:
    """Sends the command to the run controlled from ``args.directory`` and prints its
    answer (escaped: it quotes the run); 1 when refused or when no run answers there."""
    try:
        command, arguments = command_request(args.action, args.argument,
                                             save=not args.no_save)
    except ValueError as error:
        args.parser.error(str(error))
    if not 0 <= args.wait <= 60:
        args.parser.error(f"--wait {args.wait:g}: expected seconds in [0, 60]")
    try:
        answer = send_command(args.directory, command, arguments, wait=args.wait)
    except NotRunning as error:
        print(f"graphmod control: {terminal_safe(str(error))}", file=sys.stderr)
        return 1
    lines = [json.dumps(answer)] if args.json else answer_lines(command, answer)
    for line in lines:
        print(terminal_safe(line), file=sys.stdout if answer["ok"] else sys.stderr)
    return 0 if answer["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``graphmod`` command; returns the exit status.

    Usage errors exit with status 2 and a message on standard error, as argparse does;
    an interrupted command returns 130.

    Examples:
        >>> from graphmod._cli import main
        >>> main(["inspect", "/nonexistent"])  # the message goes to standard error
        2
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("a command is needed: run, resume, inspect or control")
    if args.command == "run" and args.script is None:
        args.parser.error("a script is needed: graphmod run SCRIPT [ARGS...]")
    try:
        return args.handler(args)
    except (_Failure, ResumeRefusedError) as error:  # they may quote a record: escaped
        print(f"graphmod {args.command}: {terminal_safe(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:  # one line, not a traceback through graphmod
        detail = f": {error}" if str(error) else ""
        print(f"graphmod {args.command}: interrupted{terminal_safe(detail)}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
