"""Checkpoints are verified, owned and finished: corrupted ones are named and skipped, a run
never touches another run's checkpoints, teardown and Ctrl-C leave complete checkpoints."""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import graphmod as gm
from graphmod import On, at, each
from graphmod._cli import inspect_run
from graphmod._train._checkpoint import Checkpointer, CheckpointError
from graphmod._train._checkpoint._format import storable
from graphmod._train._checkpoint._reader import counted_as_saved
from graphmod.plugins import Checkpoint
from tests.loop.conftest import Problem

Snapshot = dict[str, bytes]


def _snapshot(directory: pathlib.Path) -> Snapshot:
    """Every file under ``directory`` with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _every(n: int) -> gm.On:
    return On("step", step=each(n))


def _assert_same_arrays(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[np.ndarray]]:
    """A run directory with verified checkpoints of steps 4 and 8, and step 4's arrays."""
    problem = Problem()
    directory = tmp_path_factory.mktemp("saved") / "run"
    at_four: list[np.ndarray] = []
    loop = gm.Loop(problem.step, problem.source(8), steps=8,
                   plugins=[Checkpoint(directory, every=_every(4), keep=None)])
    loop.on(On("step", step=at(4)), lambda e: at_four.extend(storable(e.state)))
    loop.run(problem.state())
    return directory, at_four


@pytest.fixture
def run(saved: tuple[pathlib.Path, list[np.ndarray]], tmp_path: pathlib.Path
        ) -> tuple[Problem, pathlib.Path, list[np.ndarray]]:
    directory = tmp_path / "run"
    shutil.copytree(saved[0], directory)
    return Problem(), directory, saved[1]


# -- corruptions of step 8 (the newest): each named, and resume falls back to step 4 -------
def _data_files(step: pathlib.Path) -> list[pathlib.Path]:
    """The array data files of a checkpoint (tensorstore's OCDBT ``d/`` files: some hold
    b-tree nodes with small arrays inline, others the bytes of larger arrays)."""
    return [p for p in (step / "state").rglob("*") if p.is_file() and p.parent.name == "d"]


def _flip_file(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))


def _flip(step: pathlib.Path) -> None:
    for path in _data_files(step):
        _flip_file(path)


