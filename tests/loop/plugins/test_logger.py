"""Logger: CSV and JSON-lines rows of times and metrics, widening, exact resume."""

from __future__ import annotations

import csv
import importlib.util
import json
import os

import numpy as np
import pytest

import graphmod as gm
from graphmod import On, at, each
from graphmod.plugins import Logger, _logger
from tests.loop.conftest import Problem
from tests.loop.plugins.conftest import LayerMetric, fire_scores

TIMES = ["step", "epoch", "examples", "seconds", "train_seconds"]


def _csv_rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_rows_hold_every_timeline_and_the_metrics_as_floats(problem: Problem,
                                                                 tmp_path) -> None:
    template = On("step", step=each(4))
    losses: list[float] = []
    log = Logger(tmp_path / "run", every=template, tensorboard=False)
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[log])
    loop.on(template, lambda e: losses.append(float(e.metrics["loss"])))
    loop.run(problem.state())
    assert log.path == str(tmp_path / "run" / "log.csv") and log.rows == 3
    with open(log.path) as f:
        assert f.readline().strip() == ",".join(["event", *TIMES, "loss"])
    rows = _csv_rows(log.path)
    assert [(r["event"], int(r["step"]), int(r["examples"])) for r in rows] == [
        ("step", 4, 32), ("step", 8, 64), ("step", 12, 96)]
    assert [float(r["loss"]) for r in rows] == losses  # written exactly
    seconds = [float(r["seconds"]) for r in rows]
    assert seconds == sorted(seconds) and all(float(r["train_seconds"]) >= 0 for r in rows)


def test_a_due_event_never_waits_for_the_device(problem: Problem, tmp_path,
                                                monkeypatch) -> None:
    monkeypatch.setattr(_logger, "on_host", lambda metrics: False)  # metrics still in transit
    every = On("step", step=each(4))
    log = Logger(tmp_path, every=every, tensorboard=False)
    written: list[int] = []
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[log])
    loop.on(every, lambda e: written.append(log.rows))
    loop.run(problem.state())
    assert written == [0, 0, 0]  # no row was fetched while the run went on
    assert log.rows == 3 and [r["step"] for r in _csv_rows(log.path)] == ["4", "8", "12"]


def test_jsonl_rows_include_fired_events_metrics(problem: Problem, tmp_path) -> None:
    path = tmp_path / "log.jsonl"
    log = Logger(path, metrics=["loss", "valid/loss"], tensorboard=False,
                 every=On("step", step=at(2)) | On("validated"))
    loop = gm.Loop(problem.step, problem.source(32), epochs=2, plugins=[log])
    loop.on("epoch_end", fire_scores([0.5, 0.25]))
    loop.run(problem.state())
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["event"], r["step"], r.get("valid/loss")) for r in rows] == [
        ("step", 2, None), ("validated", 3, 0.5), ("validated", 6, 0.25)]
    assert set(rows[0]) == {"event", *TIMES, "loss"} and isinstance(rows[0]["loss"], float)
    assert set(rows[1]) == set(rows[2]) == {"event", *TIMES, "valid/loss"}


def test_a_new_metric_widens_the_csv_header_once(problem: Problem, tmp_path) -> None:
    log = Logger(tmp_path / "log.csv", every=On("step", step=at(1)) | On("validated"),
                 tensorboard=False)
    loop = gm.Loop(problem.step, problem.source(32), epochs=2, plugins=[log])
    loop.on("epoch_end", fire_scores([0.5, 0.25]))
    loop.run(problem.state())
    rows = _csv_rows(log.path)
    assert list(rows[0]) == ["event", *TIMES, "loss", "valid/loss"]
    assert [(r["event"], r["valid/loss"]) for r in rows] == [
        ("step", ""), ("validated", "0.5"), ("validated", "0.25")]


