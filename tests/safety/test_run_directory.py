"""Run directories: checkpoints are recognised by graphmod's marker, never by a folder's name;
a run directory has one writer at a time; resuming checks the checkpoint's record and the
data before anything is restored.

The catalogue's world: ``root/run`` is a copy of a run's directory (verified checkpoints of
steps 2 and 4, every step written by graphmod with its marker); each case first arranges it
(``_Act.prepare``: the user's photo in ``2024/``, a copied or linked step, an edited meta
record, ...), then runs or resumes a loop in it, which must be refused with nothing under
``root`` changed: the photo, the links and their targets, the other run's checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import graphmod as gm
from graphmod._train._checkpoint import Checkpointer, CheckpointError
from graphmod._train._checkpoint._lock import RunLock
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint
from tests.loop.conftest import Problem
from tests.safety.catalogue import Case, check_refused

MARKER = "graphmod-checkpoint.json"
MOVE_OUT = r"move those out of the directory, or write to another directory"


@functools.cache
def _problem() -> Problem:
    """The regression problem of every case (built once, when a case first runs)."""
    return Problem()


@pytest.fixture(scope="module")
def problem() -> Problem:
    return _problem()


@pytest.fixture(scope="module")
def saved(problem: Problem, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A run directory with verified checkpoints of steps 2 and 4."""
    directory = tmp_path_factory.mktemp("saved") / "run"
    gm.Loop(problem.step, problem.source(8), steps=4,
            plugins=[Checkpoint(directory, every=gm.On("step", step=gm.each(2)), keep=None)]
            ).run(problem.state())
    return directory


@dataclasses.dataclass(frozen=True)
class _Act:
    """``prepare(root)`` arranges ``root/run``; calling it does what must be refused."""

    prepare: Callable[[pathlib.Path], None]
    act: Callable[[pathlib.Path], Any]

    def __call__(self, root: pathlib.Path) -> Any:
        return self.act(root)


def _run(**checkpoint: Any) -> Callable[[pathlib.Path], Any]:
    """A new run (or, ``resume=True``, a continued one) checkpointing into ``root/run``."""
    def act(root: pathlib.Path) -> Any:
        problem = _problem()
        plugin = Checkpoint(root / "run", every=gm.On("step"), **checkpoint)
        return gm.Loop(problem.step, problem.source(8), steps=6, plugins=[plugin]).run(
            problem.state())
    return act


def _resume(checkpoint: int | None = 4, data: Callable[[Problem], Any] | None = None,
            **settings: Any) -> Callable[[pathlib.Path], Any]:
    """``Loop.resume`` of ``root/run`` (its checkpoint of step ``checkpoint``)."""
    def act(root: pathlib.Path) -> Any:
        problem = _problem()
        source = problem.source(8) if data is None else data(problem)
        return gm.Loop.resume(root / "run", problem.step, source, checkpoint=checkpoint,
                              steps=6, **settings)
    return act


def _setup_refused(id: str, prepare: Callable[[pathlib.Path], None], pattern: str,
                   **checkpoint: Any) -> Case:
    """A run's Checkpoint refusing ``root/run`` at its setup, as arranged by ``prepare``."""
    return Case(id, _Act(prepare, _run(**checkpoint)), gm.PluginError,
                r"(?s)plugin 'checkpoint' raised in setup: CheckpointError: \S*/run" + pattern)


def _foreign(name: str, why: str) -> str:
    return (rf": Checkpoint 'checkpoint': the directory holds what graphmod did not write, "
            rf"named like its checkpoints: {name} "
            rf"\({why}.*nothing was read, moved or deleted.*{MOVE_OUT}")


