"""``Loop.resume`` refuses what would continue a run silently wrong, before changing anything."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import warnings

import numpy as np
import optax
import pytest

import graphmod as gm
from graphmod import On
from graphmod._train._checkpoint import Checkpointer
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint
from tests.loop.conftest import Problem


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Problem, pathlib.Path]:
    """A run stopped after 4 of 8 steps, on batches of 8 of 96 shuffled rows (seed 1)."""
    problem = Problem()
    directory = tmp_path_factory.mktemp("run")
    loop = gm.Loop(problem.step, _source(problem), steps=8,
                   plugins=[Checkpoint(directory, every=On("step"), keep=None)])
    loop.on(On("step", step=gm.at(4)), lambda e: e.loop.terminate())
    loop.run(problem.state())
    return problem, directory


def _source(problem: Problem, x: np.ndarray | None = None, y: np.ndarray | None = None,
            batch_size: int = 8, seed: int = 1) -> ArraySource:
    return ArraySource({"x": problem.x if x is None else x, "y": problem.y if y is None else y},
                       batch_size, shuffle=True, seed=seed)


def _listing(directory: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _changed(problem: Problem) -> np.ndarray:
    x = problem.x.copy()
    x[17, 2] += 1.0
    return x


CHANGES = {
    "other content": (lambda p: _source(p, x=_changed(p)), ["sha256"]),
    "other seed": (lambda p: _source(p, seed=2), ["seed"]),
    "other batch size": (lambda p: _source(p, batch_size=12), ["batch_size"]),
    "other row count": (lambda p: _source(p, x=p.x[:88], y=p.y[:88]), ["sha256", "size"]),
}


@pytest.mark.parametrize("change", CHANGES)
def test_resume_refuses_other_data_naming_the_fields(saved, change: str) -> None:
    problem, directory = saved
    make, fields = CHANGES[change]
    before = _listing(directory)
    with pytest.raises(ValueError, match=r"(?s)data differ from those the checkpoint of step 4 "
                                         rf"was trained on \({', '.join(fields)}\):\n  "
                                         rf"{fields[0]}: checkpoint .*allow_data_change=True"):
        gm.Loop.resume(directory, problem.step, make(problem),
                       plugins=[Checkpoint(directory, every=On("step"), keep=None)])
    assert _listing(directory) == before


def test_allow_data_change_continues_and_is_recorded(saved, tmp_path) -> None:
    problem, directory = saved
    copy = tmp_path / "run"
    for name, _ in _listing(directory).items():  # resume a copy: the fixture stays as saved
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes((directory / name).read_bytes())
    state = gm.Loop.resume(copy, problem.step, _source(problem, seed=2), allow_data_change=True,
                           plugins=[Checkpoint(copy, every=On("step"), keep=None)])
    assert int(state.step) == 8
    meta = Checkpointer(copy, keep=None).meta(8)
    assert meta["data_changes"] == [{"step": 4, "fields": ["seed"]}]
    inputs = meta["provenance"]["inputs"]
    assert inputs["data_changes"] == meta["data_changes"] and inputs["data"]["seed"] == 2
    assert "resumed on other data at step 4: seed" in gm.inspect_run(copy)


def test_a_resume_with_other_settings_is_recorded_with_the_settings_before(saved,
                                                                         tmp_path) -> None:
    _, directory = saved
    before = Checkpointer(directory, keep=None).meta(4)["provenance"]["inputs"]["managers"]
    other = Problem(dropout=0.5)  # the same model and state, another dropout rate
    for resumed in ("Loop.resume", "Checkpoint(resume=True)"):
        copy = tmp_path / resumed
        for name, _ in _listing(directory).items():  # the fixture stays as saved
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).write_bytes((directory / name).read_bytes())
        plugin = Checkpoint(copy, every=On("step"), keep=None,
                            resume=resumed != "Loop.resume")
        with pytest.warns(UserWarning, match=r"\['managers'\] differ.*record the change"):
            if resumed == "Loop.resume":
                gm.Loop.resume(copy, other.step, _source(other), steps=6, plugins=[plugin])
            else:
                gm.Loop(other.step, _source(other), steps=6, plugins=[plugin]).run(
                    other.state())
        meta = Checkpointer(copy, keep=None).meta(6)
        assert meta["setting_changes"] == [{"step": 4, "settings": {"managers": before}}]
        inputs = meta["provenance"]["inputs"]
        assert inputs["setting_changes"] == meta["setting_changes"]
        assert inputs["managers"] != before  # the record's own: the settings now
        assert "resumed with other settings at step 4: managers" in gm.inspect_run(copy)


def test_checkpoint_resume_true_checks_the_data_too(saved) -> None:
    problem, directory = saved
    loop = gm.Loop(problem.step, _source(problem, seed=2), steps=8,
                   plugins=[Checkpoint(directory, every=On("step"), resume=True, keep=None)])
    with pytest.raises(gm.PluginError, match=r"plugin 'checkpoint' raised in setup: "
                                             r"ValueError: .*data differ.*\(seed\)") as info:
        loop.run(problem.state())
    assert "allow_data_change=True" in str(info.value.__cause__)


def test_resume_from_a_missing_directory_names_it_and_creates_nothing(saved, tmp_path) -> None:
    problem, _ = saved
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint in {missing}: no such "
                                                r"directory \(nothing was created\)"):
        gm.Loop.resume(missing, problem.step, _source(problem))
    assert not (tmp_path / "no").exists()


def test_resume_with_other_managers_warns_and_other_trainable_names_it(saved) -> None:
    _, directory = saved
    other = Problem(dropout=0.5)  # the same model and state, another dropout rate
    before = _listing(directory)
    with pytest.warns(UserWarning, match=r"resume: this run's \['managers'\] differ from those "
                      r"the checkpoint of step 4 was trained with"):
        gm.Loop.resume(directory, other.step, _source(other), steps=8)
    assert _listing(directory) == before  # nothing was saved: no checkpoint plugin
    head = gm.VariableFilter(bricks=[other.program.model.linear_layers[1]])
    narrower = gm.optimize(other.program, optax.adam(1e-2), trainable=head)
    with pytest.raises(ValueError, match="another program's state") as info:
        gm.Loop.resume(directory, narrower, _source(other), steps=8)
    assert "trained with other settings: ['managers', 'trainable']" in info.value.__notes__[0]


def test_resume_with_another_optimizer_names_it(saved, tmp_path) -> None:
    problem, directory = saved  # trained with optax.adam(1e-2), made without a record
    for other in (optax.adam(1e-1), optax.adamw(1e-2)):
        step = gm.optimize(problem.program, other)
        with pytest.warns(UserWarning, match=r"resume: this run's \['optimizer'\] differ from "
                                             r"those the checkpoint of step 4 was trained with"):
            gm.Loop.resume(directory, step, _source(problem), steps=5)
    # A checkpoint written before optimizers were described by their structure: the same
    # optimizer is no change.
    copy = tmp_path / "run"
    shutil.copytree(directory, copy)
    path = copy / "4" / "meta" / "metadata"
    record = json.loads(path.read_text())
    del record["provenance"]["inputs"]["optimizer"]["structure"]
    path.write_text(json.dumps(record))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm.Loop.resume(copy, problem.step, _source(problem), checkpoint=4, steps=5)
