"""A model saved with its fitted transforms takes raw inputs in a fresh process and predicts
bitwise what the in-training program predicted; a program with other transforms (or none)
is refused by ``load``; ``fit(transforms=...)`` fits, records and reuses them; ``graphmod
inspect`` shows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
from graphmod._cli import inspect_run
from graphmod.data import ArraySource, MinMax, Standardize, Transforms


def _data(seed: int = 0, rows: int = 48) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal([5.0, -3.0, 100.0], [2.0, 0.5, 30.0], (rows, 3)).astype(np.float32)
    return {"x": x, "y": (x[:, 0] > 5.0).astype(np.int32)}


def _cost(m, x, y):
    logits = m(x)
    return -jax.numpy.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1).mean()


def _model() -> gm.bricks.MLP:
    return gm.bricks.MLP([3, 8, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, gm.Program, dict, np.ndarray]:
    """A model trained with transforms and saved; its in-training predictions on raw x."""
    train = ArraySource(_data(), 8, shuffle=True, name="train")
    fitted = Transforms({"x": [Standardize(), MinMax(-1.0, 1.0)]}).fit(train)
    program = gm.compile(_cost, _model(), transforms=fitted)
    step = gm.optimize(program, optax.adam(1e-2))
    state = step.init(program.init(*_data(rows=1).values()), jax.random.key(0))
    state = gm.Loop(step, train, epochs=3).run(state)
    directory = tmp_path_factory.mktemp("saved") / "model"
    program.save(directory, state.variables)
    raw = _data(seed=5, rows=20)["x"]
    predicted = np.asarray(program.derive(lambda m, x: m(x)).infer(state.variables, raw))
    return directory, program, state.variables, predicted


_FRESH = textwrap.dedent("""
    import sys, jax, numpy as np, graphmod as gm
    from flax import nnx
    directory, raw, out = sys.argv[1:4]
    model = gm.bricks.MLP([3, 8, 2], activation=jax.nn.relu, rngs=nnx.Rngs(1))
    program = gm.compile(lambda m, x: m(x), model,
                         transforms=gm.provenance.transforms(directory))
    program.init(np.zeros((1, 3), np.float32))
    variables = program.load(directory)
    np.save(out, np.asarray(program.infer(variables, np.load(raw))))
    rebuilt = gm.rebuild(gm.provenance.read(directory)).compile(lambda m, x: m(x))
    rebuilt.init(np.zeros((1, 3), np.float32))
    again = rebuilt.infer(rebuilt.load(directory), np.load(raw))
    print("rebuilt equal:", bool((np.asarray(again) == np.load(out)).all()))
""")


def test_a_fresh_process_predicts_bitwise_what_training_predicted_on_raw_inputs(
        saved, tmp_path: Path) -> None:
    directory, _, _, predicted = saved
    raw, out = tmp_path / "raw.npy", tmp_path / "out.npy"
    np.save(raw, _data(seed=5, rows=20)["x"])
    done = subprocess.run([sys.executable, "-c", _FRESH, str(directory), str(raw), str(out)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(out)
    assert got.dtype == predicted.dtype and got.shape == predicted.shape
    np.testing.assert_array_equal(got, predicted)  # bitwise
    assert "rebuilt equal: True" in done.stdout


def test_load_refuses_a_program_with_other_transforms_or_none(saved) -> None:
    directory, program, variables, _ = saved
    plain = gm.compile(_cost, _model())
    plain.init(*_data(rows=1).values())
    with pytest.raises(ValueError, match=r"trained with transforms of the fields \['x'\]; "
                                         r"this program has none.*provenance\.transforms\("):
        plain.load(directory)
    refit = Transforms({"x": [Standardize(), MinMax(-1.0, 1.0)]}).fit(
        ArraySource(_data(seed=9), 8))
    other = gm.compile(_cost, _model(), transforms=refit)
    other.init(*_data(rows=1).values())
    with pytest.raises(ValueError, match=r"other transforms; transforms of 'x', metadata, "
                                         r"source differ"):
        other.load(directory)
    same = gm.compile(_cost, _model(), transforms=gm.provenance.transforms(directory))
    same.init(*_data(rows=1).values())
    loaded = same.load(directory)
    np.testing.assert_array_equal(loaded["model"]["linear_layers"][0]["W"],
                                  variables["model"]["linear_layers"][0]["W"])
    assert program.transforms == same.transforms


def test_fit_fits_on_the_training_data_records_and_reuses_the_transforms(
        tmp_path: Path) -> None:
    train = ArraySource(_data(), 8, name="train")
    valid = _data(seed=2, rows=16)
    run = dict(epochs=1, progress=False, log=False, directory=tmp_path / "run",
               validation=valid, metrics=["accuracy"], transforms={"x": Standardize()})
    first = gm.fit(_cost, _model(), train, **run)
    fitted = first.program.transforms
    np.testing.assert_allclose(fitted.metadata["x"].mean, _data()["x"].mean(0), rtol=1e-6)
    assert gm.provenance.transforms(tmp_path / "run") == fitted
    assert gm.provenance.transforms(first.provenance) == fitted
    # the run's data record holds the training source's metadata
    assert first.provenance["data"]["metadata"]["fields"]["x"]["count"] == 48
    # continued on other data (allowed): the recorded transforms, not a refit
    other = ArraySource(_data(seed=4), 8, name="train")
    again = gm.fit(_cost, _model(), other, **{**run, "epochs": 2}, allow_data_change=True)
    assert again.resumed_from == 6 and again.program.transforms == fitted
    report = inspect_run(tmp_path / "run")
    tables = report[report.index("fitted transforms:"):]
    assert "'x'" in tables and "Standardize" in tables and "mean" in tables
    assert "training data:" in tables and "Metadata of 2 fields" in tables


def test_a_loop_checkpoint_records_the_transforms_for_a_fresh_reader(tmp_path: Path) -> None:
    train = ArraySource(_data(), 16, name="train")
    fitted = Transforms({"x": Standardize()}).fit(train)
    program = gm.compile(_cost, _model(), transforms=fitted)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(*_data(rows=1).values()), jax.random.key(0))
    gm.Loop(step, train, epochs=1, plugins=[gm.plugins.Checkpoint(tmp_path)]).run(state)
    record = json.loads(gm.provenance.read(tmp_path).to_json())
    assert record["inputs"]["transforms"]["source"]["name"] == "train"
    assert gm.provenance.transforms(record) == fitted