def _photo(root: pathlib.Path) -> None:
    (root / "run" / "2024").mkdir()
    (root / "run" / "2024" / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0 the user's photo")


def _notes_in_1(root: pathlib.Path) -> None:
    shutil.rmtree(root / "run")
    (root / "run" / "1").mkdir(parents=True)
    (root / "run" / "1" / "notes.txt").write_text("the user's notes")


def _copy(source: str, target: str) -> Callable[[pathlib.Path], None]:
    return lambda root: shutil.copytree(root / "run" / source, root / "run" / target)


def _linked_step(root: pathlib.Path) -> None:
    shutil.copytree(root / "run" / "4", root / "outside" / "6")
    (root / "run" / "6").symlink_to(root / "outside" / "6")


def _linked_marker(root: pathlib.Path) -> None:
    marker = root / "run" / "4" / MARKER
    (root / "outside").mkdir()
    shutil.move(marker, root / "outside" / MARKER)
    marker.symlink_to(root / "outside" / MARKER)


def _no_marker(step: str) -> Callable[[pathlib.Path], None]:
    return lambda root: (root / "run" / step / MARKER).unlink()


def _edit(step: str, edit: Callable[[dict], Any], file: str = "meta/metadata"
          ) -> Callable[[pathlib.Path], None]:
    def prepare(root: pathlib.Path) -> None:
        path = root / "run" / step / file
        record = json.loads(path.read_text())
        edit(record)
        path.write_text(json.dumps(record))
    return prepare


def _both(*prepares: Callable[[pathlib.Path], None]) -> Callable[[pathlib.Path], None]:
    def prepare(root: pathlib.Path) -> None:
        for one in prepares:
            one(root)
    return prepare


def _file(name: str, text: str) -> Callable[[pathlib.Path], None]:
    return lambda root: (root / "run" / name).write_text(text)


def _lock_link(root: pathlib.Path) -> None:
    (root / "victim.txt").write_text("the user's file")
    (root / "run" / "graphmod.lock").symlink_to(root / "victim.txt")


def _held(root: pathlib.Path) -> Any:
    with RunLock(root / "run"):  # another writer, in this process: the lock is its file's
        return _run(resume=True)(root)


def _program_save(root: pathlib.Path) -> None:
    shutil.rmtree(root / "run")
    writer = Checkpointer(root / "run", keep=None, asynchronous=False)
    writer.save(3, _problem().state(), {"note": "no loop record"})
    writer.close()


def _wider(problem: Problem) -> ArraySource:
    x = np.concatenate([problem.x, problem.x[:, :1]], axis=1)  # 5 features, not 4
    return ArraySource({"x": x, "y": problem.y}, 8, shuffle=True, seed=1)


def _nothing(root: pathlib.Path) -> None:
    pass


def _meta_refused(id: str, edit: Callable[[dict], Any], pattern: str) -> Case:
    """``Loop.resume`` of step 4 whose meta record ``edit`` changed: refused naming the
    checkpoint's folder and the field."""
    return Case(id, _Act(_edit("4", edit), _resume()), CheckpointError,
                r"/run/4: " + pattern)


CASES: list[Case] = [
    _setup_refused("a photo in a numbered folder, overwrite=True", _photo,
                   _foreign("2024", r"no graphmod marker \(graphmod-checkpoint\.json\) and no "
                            r"meta record"), overwrite=True),
    _setup_refused("a photo in a numbered folder, resume=True", _photo,
                   _foreign("2024", "no graphmod marker"), resume=True),
    _setup_refused("a folder '1' holding the user's notes, a fresh run", _notes_in_1,
                   _foreign("1", "no graphmod marker")),
    _setup_refused("a step copied under a zero-padded name", _copy("4", "00004"),
                   _foreign("00004", r"not a step's folder name \(graphmod names step 4's "
                            r"folder 4, without leading zeros"), resume=True),
    _setup_refused("a step copied under another step's name", _copy("2", "6"),
                   _foreign("6", "its marker names step 2"), resume=True),
    _setup_refused("a step folder linked out of the run directory", _linked_step,
                   _foreign("6", r"a symbolic link \(to \S*/outside/6\); graphmod never "
                            "follows one"), resume=True),
    _setup_refused("a marker linked out of the run directory", _linked_marker,
                   _foreign("4", r"its graphmod-checkpoint\.json is a symbolic link"),
                   resume=True),
    _setup_refused("a marker naming a path as its run id",
                   _edit("4", lambda r: r.update(run_id="../../x"), MARKER),
                   _foreign("4", "its marker is not graphmod's"), resume=True),
    _setup_refused("a step written before markers, copied under another step's name",
                   _both(_no_marker("4"), _copy("4", "5")),
                   _foreign("5", r"no graphmod marker \(graphmod-checkpoint\.json\), and its "
                            "meta record names step 4"), resume=True),
    _setup_refused("a file named like a step", _file("8", "the user's file"),
                   _foreign("8", "a file, not a checkpoint's folder"), overwrite=True),
    _setup_refused("a lock file that is a link", _lock_link,
                   r"/graphmod\.lock: is a symbolic link, not graphmod's lock file.*"
                   r"move it out of the run directory", resume=True),
    _setup_refused("a lock file holding the user's text", _file("graphmod.lock", "my notes"),
                   r"/graphmod\.lock: holds something graphmod did not write.*move it "
                   "out", resume=True),
    Case("a second writer while the lock is held", _Act(_nothing, _held), gm.PluginError,
         rf"(?s)raised in setup: .*another run writes into this directory: process "
         rf"{os.getpid()} on host \S+ \(since .*\) holds its lock.*write to another directory"),
    _meta_refused("a meta record naming another step", lambda r: r.update(step=3),
                  r"the meta record's 'step' is 3, its folder is step 4's"),
    _meta_refused("a meta record without 'loop'", lambda r: r.pop("loop"),
                  r"the meta record has no 'loop': not the record of a loop's checkpoint"),
    _meta_refused("a meta record whose 'loop' passes another argument",
                  lambda r: r["loop"].update(allow_data_change=True),
                  r"the meta record's 'loop' is .*, not an object of epochs, steps, "
                  "steps_per_call"),
    _meta_refused("a negative data position", lambda r: r.update(position=-1),
                  r"the meta record's 'position' is -1, not a whole number >= 0"),
    _meta_refused("a data position that is no whole number", lambda r: r.update(position="3"),
                  r"the meta record's 'position' is '3', not a whole number >= 0"),
    Case("a checkpoint with no loop record resumed",
         _Act(_program_save, _resume(checkpoint=None)), CheckpointError,
         r"/run: no checkpoint verifies \(step 3: the meta record has no 'time' or 'position' "
         r"or 'loop'.*start a new run in a new directory"),
    Case("a resume on data of another feature size",
         _Act(_nothing, _resume(data=_wider, allow_data_change=True)), ValueError,
         r"Loop\.run: the data's batches do not fit the program: argument 'x': expected shape "
         r"\(batch, 4\) and dtype float32 \(as in init's example\), got shape \(8, 5\)"),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_run_directory_refuses(case: Case, problem: Problem, saved: pathlib.Path,
                                 tmp_path: pathlib.Path) -> None:
    shutil.copytree(saved, tmp_path / "run")
    case.call.prepare(tmp_path)
    check_refused(case, tmp_path)


def test_the_users_photo_survives_overwrite_once_moved_aside(
        problem: Problem, saved: pathlib.Path, tmp_path: pathlib.Path) -> None:
    shutil.copytree(saved, tmp_path / "run")
    _photo(tmp_path)
    with pytest.raises(gm.PluginError, match="2024"):
        _run(overwrite=True)(tmp_path)
    shutil.move(tmp_path / "run" / "2024", tmp_path / "2024")  # as the error says
    _run(overwrite=True)(tmp_path)
    assert sorted(os.listdir(tmp_path / "run")) == ["4", "5", "6"]  # keep=3, a new run
    assert (tmp_path / "2024" / "photo.jpg").read_bytes().endswith(b"the user's photo")

