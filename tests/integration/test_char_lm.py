"""``examples/char_lm.py`` in quick mode: it learns, saves and reloads its pre-trained
model, fine-tunes only LoRA's adapters, and the merged model predicts as the adapted one."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "char_lm.py"


@pytest.mark.slow
def test_quick_run_learns_and_fine_tunes_only_the_adapters(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("graphmod_examples_char_lm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        results = module.main(["--quick", "--out", str(tmp_path)])
    finally:
        sys.modules.pop(spec.name, None)
    vocabulary = len(module.VOCABULARY) + 1
    assert results["initial"] > math.log(vocabulary) - 0.5  # about uniform at init
    assert results["pretrain_valid"] < results["initial"] - 1.0  # it learned
    assert results["finetune_after"] < results["finetune_before"]
    np.testing.assert_allclose(results["merged"], results["finetune_after"], rtol=1e-4)
    base, tuned = results["base_variables"]["model"], results["variables"]["model"]
    jax.tree.map(np.testing.assert_array_equal, base, tuned)  # the base stayed frozen
    assert (tmp_path / "pretrained").is_dir()
