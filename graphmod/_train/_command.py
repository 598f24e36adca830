"""How a run was started, and the command that starts it again (``graphmod resume``).

A checkpoint records how its process was started (:func:`recorded_command`) so that
``graphmod resume DIR`` can run it again. The record is data and stays data: the interpreter
is never recorded, and :func:`resume_command` turns a record back into an argument list only
for a run started from a script file, as ``[sys.executable, "--", /absolute/script, *args]``:
the script can never be read as an interpreter option, the arguments reach the script as its
``sys.argv`` and no shell is involved.

Threat model: a checkpoint directory may come from someone else, and its record may be
crafted. So ``resume_command`` refuses, with :class:`ResumeRefusedError`, every record that
would make the interpreter run something other than a script file that exists: runs started
with ``python -c``, ``python -m``, from standard input, in a Jupyter kernel or an interactive
shell (these are continued from Python with ``graphmod.Loop.resume``), an old record whose
first argument is not an existing ``.py`` file, a script of the Python installation itself
(``timeit.py``, ``pdb.py`` and friends execute their arguments) and a script stored inside
the run directory. ``graphmod resume`` prints the command before it runs it.
"""

from __future__ import annotations

import builtins
import itertools
import os
import pathlib
import site
import sys
import sysconfig
from collections.abc import Sequence
from typing import Any, NoReturn

from graphmod import distributed


def _cwd() -> str | None:
    """The working directory, or None where it was deleted."""
    try:
        return os.getcwd()
    except OSError:
        return None


# The working directory when graphmod was imported: a script's relative arguments are
# relative to it, even if the script changes directory before its run is saved.
_START_CWD = _cwd()

# Set by `graphmod resume DIR` for the script it runs: its Checkpoint(DIR) plugins resume.
RESUME_VARIABLE = "GRAPHMOD_RESUME"

KINDS = ("script", "code", "module", "stdin", "jupyter", "interactive", "unknown")

# The graphmod command as a child process: -P keeps the working directory (a recorded one,
# when resuming) off sys.path, so no graphmod package planted there is imported.
CLI = (sys.executable, "-P", "-m", "graphmod._cli")

# A crafted record must not start a machine's worth of processes: local multi-process runs
# hold a process per accelerator or a few on a CPU.
MAX_PROCESSES, MAX_DEVICES_PER_PROCESS = 64, 1024

_HOW = {"code": "with python -c", "stdin": "from code read by python -",
        "jupyter": "in a Jupyter kernel", "interactive": "in an interactive Python shell",
        "unknown": "in a way graphmod could not identify as a script"}


class ResumeRefusedError(ValueError):
    """A recorded command that ``graphmod resume`` will not run, and why.

    Examples:
        >>> from graphmod._train._command import ResumeRefusedError, resume_command
        >>> try:
        ...     resume_command({"kind": "code", "argv": ["-c"], "cwd": "/"}, "/runs/a")
        ... except ResumeRefusedError as error:
        ...     print(str(error).split(";")[0])
        /runs/a was started with python -c (recorded argv: ['-c'])
    """


def recorded_command() -> dict[str, Any]:
    """How the current process was started, as JSON data for a checkpoint.

    ``kind`` is one of ``script`` (with ``script``, the resolved absolute path, and ``args``),
    ``module`` (``python -m``, with ``module``), ``code`` (``python -c``), ``stdin``,
    ``jupyter``, ``interactive`` or ``unknown``. ``argv`` (``sys.argv``, for display) and
    ``cwd`` (the working directory at start) come with every kind. A run started by
    ``graphmod run SCRIPT`` records ``SCRIPT``; one started by ``graphmod run --processes N
    [--devices-per-process D] SCRIPT`` also records ``processes`` (and
    ``devices_per_process``).

    Examples:
        >>> from graphmod._train._command import KINDS, recorded_command
        >>> record = recorded_command()
        >>> record["kind"] in KINDS, sorted(record)[:3]
        (True, ['argv', 'cwd', 'kind'])
    """
    argv = [str(arg) for arg in getattr(sys, "argv", [])]
    record: dict[str, Any] = {"kind": "unknown", "argv": argv, "cwd": _START_CWD}
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if _in_kernel(argv):
        record["kind"] = "jupyter"
    elif _ipython_shell() is not None or sys.flags.interactive or not argv or argv[0] == "":
        record["kind"] = "interactive"
    elif argv[0] in ("-c", "-"):
        record["kind"] = "code" if argv[0] == "-c" else "stdin"
    elif spec is not None and spec.name != "__main__":  # a directory or zip app is unknown
        record.update(kind="module", module=spec.name.removesuffix(".__main__"))
    elif spec is None:
        script = _main_script(getattr(main, "__file__", None), argv[0])
        if script is not None:
            record.update(kind="script", script=script, args=argv[1:])
    return {**record, **_processes()}


