"""``managers.QLoRA`` on Flax's Gemma (the tiny config of ``test_flax_examples``): its base
quantized to int4 by ``managers.quantize`` stays bitwise through fine-tuning, optax sees the
adapters alone, the loss falls, and the merged float Gemma infers what the QLoRA Gemma
inferred; merged across a scan over layers; and the errors."""

from __future__ import annotations

import functools
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from managers._merge import _node
from managers._quantize import stored_bytes
from tests.integration.test_flax_examples import TOKENS, gemma, gemma_inputs, gemma_loss
from tests.managers.test_quantize import ROOT, Stack

QLORA = managers.QLoRA(rank=2, group=16)  # the tiny Gemma's fan-ins are 16 and 32
STEPS = 8


def logits(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    return model(tokens, *gemma_inputs(tokens))[0]


@functools.cache
def fine_tuned() -> tuple[gm.Program, gm.Program, dict, dict, dict, list[float]]:
    """The float program over Gemma, the QLoRA one from ``managers.quantize``, the float
    variables, the quantized ones before and after fine-tuning, and the losses."""
    program = gm.compile(gemma_loss, gemma())
    pretrained = program.init(TOKENS)
    served, stored = managers.quantize(program, pretrained, QLORA)
    step = gm.optimize(served, optax.adam(3e-2), trainable=[QLORA])
    state = step.init(stored, jax.random.key(0))
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, TOKENS)
        losses.append(float(metrics["loss"]))
    return program, served, pretrained, stored, {"variables": state.variables,
                                                 "opt_state": state.opt_state}, losses


def _entries(variables: dict) -> dict[tuple[str, str], dict]:
    return {(path, name): entries for path, weights in variables["managers"]["qlora"].items()
            if path != "hparams" for name, entries in weights.items()}


def test_the_int4_base_stays_bitwise_and_only_the_adapters_train() -> None:
    _, _, pretrained, stored, trained, losses = fine_tuned()
    before, after = _entries(stored), _entries(trained["variables"])
    assert len(before) == 13  # 2 blocks of 6 projections and the embedding
    for key, entries in before.items():
        assert entries["q"].dtype == jnp.int8 and entries["q"].shape[0] * 2 == entries[
            "a"].shape[0]  # int4: two fan-in values to a byte
        np.testing.assert_array_equal(after[key]["q"], entries["q"])
        np.testing.assert_array_equal(after[key]["scale"], entries["scale"])
        assert np.abs(after[key]["b"]).max() > 0  # B started at zero and trained
    jax.tree.map(np.testing.assert_array_equal, trained["variables"]["model"], stored["model"])
    # The optimizer holds the adapters' A and B, nothing else (Adam's mu and nu of each).
    held = {jax.tree_util.keystr(path) for path, leaf in
            jax.tree_util.tree_flatten_with_path(trained["opt_state"])[0] if jnp.ndim(leaf)}
    assert held and all("'qlora'" in p and p.endswith(("['a']", "['b']")) for p in held)
    assert len(held) == 2 * 2 * len(before)
    assert losses[-1] < 0.9 * losses[0]
    # The base is stored at an eighth of its float bytes (and a float scale per 16 values).
    for (path, name), entries in before.items():
        assert entries["q"].nbytes * 8 == _node(pretrained["model"], path)[name].nbytes
    adapters = sum(e["a"].nbytes + e["b"].nbytes for e in before.values())
    assert stored_bytes(stored) - adapters < 0.25 * stored_bytes(pretrained)


def test_merged_into_a_float_gemma_it_infers_what_the_qlora_gemma_inferred() -> None:
    program, served, pretrained, stored, trained, _ = fine_tuned()
    merged = QLORA.merge(trained["variables"])
    assert "qlora" not in merged["managers"]
    shapes = jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), merged["model"])
    assert shapes == jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), pretrained["model"])
    qlora_logits = served.derive(logits).infer(trained["variables"], TOKENS)
    float_logits = program.derive(logits).infer(merged, TOKENS)
    np.testing.assert_allclose(float_logits, qlora_logits, rtol=1e-5, atol=1e-5)
    # What was compared holds the fine-tuning and the quantization both.
    base = served.derive(logits).infer(stored, TOKENS)
    unquantized = program.derive(logits).infer(pretrained, TOKENS)
    assert np.abs(np.asarray(base) - np.asarray(qlora_logits)).max() > 1e-2
    assert np.abs(np.asarray(base) - np.asarray(unquantized)).max() > 1e-3