def _truncate(step: pathlib.Path) -> None:
    for path in _data_files(step):
        os.truncate(path, path.stat().st_size // 2)


def _zero(step: pathlib.Path) -> None:
    for path in _data_files(step):
        path.write_bytes(bytes(path.stat().st_size))


def _delete(step: pathlib.Path) -> None:
    for path in _data_files(step):
        path.unlink()


def _edit_meta(edit: Callable[[dict], object]) -> Callable[[pathlib.Path], None]:
    def corrupt(step: pathlib.Path) -> None:
        path = step / "meta" / "metadata"
        record = json.loads(path.read_text())
        edit(record)
        path.write_text(json.dumps(record))
    return corrupt


def _swap_state(step: pathlib.Path) -> None:
    shutil.rmtree(step / "state")
    shutil.copytree(step.parent / "4" / "state", step / "state")


def _link_state(step: pathlib.Path) -> None:
    """``state`` moved out of the run directory, a link to it in its place."""
    outside = step.parent.parent / f"outside-{step.name}"
    shutil.move(step / "state", outside)
    (step / "state").symlink_to(outside)


def _other_shape(record: dict) -> None:
    record["arrays"][-1][1] = [3, 3]


CORRUPTIONS = {
    "16 bytes flipped mid data files": (_flip, r"fails its checksum|arrays cannot be read"),
    "data files truncated": (_truncate, r"arrays cannot be read"),
    "data files zeroed": (_zero, r"fails its checksum|arrays cannot be read"),
    "data files deleted": (_delete, r"arrays cannot be read"),
    "array index deleted": (lambda s: (s / "state" / "manifest.ocdbt").unlink(),
                            r"arrays cannot be read"),
    "state directory deleted": (lambda s: shutil.rmtree(s / "state"), r"no state directory"),
    "state of another step": (_swap_state, r"fails its checksum"),
    "meta file deleted": (lambda s: (s / "meta" / "metadata").unlink(),
                          r"meta record cannot be read"),
    "meta directory deleted": (lambda s: shutil.rmtree(s / "meta"), r"no meta record"),
    "meta not JSON": (lambda s: (s / "meta" / "metadata").write_text('{"format": 2, "tr'),
                      r"meta record is not valid JSON"),
    "meta not an object": (lambda s: (s / "meta" / "metadata").write_text("[1, 2]"),
                           r"meta record is not a JSON object"),
    # Read as graphmod 0.1's layout (one tree of arrays), which this flat list is not.
    "meta of an older format": (_edit_meta(lambda r: r.update(format=1)),
                                r"format 1\): restorable, but it cannot be verified|the "
                                r"arrays cannot be read"),
    "meta array list malformed": (_edit_meta(lambda r: r["arrays"][0].__setitem__(2, "object")),
                                  r"array list is malformed"),
    "meta checksum changed": (_edit_meta(lambda r: r["arrays"][0].__setitem__(3, "0badf00d")),
                              r"fails its checksum"),
    "meta says another shape": (_edit_meta(_other_shape),
                                r"does not match its tree|is stored as \["),
    "meta lists fewer arrays": (_edit_meta(lambda r: r["arrays"].pop()),
                                r"does not match its tree|structures do not match"),
    "state a link out of the run directory": (_link_state,
                                              r"holds a symbolic link \(state\)"),
    "meta names another step": (_edit_meta(lambda r: r.update(step=7)),
                                r"the meta record's 'step' is 7, its folder is step 8's"),
    "meta names another run": (_edit_meta(lambda r: r.update(run_id="other")),
                               r"the meta record's 'run_id' is 'other', its marker names run"),
    "meta run id naming a path": (_edit_meta(lambda r: r.update(run_id="../../x")),
                                  r"'run_id' '../../x' is not a run id"),
    "meta without loop": (_edit_meta(lambda r: r.pop("loop")), r"the meta record has no 'loop'"),
    "meta loop not an object": (_edit_meta(lambda r: r.update(loop=[1])),
                                r"the meta record's 'loop' is \[1\], not an object"),
    "meta loop with another setting": (
        _edit_meta(lambda r: r["loop"].update(plugins=[])),
        r"'loop' is .*, not an object of epochs, steps, steps_per_call"),
    "meta negative data position": (_edit_meta(lambda r: r.update(position=-3)),
                                    r"the meta record's 'position' is -3, not a whole number"),
    "meta fractional data position": (_edit_meta(lambda r: r.update(position=2.5)),
                                      r"the meta record's 'position' is 2.5"),
    "meta time of another step": (_edit_meta(lambda r: r["time"].update(step=9)),
                                  r"'time.step' is 9, its folder is step 8's"),
    "meta time not counts": (_edit_meta(lambda r: r["time"].update(epoch="0")),
                             r"'time.epoch' is '0', not a whole number"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_corrupted_checkpoint_is_named_and_restore_falls_back(
        run: tuple[Problem, pathlib.Path, list[np.ndarray]], name: str,
        capfd: pytest.CaptureFixture) -> None:
    problem, directory, at_four = run
    corrupt, reason = CORRUPTIONS[name]
    corrupt(directory / "8")
    reader = Checkpointer(directory, keep=None)
    assert reader.verify(4) is None
    assert re.search(reason, reader.verify(8) or "no failure")
    template = problem.state()
    with pytest.warns(UserWarning, match=rf"skipped .*step 8: .*({reason}).*; using step 4"):
        state, meta = reader.restore(template)
    assert meta["step"] == 4 and int(state.step) == 4
    _assert_same_arrays(storable(state), at_four)  # step 4's arrays, nothing else
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(directory / '8'))}: .*({reason})"):
        reader.restore(template, step=8)
    reader.close()
    time.sleep(0.2)  # reads orbax left running report (or not) after its restore failed
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err, err


def test_inspect_names_a_meta_record_without_loop_and_describes_the_one_before(
        run: tuple[Problem, pathlib.Path, list[np.ndarray]]) -> None:
    _, directory, _ = run
    _edit_meta(lambda r: r.pop("loop"))(directory / "8")
    report = inspect_run(str(directory))
    assert "checkpoint 8: FAILS verification: the meta record has no 'loop'" in report
    assert "latest: step=4," in report


def test_flipped_bytes_that_decode_are_caught_by_the_checksum(tmp_path: pathlib.Path) -> None:
    state = {"w": np.random.default_rng(0).normal(size=(2048,)).astype(np.float32)}
    writer = Checkpointer(tmp_path, keep=None)
    writer.save(1, state, {})
    writer.wait()
    # Random floats hardly compress: flipped bytes in their data file decode, changed.
    _flip_file(max(_data_files(tmp_path / "1"), key=lambda p: p.stat().st_size))
    assert "fails its checksum" in (writer.verify(1) or "")
    with pytest.raises(CheckpointError, match=r"array \['w'\] fails its checksum"):
        writer.restore(state)
    writer.close()


def test_what_graphmod_did_not_write_is_named_and_never_read(
        run: tuple[Problem, pathlib.Path, list[np.ndarray]]) -> None:
    problem, directory, _ = run
    for step in ("7", "12"):
        (directory / step).mkdir()
        (directory / step / "junk.txt").write_text("not a checkpoint")
    (directory / "16").mkdir()  # empty
    shutil.copytree(directory / "8", directory / "00095")  # a step's name, zero-padded
    shutil.copytree(directory / "8", directory / "9")  # its marker names step 8
    (directory / "20").write_text("a file")
    (directory / "24").symlink_to(directory / "8")
    (directory / "13.orbax-checkpoint-tmp").mkdir()
    (directory / "13.orbax-checkpoint-tmp" / "state").mkdir()
    before = _snapshot(directory)
    reader = Checkpointer(directory, keep=None)
    assert reader.steps() == [4, 8]
    assert list(reader.leftovers()) == ["13.orbax-checkpoint-tmp"]
    foreign = reader.foreign()
    assert sorted(foreign) == ["00095", "12", "16", "20", "24", "7", "9"]
    assert "graphmod names step 95's folder 95, without leading zeros" in foreign["00095"]
    assert foreign["7"] == foreign["16"] == \
        "no graphmod marker (graphmod-checkpoint.json) and no meta record"
    assert foreign["9"] == "its marker names step 8"
    assert foreign["20"] == "a file, not a checkpoint's folder"
    assert foreign["24"].startswith("a symbolic link (to ")
    assert reader.verify(7) == "not a checkpoint graphmod wrote: " + foreign["7"]
    with pytest.warns(UserWarning, match=r"not read, and left alone: 00095 \(.*; 12 \(no "
                                         r"graphmod marker.*24 \(a symbolic link"):
        _, meta = reader.restore(problem.state())
    assert meta["step"] == 8
    assert reader.meta()["step"] == 8  # the newest readable record, quietly
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 9 .*saved steps: "
                                                r"\[4, 8\] \(9 is not graphmod's: its marker "
                                                r"names step 8\)"):
        reader.restore(problem.state(), step=9)
    reader.close()
    report = inspect_run(str(directory))
    assert "checkpoints: 4, 8\n" in report and "checkpoint 8: verified" in report
    assert "not graphmod's 7: no graphmod marker" in report
    assert "not graphmod's 24: a symbolic link" in report
    assert "leftover 13.orbax-checkpoint-tmp: an incomplete write" in report
    assert "step=8" in report  # the newest verified checkpoint is described
    assert _snapshot(directory) == before


