"""Logger's Weights & Biases backend, in W&B's offline mode (no network): the run directory
holds the metrics, the provenance as config, and checkpoints as artifacts when asked."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct
import time
from typing import Any

import pytest

import graphmod as gm
from graphmod import On
from graphmod.plugins import Checkpoint, Logger
from tests.loop.conftest import Problem

pytestmark = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                reason="wandb is not installed: pip install 'graphmod[wandb]'")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def _records(directory: str, run_id: str) -> list[Any]:
    """The records of the offline run ``run_id`` under ``directory``, once W&B's service
    wrote its last (``exit``): ``wandb.finish`` returns before its file is on disk."""
    [path] = glob.glob(os.path.join(directory, "wandb", f"offline-run-*-{run_id}",
                                    f"run-{run_id}.wandb"))
    for _ in range(600):  # a minute at most
        records = _read(path)
        if any(r.HasField("exit") for r in records):
            return records
        time.sleep(0.1)
    raise AssertionError(f"{path}: W&B wrote no exit record within a minute")


def _read(path: str) -> list[Any]:
    """A ``run-<id>.wandb`` file's records: a LevelDB log (32 KiB blocks of checksummed,
    typed chunks) of protobuf Records, after a 7-byte W&B header."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert len(data) < 4 or data[:4] == b":W&B"
    chunks, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            break  # still being written
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # a whole record; 2, 3, 4: its first, middle, last chunks
            chunks.append(chunk)
        elif kind in (2, 3):
            pending = chunk if kind == 2 else pending + chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def _history(records: list[Any]) -> list[dict[str, Any]]:
    return [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
             for i in r.history.item} for r in records if r.HasField("history")]


def _config(records: list[Any]) -> list[dict[str, Any]]:
    """The run's config as first sent, then each update."""
    items = [r.run.config.update for r in records if r.HasField("run")]
    items += [r.config.update for r in records if r.HasField("config")]
    return [{i.key: json.loads(i.value_json) for i in update} for update in items]


def test_an_offline_run_holds_the_metrics_the_provenance_and_the_checkpoints(
        problem: Problem, tmp_path) -> None:
    log = Logger(tmp_path / "run", every=On("epoch_end"), wandb={"project": "graphmod-test"},
                 log_checkpoints=True)
    ckpt = Checkpoint(tmp_path / "run" / "checkpoints", every=On("epoch_end"))
    loop = gm.Loop(problem.step, problem.source(32), epochs=2, plugins=[ckpt, log])
    loop.run(problem.state())
    records = _records(str(tmp_path / "run"), log.wandb.id)
    rows = [r for r in _history(records) if "loss" in r]
    with open(log.path) as f:
        logged = [line.split(",") for line in f.read().splitlines()[1:]]
    assert [(r["_step"], r["epoch"], r["examples"]) for r in rows] == [(3, 1, 96), (6, 2, 192)]
    assert [r["loss"] for r in rows] == [float(line[-1]) for line in logged]  # the CSV's
    first, *updates = _config(records)
    assert first["provenance"]["inputs"] == loop.provenance.to_dict()["inputs"]
    assert updates[-1]["provenance"]["derived"]["steps"] == 6  # the final record
    artifacts = [r.artifact for r in records if r.HasField("artifact")]
    assert [sorted(a.aliases) for a in artifacts] == [["latest", "step-3"],
                                                       ["latest", "step-6"]]
    assert {a.type for a in artifacts} == {"model"}
    assert all("graphmod-checkpoint.json" in {e.path for e in a.manifest.contents}
               for a in artifacts)


def test_a_resumed_logger_continues_its_wandb_run(problem: Problem, tmp_path) -> None:
    log = Logger(tmp_path, every=On("epoch_end"), wandb=True)
    log.load_state_dict({"rows": 0, "wandb_id": "graphmodresume1"})  # as Loop.resume does
    gm.Loop(problem.step, problem.source(32), epochs=1, plugins=[log]).run(problem.state())
    assert log.wandb.id == "graphmodresume1"
    assert log.state_dict()["wandb_id"] == "graphmodresume1"
    assert [r["loss"] > 0 for r in _history(_records(str(tmp_path), "graphmodresume1"))
            if "loss" in r] == [True]


def test_bad_wandb_settings_are_refused_before_anything_runs(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"log_checkpoints=True.*pass wandb=True"):
        Logger(tmp_path, log_checkpoints=True)
    with pytest.raises(TypeError, match=r"Logger\(wandb='digits'\)"):
        Logger(tmp_path, wandb="digits")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"wandb=\{'config'.*provenance"):
        Logger(tmp_path, wandb={"config": {"lr": 0.1}})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'graphmod\[wandb\]'"):
        Logger(tmp_path, wandb=True)
    assert not os.listdir(tmp_path)