def test_qlora_draws_loras_adapters_and_merges_across_a_scan_over_layers() -> None:
    x = jax.random.normal(jax.random.key(2), (4, 64))
    program = gm.compile(lambda m, x: m(x), Stack())
    variables = program.init(x)
    qlora = managers.QLoRA(rank=3, dtype="int8", group=None)
    served, stored = managers.quantize(program, variables, qlora)
    entries = stored["managers"]["qlora"]["/blocks/lin"]["kernel"]
    assert entries["q"].shape == (3, 64, 64) and entries["a"].shape == (3, 64, 3)
    lora = gm.compile(lambda m, x: m(x), Stack(), managers=[managers.LoRA(rank=3)])
    np.testing.assert_array_equal(entries["a"], lora.init(x)["managers"]["lora"][
        "/blocks/lin"]["kernel"]["a"])  # the A a LoRA of the same seed draws
    tuned = jax.tree.map(lambda leaf: leaf, stored)  # a trained B, without training
    for weights in tuned["managers"]["qlora"].values():
        for pair in weights.values():
            if "b" in pair:
                pair["b"] = jax.random.normal(jax.random.key(3), pair["b"].shape) * 0.1
    np.testing.assert_allclose(program.infer(qlora.merge(tuned), x), served.infer(tuned, x),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_qlora_fine_tunes_the_character_lms_bricks_over_their_int4_base() -> None:
    spec = importlib.util.spec_from_file_location("graphmod_qlora_char_lm",
                                                  ROOT / "examples" / "char_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        windows = module.windows(np.arange(4_000) % 23, 32, 16, 0)  # a cycle to learn
        model = module.CharLM(len(module.VOCABULARY) + 1, 16, 32, 2, 1, rngs=nnx.Rngs(0))
    finally:
        sys.modules.pop(spec.name, None)
    program = gm.compile(module.cost, model)
    qlora = managers.QLoRA(rank=4, group=16, bricks=[gm.bricks.Linear])  # graphmod's bricks
    served, stored = managers.quantize(program, program.init(windows[:2]), qlora)
    step = gm.optimize(served, optax.adam(1e-2), trainable=[qlora])
    state = step.init(stored, jax.random.key(0))
    losses = []
    for _ in range(6):
        state, metrics = step(state, windows)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    for key, entries in _entries(stored).items():
        np.testing.assert_array_equal(_entries(state.variables)[key]["q"], entries["q"])
    np.testing.assert_allclose(program.infer(qlora.merge(state.variables), windows),
                               served.infer(state.variables, windows), rtol=1e-5)


# -- bad input ---------------------------------------------------------------------------
def test_a_group_that_does_not_divide_a_fan_in_names_the_weight_and_the_fix() -> None:
    program = gm.compile(lambda m, x: m(x), nnx.Linear(24, 4, rngs=nnx.Rngs(0)))
    variables = program.init(jnp.ones((1, 24)))
    with pytest.raises(ValueError, match=r"group=\(128, 64, 32\) does not divide the fan-in "
                                         r"24 of weight /\.kernel.*Choose a group"):
        managers.quantize(program, variables, managers.QLoRA(rank=2))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rank": 0}, r"QLoRA\(rank=0\): must be a positive int"),
    ({"rank": 2.0}, r"QLoRA\(rank=2\.0\)"),
    ({"rank": 2, "group": None}, r"int4 needs a group"),
    ({"rank": 2, "dtype": "float8_e4m3fn"}, r"QLoRA\(dtype='float8_e4m3fn'\).*managers\.LoRA"),
    ({"rank": 2, "alpha": float("nan")}, r"QLoRA\(alpha=nan\)"),
])
def test_bad_arguments_are_refused_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        managers.QLoRA(**kwargs)
