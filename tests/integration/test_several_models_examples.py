"""The examples of several models in one loop, at their small sizes: ``examples/gan_ring.py``
(each cost reads the other model's current variables) and ``examples/distill_digits.py`` (a
frozen teacher read by its student)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np
import pytest

import graphmod


@pytest.fixture(scope="module")
def gan_ring() -> ModuleType:
    return importlib.import_module("examples.gan_ring")


@pytest.fixture(scope="module")
def distill_digits() -> ModuleType:
    return importlib.import_module("examples.distill_digits")


def _host(tree: Any) -> Any:
    return jax.tree.map(np.array, tree)  # copies: the next step donates the state


class LastSteps:
    """Keeps host copies of the states after the last two iterations, and their metrics."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.states: dict[int, Any] = {}
        self.metrics: dict[int, dict[str, float]] = {}

    def __call__(self, event: graphmod.Event) -> None:
        if event.type == "step" and event.time.step >= self.last - 1:
            self.states[event.time.step] = _host(event.state)
            self.metrics[event.time.step] = {k: float(v) for k, v in event.metrics.items()}


def test_the_gan_trains_both_models_and_the_generator_reads_the_updated_discriminator(
        gan_ring: ModuleType, tmp_path: Path) -> None:
    n = 200
    argv = ["--iterations", str(n), "--hidden", "32", "--batch-size", "64", "--samples",
            "2000", "--out", str(tmp_path), "--quiet"]
    probe = LastSteps(n)
    returned = gan_ring.main(argv, plugins=[probe])

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["modes_covered"] == returned["modes_covered"]
    assert 0 <= results["modes_covered"] <= 8 and len(results["per_mode"]) == 8
    assert 0.0 <= results["high_quality"] <= 1.0
    assert (results["disc_steps"], results["gen_steps"]) == (n, n)
    assert np.isfinite([results["disc_loss"], results["gen_loss"]]).all()
    # Trained, the samples lie nearer the ring's modes than the initial generator's.
    assert results["mean_distance"] < results["initial"]["mean_distance"]
    assert set(probe.metrics[n]) >= {"disc/loss", "gen/loss"}

    # In iteration n the discriminator steps first, then the generator reads its variables
    # just updated: the generator's logged loss is its cost at (gen after n-1, disc after n),
    # not at the discriminator of the iteration before.
    gan = gan_ring.build(gan_ring.parse_args(argv))
    epoch, index = divmod(n - 1, len(gan.source))
    z = next(iter(gan.source.iter_epoch(epoch, start=index)))["z"]
    fake = gan.draw.infer(probe.states[n - 1]["gen"].variables, z)

    def gen_loss(disc: dict) -> float:
        return float(gan_ring.generator_loss(gan.judge.infer(disc, fake)))

    logged = probe.metrics[n]["gen/loss"]
    fresh = gen_loss(probe.states[n]["disc"].variables)
    stale = gen_loss(probe.states[n - 1]["disc"].variables)
    assert abs(logged - fresh) < 1e-5 and abs(logged - stale) > 1e-4, (logged, fresh, stale)


def test_the_measure_counts_modes_within_three_sigma(gan_ring: ModuleType) -> None:
    centers = gan_ring.centers()
    on_two = np.concatenate([np.repeat(centers[:2], 50, axis=0),
                             np.full((100, 2), 5.0, np.float32)])  # half far from any mode
    result = gan_ring.measure(on_two)
    assert (result["modes_covered"], result["high_quality"]) == (2, 0.5)
    assert result["per_mode"][:3] == [0.25, 0.25, 0.0]
    just_out = centers[:1] + np.float32([[3 * gan_ring.STD * 1.01, 0.0]])
    assert gan_ring.measure(just_out)["modes_covered"] == 0


class Teacher:
    """Keeps the frozen teacher's variables at the loop's begin and end, and the metrics'
    names."""

    def __init__(self) -> None:
        self.begin: Any = None
        self.end: Any = None
        self.names: list[str] = []

    def __call__(self, event: graphmod.Event) -> None:
        if event.type == "begin":
            self.begin = _host(event.state["teacher"])
        elif event.type == "end":
            self.end = _host(event.state["teacher"])
            self.names = sorted(event.loop.metrics)


def test_distillation_trains_the_student_and_leaves_the_teacher_bitwise_unchanged(
        distill_digits: ModuleType, tmp_path: Path) -> None:
    probe = Teacher()
    returned = distill_digits.main(["--seeds", "1", "--epochs", "2", "--out", str(tmp_path),
                                    "--quiet"], plugins=[probe])

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["distilled"] == returned["distilled"]
    assert [run["seed"] for run in results["runs"]] == [0]
    for name in ("teacher", "distilled", "alone"):
        # 10 classes: chance is 0.1; two epochs already do far better.
        assert 0.5 < results[name]["mean"] <= 1.0 and results[name]["std"] == 0.0
    assert (results["teacher_dims"], results["student_dims"]) == (
        [64, 256, 256, 10], [64, 128, 128, 10])

    assert probe.names == ["student/accuracy", "student/loss"]
    leaves = jax.tree.leaves_with_path(probe.begin)
    assert leaves, "the teacher's variables were not seen"
    for (path, before), after in zip(leaves, jax.tree.leaves(probe.end), strict=True):
        assert before.dtype == after.dtype and np.array_equal(before, after), path


def test_the_distillation_loss_is_hintons(distill_digits: ModuleType) -> None:
    rng = np.random.default_rng(0)
    student, teacher = rng.normal(size=(2, 5, 10)).astype(np.float32)
    labels = rng.integers(10, size=5)
    t, alpha = 3.0, 0.7

    def softmax(z: np.ndarray) -> np.ndarray:
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p_t, p_s = softmax(teacher / t), softmax(student / t)
    soft = (p_t * (np.log(p_t) - np.log(p_s))).sum(-1)
    hard = -np.log(softmax(student)[np.arange(5), labels])
    want = (alpha * t * t * soft + (1 - alpha) * hard).mean()
    # Jitted: one compile instead of one per eager operation.
    loss = jax.jit(distill_digits.distillation_loss, static_argnames=("temperature", "alpha"))
    got = loss(student, teacher, labels, temperature=t, alpha=alpha)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
