"""Flax's Gemma as published (``examples/flax_nnx/gemma``) fine-tuned with ``managers.LoRA``,
no surgery: adapters on every weight Gemma reads — its ``nnx.Einsum`` projections in their
own layouts (the query ``NDH`` contracts ``D``, the key-value ``CKDH`` its third axis), the
gated MLP's ``nnx.Linear`` layers and the embedding, tied with ``attend`` for the logits —
train alone; then the fine-tuned program decodes through Gemma's own key-value cache (passed
in and returned by its ``__call__``, as Gemma's sampler does) token by token, as eager Gemma
with the adapters merged into its weights by ``LoRA.merge`` does. Gemma's own intermediates
(``sow_lib.SowConfig``: sown on its ``nnx.List`` of blocks' modules) come out of a program by
``nnx.capture`` as out of eager Gemma, and ``Remat(bricks=[model.layers])`` rematerializes
each of its blocks with the gradients (and dropout masks) of the program without it.

The model and its loss are ``test_flax_examples``'s (where Gemma also runs every regularizer
and equals eager Flax with rates 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import graphmod as gm
import managers
from examples.flax_nnx.gemma import sow_lib
from examples.flax_nnx.gemma import transformer as gemma_lib
from graphmod import roles
from tests.integration.test_flax_examples import (
    GEMMA_EINSUMS,
    GEMMA_MLPS,
    TOKENS,
    gemma,
    gemma_inputs,
    gemma_loss,
)
from tests.integration.test_flax_transforms import assert_trees_close

LORA = managers.LoRA(rank=2, roles=[roles.WEIGHT])
STEPS = 10


@functools.cache
def fine_tuned() -> tuple[gm.Program, dict, dict, list[float]]:
    """The program over Gemma under LoRA, its initial and fine-tuned variables, the losses."""
    program = gm.compile(gemma_loss, gemma(), managers=[LORA])
    variables = program.init(TOKENS)
    step = gm.optimize(program, optax.adam(3e-2), trainable=[LORA])
    state = step.init(variables, jax.random.key(0))
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, TOKENS)
        losses.append(float(metrics["loss"]))
    return program, variables, state.variables, losses


def test_lora_adapts_every_gemma_weight_in_its_layout_and_only_the_adapters_train() -> None:
    _, initial, trained, losses = fine_tuned()
    adapters = trained["managers"]["lora"]
    assert set(adapters) - {"hparams"} == {*GEMMA_MLPS, *GEMMA_EINSUMS, "/embedder"}
    shapes = {name: {k: v.shape for k, v in adapters[f"/layers/0/attn/{name}"]["kernel"].items()}
              for name in ("q_einsum", "kv_einsum", "attn_vec_einsum")}
    assert shapes == {  # B keeps the kernel's axes, its contracted ones of size 1
        "q_einsum": {"a": (16, 2), "b": (2, 4, 1, 4)},  # NDH, D contracted
        "kv_einsum": {"a": (16, 2), "b": (2, 2, 1, 1, 4)},  # CKDH, D contracted
        "attn_vec_einsum": {"a": (16, 2), "b": (2, 16)}}  # NHD, N and H contracted
    assert losses[-1] < 0.8 * losses[0]
    # Gemma's own weights did not move (bitwise); every adapter's B did.
    jax.tree.map(np.testing.assert_array_equal, trained["model"], initial["model"])
    assert all(np.abs(pair["b"]).max() > 0 for path, weights in adapters.items()
               if path != "hparams" for pair in weights.values())


def test_the_fine_tuned_program_decodes_with_gemmas_cache_as_merged_eager_gemma() -> None:
    program, initial, trained, _ = fine_tuned()
    decoder = program.derive(lambda m, tokens, positions, cache, mask: m(
        tokens, positions, cache, mask))
    eager = gemma()
    eager.eval()
    nnx.update(eager, LORA.merge(trained)["model"])
    batch, length = TOKENS.shape
    empty = eager.init_cache(cache_size=length, batch_size=batch)
    cache, eager_cache, first = empty, empty, []
    for position in range(4):  # Gemma's sampler: one token, its position, the cache so far
        token, at = TOKENS[:, position:position + 1], jnp.full((batch, 1), position)
        mask = jnp.broadcast_to(jnp.arange(length) <= position, (batch, 1, length))
        logits, cache = decoder.infer(trained, token, at, cache, mask)
        expected, eager_cache = eager(token, at, eager_cache, mask)
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
        first = first or [token, at, mask, logits]
    assert_trees_close(cache, eager_cache)
    assert [int(cache[f"layer_{i}"]["end_index"][0]) for i in range(2)] == [4, 4]
    # The adapters change Gemma's logits: the fine-tuning is in what was compared.
    token, at, mask, logits = first
    untuned, _ = decoder.infer(initial, token, at, empty, mask)
    assert np.abs(np.asarray(untuned) - np.asarray(logits)).max() > 1e-2


def test_gemmas_sown_intermediates_come_out_of_a_program_by_nnx_capture_as_in_flax() -> None:
    def captured(model: gemma_lib.Transformer, tokens: jax.Array) -> tuple[jax.Array, dict]:
        (logits, _), sown = nnx.capture(model, nnx.Intermediate)(tokens, *gemma_inputs(tokens))
        return logits, nnx.to_pure_dict(sown)

    model = gemma(sow_config=sow_lib.SowConfig(
        embeddings=True, rs_after_attention=True, mlp_hidden_topk=2, attn_logits_topk=2))
    program = gm.compile(captured, model, managers=[LORA])
    logits, sown = program.infer(program.init(TOKENS), TOKENS)
    model.eval()
    eager_logits, eager = captured(model, TOKENS)
    assert set(eager["layers"][1]) == {"attn", "mlp", "rs_after_attention"}
    assert set(eager["layers"][1]["attn"]) == {"logits_topk_values", "logits_topk_indices"}
    np.testing.assert_allclose(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert_trees_close(sown, eager)


def test_remat_of_gemmas_blocks_named_by_its_list_wraps_them_and_keeps_the_gradients() -> None:
    model = gemma()  # its dropout on: recomputed, each mask must be the one drawn first

    def gradients(chosen: list) -> tuple[dict, list]:
        program = gm.compile(gemma_loss, model, managers=chosen)
        variables = program.init(TOKENS)
        grads = jax.grad(lambda v: program.train(v, TOKENS, rng=jax.random.key(0))[0])(
            variables)
        return grads["model"], [(r.manager, r.path) for r in program.rewrites["train"]]

    plain, _ = gradients([])
    rematerialized, wrapped = gradients([managers.Remat(bricks=[model.layers])])
    assert [path for manager, path in wrapped if manager == "remat"] == [
        "/layers/0", "/layers/1"]
    assert wrapped.index(("remat", "/layers/1")) > wrapped.index(
        ("nnx.Dropout", "/layers/0/dropout"))  # in the order Gemma runs
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 rematerialized, plain)