def test_a_run_never_starts_among_folders_graphmod_did_not_write(
        foreign: pathlib.Path) -> None:
    (foreign / "2024").mkdir()
    (foreign / "2024" / "photo.jpg").write_bytes(b"\xff\xd8 a photo")
    (foreign / "notes.txt").write_text("mine")  # not named like a checkpoint: no matter
    before = _snapshot(foreign)
    problem = Problem()
    for plugin in (Checkpoint(foreign, overwrite=True), Checkpoint(foreign, resume=True),
                   Checkpoint(foreign)):
        loop = gm.Loop(problem.step, problem.source(8), steps=100, plugins=[plugin])
        with pytest.raises(gm.PluginError, match=r"(?s)holds what graphmod did not write, named "
                           r"like its checkpoints: 2024 \(no graphmod marker.*nothing was read, "
                           r"moved or deleted.*move those out of the directory"):
            loop.run(problem.state())
        assert loop.time.step == 0
        assert _snapshot(foreign) == before  # the photo, and the other run's checkpoints
    shutil.rmtree(foreign / "2024")  # moved out, as the error says: the run goes on
    gm.Loop(problem.step, problem.source(8), steps=100,
            plugins=[Checkpoint(foreign, every=_every(5), resume=True)]).run(problem.state())
    assert Checkpointer(foreign, keep=None).steps() == [90, 95, 100]
    assert (foreign / "notes.txt").read_text() == "mine"


def test_overwrite_keeps_what_it_cannot_verify_and_what_graphmod_did_not_write(
        foreign: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    _flip(foreign / "90")
    (foreign / "95" / "graphmod-checkpoint.json").unlink()  # as written before markers
    (foreign / "log.csv").write_text("step,loss\n")
    problem = Problem()
    with caplog.at_level(logging.WARNING, logger="graphmod.checkpoint"):
        gm.Loop(problem.step, problem.source(8), steps=5,
                plugins=[Checkpoint(foreign, every=_every(5), overwrite=True)]
                ).run(problem.state())
    assert "deleted the checkpoints of steps [85, 95] and set aside ['90.unverified']" \
        in caplog.text
    assert sorted(os.listdir(foreign)) == ["5", "90.unverified", "log.csv"]


def _strip_markers(directory: pathlib.Path) -> None:
    """Makes the checkpoints of ``directory`` those graphmod wrote before markers."""
    for marker in directory.glob("*/graphmod-checkpoint.json"):
        marker.unlink()


def test_checkpoints_written_before_markers_resume_and_are_recognised_by_their_record(
        foreign: pathlib.Path) -> None:
    _strip_markers(foreign)
    shutil.copytree(foreign / "95", foreign / "96")  # its record names step 95: not a step
    reader = Checkpointer(foreign, keep=None)
    assert reader.steps() == [85, 90, 95] and reader.verify(95) is None
    assert reader.foreign() == {"96": "no graphmod marker (graphmod-checkpoint.json), and its "
                                      "meta record names step 95"}
    own_run = reader.run_of(95)
    assert own_run is not None and len({reader.run_of(s) for s in (85, 90, 95)}) == 1
    shutil.rmtree(foreign / "96")
    problem = Problem()
    gm.Loop(problem.step, problem.source(8), steps=105,
            plugins=[Checkpoint(foreign, every=_every(5), keep=3, resume=True)]
            ).run(problem.state())
    reader = Checkpointer(foreign, keep=None)
    assert reader.steps() == [95, 100, 105]  # pruned by keep=3: its run's, by their record
    assert {reader.run_of(s) for s in reader.steps()} == {own_run}
    assert not (foreign / "95" / "graphmod-checkpoint.json").exists()  # never rewritten
    assert (foreign / "105" / "graphmod-checkpoint.json").exists()


def test_keep_prunes_only_what_is_still_the_runs_own(tmp_path: pathlib.Path) -> None:
    writer = Checkpointer(tmp_path, keep=1, run_id="run", asynchronous=False)
    writer.save(1, {"w": np.zeros(3)}, {})
    shutil.rmtree(tmp_path / "1")  # replaced by the user's own folder, under the same name
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "mine.txt").write_text("mine")
    writer.save(2, {"w": np.ones(3)}, {})  # keep=1 would prune step 1
    writer.close()
    assert (tmp_path / "1" / "mine.txt").read_text() == "mine"
    with pytest.raises(ValueError, match=r"run_id='\.\./x': a run id is 1 to 256 letters"):
        Checkpointer(tmp_path, run_id="../x")


