"""Bad input, second round: stop signals. ``GRAPHMOD_STOP_SIGNALS`` (the signals opted in
to stop a run at a step, beside SIGINT and SIGTERM) and the launcher's pid that ``graphmod
run --processes`` gives its processes are refused, naming the culprit and the choices,
before a run or a process starts: nothing is created, nothing runs. The step is built when
a case runs, so that counting the cases (``test_catalogue_size.py``) builds none.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import graphmod as gm
from graphmod import distributed
from graphmod._cli import _Failure, _parser
from graphmod._train._interrupt import STOP_SIGNALS_VARIABLE
from graphmod.plugins import Checkpoint
from tests.loop.conftest import Problem
from tests.safety.catalogue import Case, check_refused

CHOICES = r"; name SIGHUP, SIGUSR1 or SIGUSR2 \(SIGINT and SIGTERM always stop a run\)"


@contextlib.contextmanager
def _environment(**variables: str) -> Iterator[None]:
    """``variables`` set in the environment, the earlier values back afterwards."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@functools.cache
def _problem() -> Problem:
    return Problem()


def _loop(setting: str) -> Callable[[pathlib.Path], Any]:
    """A run checkpointing into ``root/run`` with ``GRAPHMOD_STOP_SIGNALS=setting``."""
    def call(root: pathlib.Path) -> Any:
        problem = _problem()
        loop = gm.Loop(problem.step, problem.source(), steps=2,
                       plugins=[Checkpoint(root / "run", every=gm.On("step"))])
        with _environment(**{STOP_SIGNALS_VARIABLE: setting}):
            return loop.run(problem.state())
    return call


def _command(*args: str, **variables: str) -> Callable[[pathlib.Path], Any]:
    """``graphmod run ARGS root/train.py`` (a script that would write ``root/ran``) with
    ``variables`` in the environment, as ``graphmod run`` handles it (before its errors
    become a message and status 2)."""
    def call(root: pathlib.Path) -> Any:
        parsed = _parser().parse_args(["run", *args, str(root / "train.py")])
        with _environment(**variables):
            return parsed.handler(parsed)
    return call


CASES: list[Case] = [
    Case("an unknown signal name", _loop("SIGFOO"), ValueError,
         rf"GRAPHMOD_STOP_SIGNALS='SIGFOO': 'SIGFOO' is not a signal's name{CHOICES}"),
    Case("one bad name in a list", _loop("USR1, USR3"), ValueError,
         rf"GRAPHMOD_STOP_SIGNALS='USR1, USR3': 'USR3' is not a signal's name{CHOICES}"),
    Case("a signal that cannot be caught", _loop("KILL"), ValueError,
         rf"'KILL': SIGKILL cannot be caught, so it cannot stop a run{CHOICES}"),
    Case("a signal number", _loop("10"), ValueError,
         rf"'10': 10 is a number: name the signal instead \(SIGUSR1, not 10\){CHOICES}"),
    Case("a crash signal", _loop("SIGSEGV"), ValueError,
         rf"'SIGSEGV': SIGSEGV is not a request to stop, so it does not stop a run{CHOICES}"),
    Case("graphmod run, a bad name", _command(**{STOP_SIGNALS_VARIABLE: "TERMINATE"}),
         _Failure, r"GRAPHMOD_STOP_SIGNALS='TERMINATE': 'TERMINATE' is not a signal's name"),
    Case("graphmod run --processes 2, a bad name",
         _command("--processes", "2", **{STOP_SIGNALS_VARIABLE: "STOP"}), _Failure,
         rf"'STOP': SIGSTOP cannot be caught, so it cannot stop a run{CHOICES}"),
    Case("a launcher pid that is not a number",
         _command(**{distributed.LAUNCHER_PID: "launcher"}), _Failure,
         r"GRAPHMOD_LAUNCHER_PID='launcher' is not a process id: 'graphmod run --processes "
         r"N' sets it for the processes it starts; unset it"),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_refused_naming_the_culprit(case: Case, tmp_path: pathlib.Path) -> None:
    (tmp_path / "train.py").write_text(  # run, it would leave a trace
        "import pathlib, sys\npathlib.Path(sys.argv[0]).with_name('ran').write_text('')\n")
    check_refused(case, tmp_path)
