"""``examples/pbt_digits.py --small``: a grid and a PBT population of the digits MLP train,
from the same start, on the same steps; PBT makes its decisions and reports the best member."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pbt_digits.py"


def test_the_small_run_trains_a_grid_and_a_pbt_population_of_the_same_budget(capsys) -> None:
    module = runpy.run_path(str(EXAMPLE), run_name="graphmod_examples_pbt_digits")
    results = module["main"](["--small", "--quiet"])
    grid, pbt = results["grid"], results["pbt"]
    assert results["members"] == 4 and grid["steps"] == pbt["steps"] == 2 * (1077 // 64)
    # One round after the first epoch (none after the last): one member of 4 replaced.
    assert grid["exploits"] == 0 and pbt["exploits"] == 1
    for run in (grid, pbt):
        assert 0.5 < run["valid_accuracy"] <= 1 and 0 <= run["best_member"] < 4
        assert run["valid_accuracy"] >= run["mean_valid_accuracy"]
    # The grid's hyperparameters stay where the grid put them (stored as float32).
    points = {(float(np.float32(lr)), float(np.float32(rate)))
              for lr, rate in zip(*module["grid"](4), strict=True)}
    assert (grid["learning_rate"], grid["dropout_rate"]) in points
    assert '"pbt": {' in capsys.readouterr().out
