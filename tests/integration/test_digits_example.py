"""End to end: ``examples/digits.py`` trains to >= 97% test accuracy, saves, resumes."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import jax
import numpy as np
import pytest

import graphmod as gm
from graphmod._cli import inspect_run
from graphmod._train._command import RESUME_VARIABLE

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.py"


@pytest.fixture(scope="module")
def digits() -> Iterator[ModuleType]:
    """The example script, imported from its file (``examples/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("graphmod_examples_digits", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _load(digits: ModuleType, checkpoint: str) -> dict:
    """The variables ``program.save`` wrote, read back by a program built as the script's
    (with the scaling they were trained with, which ``program.load`` checks)."""
    _, program = digits.build(0, 0.2, gm.provenance.transforms(checkpoint))
    program.init(np.zeros((1, 64), np.float32), np.zeros(1, np.int32))  # the shapes
    return program.load(checkpoint)


def _steps(out: Path) -> list[int]:
    return sorted(int(p.name) for p in out.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_default_run_reaches_97_percent_and_can_be_inspected(digits: ModuleType,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "digits"
    metrics = digits.main(["--out", str(out), "--quiet"])

    assert metrics["test_accuracy"] >= 0.97, metrics
    assert metrics["eager_max_abs_diff"] < 1e-3 and metrics["eager_agreement"] >= 0.99
    assert metrics["steps"] == metrics["epochs"] * (1347 // 64)
    assert (out / "metrics.json").is_file()
    assert metrics["train_seconds"] > 0

    trained = metrics["variables"]
    restored = _load(digits, metrics["checkpoint"])
    assert jax.tree.structure(restored) == jax.tree.structure(trained)
    for want, got in zip(jax.tree.leaves(trained), jax.tree.leaves(restored), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
    # The loop's checkpoints (the last two epochs) make the run inspectable and resumable.
    assert _steps(out) == [819, 840]
    report = inspect_run(str(out))
    assert "latest: step=840, epoch=40" in report and "adam" in report


@pytest.mark.slow
def test_a_new_run_replaces_the_old_and_resume_continues(digits: ModuleType,
                                                         tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    out = tmp_path / "digits"
    first = digits.main(["--epochs", "1", "--seed", "1", "--out", str(out), "--quiet"])
    second = digits.main(["--epochs", "1", "--seed", "2", "--out", str(out), "--quiet"])
    assert first["checkpoint"] == second["checkpoint"] and _steps(out) == [21]
    kernel = lambda variables: np.asarray(variables["model"]["linear_layers"][0]["W"])
    np.testing.assert_array_equal(kernel(_load(digits, second["checkpoint"])),
                                  kernel(second["variables"]))
    assert not np.array_equal(kernel(second["variables"]), kernel(first["variables"]))
    # As `graphmod resume out` runs it: the loop continues from step 21, not from 0.
    monkeypatch.setenv(RESUME_VARIABLE, str(out))
    resumed = digits.main(["--epochs", "2", "--seed", "2", "--out", str(out), "--quiet"])
    assert resumed["steps"] == 42 and _steps(out) == [21, 42]
