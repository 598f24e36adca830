"""How a run was started, and the command that starts it again (``graphmod resume``).

A checkpoint records how its process was started (:func:`recorded_command`) so that
``graphmod resume DIR`` can run it again. The record is data and stays data: the interpreter
is never recorded, and :func:`resume_command` turns a record back into an argument list only
for a run started from a script file, as ``[sys.executable, "--", /absolute/script, *args]``
(``[*CLI, "run", "--processes", N, "--", /absolute/script, *args]`` for several processes
of ``graphmod run``): the script can never be read as an interpreter option, the arguments
reach the script as its ``sys.argv`` and no shell is involved.

A run of several processes also records how they were launched (``launcher``: see
:mod:`graphmod.distributed`, and ``job``: the scheduler's facts that help to submit it
again, such as Slurm's job id, name, partition and nodes). ``graphmod resume`` starts only
the local processes of ``graphmod run``; a run another launcher started (Slurm, MPI, a TPU
pod, Kubernetes, explicit arguments) is resumed in place inside a new launch of it
(``srun graphmod resume DIR``: every process runs the script itself, ``in_place``), and
refused outside one with :class:`ResubmitRequiredError`, which carries the command that
submits it again (printed, never run). Records without these fields read as before.

Threat model: a checkpoint directory may come from someone else, and its record may be
crafted, hash included. So the trust anchor is the directory ``graphmod resume`` runs from,
never the record: ``resume_command`` runs only a script file inside that directory whose
sha256 is the one recorded when the run started (``script_sha256``), or the file the user
names (``graphmod resume DIR --script PATH``). It refuses, with :class:`ResumeRefusedError`,
runs started with ``python -c``, ``python -m``, from standard input, in a Jupyter kernel or
an interactive shell (these are continued from Python with ``graphmod.Loop.resume``), an old
record whose first argument is not an existing ``.py`` file, a script stored inside the run
directory, and any file of any Python installation (``timeit.py``, ``pdb.py`` and friends
execute their arguments), even one named with ``--script``. ``graphmod resume`` prints the
script, its hash and the command before it runs it.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import itertools
import os
import pathlib
import re
import shlex
import site
import sys
import sysconfig
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn, TypeGuard

from graphmod import distributed

if TYPE_CHECKING:
    from graphmod.typing import JSON


def working_directory() -> str | None:
    """The working directory, or None where it was deleted."""
    try:
        return os.getcwd()
    except OSError:
        return None


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


def recorded_command(cwd: str | None = None) -> dict[str, JSON]:
    """How the current process was started, as JSON data for a checkpoint; ``cwd``: the
    working directory the run started in (a ``Loop`` notes it when it is made, so a script's
    relative arguments stay relative to it even if the script changes directory later;
    default: the current one).

    ``kind`` is one of ``script`` (with ``script``, the resolved absolute path, ``args`` and
    ``script_sha256``, the script's content hash when the process first records itself),
    ``module`` (``python -m``, with ``module``), ``code`` (``python -c``), ``stdin``,
    ``jupyter``, ``interactive`` or ``unknown``. ``argv`` (``sys.argv``, for display) and
    ``cwd`` (the working directory at start) come with every kind. A run started by
    ``graphmod run SCRIPT`` records ``SCRIPT``; a process of a run of several also records
    ``processes``, ``launcher`` (``graphmod`` for ``graphmod run --processes N
    [--devices-per-process D] SCRIPT``, with ``devices_per_process``; ``slurm`` and the
    others of :mod:`graphmod.distributed`) and, for a scheduler, ``job`` (its facts, as
    strings).

    Examples:
        >>> from graphmod._train._command import KINDS, recorded_command
        >>> record = recorded_command()
        >>> record["kind"] in KINDS, sorted(record)[:3]
        (True, ['argv', 'cwd', 'kind'])
    """
    argv = [str(arg) for arg in getattr(sys, "argv", [])]
    cwd = working_directory() if cwd is None else cwd
    record: dict[str, JSON] = {"kind": "unknown", "argv": list(argv), "cwd": cwd}
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
        script = _main_script(getattr(main, "__file__", None), argv[0], cwd)
        if script is not None:
            record.update(kind="script", script=script, args=list(argv[1:]),
                          script_sha256=_first_sha256(script))
    return {**record, **_processes()}


def script_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, as hex: what ``graphmod resume`` compares with the
    hash recorded when the run started.

    Examples:
        >>> import tempfile
        >>> from graphmod._train._command import script_sha256
        >>> with tempfile.NamedTemporaryFile(suffix=".py") as file:
        ...     script_sha256(file.name)[:16]  # the hash of no bytes
        'e3b0c44298fc1c14'
    """
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


# A process records its script's hash once, as it was when the run started: an edit made
# while it runs must not become the hash that a resume trusts.
_first_sha256 = functools.cache(script_sha256)


# The scheduler's facts a record keeps, {field: variable}: what helps to submit it again.
_SLURM_FACTS = {"job_id": "SLURM_JOB_ID", "job_name": "SLURM_JOB_NAME",
                "partition": "SLURM_JOB_PARTITION", "account": "SLURM_JOB_ACCOUNT",
                "qos": "SLURM_JOB_QOS", "nodes": "SLURM_JOB_NUM_NODES",
                "cpus_per_task": "SLURM_CPUS_PER_TASK", "gpus_per_node": "SLURM_GPUS_PER_NODE",
                "submit_dir": "SLURM_SUBMIT_DIR"}
_POD_FACTS = {"jobset": "JOBSET_NAME", "job": "REPLICATED_JOB_NAME", "pod": "HOSTNAME"}
_FACTS = {"slurm": _SLURM_FACTS, "kubernetes": _POD_FACTS, "gketpu": _POD_FACTS}


def _processes() -> dict[str, JSON]:
    """``{"processes": N, "launcher": ..., ...}`` in a process of a run of several (the one
    it joined, else the one ``graphmod run --processes N`` started it in: D devices when its
    XLA flags set them); ``{}`` in a process alone."""
    launch = distributed.joined()
    if launch is None:  # not joined (yet): graphmod run's variable alone says so, as before
        try:
            count = int(os.environ.get(distributed.NUM_PROCESSES, "1"))
        except ValueError:
            return {}
        record: dict[str, JSON] = {"processes": count}
    else:
        count = launch.num_processes or 1
        record = {"processes": count, "launcher": launch.launcher}
    if count <= 1:
        return {}
    if record.get("launcher", "graphmod") == "graphmod":
        for flag in os.environ.get("XLA_FLAGS", "").split():
            name, _, value = flag.partition("=")
            if name == distributed.DEVICE_COUNT_FLAG and value.isdigit():
                record["devices_per_process"] = int(value)
    launcher = record.get("launcher", "")
    facts: dict[str, JSON] = {field: os.environ[name] for field, name in _FACTS.get(
        launcher if isinstance(launcher, str) else "", {}).items() if name in os.environ}
    return {**record, **({"job": facts} if facts else {})}


def _main_script(file: object, argv0: str, cwd: str | None) -> str | None:
    """The resolved path of ``__main__``'s file when it is the file ``sys.argv[0]`` names
    (relative to ``cwd``)."""
    if not isinstance(file, str) or not os.path.isfile(file):
        return None
    script = os.path.realpath(file)
    same = os.path.realpath(os.path.join(cwd or "", argv0)) == script
    return script if same else None


def _ipython_shell() -> object:
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


def command_text(record: JSON) -> str:
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
        args = record.get("args") or []
        words = [str(record.get("script")), *map(str, args if isinstance(args, list) else [args])]
        processes = record.get("processes")
        devices = record.get("devices_per_process")
        many = "" if processes is None else f"; {processes} processes" + (
            "" if devices is None else f" of {devices} devices")
        return f"script {' '.join(words)} (in {cwd}{many})"
    if record.get("kind") == "module":
        return f"started with python -m {record.get('module')} (argv {record.get('argv')!r})"
    if "kind" not in record:
        return f"argv {record.get('argv')!r} (old format, in {cwd})"
    how = _HOW.get(_kind(record["kind"]), f"of unknown kind {record['kind']!r}")
    return f"started {how} (argv {record.get('argv')!r}, in {cwd})"


class ResubmitRequiredError(ResumeRefusedError):
    """A run another launcher started (Slurm, MPI, a TPU pod, Kubernetes, explicit
    arguments), resumed outside a launch of it: ``graphmod resume`` starts no process.
    :attr:`command` submits it again where one can be written (each of its processes then
    runs ``graphmod resume DIR``, in place), else None; it is printed, never run.

    Examples:
        >>> import os, tempfile
        >>> from graphmod._train._command import ResubmitRequiredError, resume_command
        >>> folder = tempfile.mkdtemp()
        >>> script = os.path.join(folder, "train.py")
        >>> open(script, "w").close()  # started by mpirun -np 4 python train.py
        >>> record = {"kind": "script", "script": script, "args": [], "cwd": folder,
        ...           "launcher": "ompi", "processes": 4}
        >>> try:
        ...     resume_command(record, "/runs/a", script=script)
        ... except ResubmitRequiredError as error:
        ...     print(error.command)  # doctest: +ELLIPSIS
        mpirun -np 4 graphmod resume /runs/a --script ...train.py
        >>> resume_command(record, "/runs/a", script=script, in_place=True).argv[1]
        '--'
    """

    def __init__(self, message: str, command: str | None) -> None:
        super().__init__(message)
        self.command = command


class ResumeCommand(NamedTuple):
    """What ``graphmod resume`` runs: the argument list (to run without a shell), its working
    directory, and the script with its sha256 (shown before it runs).

    Examples:
        >>> from graphmod._train._command import ResumeCommand
        >>> ResumeCommand(["python", "--", "/w/t.py"], "/w", "/w/t.py", "e3b0").script
        '/w/t.py'
    """

    argv: list[str]
    cwd: str
    script: str
    sha256: str


def resume_command(record: JSON, directory: str | os.PathLike, *,
                   script: str | os.PathLike | None = None,
                   trusted: str | os.PathLike | None = None,
                   in_place: bool = False) -> ResumeCommand:
    """The command, working directory and script that run ``record``'s script again.

    Args:
        record: a checkpoint's ``command`` entry (from :func:`recorded_command`, or the old
            ``{"argv": [...], "cwd": ...}`` / plain argv list).
        directory: the run directory being resumed (a script inside it is refused).
        script: the script the user names (``graphmod resume DIR --script PATH``), run in
            place of the recorded one when it is that file (changed or not) or a file with
            its recorded hash (the script moved), wherever it lies.
        trusted: without ``script``, the directory the recorded script must lie in
            (default: the working directory, the one ``graphmod resume`` runs from).
        in_place: this process is one of a launch of several (``srun graphmod resume``):
            run the script in this process, whoever launched the run before.

    Returns:
        ``[sys.executable, "--", script, *args]``, for a run of several processes of
        ``graphmod run`` ``[*CLI, "run", "--processes", N, ("--devices-per-process", D,)
        "--", script, *args]`` (unless ``in_place``), with the recorded working directory,
        the resolved script and its sha256.

    Raises:
        ResumeRefusedError: the record names no script to run (see the module docstring),
            the script lies outside ``trusted`` or its hash is not the recorded one, or the
            arguments or directory are not plain strings; the message names the script,
            both hashes and the fix.
        ResubmitRequiredError: (not ``in_place``) another launcher started the run's
            processes; it carries the command that submits it again.

    Examples:
        >>> import hashlib, os, tempfile
        >>> from graphmod._train._command import resume_command
        >>> folder = tempfile.mkdtemp()
        >>> script = os.path.join(folder, "train.py")
        >>> open(script, "w").close()
        >>> record = {"kind": "script", "script": script, "args": ["--lr", "0.1"], "cwd": folder,
        ...           "script_sha256": hashlib.sha256(b"").hexdigest()}
        >>> command, cwd, _, _ = resume_command(record, "/runs/a", trusted=folder)
        >>> command[1:] == ["--", os.path.realpath(script), "--lr", "0.1"], cwd == folder
        (True, True)
    """
    directory = os.path.abspath(os.fspath(directory))
    recorded, args, cwd, digest = _script_record(record, directory)
    if not isinstance(recorded, str) or not os.path.isabs(recorded) or recorded.startswith("-"):
        _refuse(f"{directory} recorded the script {recorded!r}, which is not an absolute path",
                directory)
    if script is None:
        anchor = working_directory() if trusted is None else os.fspath(trusted)
        if anchor is None:
            _refuse("the directory graphmod resume runs from was deleted", directory,
                    "change to the directory that holds your script and run it again")
        path, found = _trusted_script(recorded, digest, directory, os.path.realpath(anchor))
    else:
        path, found = _named_script(os.fspath(script), recorded, digest, directory)
    arguments = _strings(args)
    if arguments is None or any("\0" in a for a in arguments):
        _refuse(f"{directory} recorded the arguments {args!r}, not a list of plain strings",
                directory)
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        _refuse(f"{directory} recorded the working directory {cwd!r}, which does not exist",
                directory)
    launch = [] if in_place else _launch(record, directory, path if script else None)
    # "--" ends the options: neither the script nor its arguments can be read as one.
    argv = ([*CLI, "run", *launch, "--", path, *arguments] if launch
            else [sys.executable, "--", path, *arguments])
    return ResumeCommand(argv, cwd, path, found)


def _whole(n: object, most: float) -> TypeGuard[int]:
    """Whether ``n`` is a whole number from 1 to ``most`` (a bool is no count)."""
    return type(n) is int and 1 <= n <= most


def _launch(record: JSON, directory: str, script: str | None) -> list[str]:
    """``graphmod run``'s options that start a multi-process run again (``[]`` for a run
    of one process); refuses counts that are not whole numbers within bounds, and a run
    another launcher started (:func:`_resubmit`)."""
    if not isinstance(record, dict) or "processes" not in record:
        return []
    if record.get("launcher", "graphmod") != "graphmod":
        _resubmit(record, directory, script)
    count, devices = record["processes"], record.get("devices_per_process")
    whole = _whole
    if not whole(count, MAX_PROCESSES) or not (devices is None
                                               or whole(devices, MAX_DEVICES_PER_PROCESS)):
        _refuse(f"{directory} recorded {count!r} processes of {devices!r} devices each, not "
                f"whole numbers from 1 to {MAX_PROCESSES} and {MAX_DEVICES_PER_PROCESS}",
                directory)
    options = ["--processes", str(count)]
    return options if devices is None else [*options, "--devices-per-process", str(devices)]


_LAUNCHED_BY = {"slurm": "Slurm", "ompi": "Open MPI's mpirun", "mpi": "an MPI launcher",
               "gcetpu": "a TPU VM pod", "gketpu": "a TPU slice on GKE",
               "kubernetes": "Kubernetes", "environment": "a launcher of its own",
               "explicit": "a launcher of its own (explicit arguments)"}


def _submit_command(launcher: str, count: int, facts: dict[str, str],
                    resume: list[str]) -> str | None:
    """The command that starts ``count`` processes of ``launcher`` again, each running
    ``resume`` (None where no command can be written: Kubernetes, your own launcher)."""
    cwd = working_directory() or "."
    if launcher == "slurm":
        options = [f"--{field.replace('_', '-')}={facts[field]}" for field in
                   ("job_name", "partition", "account", "qos", "nodes") if field in facts]
        options += [f"--ntasks={count}", *(f"--{field.replace('_', '-')}={facts[field]}"
                                           for field in ("cpus_per_task", "gpus_per_node")
                                           if field in facts)]
        return shlex.join(["sbatch", *options, f"--chdir={cwd}",
                           f"--wrap={shlex.join(['srun', *resume])}"])
    if launcher == "ompi":
        return shlex.join(["mpirun", "-np", str(count), *resume])
    if launcher == "mpi":
        return f"{distributed.COORDINATOR}=RANK0_HOST:PORT " + shlex.join(
            ["mpiexec", "-n", str(count), *resume])
    if launcher == "gcetpu":
        inner = f"cd {shlex.quote(cwd)} && {distributed.CLUSTER}=gcetpu {shlex.join(resume)}"
        return shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "TPU_NAME",
                           "--zone=ZONE", "--worker=all", f"--command={inner}"])
    return None


