"""End to end: ``examples/digits.py`` trains to >= 97% test accuracy and checkpoints exactly."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

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


def _restore(path: Path, like: dict) -> dict:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, abstract)


@pytest.mark.slow
def test_default_run_reaches_97_percent_and_restores(digits: ModuleType,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "digits"
    metrics = digits.main(["--out", str(out)])

    assert metrics["test_accuracy"] >= 0.97, metrics
    assert metrics["eager_max_abs_diff"] < 1e-3 and metrics["eager_agreement"] >= 0.99
    assert metrics["steps"] == metrics["epochs"] * (1347 // 64)
    assert (out / "metrics.json").is_file()

    trained = metrics["variables"]
    restored = _restore(Path(metrics["checkpoint"]), trained)
    assert jax.tree.structure(restored) == jax.tree.structure(trained)
    for want, got in zip(jax.tree.leaves(trained), jax.tree.leaves(restored), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.slow
def test_saving_again_replaces_the_checkpoint(digits: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "digits"
    first = digits.main(["--epochs", "1", "--seed", "1", "--out", str(out), "--quiet"])
    second = digits.main(["--epochs", "1", "--seed", "2", "--out", str(out), "--quiet"])

    assert first["checkpoint"] == second["checkpoint"]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "variables"]
    restored = digits.load_variables(second["checkpoint"], like=second["variables"])
    kernel = lambda variables: np.asarray(variables["model"]["linear_layers"][0]["W"])
    np.testing.assert_array_equal(kernel(restored), kernel(second["variables"]))
    assert not np.array_equal(kernel(restored), kernel(first["variables"]))
