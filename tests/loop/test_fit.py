"""``graphmod.fit``: the same run as by hand, bit for bit; a killed fit continues exactly, a
finished one returns at once, another run's directory is refused untouched; every default
can be turned off or replaced; bad input is refused before anything runs."""

from __future__ import annotations

import io
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import graphmod as gm
from graphmod import On, each
from graphmod._train._checkpoint import CheckpointReader
from graphmod.data import ArraySource
from graphmod.plugins import Checkpoint, EarlyStopping, Logger, ProgressBar, Validation
from tests.loop import fit_run

ROOT = pathlib.Path(__file__).parents[2]


def _leaves(variables: Any) -> list[tuple[str, np.ndarray]]:
    return [(jax.tree_util.keystr(path), np.asarray(leaf))
            for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]]


def _assert_bitwise(a: Any, b: Any) -> None:
    left, right = _leaves(a), _leaves(b)
    assert [p for p, _ in left] == [p for p, _ in right]
    for (path, x), (_, y) in zip(left, right, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=path)


def _files(directory: pathlib.Path) -> dict[str, bytes | None]:
    """Every entry under ``directory`` by relative path: a file's bytes, a folder's None."""
    return {str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes()
            for p in sorted(directory.rglob("*"))}


def _steps(seen: list[str]) -> Any:
    """A plugin that notes the type of every event it gets."""
    return lambda event: seen.append(event.type)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[gm.FitResult, pathlib.Path]:
    """The whole run, fitted into a run directory of its own."""
    directory = tmp_path_factory.mktemp("reference")
    return fit_run.fit(directory), directory


def test_fit_is_the_run_assembled_by_hand_bit_for_bit(reference, tmp_path) -> None:
    result, _ = reference
    model, chosen = fit_run.parts()
    program = gm.compile(fit_run.cost, model, managers=chosen)
    source = fit_run.training_data()
    step = gm.optimize(program, optax.adam(1e-2))
    state = step.init(program.init(*next(source.iter_epoch(0))), jax.random.key(0))
    valid = Validation(program, ArraySource(fit_run.held_out(), 40, drop_remainder=False,
                                            name="validation"))
    rows: list[tuple[int, float, float]] = []
    loop = gm.Loop(step, source, epochs=fit_run.EPOCHS, plugins=[
        valid, Logger(tmp_path, every=On("epoch_end") | On("validated")), Checkpoint(tmp_path)])
    loop.on("step", lambda e: rows.append(
        (e.time.step, float(e.metrics["loss"]), float(e.metrics["accuracy"]))))
    final = loop.run(state)

    _assert_bitwise(result.state, final)
    steps = result.history["steps"]
    assert list(zip(steps["step"], steps["loss"], steps["accuracy"], strict=True)) == rows
    assert steps["epoch"] == [1] * 6 + [2] * 6 + [3] * 6
    epochs = result.history["epochs"]
    assert epochs["step"] == [6, 12, 18]
    assert epochs["loss"] == [float(np.mean([r[1] for r in rows[i:i + 6]])) for i in (0, 6, 12)]
    assert result.history["validation"] == {
        "step": [s for s, _ in valid.history],
        **{name: [float(r[name]) for _, r in valid.history] for name in valid.history[0][1]}}
    assert result.evaluation == {"step": 18, **valid.history[-1][1]}
    assert result.monitor == ("valid/loss", "min")
    assert result.best["step"] == min(valid.history, key=lambda e: e[1]["valid/loss"])[0]
    assert (tmp_path / "log.csv").read_text().count("\n") == \
        (reference[1] / "log.csv").read_text().count("\n")
    assert result.provenance.derived["steps"] == 18
    assert result.provenance["optimizer"] == loop.provenance["optimizer"]