def _job_facts(record: dict[str, JSON]) -> dict[str, str]:
    """The scheduler's facts a record holds, those that are plain strings or numbers."""
    job = record.get("job")
    return {str(k): str(v) for k, v in job.items() if type(v) in (str, int)} \
        if isinstance(job, dict) else {}


def launch_text(record: JSON) -> str:
    """How a recorded run's processes were launched, in one line (``graphmod inspect``).

    Examples:
        >>> from graphmod._train._command import launch_text
        >>> launch_text({"kind": "script", "processes": 2, "launcher": "slurm",
        ...              "job": {"job_id": "4242", "nodes": "1"}})
        'slurm: 2 processes (job_id 4242, nodes 1)'
        >>> launch_text({"kind": "script", "processes": 2, "devices_per_process": 4})
        'graphmod run --processes 2 --devices-per-process 4'
        >>> launch_text({"kind": "script"})
        'one process'
    """
    if not isinstance(record, dict) or "processes" not in record:
        return "one process"
    launcher, count = record.get("launcher", "graphmod"), record["processes"]
    if launcher == "graphmod":
        devices = record.get("devices_per_process")
        return f"graphmod run --processes {count}" + (
            "" if devices is None else f" --devices-per-process {devices}")
    facts = ", ".join(f"{field} {value}" for field, value in _job_facts(record).items())
    return f"{launcher}: {count} processes" + (f" ({facts})" if facts else "")