def test_a_resumed_run_cuts_the_log_back_to_its_checkpoint(problem: Problem, tmp_path) -> None:
    every = On("step", step=each(4))
    saved: list[dict] = []
    log = Logger(tmp_path, every=every, tensorboard=False)
    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[log])
    loop.on(On("step", step=at(8)), lambda e: saved.append(log.state_dict()))
    loop.run(problem.state())
    assert saved == [{"rows": 2, "file": "log.csv"}] and len(_csv_rows(log.path)) == 3
    # A new process resumes from the checkpoint taken at step 8: row 3 is written again.
    resumed = Logger(tmp_path, every=every, tensorboard=False)
    resumed.load_state_dict(json.loads(json.dumps(saved[0])))
    again = gm.Loop(problem.step, problem.source(8), steps=4, plugins=[resumed])
    again.run(problem.state())
    assert [r["step"] for r in _csv_rows(log.path)] == ["4", "8", "4"]
    assert resumed.rows == 3


def test_a_metric_per_layer_is_one_column_per_index(layer_metric: LayerMetric, tmp_path) -> None:
    every = On("step", step=each(2))
    seen: list[np.ndarray] = []
    log = Logger(tmp_path / "log.csv", every=every, tensorboard=False)
    layer_metric.loop([log], seen, every).run(layer_metric.state())
    rows = _csv_rows(log.path)
    name = layer_metric.name
    assert {"loss", *(f"{name}[{i}]" for i in range(3))} <= set(rows[0])
    assert f"{name}[3]" not in rows[0]
    assert [[float(r[f"{name}[{i}]"]) for i in range(3)] for r in rows] == [
        list(map(float, means)) for means in seen]


@pytest.mark.skipif(importlib.util.find_spec("tensorboardX") is None,
                    reason="tensorboardX is not installed")
def test_tensorboard_scalars_are_written_when_available(problem: Problem, tmp_path) -> None:
    assert not Logger(tmp_path).tensorboard  # opt-in
    log = Logger(tmp_path, every=On("step", step=each(6)), tensorboard=True)
    gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[log]).run(problem.state())
    assert any(name.startswith("events.out.tfevents")
               for name in os.listdir(tmp_path / "log.tensorboard"))


def test_bad_arguments_are_named(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"Logger\(format='xml'\)"):
        Logger(tmp_path, format="xml")
    with pytest.raises(ValueError, match=r"suffix says 'csv'"):
        Logger(tmp_path / "log.csv", format="jsonl")
    with pytest.raises(TypeError, match=r"Logger\(directory_or_path\)"):
        Logger(3)  # type: ignore[arg-type]
    if importlib.util.find_spec("tensorboardX") is None:
        with pytest.raises(ImportError, match="pip install tensorboardX"):
            Logger(tmp_path, tensorboard=True)


def test_a_second_run_logs_to_its_own_file_and_resumes_into_it(problem: Problem,
                                                                tmp_path) -> None:
    every = On("step", step=each(4))
    first = Logger(tmp_path, every=every)
    gm.Loop(problem.step, problem.source(8), steps=8, plugins=[first]).run(problem.state())
    second = Logger(tmp_path, every=every)
    saved: list[dict] = []
    loop = gm.Loop(problem.step, problem.source(8), steps=8, plugins=[second])
    loop.on(On("step", step=at(4)), lambda e: saved.append(second.state_dict()))
    with pytest.warns(UserWarning, match=r"log.csv holds another run's rows; this run logs "
                                         r"to .*log-2.csv"):
        loop.run(problem.state())
    assert second.path == str(tmp_path / "log-2.csv")
    assert [r["step"] for r in _csv_rows(first.path)] == ["4", "8"]  # untouched
    assert [r["step"] for r in _csv_rows(second.path)] == ["4", "8"]
    # Resuming the second run from its step-4 state cuts back and appends to log-2.csv.
    resumed = Logger(tmp_path, every=every)
    resumed.load_state_dict(saved[0])
    gm.Loop(problem.step, problem.source(8), steps=4, plugins=[resumed]).run(problem.state())
    assert resumed.path == second.path
    assert [r["step"] for r in _csv_rows(second.path)] == ["4", "4"]
    assert [r["step"] for r in _csv_rows(first.path)] == ["4", "8"]
    with pytest.raises(ValueError, match=r"names log file '../x.csv'"):
        Logger(tmp_path).load_state_dict({"rows": 1, "file": "../x.csv"})