def test_a_writer_never_writes_over_a_folder_it_did_not_write(tmp_path: pathlib.Path) -> None:
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "mine.txt").write_text("mine")
    writer = Checkpointer(tmp_path, keep=None, run_id="run")
    writer.save(3, {"w": np.zeros(3)}, {})
    with pytest.raises(CheckpointError, match=r"/3: is in the way of step 3's checkpoint, and "
                                              r"graphmod did not write it.*move it out"):
        writer.wait()
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["3"]
    assert os.listdir(tmp_path / "3") == ["mine.txt"]


def test_resume_falls_back_and_matches_an_uninterrupted_run(
        run: tuple[Problem, pathlib.Path, list[np.ndarray]]) -> None:
    problem, directory, _ = run
    full = gm.Loop(problem.step, problem.source(8), steps=12).run(problem.state())
    _flip(directory / "8")
    (directory / "8" / "meta" / "metadata").write_text("{garbage")
    with pytest.warns(UserWarning, match=r"step 8: the meta record is not valid JSON"):
        resumed = gm.Loop.resume(str(directory), problem.step, problem.source(8), steps=12,
                                 plugins=[Checkpoint(directory, every=_every(4), keep=None)])
    assert int(resumed.step) == 12
    _assert_same_arrays(storable(resumed), storable(full))
    reader = Checkpointer(directory, keep=None)
    assert reader.steps() == [4, 8, 12]  # the skipped step 8 was written again
    assert [reader.verify(s) for s in reader.steps()] == [None, None, None]
    # Its owner unknown (no readable meta), the broken one was set aside, not deleted.
    assert list(reader.leftovers()) == ["8.unverified"]
    assert (directory / "8.unverified" / "meta" / "metadata").read_text() == "{garbage"
    assert len({reader.run_of(s) for s in reader.steps()}) == 1  # one run throughout


def test_checkpoint_resume_true_falls_back_too(
        run: tuple[Problem, pathlib.Path, list[np.ndarray]]) -> None:
    problem, directory, _ = run
    _flip(directory / "8")
    (directory / "8" / "meta" / "metadata").unlink()
    loop = gm.Loop(problem.step, problem.source(8), steps=6,
                   plugins=[Checkpoint(directory, every=_every(4), resume=True)])
    with pytest.warns(UserWarning, match=r"step 8: the meta record cannot be read"):
        state = loop.run(problem.state())
    assert int(state.step) == 6 and loop.time.step == 6


def test_no_verified_checkpoint_left_is_a_clear_error(
        run: tuple[Problem, pathlib.Path, list[np.ndarray]]) -> None:
    problem, directory, _ = run
    _flip(directory / "8")
    (directory / "8" / "meta" / "metadata").write_text("[]")
    shutil.rmtree(directory / "4" / "state")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(directory))}: no checkpoint "
                                              r"verifies \(step 8: .*; step 4: no state"):
        gm.Loop.resume(str(directory), problem.step, problem.source(8))
    missing = directory.parent / "missing"
    reader = Checkpointer(missing, keep=None)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*does not exist"):
        reader.restore(problem.state())
    reader.close()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in"):
        gm.Loop.resume(str(missing), problem.step, problem.source(8))
    assert not missing.exists()  # reading creates nothing


# -- ownership: a run never deletes or overwrites checkpoints it did not write --------------
@pytest.fixture(scope="module")
def other_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Another run's directory: steps 85, 90, 95 (keep=3)."""
    problem = Problem()
    directory = tmp_path_factory.mktemp("other") / "run"
    gm.Loop(problem.step, problem.source(8), steps=95,
            plugins=[Checkpoint(directory, every=_every(5), keep=3)]).run(problem.state())
    return directory