def _resubmit(record: dict[str, JSON], directory: str, script: str | None) -> NoReturn:
    """Raises :class:`ResubmitRequiredError` for a run ``record``'s launcher started."""
    launcher, count = str(record.get("launcher")), record.get("processes")
    if not _whole(count, float("inf")):
        _refuse(f"{directory} recorded {count!r} processes, not a whole number >= 1",
                directory)
    resume = ["graphmod", "resume", directory, *(["--script", script] if script else [])]
    command = _submit_command(launcher, count, _job_facts(record), resume)
    by = _LAUNCHED_BY.get(launcher, f"JAX's {launcher!r} detection")
    how = (f"submit it again with: {command}" + (
        " (with the options the record cannot see: --time, --gres, --signal=USR1@60, ...)"
        if launcher == "slurm" else "") if command else
        f"start its processes again as you started them, each running {shlex.join(resume)} "
        f"(or its script with Checkpoint({directory!r}, resume=True))")
    raise ResubmitRequiredError(
        f"{directory} was started by {by} ({launch_text(record)}), which graphmod resume does "
        f"not start: inside a launch of it, where every process runs graphmod resume, it "
        f"resumes in place; {how}", command)


def _runnable(script: str, where: str, directory: str) -> str:
    """The resolved path of ``script`` (``where`` says who named it); refuses one that is no
    existing file, lies inside the run directory, or is a file of a Python installation."""
    if not os.path.isfile(script):
        _refuse(f"{where}, which is not an existing file", directory)
    path = os.path.realpath(script)
    if any(_inside(name, os.path.realpath(directory)) or _inside(name, directory)
           for name in (path, os.path.abspath(script))):  # a link in it, to anywhere
        _refuse(f"{where}, which lies inside the run directory: a script stored with the "
                "checkpoints is not run", directory)
    installation = _installation_folder(path)
    if installation is not None:
        _refuse(f"{where}, which belongs to a Python installation ({installation}), not "
                "to a training run", directory)
    return path