def _processes() -> dict[str, int]:
    """``{"processes": N, "devices_per_process": D}`` in a process of a run started by
    ``graphmod run --processes N [--devices-per-process D]`` (D when its XLA flags set it);
    ``{}`` in a process started alone."""
    try:
        count = int(os.environ.get(distributed.NUM_PROCESSES, "1"))
    except ValueError:
        return {}
    if count <= 1:
        return {}
    record = {"processes": count}
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == distributed.DEVICE_COUNT_FLAG and value.isdigit():
            record["devices_per_process"] = int(value)
    return record


def _main_script(file: Any, argv0: str) -> str | None:
    """The resolved path of ``__main__``'s file when it is the file ``sys.argv[0]`` names."""
    if not isinstance(file, str) or not os.path.isfile(file):
        return None
    script = os.path.realpath(file)
    same = os.path.realpath(os.path.join(_START_CWD or "", argv0)) == script
    return script if same else None


def _ipython_shell() -> Any:
    """The running IPython shell, if IPython is loaded and one runs (never imports IPython)."""
    for getter in (getattr(builtins, "get_ipython", None),  # set while a shell runs code
                   getattr(sys.modules.get("IPython"), "get_ipython", None)):
        try:
            shell = getter() if callable(getter) else None
        except Exception:  # a broken IPython install is no shell
            shell = None
        if shell is not None:
            return shell
    return None