@pytest.fixture
def foreign(other_run: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    directory = tmp_path / "run"
    shutil.copytree(other_run, directory)
    return directory


def test_a_new_run_stops_before_training_in_another_runs_directory(
        foreign: pathlib.Path) -> None:
    before = _snapshot(foreign)
    assert Checkpointer(foreign, keep=None).steps() == [85, 90, 95]
    problem = Problem()
    state = problem.state()
    loop = gm.Loop(problem.step, problem.source(8), steps=15,
                   plugins=[Checkpoint(foreign, every=_every(5), keep=3)])
    with pytest.raises(Exception, match=r"(?s)holds checkpoints this run did not write "
                                        r"\(steps 85, 90, 95\).*resume=True.*new directory"
                                        r".*overwrite=True") as caught:
        loop.run(state)
    assert isinstance(caught.value, CheckpointError) or \
        isinstance(caught.value.__cause__, CheckpointError)
    assert loop.time.step == 0 and int(state.step) == 0
    assert _snapshot(foreign) == before


def test_overwrite_true_deletes_the_other_runs_checkpoints_first(
        foreign: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    problem = Problem()
    old_run = Checkpointer(foreign, keep=None).run_of(95)
    with caplog.at_level(logging.WARNING, logger="graphmod.checkpoint"):
        gm.Loop(problem.step, problem.source(8), steps=15,
                plugins=[Checkpoint(foreign, every=_every(5), keep=3, overwrite=True)]
                ).run(problem.state())
    assert "deleted the checkpoints of steps [85, 90, 95]" in caplog.text
    reader = Checkpointer(foreign, keep=None)
    assert reader.steps() == [5, 10, 15]
    runs = {reader.run_of(s) for s in reader.steps()}
    assert len(runs) == 1 and old_run not in runs
    with pytest.raises(ValueError, match=r"resume=True, overwrite=True\): pick one"):
        Checkpoint(foreign, resume=True, overwrite=True)


def test_keep_prunes_only_the_resumed_runs_own_checkpoints(foreign: pathlib.Path) -> None:
    problem = Problem()
    own_run = Checkpointer(foreign, keep=None).run_of(95)
    stranger = Checkpointer(foreign, keep=None, run_id="stranger", asynchronous=False)
    stranger.save(1, problem.state(), {})
    stranger.save(2, problem.state(), {})
    stranger.close()
    strangers = {k: v for k, v in _snapshot(foreign).items() if k.split(os.sep)[0] in "12"}
    gm.Loop(problem.step, problem.source(8), steps=105,
            plugins=[Checkpoint(foreign, every=_every(5), keep=2, resume=True)]
            ).run(problem.state())
    reader = Checkpointer(foreign, keep=None)
    assert reader.steps() == [1, 2, 100, 105]
    assert [reader.run_of(s) for s in (100, 105)] == [own_run, own_run]
    after = _snapshot(foreign)
    assert {k: after[k] for k in strangers} == strangers


def test_a_writer_never_replaces_a_step_another_run_wrote(tmp_path: pathlib.Path) -> None:
    state = {"w": np.arange(3.0)}
    first = Checkpointer(tmp_path, keep=None, run_id="first", asynchronous=False)
    first.save(3, state, {})
    first.close()
    before = _snapshot(tmp_path)
    second = Checkpointer(tmp_path, keep=1, run_id="second")
    second.save(3, {"w": np.zeros(3)}, {})
    with pytest.raises(CheckpointError, match=r"/3: holds a checkpoint another run wrote"):
        second.wait()
    second.save(4, {"w": np.ones(3)}, {})
    second.save(5, {"w": np.ones(3)}, {})  # keep=1 prunes step 4, its own, never step 3
    second.close()
    assert Checkpointer(tmp_path, keep=None).steps() == [3, 5]
    assert {k: v for k, v in _snapshot(tmp_path).items() if k.startswith("3")} == before


def test_a_step_saved_on_a_step_event_is_saved_again_when_the_run_ends_on_it(
        tmp_path: pathlib.Path) -> None:
    problem = Problem()  # 96 rows in batches of 8: the run's last step, 12, ends its epoch
    every = _every(4) | On("end")
    state = gm.Loop(problem.step, problem.source(8), epochs=1,
                    plugins=[Checkpoint(tmp_path, every=every)]).run(problem.state())
    assert sorted(os.listdir(tmp_path), key=int) == ["4", "8", "12"]  # and no leftover
    assert "latest: step=12, epoch=1," in inspect_run(str(tmp_path))  # the epoch finished
    resumed = gm.Loop.resume(str(tmp_path), problem.step, problem.source(8), epochs=1)
    chex.assert_trees_all_equal(resumed, state)


def test_a_writer_saving_its_own_step_again_replaces_it_whole(tmp_path: pathlib.Path) -> None:
    writer = Checkpointer(tmp_path, keep=None, run_id="run", asynchronous=False)
    writer.save(3, {"w": np.zeros(3)}, {"note": "first"})
    writer.save(3, {"w": np.ones(3)}, {"note": "again"})
    writer.close()
    assert os.listdir(tmp_path) == ["3"]
    restored, meta = Checkpointer(tmp_path, keep=None).restore({"w": np.zeros(3)})
    np.testing.assert_array_equal(restored["w"], np.ones(3))
    assert meta["note"] == "again"


def test_loading_an_orbax_checkpoint_of_flaxs_guide_says_what_it_is(
        tmp_path: pathlib.Path) -> None:
    checkpointer = ocp.StandardCheckpointer()  # as Flax's checkpointing guide saves a state
    checkpointer.save(tmp_path / "state", {"w": np.ones(3)})
    checkpointer.wait_until_finished()
    checkpointer.close()
    with pytest.raises(FileNotFoundError, match=r"it is an orbax checkpoint of its own .*"
                       r"nnx\.update\(model, state\)\), then compile and init"):
        Problem().program.load(tmp_path / "state")


# -- teardown, interrupts, and orbax's noise -----------------------------------------------
def test_a_clean_run_leaves_complete_checkpoints_only(tmp_path: pathlib.Path) -> None:
    problem = Problem()
    gm.Loop(problem.step, problem.source(8), steps=20,
            plugins=[Checkpoint(tmp_path, every=On("step"), keep=2)]).run(problem.state())
    assert sorted(os.listdir(tmp_path)) == ["19", "20"]
    reader = Checkpointer(tmp_path, keep=None)
    assert reader.verify(19) is None and reader.verify(20) is None


def test_disk_full_at_the_last_save_is_named_and_leaves_the_previous_checkpoint(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture) -> None:
    original = ocp.handlers.JsonCheckpointHandler._save_fn
    started = []

    async def full(self: object, record: object, directory: object) -> None:
        # Step 8's write (its folder's name starts so; the run id in it is random).
        if any(part.startswith("8.orbax-checkpoint-tmp")
               for part in pathlib.Path(str(directory)).parts):  # the arrays are written by now
            started.append(any(tmp_path.glob("8.orbax-checkpoint-tmp*")))
            raise OSError(errno.ENOSPC, "No space left on device")
        await original(self, record, directory)

    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", full)
    problem = Problem()
    loop = gm.Loop(problem.step, problem.source(8), steps=8,
                   plugins=[Checkpoint(tmp_path, every=_every(4))])
    with pytest.raises(Exception, match=rf"{re.escape(str(tmp_path / '8'))}: Checkpoint "
                                        r"'checkpoint' could not finish its last save: .*"
                                        r"disk full.*step 4 is intact"):
        loop.run(problem.state())
    assert started == [True]
    assert os.listdir(tmp_path) == ["4"]  # no leftover of the failed write
    assert Checkpointer(tmp_path, keep=None).verify(4) is None
    err = capfd.readouterr().err
    assert "Traceback" not in err and "absl" not in err, err


def test_an_interrupt_saves_the_last_finished_step_and_says_how_to_continue(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    problem = Problem()
    full = gm.Loop(problem.step, problem.source(8), steps=40).run(problem.state())

    def ctrl_c(event: gm.Event) -> None:
        raise KeyboardInterrupt

    loop = gm.Loop(problem.step, problem.source(8), steps=40,
                   plugins=[Checkpoint(tmp_path, every=_every(10))])
    loop.on(On("step", step=at(37)), ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        loop.run(problem.state())
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"graphmod: interrupted - saved step 37 to {tmp_path}; continue with: "
                     f"graphmod resume {tmp_path} (or graphmod.Loop.resume from Python)"]
    reader = Checkpointer(tmp_path, keep=None)
    assert reader.steps() == [20, 30, 37] and reader.verify(37) is None  # keep=3
    resumed = gm.Loop.resume(str(tmp_path), problem.step, problem.source(8),
                             plugins=[Checkpoint(tmp_path, every=_every(10))])
    _assert_same_arrays(storable(resumed), storable(full))


def test_a_stop_before_any_step_of_the_run_finished_saves_nothing(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    problem = Problem()

    def ctrl_c(event: gm.Event) -> None:
        raise KeyboardInterrupt

    fresh = gm.Loop(problem.step, problem.source(8), steps=8, plugins=[Checkpoint(tmp_path)])
    fresh.on(On("begin"), ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        fresh.run(problem.state())
    assert capsys.readouterr().err.splitlines() == [
        "graphmod: interrupted at step 0, before this run finished a step: nothing to save; "
        "run it again from the start"]
    assert Checkpointer(tmp_path, keep=None).steps() == []
    gm.Loop(problem.step, problem.source(8), epochs=1,  # 12 steps, in the same directory
            plugins=[Checkpoint(tmp_path)]).run(problem.state())
    before = _snapshot(tmp_path)
    # Resumed, and stopped again before its first step: step 12 is on disk already.
    again = gm.Loop(problem.step, problem.source(8), epochs=2,
                    plugins=[Checkpoint(tmp_path, resume=True)])
    again.on(On("epoch_begin"), ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        again.run(problem.state())
    assert capsys.readouterr().err.splitlines() == [
        f"graphmod: interrupted - saved step 12 to {tmp_path}; continue with: graphmod resume "
        f"{tmp_path} (or graphmod.Loop.resume from Python)"]

    class CtrlC(gm.Plugin):
        def on_epoch_begin(self, event: gm.Event) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the same by Loop.resume
        gm.Loop.resume(str(tmp_path), problem.step, problem.source(8), epochs=2,
                       plugins=[Checkpoint(tmp_path), CtrlC()])
    assert capsys.readouterr().err.splitlines() == [
        "graphmod: interrupted at step 12, before this run finished a step: nothing to save; "
        f"continue with: graphmod resume {tmp_path}"]
    assert _snapshot(tmp_path) == before


def test_orbax_reads_finishing_late_are_not_reported(tmp_path: pathlib.Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    reported: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))
    Checkpointer(tmp_path).close()  # the first Checkpointer wraps the hook

    def unraisable(error: BaseException) -> types.SimpleNamespace:
        return types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None,
                                     err_msg=None, object=None)

    closed, other = RuntimeError("Event loop is closed"), RuntimeError("something else")
    sys.unraisablehook(unraisable(closed))  # a tensorstore read after a failed restore
    sys.unraisablehook(unraisable(other))
    assert reported == [other]  # everything else is reported as before


def test_every_kind_of_leaf_comes_back_bitwise(tmp_path: pathlib.Path) -> None:
    import jax
    import jax.numpy as jnp

    state = {"bf16": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3), "empty": jnp.zeros((0, 4)),
             "flags": jnp.array([True, False]), "byte": jnp.uint8(7), "count": 5,
             "host": np.linspace(0, 1, 5, dtype=np.float32), "key": jax.random.key(3),
             "rbg": jax.random.key(4, impl="rbg"), "none": None}
    writer = Checkpointer(tmp_path, keep=None)
    writer.save(2, state, {"note": "kinds"})
    writer.wait()
    assert writer.verify(2) is None
    restored, meta = writer.restore(state)
    writer.close()
    assert meta["note"] == "kinds" and restored["none"] is None
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for name in ("bf16", "empty", "flags", "byte"):
        assert restored[name].dtype == state[name].dtype
    _assert_same_arrays(storable(restored), storable(state))
    assert restored["rbg"].dtype == state["rbg"].dtype


def test_a_graphmod_0_1_checkpoint_resumes_unverified_with_a_warning(
        tmp_path: pathlib.Path) -> None:
    # tests/loop/data/format1: written by graphmod 0.1 (format 1, no run id, no checksums)
    # running tests/loop/resumable_run.py's build() for 6 steps, saving at step 6.
    from tests.loop.resumable_run import build

    directory = tmp_path / "run"
    shutil.copytree(pathlib.Path(__file__).parent / "data" / "format1", directory)
    step, data, _ = build()
    with pytest.warns(UserWarning, match=r"format 1.*restored unverified"):
        restored = gm.Loop.resume(directory, step, data, steps=6)
    # What was stored, read by orbax alone: the arrays were computed by graphmod 0.1 on
    # another machine (other keys, other XLA rounding), so they are compared with the file,
    # not with a run here; bitwise resume on one machine is what the SIGKILL tests check.
    stored = ocp.PyTreeCheckpointer().restore((directory / "6" / "state").resolve())
    assert int(restored.step) == 6
    _assert_same_arrays(jax.tree.leaves(restored.variables),
                        jax.tree.leaves(stored["variables"]))
    _assert_same_arrays(jax.tree.leaves(restored.opt_state),
                        jax.tree.leaves(stored["opt_state"]))
    with pytest.warns(UserWarning, match=r"format 1.*restored unverified"):
        resumed = gm.Loop.resume(directory, step, data, steps=12)
    assert int(resumed.step) == 12
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(resumed.variables))
    reason = Checkpointer(directory, keep=None).verify(6)
    assert reason is not None and "cannot be verified" in reason
    assert "cannot be verified" in inspect_run(str(directory))


class _VariablesFirst(NamedTuple):
    """A train state as checkpoints written before 2026-11-27 list it: the same paths
    (``.variables[...]``, ``.opt_state[...]``, ...), the variables' leaves first."""

    variables: Any
    opt_state: Any
    step: Any
    rng: Any
    skipped: Any


def test_a_state_saved_variables_first_restores_each_leaf_by_its_path(
        tmp_path: pathlib.Path) -> None:
    problem = Problem()
    # SGD's momentum has the parameters' shapes: read by position, the parameters and their
    # momentum would swap without a shape to tell them apart.
    step = gm.optimize(problem.program, optax.sgd(0.1, momentum=0.9))
    state = step.init(problem.variables, jax.random.key(0))
    for i in range(3):
        state, _ = step(state, problem.x[8 * i:8 * i + 8], problem.y[8 * i:8 * i + 8])
    # loss_scale came later (None here); a count of skipped steps was always there then
    old = _VariablesFirst(*state[:4], skipped=np.int32(2))
    assert storable(old)[0].shape == storable(state)[0].shape  # same shapes, other leaves
    writer = Checkpointer(tmp_path / "run", keep=None)
    writer.save(3, old, {})
    writer.wait()
    restored, _ = writer.restore(jax.tree.map(np.zeros_like, state))
    writer.close()
    assert isinstance(restored, gm.TrainState) and int(restored.skipped) == 2  # kept
    for field in set(gm.TrainState._fields) - {"skipped"}:
        _assert_same_arrays(jax.tree.leaves(getattr(restored, field)),
                            jax.tree.leaves(getattr(state, field)))
    momentum = jax.tree.leaves(state.opt_state)
    assert not all(np.array_equal(m, v) for m, v in
                   zip(momentum, jax.tree.leaves(state.variables), strict=False))


def test_a_count_of_skipped_steps_is_kept_or_started_across_steps_that_skip_or_not(
        tmp_path: pathlib.Path) -> None:
    # Only a step with skip_nonfinite carries the count (a leaf costs every call): a run
    # resumed by a step without keeps a saved count (every checkpoint before 2026-12-04
    # holds one), a step with it resuming a checkpoint without counts from 0.
    problem = Problem()
    plain = gm.optimize(problem.program, optax.sgd(0.1))
    skipping = gm.optimize(problem.program, optax.sgd(0.1), skip_nonfinite=True)
    bad = problem.y[:8].copy()
    bad[0] = np.nan
    state, metrics = skipping(skipping.init(problem.variables, jax.random.key(0)),
                              problem.x[:8], bad)
    assert int(state.skipped) == 1 and int(metrics["skipped_steps"]) == 1
    writer = Checkpointer(tmp_path / "skipping", keep=None)
    writer.save(1, state, {})
    writer.wait()
    template = plain.init(problem.variables, jax.random.key(0))
    assert template.skipped is None
    restored, _ = writer.restore(template)
    writer.close()
    assert int(restored.skipped) == 1  # kept, and carried as it is by the plain step
    after, _ = plain(plain.place(restored), problem.x[:8], problem.y[:8])
    assert int(after.skipped) == 1 and int(after.step) == 2

    writer = Checkpointer(tmp_path / "plain", keep=None)
    writer.save(2, after._replace(skipped=None), {})
    writer.wait()
    restored, _ = writer.restore(skipping.init(problem.variables, jax.random.key(0)))
    writer.close()
    assert int(restored.skipped) == 0 and int(restored.step) == 2  # counted from 0
    # A meta record's spec of the count is read as data: a crafted shape allocates nothing
    # (then fails the restore's comparison with the array list), a non-count is no count.
    huge, _ = counted_as_saved(template, {".skipped": [[10**12], "int32"]})
    assert huge.skipped.strides == (0,)
    for crafted in ([[], "object"], [["2"], "int32"], "int32", [[2, 2], "int32"]):
        assert counted_as_saved(template, {".skipped": crafted})[0].skipped is None
    # A state another step made: placed (as the loop does) or passed straight in.
    for place in (skipping.place, lambda state: state):
        given = place(plain.init(problem.variables, jax.random.key(0)))
        out, metrics = skipping(given, problem.x[:8], bad)
        assert int(out.skipped) == 1 and int(metrics["skipped_steps"]) == 1


# -- the writer's lock: one run writes into a run directory at a time ---------------------
_ROOT = pathlib.Path(__file__).parents[2]
_HOLDING_WRITER = """
import os, pathlib, sys, time
import graphmod as gm
from graphmod.plugins import Checkpoint
from tests.loop.conftest import Problem

directory, release = sys.argv[1], pathlib.Path(sys.argv[2])

def hold(event):  # set up, so the lock is held: wait for the test to let go
    pathlib.Path(f"{release}-{os.getpid()}").touch()
    deadline = time.monotonic() + 600
    while not release.exists():
        assert time.monotonic() < deadline, "never released"
        time.sleep(0.05)

problem = Problem()
loop = gm.Loop(problem.step, problem.source(8), steps=2,
               plugins=[Checkpoint(directory, every=gm.On("step"))])
loop.on(gm.On("begin"), hold)
loop.run(problem.state())
"""


def _python(code: str, *args: str, **kwargs: Any) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(_ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=_ROOT,
                            **kwargs)


def _first_to_end(processes: list[subprocess.Popen], timeout: float = 600) -> int:
    """The index of the first of ``processes`` to end (failing loudly after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        for i, process in enumerate(processes):
            if process.poll() is not None:
                return i
        assert time.monotonic() < deadline, "neither process ended"
        time.sleep(0.1)


def test_two_writers_at_one_fresh_directory_one_runs_the_other_is_refused_at_setup(
        tmp_path: pathlib.Path) -> None:
    directory, release = tmp_path / "run", tmp_path / "release"
    writers = [_python(_HOLDING_WRITER, str(directory), str(release),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    try:
        refused = writers[_first_to_end(writers)]
        holder = writers[1 - writers.index(refused)]
        err = refused.stderr.read().decode()
        assert refused.returncode != 0, err
        assert re.search(rf"plugin 'checkpoint' raised in setup: CheckpointError: {directory}: "
                         rf"another run writes into this directory: process {holder.pid} on "
                         r"host \S+ \(since .*\) holds its lock \(graphmod.lock\); wait for "
                         r"that run to end", err), err
        assert not pathlib.Path(f"{release}-{refused.pid}").exists()  # it never ran
        assert pathlib.Path(f"{release}-{holder.pid}").exists()
        release.touch()
        assert holder.wait(timeout=600) == 0, holder.stderr.read().decode()
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
    assert Checkpointer(directory, keep=None).steps() == [1, 2]
    assert not (directory / "graphmod.lock").exists()  # let go, and deleted


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "run"
    holder = _python("import sys, time\nfrom graphmod._train._checkpoint._lock import RunLock\n"
                     "RunLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\n"
                     "time.sleep(600)", str(directory), stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        problem = Problem()
        with pytest.raises(gm.PluginError, match=rf"process {holder.pid} on host"):
            gm.Loop(problem.step, problem.source(8), steps=2,
                    plugins=[Checkpoint(directory)]).run(problem.state())
    finally:
        holder.kill()
        holder.wait()
    assert (directory / "graphmod.lock").exists()  # the file stays; its lock went with it
    gm.Loop(problem.step, problem.source(8), steps=2,
            plugins=[Checkpoint(directory)]).run(problem.state())
    assert sorted(os.listdir(directory)) == ["2"]


@pytest.mark.parametrize("stop", [RuntimeError, KeyboardInterrupt])
def test_the_lock_is_let_go_when_a_run_stops(tmp_path: pathlib.Path, stop: type) -> None:
    problem = Problem()
    held = []

    def fail(event: gm.Event) -> None:
        held.append((tmp_path / "graphmod.lock").exists())
        raise stop("stop")

    loop = gm.Loop(problem.step, problem.source(8), steps=4, plugins=[Checkpoint(tmp_path)])
    loop.on(On("step", step=at(2)), fail)
    with pytest.raises((gm.PluginError, KeyboardInterrupt)):
        loop.run(problem.state())
    assert held == [True] and sorted(os.listdir(tmp_path)) == ["2"]
    gm.Loop.resume(tmp_path, problem.step, problem.source(8), steps=4,
                   plugins=[Checkpoint(tmp_path)])  # the directory is free again
    assert Checkpointer(tmp_path, keep=None).steps() == [2, 4]


def test_a_refused_setup_leaves_no_directory_behind(tmp_path: pathlib.Path) -> None:
    problem = Problem()
    directory = tmp_path / "new" / "run"
    loop = gm.Loop(problem.step, problem.source(8), steps=2,
                   plugins=[Checkpoint(directory), Checkpoint(directory, name="again")])
    with pytest.raises(gm.PluginError, match=rf"plugin 'again' raised in setup: .*process "
                                             rf"{os.getpid()} on host"):
        loop.run(problem.state())
    assert os.listdir(tmp_path) == []
