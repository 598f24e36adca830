"""``managers.quantize`` and ``managers.QLoRA`` against Qwix on one model, Flax's Gemma (the
tiny config of ``test_flax_examples``): with the same scheme, the same logits to float
rounding. Weight-only PTQ int8 per channel and int4 per channel over every projection
(``nnx.Einsum`` and ``nnx.Linear``), int4 in groups of 4 where the projection contracts one
axis, and QLoRA (int4, groups of 8) on the gated MLP with the same adapters.

Qwix tiles one contracting axis of a weight and takes the others whole: for Gemma's output
projection (``NHD``, contracting ``N`` and ``H``) a group smaller than the fan-in is a
different scheme from graphmod's (groups of the flattened fan-in), so that projection sits
out of the grouped comparison.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from tests.integration.test_flax_examples import TOKENS, gemma, gemma_inputs

qwix = pytest.importorskip("qwix", reason="qwix is not installed: pip install qwix")
# Qwix 0.1.8 calls Flax APIs that Flax now deprecates (Variable.value, VariableState, ...).
pytestmark = pytest.mark.filterwarnings(r"ignore::DeprecationWarning:qwix\..*")


def logits(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    return model(tokens, *gemma_inputs(tokens))[0]


@functools.cache
def float_gemma() -> tuple[nnx.Module, gm.Program, dict]:
    model = gemma()
    model.eval()  # Qwix runs the model eagerly: Gemma's dropout off, as in a program's infer
    program = gm.compile(logits, model)
    return model, program, program.init(TOKENS)


SCHEMES = {  # label: (Qwix's rule, graphmod's manager)
    "int8 per channel": (dict(module_path=".*", weight_qtype="int8"),
                         managers.Quantized("int8", bricks=[nnx.Linear, nnx.Einsum])),
    "int4 per channel": (dict(module_path=".*", weight_qtype="int4"),  # fan-ins 16 and 32
                         managers.Quantized("int4", group=(32, 16),
                                            bricks=[nnx.Linear, nnx.Einsum])),
    "int4 groups of 4": (dict(module_path=".*(mlp|q_einsum|kv_einsum).*", weight_qtype="int4",
                              tile_size=4),
                         managers.Quantized("int4", group=4, path="*/[gudqk]*.kernel")),
}


@pytest.mark.parametrize("label", list(SCHEMES))
def test_the_same_ptq_scheme_gives_qwixs_logits(label: str) -> None:
    model, program, variables = float_gemma()
    rule, quantized = SCHEMES[label]
    theirs = qwix.quantize_model(model, qwix.PtqProvider([qwix.QuantizationRule(**rule)]),
                                 TOKENS, *gemma_inputs(TOKENS))
    served, stored = managers.quantize(program, variables, quantized)
    ours = served.infer(stored, TOKENS)
    np.testing.assert_allclose(ours, logits(theirs, TOKENS), rtol=1e-5, atol=1e-5)
    # Quantization changed the logits: the comparison is of two quantized models.
    assert np.abs(np.asarray(ours) - np.asarray(program.infer(variables, TOKENS))).max() > 1e-3


def test_qlora_with_the_same_adapters_gives_qwixs_lora_logits() -> None:
    model, program, variables = float_gemma()
    qlora = managers.QLoRA(rank=2, group=8, alpha=4.0, bricks=[nnx.Linear])
    served, stored = managers.quantize(program, variables, qlora)
    provider = qwix.LoraProvider(module_path=".*mlp.*", rank=2, alpha=4.0,
                                 weight_qtype="int4", tile_size=8)
    theirs = qwix.apply_lora_to_model(model, provider, TOKENS, *gemma_inputs(TOKENS),
                                      rngs=nnx.Rngs(0))
    state = nnx.to_pure_dict(nnx.state(theirs, nnx.LoRAParam))
    adapters = stored["managers"]["qlora"]
    for i in (0, 1):
        for name in ("gate_proj", "up_proj", "down_proj"):
            pair = adapters[f"/layers/{i}/mlp/{name}"]["kernel"]
            pair["b"] = jax.random.normal(jax.random.key(i), pair["b"].shape) * 0.1
            state["layers"][i]["mlp"][name].update(kernel_lora_a=pair["a"],
                                                   kernel_lora_b=pair["b"])
    nnx.update(theirs, state)
    ours = served.infer(stored, TOKENS)
    np.testing.assert_allclose(ours, logits(theirs, TOKENS), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(ours) - np.asarray(program.infer(variables, TOKENS))).max() > 1e-2