def _trusted_script(recorded: str, digest: str | None, directory: str,
                    anchor: str) -> tuple[str, str]:
    """``(path, sha256)`` of a recorded script inside ``anchor`` whose hash is the recorded
    one; refuses any other."""
    where = f"{directory} recorded the script {recorded!r}"
    path = _runnable(recorded, where, directory)
    found = script_sha256(path)
    name_it = f"name it: graphmod resume {shlex.join([directory, '--script', path])}"
    if not _inside(path, anchor):
        why = (f"which resolves to {path}, outside the directory graphmod resume runs from "
               f"({anchor})")
        fix = ("run graphmod resume from the directory that holds your script, or, once you "
               f"have read the script, {name_it}")
    elif digest is None:
        why = "but no hash of it (a record made before graphmod recorded script hashes)"
        fix = f"once you have read the script, {name_it}"
    elif digest != found:
        why = "whose content changed since the run started"
        fix = f"if you changed it yourself, read it and {name_it}"
    else:
        return path, found
    _refuse(f"{where}, {why}; recorded sha256: {digest or 'none'}, the file's sha256: "
            f"{found}", directory, fix)


def _named_script(named: str, recorded: str, digest: str | None,
                  directory: str) -> tuple[str, str]:
    """``(path, sha256)`` of the script named with ``--script``: the recorded file, or one
    with the recorded hash; refuses any other, and every file ``_runnable`` refuses."""
    path = _runnable(named, f"--script names {named!r}", directory)
    found = script_sha256(path)
    if path == os.path.realpath(recorded) or found == digest:
        return path, found
    _refuse(f"--script names {named!r} ({path}, sha256: {found}), which is not the script "
            f"{directory} recorded ({recorded!r}, sha256: {digest or 'none'})", directory,
            fix="name the recorded script (its path, or the same file moved elsewhere), or "
                "run your script again yourself with Checkpoint(DIR, resume=True).")


