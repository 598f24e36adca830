"""Exact resume: a run killed mid-epoch continues bitwise identically; saves are atomic."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graphmod as gm
from graphmod import On, at
from graphmod._cli import inspect_run
from graphmod._train._checkpoint import Checkpointer, CheckpointError
from graphmod.plugins import Checkpoint
from tests.loop.conftest import Problem

SCRIPT = pathlib.Path(__file__).with_name("resumable_run.py")
ROOT = pathlib.Path(__file__).parents[2]


def _run(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], env=env, cwd=ROOT)


@pytest.mark.slow
def test_resume_after_sigkill_mid_epoch_is_bitwise_identical(tmp_path: pathlib.Path) -> None:
    full = _run(str(tmp_path / "full"), str(tmp_path / "full.npz"))
    killed_dir = tmp_path / "killed"
    killed = _run(str(killed_dir), str(tmp_path / "unused.npz"), "--stop-at", "10")
    assert full.wait(timeout=300) == 0
    deadline = time.monotonic() + 300
    while not (killed_dir / "ready").exists():
        assert killed.poll() is None, "the run to be killed ended early"
        assert time.monotonic() < deadline, "the run never reached its checkpoint"
        time.sleep(0.2)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert Checkpointer(killed_dir, keep=None).latest() == 10  # step 10: inside epoch 2
    resumed = _run(str(killed_dir), str(tmp_path / "resumed.npz"), "--resume")
    assert resumed.wait(timeout=300) == 0
    a, b = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(a.files) == sorted(b.files) and int(a["step"]) == 24
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_save_cut_off_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch) -> None:
    import orbax.checkpoint as ocp

    ckpt = Checkpointer(tmp_path, keep=3)
    state = {"w": jnp.arange(3.0), "rng": jax.random.key(7)}
    ckpt.save(1, state, {"note": "first"})
    ckpt.wait()

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")  # the arrays are written, the record is not

    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "async_save", fail)
    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "save", fail)
    with pytest.raises(CheckpointError, match=r"step 2: OSError: disk full; the checkpoint "
                                              r"of step 1 is intact"):
        ckpt.save(2, {"w": jnp.zeros(3), "rng": jax.random.key(8)}, {"note": "second"})
        ckpt.wait()
    monkeypatch.undo()
    reader = Checkpointer(tmp_path, keep=None)
    assert reader.steps() == [1]
    restored, meta = reader.restore(state)
    assert meta["note"] == "first"
    np.testing.assert_array_equal(restored["w"], [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(jax.random.key_data(restored["rng"]),
                                  jax.random.key_data(state["rng"]))


def test_keep_n_and_in_process_resume(tmp_path) -> None:
    problem = Problem()
    directory = tmp_path / "run"
    loop = gm.Loop(problem.step, problem.source(8), epochs=3,
                   plugins=[Checkpoint(directory, keep=2)])
    final = loop.run(problem.state())
    assert Checkpointer(directory, keep=None).steps() == [24, 36]
    # Stop after epoch 1 in a fresh run, then resume from its checkpoint.
    problem = Problem()
    other = tmp_path / "other"
    loop = gm.Loop(problem.step, problem.source(8), epochs=3, plugins=[Checkpoint(other)])
    loop.on(On("epoch_end", epoch=at(1)), lambda e: e.loop.terminate())
    loop.run(problem.state())
    resumed = gm.Loop.resume(str(other), problem.step, problem.source(8),
                             plugins=[Checkpoint(other)])
    assert int(resumed.step) == 36
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, final.variables),
                 jax.tree.map(np.asarray, resumed.variables))


def test_a_finished_run_resumed_has_its_last_metrics(tmp_path) -> None:
    problem = Problem()
    finished = gm.Loop(problem.step, problem.source(8), epochs=1,
                       plugins=[Checkpoint(tmp_path)])
    finished.run(problem.state())
    again = gm.Loop(problem.step, problem.source(8), epochs=1,
                    plugins=[Checkpoint(tmp_path, resume=True)])
    again.run(problem.state())  # nothing left to run: its metrics are the checkpoint's
    assert again.metrics == {"loss": float(finished.metrics["loss"])}
    report = inspect_run(str(tmp_path))
    assert f"metrics at step 12: loss={float(finished.metrics['loss']):.6g}" in report
    assert max(map(len, report.splitlines())) <= 100  # long lines wrapped, not cut


def test_by_default_the_last_step_of_a_run_stopped_on_steps_is_saved(tmp_path) -> None:
    problem = Problem()  # twelve batches of 8 an epoch
    full = gm.Loop(problem.step, problem.source(8), steps=20).run(problem.state())
    problem = Problem()
    gm.Loop(problem.step, problem.source(8), steps=17,
            plugins=[Checkpoint(tmp_path)]).run(problem.state())
    assert Checkpointer(tmp_path, keep=None).steps() == [12, 17]  # the epoch's end, the run's
    resumed = gm.Loop.resume(str(tmp_path), problem.step, problem.source(8), steps=20,
                             plugins=[Checkpoint(tmp_path)])
    assert int(resumed.step) == 20
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, full.variables),
                 jax.tree.map(np.asarray, resumed.variables))


def test_checkpoint_resume_flag_continues_a_stopped_run(tmp_path) -> None:
    problem = Problem()
    loop = gm.Loop(problem.step, problem.source(8), steps=5,
                   plugins=[Checkpoint(tmp_path, every=On("step"))])
    loop.run(problem.state())
    again = gm.Loop(problem.step, problem.source(8), steps=9,
                    plugins=[Checkpoint(tmp_path, every=On("step"), resume=True)])
    state = again.run(problem.state())
    assert int(state.step) == 9 and again.time.step == 9


def test_a_plugin_error_saves_and_reraises_naming_the_plugin(tmp_path) -> None:
    problem = Problem()

    def explode(event: gm.Event) -> None:
        raise RuntimeError("bad plugin")

    loop = gm.Loop(problem.step, problem.source(8), epochs=1, plugins=[Checkpoint(tmp_path)])
    loop.on(On("step", step=at(3)), explode)
    with pytest.raises(gm.PluginError, match=r"plugin 'explode' raised.*step 3.*bad plugin"):
        loop.run(problem.state())
    assert Checkpointer(tmp_path, keep=None).latest() == 3


def test_resuming_another_programs_checkpoint_names_the_differing_paths(tmp_path) -> None:
    problem = Problem()
    gm.Loop(problem.step, problem.source(8), steps=2,
            plugins=[Checkpoint(tmp_path, every=On("step"))]).run(problem.state())
    import optax
    from flax import nnx

    mlp = gm.bricks.MLP([4, 32, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), mlp)
    step = gm.optimize(program, optax.adam(1e-2))
    with pytest.raises(ValueError, match=r"(?s)another program's state; differing paths:.*"
                                         r"linear_layers'\]\[0\]\['W'\]: checkpoint \[4, 16\]"):
        gm.Loop.resume(str(tmp_path), step, problem.source(8))
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        gm.Loop.resume(str(tmp_path / "empty"), step, problem.source(8))


def test_resume_at_an_epoch_end_keeps_an_epoch_annealed_rate(tmp_path) -> None:
    from graphmod.plugins import Anneal

    problem = Problem(dropout=gm.dynamic(0.5))
    rate = problem.dropout.hparam("rate")

    def schedule(t: gm.Time) -> float:
        return 0.5 if t.epoch < 1 else 0.1

    full = gm.Loop(problem.step, problem.source(8), epochs=2,
                   plugins=[Anneal(rate, schedule)]).run(problem.state())
    loop = gm.Loop(problem.step, problem.source(8), epochs=2,
                   plugins=[Anneal(rate, schedule), Checkpoint(tmp_path)])
    loop.on(On("epoch_end", epoch=at(1)), lambda e: e.loop.terminate())
    loop.run(problem.state())
    resumed = gm.Loop.resume(str(tmp_path), problem.step, problem.source(8),
                             plugins=[Anneal(rate, schedule), Checkpoint(tmp_path)])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, full.variables),
                 jax.tree.map(np.asarray, resumed.variables))
