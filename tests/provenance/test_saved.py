"""Checkpoints of the loop and saved programs carry the provenance; `graphmod inspect`."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
from graphmod._cli import inspect_run, main
from graphmod.plugins import Checkpoint
from tests.provenance.provenance_workload import build, source


def test_loop_checkpoints_hold_the_training_provenance(tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    step, state = build()
    loop = gm.Loop(step, source(), epochs=2,
                   plugins=[Checkpoint(tmp_path, every=gm.On("epoch_end"), keep=None)])
    loop.run(state)
    latest, first = gm.provenance.read(tmp_path), gm.provenance.read(tmp_path, step=6)
    assert latest.kind == "training" and latest.derived["steps"] == 12
    assert first.derived["steps"] == 6 and first.inputs == latest.inputs
    assert latest.inputs["data"]["name"] == "toy-regression"
    assert latest.inputs["optimizer"]["name"] == "adam"
    assert latest.inputs["loop"]["epochs"] == 2
    assert latest.inputs["seeds"]["train"]["data"] == (0, 7)
    assert latest.fingerprint == step.program.provenance.fingerprint
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "provenance:" in out and "managers.Dropout(rate=0.1" in out
    assert "optimizer    adam(learning_rate=0.01)" in out and "12 steps" in out


def test_a_resumed_run_keeps_recording(tmp_path: pathlib.Path) -> None:
    step, state = build()
    every = gm.On("step", step=gm.each(4))
    gm.Loop(step, source(), steps=8, plugins=[Checkpoint(tmp_path, every=every)]).run(state)
    step, _ = build()
    gm.Loop.resume(str(tmp_path), step, source(), steps=12,
                   plugins=[Checkpoint(tmp_path, every=every)])
    record = gm.provenance.read(tmp_path)
    assert record.derived["steps"] == 12 and record.inputs["seeds"]["train"]["data"] == (0, 7)


def test_unrecorded_optimizers_and_explicit_configs() -> None:
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
    program.init(np.ones((1, 2), np.float32))
    plain = gm.optimize(program, optax.sgd(0.1)).provenance["optimizer"]
    assert plain["name"] is None and plain["source"] == "unrecorded"
    assert re.search(r"optimizer +not recorded \(optax\.\S+\); to record one, make it with "
                     r"graphmod\.provenance\.optimizer\(name, \*\*arguments\)",
                     str(gm.optimize(program, optax.sgd(0.1)).provenance))
    explicit = gm.optimize(program, optax.sgd(0.1),
                           config={"name": "sgd", "learning_rate": 0.1}).provenance["optimizer"]
    assert (explicit["name"], explicit["arguments"], explicit["source"]) == \
        ("sgd", {"learning_rate": 0.1}, "explicit")
    with pytest.raises(TypeError, match=r"optimize\(config=...\).*'name'"):
        gm.optimize(program, optax.sgd(0.1), config={"learning_rate": 0.1})
    schedule = gm.provenance.optimizer("exponential_decay", 0.1, 10, 0.5)
    chained = gm.provenance.optimizer("chain", gm.provenance.optimizer("clip_by_global_norm", 1.0),
                                      gm.provenance.optimizer("adam", schedule))
    step = gm.optimize(program, chained)
    state = step.init(program.init(np.ones((1, 2), np.float32)), jax.random.key(0))
    state, _ = step(state, np.ones((3, 2), np.float32))
    again = gm.rebuild(step.provenance).optimizer
    assert again.config == chained.config
    with pytest.raises(ValueError, match=r"optax has no function 'adamm'"):
        gm.provenance.optimizer("adamm", 1e-3)


def test_saved_programs_hold_their_provenance(tmp_path: pathlib.Path) -> None:
    step, state = build()
    program = step.program
    program.save(tmp_path / "saved", state.variables, step=3)
    assert gm.provenance.read(tmp_path / "saved") == program.provenance
    loaded = program.load(tmp_path / "saved")
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state.variables), strict=True):
        np.testing.assert_array_equal(a, b)
    report = inspect_run(str(tmp_path / "saved"))
    assert "checkpoints: 3" in report and "graphmod.bricks.MLP(dims=[4, 8, 2]" in report
    fresh = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
    with pytest.raises(RuntimeError, match=r"call program.init"):
        fresh.load(tmp_path / "saved")


def test_reading_a_run_without_provenance_says_why(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="no provenance at"):
        gm.provenance.read(tmp_path / "missing")
    step, state = build()
    loop = gm.Loop(lambda s, **batch: step(s, **batch), source(), steps=2,
                   plugins=[Checkpoint(tmp_path, every=gm.On("end"))])
    loop.run(state)
    with pytest.raises(ValueError, match=r"holds no provenance record.*not a graphmod\.optimize"):
        gm.provenance.read(tmp_path)