def test_a_fit_killed_by_sigkill_continues_bit_for_bit(reference, tmp_path) -> None:
    directory = tmp_path / "run"
    killed = subprocess.Popen(
        [sys.executable, "-m", "tests.loop.fit_run", str(directory), "--hang-at", "10"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (directory / "ready").exists():
        assert killed.poll() is None, killed.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the run never reached step 10"
        time.sleep(0.1)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=60) == -signal.SIGKILL
    killed.stderr.close()
    reader = CheckpointReader(directory)
    assert reader.steps() == [6, 10]  # step 10 is inside epoch 2
    reader.close()

    resumed = fit_run.fit(directory, progress=True)  # every default on
    result = reference[0]
    assert resumed.resumed_from == 10 and resumed.steps_run == 8
    _assert_bitwise(result.state, resumed.state)
    assert resumed.history == result.history
    assert resumed.evaluation == result.evaluation and resumed.best == result.best
    assert [p.name for p in resumed.loop.plugins] == [
        "history", "validation", "progress_bar", "print", "logger", "checkpoint"]


def test_a_fit_stopped_by_an_error_after_a_checkpoint_continues_bit_for_bit(
        reference, tmp_path) -> None:
    def fail(event: gm.Event) -> None:
        if event.type == "step" and event.time.step == 8:
            raise RuntimeError("stopped at step 8")

    with pytest.raises(gm.PluginError, match="stopped at step 8"):
        fit_run.fit(tmp_path, plugins=[fail])
    reader = CheckpointReader(tmp_path)
    assert reader.steps() == [6, 8]  # the checkpoint saves the step the error stopped at
    reader.close()
    resumed = fit_run.fit(tmp_path)
    assert resumed.resumed_from == 8
    _assert_bitwise(reference[0].state, resumed.state)
    assert resumed.history == reference[0].history


def test_a_finished_fit_returns_at_once_with_the_same_result(reference) -> None:
    result, directory = reference
    before = _files(directory)
    seen: list[str] = []
    again = fit_run.fit(directory, plugins=[_steps(seen)])
    assert seen == [] and again.steps_run == 0 and again.resumed_from == 18
    assert int(again.state.step) == 18
    _assert_bitwise(result.state, again.state)
    assert again.history == result.history
    assert again.evaluation == result.evaluation and again.best == result.best
    assert _files(directory) == before


@pytest.mark.parametrize(("change", "named"), [
    ({"width": 32}, r"bricks\['/'\]\.arguments\.dims\[1\]: checkpoint 16, now 32"),
    ({"shift": 0.5}, r"data\.sha256: checkpoint '[0-9a-f]{12}\.\.\.', now "),
    ({"optimizer": optax.sgd(0.1)}, r"optimizer\.structure: checkpoint 'chain\("),
], ids=["model width", "data", "optimizer"])
def test_a_directory_of_another_run_is_refused_naming_the_difference(
        reference, change, named) -> None:
    directory = reference[1]
    before = _files(directory)
    seen: list[str] = []
    with pytest.raises(gm.CheckpointError, match=r"holds another run(.|\n)*" + named):
        fit_run.fit(directory, plugins=[_steps(seen)], **change)
    assert seen == []
    assert _files(directory) == before


def test_other_data_are_allowed_with_allow_data_change(reference) -> None:
    directory = reference[1]
    before = _files(directory)
    again = fit_run.fit(directory, shift=0.5, allow_data_change=True)
    assert again.resumed_from == 18 and again.steps_run == 0  # finished: nothing to run
    assert _files(directory) == before


def test_every_default_can_be_turned_off(tmp_path) -> None:
    result = fit_run.fit(tmp_path, validation=None, progress=False, log=False,
                         checkpoint=False, steps=3)
    assert [p.name for p in result.loop.plugins] == ["history"]
    assert result.directory == str(tmp_path) and list(tmp_path.iterdir()) == []
    assert result.evaluation is result.best is result.monitor is None
    assert result.history["validation"] == {"step": []}
    assert result.history["steps"]["step"] == [1, 2, 3]


def test_every_default_can_be_replaced(tmp_path) -> None:
    bar = ProgressBar(file=io.StringIO())
    log = Logger(tmp_path / "log.jsonl", every=On("step"))
    saves = Checkpoint(tmp_path / "run", every=On("step", step=each(4)), keep=None)
    stop = EarlyStopping("valid/hits", mode="max", patience=1, restore_best=False)
    seen: list[str] = []
    result = fit_run.fit(
        None, checkpoint=saves, progress=bar, log=log, early_stopping=stop,
        metrics={"hits": lambda outputs, batch: jnp.argmax(outputs, -1) == batch[1]},
        predict=lambda m, x: m(x), optimizer=optax.sgd(0.5), seed=5,
        plugins=[_steps(seen)])
    assert [p.name for p in result.loop.plugins[:-1]] == [
        "history", "validation", "early_stopping", "progress_bar", "logger", "checkpoint"]
    assert result.loop.plugins[4] is log and result.loop.plugins[5] is saves
    assert bar.position == result.loop.time.step == seen.count("step")
    assert result.directory == saves.directory
    reader = CheckpointReader(saves.directory)
    steps = reader.steps()
    reader.close()
    assert all(s % 4 == 0 or s == result.loop.time.step for s in steps) and len(steps) >= 3
    assert (tmp_path / "log.jsonl").read_text().count("\n") == result.loop.time.step
    assert result.monitor == ("valid/hits", "max")
    assert result.history["validation"]["valid/hits"]
    assert result.provenance["optimizer"]["structure"].startswith("chain(")
    assert result.provenance["seeds"]["train"]["data"][-1] == 5


def test_a_validation_of_your_own_and_early_stopping_by_name() -> None:
    model, chosen = fit_run.parts()
    predict = gm.compile(fit_run.cost, model, managers=chosen).derive(lambda m, x: m(x))
    mine = Validation(predict, ArraySource(fit_run.held_out(), 16, drop_remainder=False),
                      metrics=["accuracy"], prefix="test/")
    result = gm.fit(fit_run.cost, model, fit_run.training_data(), managers=chosen, epochs=2,
                    validation=mine, early_stopping="test/accuracy", progress=False)
    stop = result.loop.plugins[2]
    assert result.loop.plugins[1] is mine and isinstance(stop, EarlyStopping)
    assert (stop.metric, stop.mode, stop.patience, stop.restore_best) == (
        "test/accuracy", "max", 5, False)
    assert result.monitor == ("test/accuracy", "max")
    assert result.history["validation"]["step"] == [6, 12]
    assert result.best["test/accuracy"] == max(result.history["validation"]["test/accuracy"])


def _refused(tmp_path: pathlib.Path, options: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    fit_run.fit(tmp_path / "run", plugins=[_steps(seen)], **options)
    return seen


BAD_INPUT = {
    "a batch as data": ({"data": (np.ones((8, 4)),)}, TypeError,
                        r"fit\(data=...\): a tuple is one batch, not a data source; pass "
                        r"graphmod.data.ArraySource"),
    "an iterator as data": ({"data": iter([])}, TypeError,
                            r"fit\(data=...\): a list_iterator is an iterator"),
    "a number as data": ({"data": 3}, TypeError,
                         r"fit\(data=...\): expected a graphmod.data.ArraySource"),
    "a metric not callable": ({"metrics": {"acc": 3}}, TypeError,
                              r"fit\(metrics=...\): entry 'acc' must map a name to fn"),
    "an unknown metric": ({"metrics": ["acuracy"]}, ValueError,
                          r"fit\(metrics=...\): unknown metric 'acuracy' \(did you mean "
                          r"'accuracy'\?\)"),
    "metrics without validation": ({"metrics": ["accuracy"], "validation": None}, ValueError,
                                   r"fit\(metrics=...\): metrics belong to the validation; "
                                   r"pass validation="),
    "batches as validation": ({"validation": [(np.ones((4, 4)),)]}, TypeError,
                              r"fit\(validation=...\): expected an ArraySource, arrays"),
    "stopping on no metric": ({"early_stopping": "valid/acuracy"}, ValueError,
                              r"the validation produces no 'valid/acuracy' \(did you mean "
                              r"'valid/accuracy'\?\)"),
    "a plugin on no metric": ({"early_stopping": EarlyStopping("grad")}, ValueError,
                              r"no plugin or step produces 'grad'; the validation produces "
                              r"\['valid/loss', 'valid/accuracy'\], the step \['accuracy', "
                              r"'loss'\]"),
    "stopping without validation": ({"early_stopping": "valid/loss", "validation": None},
                                    ValueError, r"pass validation=\(x_test, y_test\) too"),
    "stopping not a name": ({"early_stopping": 3}, TypeError,
                            r"fit\(early_stopping=3\): expected a validation metric's name"),
    "predict misfits the data": ({"predict": lambda m, x, y, z: m(x), "metrics": ["accuracy"]},
                                 ValueError, r"validation: the program takes 3 inputs"),
    "a metric of the whole batch": ({"metrics": {"acc": lambda out, batch: out.mean()}},
                                    ValueError, r"fit: the validation's metrics fail on its "
                                    r"first batch: metric 'acc' returned a scalar"),
    "a negative seed": ({"seed": -1}, TypeError, r"fit\(seed=-1\): expected an int >= 0"),
    "no epochs": ({"epochs": 0}, ValueError, r"fit\(epochs=0\): must be a positive int"),
    "progress not a plugin": ({"progress": "yes"}, TypeError,
                              r"fit\(progress='yes'\): expected True, False or a ProgressBar"),
    "an optimizer's name": ({"optimizer": "adam"}, TypeError,
                            r"fit\(optimizer=...\): expected an optax transformation"),
}


@pytest.mark.parametrize(("options", "error", "message"), BAD_INPUT.values(), ids=BAD_INPUT)
def test_bad_input_is_refused_before_anything_runs(tmp_path, options, error, message) -> None:
    seen: list[str] = []
    with pytest.raises(error, match=message):
        seen = _refused(tmp_path, options)
    assert seen == [] and not (tmp_path / "run").exists()


def test_a_directory_that_is_a_file_is_refused(tmp_path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(NotADirectoryError, match=r"is a file, not a run directory"):
        fit_run.fit(path)
    assert path.read_text() == "mine"