def _script_record(record: JSON, directory: str) -> tuple[JSON, JSON, JSON, str | None]:
    """``(script, args, cwd, sha256)`` from a new or old-format record (an old one, or a hash
    that is no string, has no hash); refuses every other kind."""
    if isinstance(record, list):
        record = {"argv": record}
    if not isinstance(record, dict):
        _refuse(f"{directory} records no command (found {record!r})", directory)
    if "kind" not in record:
        record = _from_old_format(record, directory)
    kind = record.get("kind")
    if kind == "script":
        digest = record.get("script_sha256")
        return (record.get("script"), record.get("args"), record.get("cwd"),
                digest if isinstance(digest, str) else None)
    if kind == "module":
        how = f"with python -m {record.get('module')}"
    else:
        how = _HOW.get(_kind(kind), f"in a way graphmod does not know ({kind!r})")
    _refuse(f"{directory} was started {how} (recorded argv: {record.get('argv')!r})", directory)


def _from_old_format(record: dict[str, JSON], directory: str) -> dict[str, JSON]:
    """The record of an old ``{"argv", "cwd"}`` entry: a script only if ``argv[0]`` is an
    existing ``.py`` file."""
    argv, cwd = _strings(record.get("argv")), record.get("cwd", os.getcwd())
    if argv is not None:
        if _kernel_argv(argv):
            return {"kind": "jupyter", "argv": list(argv), "cwd": cwd}
        first = argv[0] if argv else ""
        if (isinstance(cwd, str) and not first.startswith("-") and first.endswith(".py")
                and os.path.isfile(os.path.join(cwd, first))):
            return {"kind": "script", "script": os.path.join(cwd, first),
                    "args": list(argv[1:]), "cwd": cwd}
    _refuse(f"{directory} holds an old-format record whose first argument is not an existing "
            f".py file (recorded argv: {record.get('argv')!r})", directory)