def _kernel_argv(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a Jupyter kernel's (a kernel launcher, or a connection file)."""
    return bool(argv) and (
        os.path.basename(argv[0]).endswith("kernel_launcher.py")
        or any(flag == "-f" and _connection_file(path) for flag, path in itertools.pairwise(argv))
        or any(arg.startswith("--f=") and _connection_file(arg[4:]) for arg in argv))


def _in_kernel(argv: Sequence[str]) -> bool:
    """Whether this process is a Jupyter/IPython kernel (ipykernel, Colab, VS Code)."""
    if _kernel_argv(argv):
        return True
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", "") or ""
    return (spec_name.startswith(("ipykernel", "colab_kernel"))
            or getattr(_ipython_shell(), "kernel", None) is not None)


def _connection_file(path: str) -> bool:
    """Whether ``path`` looks like a Jupyter connection file (``kernel-<id>.json``)."""
    name = os.path.basename(path)
    return name.startswith("kernel") and name.endswith(".json")


def command_text(record: Any) -> str:
    """A one-line, human-readable account of a recorded command (for ``graphmod inspect``).

    Examples:
        >>> from graphmod._train._command import command_text
        >>> command_text({"kind": "script", "script": "/w/train.py", "args": ["--lr", "1"],
        ...               "argv": ["train.py", "--lr", "1"], "cwd": "/w"})
        'script /w/train.py --lr 1 (in /w)'
        >>> command_text({"kind": "code", "argv": ["-c"], "cwd": "/w"})
        "started with python -c (argv ['-c'], in /w)"
    """
    if isinstance(record, list):  # the old format: sys.argv alone
        return f"argv {record!r} (old format)"
    if not isinstance(record, dict):
        return f"unreadable record {record!r}"
    cwd = record.get("cwd")
    if record.get("kind") == "script":
        words = [str(record.get("script")), *map(str, record.get("args") or [])]
        processes = record.get("processes")
        devices = record.get("devices_per_process")
        many = "" if processes is None else f"; {processes} processes" + (
            "" if devices is None else f" of {devices} devices")
        return f"script {' '.join(words)} (in {cwd}{many})"
    if record.get("kind") == "module":
        return f"started with python -m {record.get('module')} (argv {record.get('argv')!r})"
    if "kind" not in record:
        return f"argv {record.get('argv')!r} (old format, in {cwd})"
    how = _HOW.get(record["kind"], f"of unknown kind {record['kind']!r}")
    return f"started {how} (argv {record.get('argv')!r}, in {cwd})"


def resume_command(record: Any, directory: str | os.PathLike) -> tuple[list[str], str]:
    """The argument list and working directory that run ``record``'s script again.

    Args:
        record: a checkpoint's ``command`` entry (from :func:`recorded_command`, or the old
            ``{"argv": [...], "cwd": ...}`` / plain argv list).
        directory: the run directory being resumed (a script inside it is refused).

    Returns:
        ``([sys.executable, "--", script, *args], cwd)``, to run without a shell; for a run
        of several processes ``[*CLI, "run", "--processes", N, ("--devices-per-process",
        D,) script, *args]``.

    Raises:
        ResumeRefusedError: the record names no existing script file outside the Python
            installation and the run directory, or its arguments or directory are not
            plain strings; the message says what was recorded and to use ``Loop.resume``.

    Examples:
        >>> import os, tempfile
        >>> from graphmod._train._command import resume_command
        >>> folder = tempfile.mkdtemp()
        >>> script = os.path.join(folder, "train.py")
        >>> open(script, "w").close()
        >>> record = {"kind": "script", "script": script, "args": ["--lr", "0.1"], "cwd": folder}
        >>> command, cwd = resume_command(record, "/runs/a")
        >>> command[1:] == ["--", os.path.realpath(script), "--lr", "0.1"], cwd == folder
        (True, True)
    """
    directory = os.path.abspath(os.fspath(directory))
    script, args, cwd = _script_record(record, directory)
    path = _checked_script(script, directory)
    if not isinstance(args, list) or not all(isinstance(a, str) and "\0" not in a for a in args):
        _refuse(f"{directory} recorded the arguments {args!r}, not a list of plain strings",
                directory)
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        _refuse(f"{directory} recorded the working directory {cwd!r}, which does not exist",
                directory)
    launch = _launch(record, directory)
    if launch:
        return [*CLI, "run", *launch, path, *args], cwd
    return [sys.executable, "--", path, *args], cwd


def _launch(record: Any, directory: str) -> list[str]:
    """``graphmod run``'s options that start a multi-process run again (``[]`` for a run
    of one process); refuses counts that are not whole numbers within bounds."""
    if not isinstance(record, dict) or "processes" not in record:
        return []
    count, devices = record["processes"], record.get("devices_per_process")
    whole = lambda n, most: type(n) is int and 1 <= n <= most  # a bool is no count
    if not whole(count, MAX_PROCESSES) or not (devices is None
                                               or whole(devices, MAX_DEVICES_PER_PROCESS)):
        _refuse(f"{directory} recorded {count!r} processes of {devices!r} devices each, not "
                f"whole numbers from 1 to {MAX_PROCESSES} and {MAX_DEVICES_PER_PROCESS}",
                directory)
    options = ["--processes", str(count)]
    return options if devices is None else [*options, "--devices-per-process", str(devices)]


def _checked_script(script: Any, directory: str) -> str:
    """The resolved path of a recorded script that may be run again; refuses one that is
    no existing file, or lies inside the run directory or the Python installation."""
    where = f"{directory} recorded the script {script!r}"
    if not isinstance(script, str) or not os.path.isabs(script) or script.startswith("-"):
        _refuse(f"{where}, which is not an absolute path", directory)
    if not os.path.isfile(script):
        _refuse(f"{where}, which is not an existing file", directory)
    path = os.path.realpath(script)
    if _inside(path, os.path.realpath(directory)):
        _refuse(f"{where}, which lies inside the run directory: a script stored with the "
                "checkpoints is not run", directory)
    installation = next((d for d in _installation() if _inside(path, d)), None)
    if installation is not None:
        _refuse(f"{where}, which belongs to the Python installation ({installation}), not "
                "to a training run", directory)
    return path


def _script_record(record: Any, directory: str) -> tuple[Any, Any, Any]:
    """``(script, args, cwd)`` from a new or old-format record; refuses every other kind."""
    if isinstance(record, list):
        record = {"argv": record}
    if not isinstance(record, dict):
        _refuse(f"{directory} records no command (found {record!r})", directory)
    if "kind" not in record:
        record = _from_old_format(record, directory)
    kind = record.get("kind")
    if kind == "script":
        return record.get("script"), record.get("args"), record.get("cwd")
    if kind == "module":
        how = f"with python -m {record.get('module')}"
    else:
        how = _HOW.get(kind, f"in a way graphmod does not know ({kind!r})")
    _refuse(f"{directory} was started {how} (recorded argv: {record.get('argv')!r})", directory)


def _from_old_format(record: dict[str, Any], directory: str) -> dict[str, Any]:
    """The record of an old ``{"argv", "cwd"}`` entry: a script only if ``argv[0]`` is an
    existing ``.py`` file."""
    argv, cwd = record.get("argv"), record.get("cwd", os.getcwd())
    if isinstance(argv, list) and all(isinstance(arg, str) for arg in argv):
        if _kernel_argv(argv):
            return {"kind": "jupyter", "argv": argv, "cwd": cwd}
        first = argv[0] if argv else ""
        if (isinstance(cwd, str) and not first.startswith("-") and first.endswith(".py")
                and os.path.isfile(os.path.join(cwd, first))):
            return {"kind": "script", "script": os.path.join(cwd, first), "args": argv[1:],
                    "cwd": cwd}
    _refuse(f"{directory} holds an old-format record whose first argument is not an existing "
            f".py file (recorded argv: {argv!r})", directory)


def _refuse(reason: str, directory: str) -> NoReturn:
    """Raises :class:`ResumeRefusedError` with ``reason`` and what to do instead."""
    raise ResumeRefusedError(
        f"{reason}; graphmod resume only re-runs a script file started as "
        f"python SCRIPT [ARGS...]. Continue the run from Python instead: "
        f"graphmod.Loop.resume({directory!r}, step, data, plugins=[...]), or run your "
        f"script again yourself with Checkpoint({directory!r}, resume=True).")


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies below it."""
    return pathlib.Path(path).is_relative_to(folder)


def _installation() -> list[str]:
    """The folders of the Python installation (standard library, site-packages, scripts)."""
    bases = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
             "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}
    keys = ("stdlib", "platstdlib", "purelib", "platlib", "scripts")
    folders = [paths[key] for paths in (sysconfig.get_paths(), sysconfig.get_paths(vars=bases))
               for key in keys]
    folders += [*site.getsitepackages(), site.getusersitepackages()]
    return sorted({os.path.realpath(folder) for folder in folders})