def _strings(value: JSON) -> list[str] | None:
    """``value`` if it is a list of strings (an argument list), else None."""
    if not isinstance(value, list):
        return None
    strings = [item for item in value if isinstance(item, str)]
    return strings if len(strings) == len(value) else None


def _kind(kind: JSON) -> str:
    """A recorded kind, to look up (a crafted one need not be a string)."""
    return kind if isinstance(kind, str) else repr(kind)


def _refuse(reason: str, directory: str, fix: str | None = None) -> NoReturn:
    """Raises :class:`ResumeRefusedError` with ``reason`` and what to do instead (``fix``,
    by default: continue from Python)."""
    raise ResumeRefusedError(f"{reason}; " + (fix or (
        f"graphmod resume only re-runs a script file started as python SCRIPT [ARGS...]. "
        f"Continue the run from Python instead: graphmod.Loop.resume({directory!r}, step, "
        f"data, plugins=[...]), or run your script again yourself with "
        f"Checkpoint({directory!r}, resume=True).")))


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies below it."""
    return pathlib.Path(path).is_relative_to(folder)


# lib/python3.9, lib64/python3.13t: where an installation keeps its standard library.
_VERSIONED_LIB = re.compile(r"python[0-9]+\.[0-9]+t?", re.IGNORECASE)


def _installation_folder(path: str) -> str | None:
    """The folder that makes ``path`` a file of a Python installation, this interpreter's or
    any other (a standard library, site-packages, an environment's scripts), or None."""
    own = next((folder for folder in _installation() if _inside(path, folder)), None)
    if own is not None:
        return own
    for folder in pathlib.Path(path).parents:
        name = folder.name.lower()
        if (name in ("site-packages", "dist-packages") or _holds_stdlib(folder)
                or (_VERSIONED_LIB.fullmatch(name) and folder.parent.name.lower()
                    .startswith("lib"))
                or (name in ("bin", "scripts") and _is_prefix(folder.parent))):
            return str(folder)
    return None


def _holds_stdlib(folder: pathlib.Path) -> bool:
    """Whether ``folder`` holds a standard library (its ``os.py`` and ``site.py``)."""
    return (folder / "os.py").is_file() and (folder / "site.py").is_file()


def _is_prefix(folder: pathlib.Path) -> bool:
    """Whether ``folder`` is where a Python is installed: a virtual environment, or a folder
    whose ``lib/pythonX.Y`` (``Lib`` on Windows) holds a standard library or site-packages."""
    return ((folder / "pyvenv.cfg").is_file() or _holds_stdlib(folder / "Lib")
            or any(_holds_stdlib(lib) or (lib / "site-packages").is_dir()
                   for lib in folder.glob("lib*/python*")))


def _installation() -> list[str]:
    """The folders of the running Python's installation (standard library, site-packages,
    scripts)."""
    bases = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
             "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}
    keys = ("stdlib", "platstdlib", "purelib", "platlib", "scripts")
    folders = [paths[key] for paths in (sysconfig.get_paths(), sysconfig.get_paths(vars=bases))
               for key in keys]
    folders += [*site.getsitepackages(), site.getusersitepackages()]
    return sorted({os.path.realpath(folder) for folder in folders})
