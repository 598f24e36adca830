"""Flax's own example models, unmodified (``examples/flax_nnx``), under graphmod's managers.

Each model — the MNIST CNN, a tiny lm1b TransformerLM (tied ``Embed.attend``), a tiny
Gemma 3 (``nnx.Einsum`` projections, sliding-window and global attention), the
scan-over-layers MLP and a classifier around ``nnx.RNN(nnx.LSTMCell)`` — is compiled as
published under ``Dropout`` + ``WeightNoise`` + ``GaussianNoise`` + a LoRA manager written
here (owned variables per parameter), with its own ``nnx.Dropout``/``nnx.BatchNorm``. With
every rate 0 the program is eager Flax (outputs, state, gradients) and inference draws no
random number eager Flax would not (``nnx.RNN`` draws its carry from its own stream); with
nonzero rates every manager rewrites where expected and training lowers the loss; the
TransformerLM decodes token by token through ``program.infer(..., mutable=True)``.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from examples.flax_nnx import lm1b, mnist, scan_over_layers
from examples.flax_nnx.gemma import transformer as gemma_lib
from examples.flax_nnx.gemma import transformer_cfg as gemma_cfg
from graphmod import roles
from tests.conftest import RANDOM_PRIMITIVES, primitives
from tests.integration.test_flax_transforms import assert_trees_close

TOL = {"rtol": 1e-5, "atol": 1e-5}
KEY = jax.random.key(3)
LR = 3e-3
RNG = np.random.default_rng(0)
IMAGES = RNG.normal(size=(4, 28, 28, 1)).astype(np.float32)
TOKENS = RNG.integers(1, 32, size=(2, 8)).astype(np.int32)
FEATURES = RNG.normal(size=(6, 4)).astype(np.float32)
SEQUENCES = RNG.normal(size=(2, 5, 4)).astype(np.float32)
LABELS = np.array([0, 3, 1, 2])  # of the 4 images
CLASSES = np.array([0, 2])  # of the 2 sequences
# The lm1b model as published reads and writes Variable.value, which Flax now deprecates.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:'\.value' (access|setter) is now deprecated:DeprecationWarning")


class Lora(gm.Manager):
    """LoRA: ``W + (A @ B)`` reshaped to ``W``'s shape, one (A, B) pair per parameter; B
    starts at zero, so the model starts unchanged."""

    def __init__(self, rank: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rank = rank

    def rewrite_parameter(self, call: gm.ApplicationCall, name: str,
                          value: jax.Array) -> jax.Array:
        rows, cols = value.shape[0], int(np.prod(value.shape[1:]))
        seed = zlib.crc32(call.parameter.encode())  # A differs per parameter
        a = call.variable("lora_a", lambda: np.random.default_rng(seed).normal(
            0.0, 0.1, (rows, self.rank)).astype(np.float32), role=roles.PARAMETER)
        b = call.variable("lora_b", lambda: np.zeros((self.rank, cols), np.float32),
                          role=roles.PARAMETER)
        return value + (a.value @ b.value).reshape(value.shape)


def regularizers(rate: float, std: float) -> list[gm.Manager]:
    return [managers.Dropout(rate, bricks=[nnx.Linear], roles=[roles.INPUT]),
            managers.WeightNoise(std, roles=[roles.WEIGHT]),
            managers.GaussianNoise(std, bricks=[nnx.Linear], roles=[roles.OUTPUT]),
            Lora(bricks=[nnx.Linear, nnx.LinearGeneral], roles=[roles.WEIGHT])]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# -- the models: built as their examples build them ---------------------------------------
def transformer_lm() -> lm1b.TransformerLM:
    """A tiny lm1b TransformerLM, its logits through the embedding (``Embed.attend``)."""
    config = lm1b.TransformerConfig(
        vocab_size=32, output_vocab_size=32, logits_via_embedding=True, emb_dim=16,
        num_heads=2, num_layers=2, qkv_dim=16, mlp_dim=32, max_len=16)
    with nnx.use_eager_sharding(False):  # its sharding annotations, without a mesh
        model = lm1b.TransformerLM(config, rngs=nnx.Rngs(0))
    model.set_attributes(deterministic=False, decode=False)  # as lm1b's train_step
    return model


def gemma(**kwargs: Any) -> gemma_lib.Transformer:
    """A tiny Gemma 3: a local sliding-window and a global attention layer, four query heads
    sharing one key-value head, QK norm, its own dropout 0.1 (``kwargs``: ``sow_config``)."""
    attention = gemma_cfg.AttentionType
    config = gemma_cfg.TransformerConfig.gemma3_270m(
        num_layers=2, num_embed=32, embed_dim=16, hidden_dim=32, num_heads=4, head_dim=4,
        num_kv_heads=1, sliding_window_size=4, dropout_rate=0.1,
        attention_types=(attention.LOCAL_SLIDING, attention.GLOBAL))
    with nnx.use_eager_sharding(False):  # its sharding annotations, without a mesh
        return gemma_lib.Transformer(config, rngs=nnx.Rngs(0), **kwargs)


def gemma_inputs(tokens: jax.Array) -> tuple[jax.Array, None, jax.Array]:
    """Gemma's arguments after the tokens as its trainer makes them: positions, no cache,
    the causal mask."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return positions, None, gemma_lib.make_causal_attn_mask(tokens > 0)


def gemma_loss(model: gemma_lib.Transformer, tokens: jax.Array) -> jax.Array:
    """Next-token loss, Gemma called as its trainer calls it."""
    logits, _ = model(tokens, *gemma_inputs(tokens))
    return cross_entropy(logits[:, :-1], tokens[:, 1:])


class RNNClassifier(nnx.Module):
    """The last output of ``nnx.RNN(nnx.LSTMCell)`` (its carry drawn from its stored
    stream), Flax's Dropout, and a linear read-out."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.rnn = nnx.RNN(nnx.LSTMCell(4, 8, rngs=rngs), rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.linear = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(self.dropout(self.rnn(x)[:, -1]))


LSTM = [f"/rnn/cell/{gate}" for gate in ("ii", "if_", "ig", "io", "hi", "hf", "hg", "ho")]
BLOCKS = [f"/decoder/encoderdecoderblock_{i}" for i in range(2)]
PROJECTIONS = [f"{b}/attention/{p}" for b in BLOCKS for p in ("query", "key", "value", "out")]
MLPS = [f"{b}/mlp/{linear}" for b in BLOCKS for linear in ("linear1", "linear2")]
GEMMA_BLOCKS = ["/layers/0", "/layers/1"]
GEMMA_MLPS = {f"{b}/mlp/{p}" for b in GEMMA_BLOCKS for p in ("gate_proj", "up_proj", "down_proj")}
GEMMA_EINSUMS = {f"{b}/attn/{p}_einsum" for b in GEMMA_BLOCKS for p in ("q", "kv", "attn_vec")}


@dataclasses.dataclass(frozen=True)
class Case:
    """A model, the cost compiled over it, its arguments, and where each manager rewrites
    with nonzero rates (by manager name: the paths of ``program.rewrites["train"]``, with
    ``.application`` for applications other than ``apply``)."""

    build: Callable[[], nnx.Module]
    fn: Callable[..., jax.Array]
    args: tuple
    rewritten: dict[str, set[str]]
    # Random primitives eager Flax's inference itself has (nnx.RNN's carry: its own stream).
    own_random: frozenset[str] = frozenset()


CASES = {
    "mnist_cnn": Case(
        lambda: mnist.CNN(rngs=nnx.Rngs(0)),
        # No Rngs passed: in a program its Dropout draws from the step key.
        lambda m, x, y: cross_entropy(m(x, None), y), (IMAGES, LABELS),
        {"dropout": {"/linear1", "/linear2"}, "gaussian_noise": {"/linear1", "/linear2"},
         "lora": {"/linear1", "/linear2"},
         "weight_noise": {"/conv1", "/conv2", "/linear1", "/linear2"},
         "nnx.Dropout": {"/dropout1", "/dropout2"}}),
    "transformer_lm": Case(
        transformer_lm, lambda m, t: cross_entropy(m(t), t), (TOKENS,),
        {"dropout": set(MLPS), "gaussian_noise": set(MLPS), "lora": {*MLPS, *PROJECTIONS},
         "weight_noise": {*MLPS, *PROJECTIONS, "/decoder/output_embed",
                          "/decoder/output_embed.attend"},  # the tied embedding, twice
         "nnx.Dropout": {"/decoder/dropout", *(f"{b}/dropout" for b in BLOCKS),
                         *(f"{b}/mlp/dropout" for b in BLOCKS),
                         *(f"{b}/attention" for b in BLOCKS)}}),
    "gemma": Case(
        gemma, gemma_loss, (TOKENS,),
        {"dropout": GEMMA_MLPS, "gaussian_noise": GEMMA_MLPS, "lora": GEMMA_MLPS,
         "weight_noise": {*GEMMA_MLPS, *GEMMA_EINSUMS, "/embedder", "/embedder.attend"},
         "nnx.Dropout": {"/final_dropout", *(f"{b}/{d}" for b in GEMMA_BLOCKS for d in (
             "dropout", "attn/dropout", "mlp/dropout"))}}),
    "scan_mlp": Case(
        lambda: scan_over_layers.ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0)),
        lambda m, x: (m(x) ** 2).mean(), (FEATURES,),
        {"dropout": {"/layers/linear"}, "gaussian_noise": {"/layers/linear"},
         "lora": {"/layers/linear"}, "weight_noise": {"/layers/linear"},
         "nnx.Dropout": {"/layers/dropout"}}),
    "rnn_classifier": Case(
        lambda: RNNClassifier(rngs=nnx.Rngs(0)),
        lambda m, x, y: cross_entropy(m(x), y), (SEQUENCES, CLASSES),
        {"dropout": {*LSTM, "/linear"}, "gaussian_noise": {*LSTM, "/linear"},
         "lora": {*LSTM, "/linear"}, "weight_noise": {*LSTM, "/linear"},
         "nnx.Dropout": {"/dropout"}},
        own_random=frozenset({"random_fold_in"})),
}


def random_primitives(jaxpr: Any) -> set[str]:
    return RANDOM_PRIMITIVES & set(primitives(jaxpr))


@pytest.mark.filterwarnings("ignore:these Flax layers stay in eval mode")  # on purpose here
@pytest.mark.parametrize("name", CASES)
def test_with_rates_zero_the_program_equals_flax(name: str) -> None:
    case = CASES[name]
    model = case.build()
    model.train()
    model.set_attributes(deterministic=True, raise_if_not_found=False)  # its dropout, explicitly
    program = gm.compile(case.fn, model, managers=regularizers(0.0, 0.0))
    variables = program.init(*case.args)
    (out, trained), grads = jax.value_and_grad(
        lambda v: program.train(v, *case.args, rng=KEY), has_aux=True, allow_int=True)(variables)
    eager = nnx.clone(model)  # Flax's own run, jitted as Flax's examples jit it
    loss, eager_grads = nnx.jit(nnx.value_and_grad(case.fn))(eager, *case.args)
    # Training: the loss and the state written (batch statistics, the RNN's stream) as Flax.
    np.testing.assert_allclose(out, loss, **TOL)
    assert_trees_close(trained["model"], nnx.to_pure_dict(nnx.state(eager)))
    # Gradients of every parameter of the model: nnx.grad's.
    flat = dict(nnx.traversals.flatten_mapping(grads["model"]))
    expected = nnx.traversals.flatten_mapping(nnx.to_pure_dict(eager_grads))
    assert expected
    for path, expected_grad in expected.items():
        np.testing.assert_allclose(flat[path], expected_grad, **TOL)
    # Inference: as model.eval(), drawing no random number Flax itself would not draw.
    evaluated = nnx.clone(model)
    evaluated.eval()
    np.testing.assert_allclose(program.infer(variables, *case.args),
                               nnx.jit(case.fn)(evaluated, *case.args), **TOL)
    assert random_primitives(jax.make_jaxpr(program.infer)(variables, *case.args)) == set(
        case.own_random)
    graph, state = nnx.split(evaluated)  # Flax's lifted transforms trace from the top only
    eager_infer = jax.make_jaxpr(lambda s: case.fn(nnx.merge(graph, s), *case.args))(state)
    assert random_primitives(eager_infer) == set(case.own_random)


@pytest.mark.parametrize("name", CASES)
def test_every_manager_rewrites_its_flax_paths_and_training_lowers_the_loss(name: str) -> None:
    case = CASES[name]
    model = case.build()
    model.train()  # its own dropout on
    program = gm.compile(case.fn, model, managers=regularizers(0.1, 0.01))
    variables = program.init(*case.args)
    # LoRA's pairs are keyed per parameter, at the Flax paths of the layers.
    assert set(variables["managers"]["lora"]) - {"hparams"} == case.rewritten["lora"]
    step = gm.optimize(program, optax.adam(LR))
    state = step.init(variables, jax.random.key(0))
    losses = []
    for _ in range(8):
        # Step 0's key every time: one draw of every mask and noise, so losses compare.
        state, metrics = step(state._replace(step=jnp.zeros_like(state.step)), *case.args)
        losses.append(float(metrics["loss"]))
    paths: dict[str, set[str]] = {}
    for r in program.rewrites["train"]:
        where = r.path if r.application == "apply" else f"{r.path}.{r.application}"
        paths.setdefault(r.manager, set()).add(where)
    assert paths == case.rewritten
    assert losses[-1] < losses[0]
    lora_b = [v["kernel"]["lora_b"] for k, v in state.variables["managers"]["lora"].items()
              if k != "hparams"]
    assert all(np.abs(b).max() > 0 for b in lora_b)  # trained: owned PARAMETER variables


def test_transformer_lm_decodes_token_by_token_through_a_program_like_eager_flax() -> None:
    model = transformer_lm()
    config = model.config
    # lm1b's predict_step: a cache for every HasCache module, then decode mode.
    for _path, module in nnx.iter_modules(model):
        if isinstance(module, lm1b.HasCache):
            module.init_cache((TOKENS.shape[0], config.max_len, config.emb_dim),
                              dtype=config.dtype)
    model.set_attributes(deterministic=True, decode=True)
    program = gm.compile(lambda m, t: m(t), model, managers=regularizers(0.1, 0.01))
    variables = program.init(TOKENS[:, :1])
    eager = nnx.clone(model)
    for position in range(4):
        token = TOKENS[:, position:position + 1]
        logits, variables = program.infer(variables, token, mutable=True)
        np.testing.assert_allclose(logits, eager(token), **TOL)
        assert int(variables["model"]["decoder"]["posembed_output"]["cache_index"]) == (
            position + 1)
    assert_trees_close(variables["model"], nnx.to_pure_dict(nnx.state(eager)))
    assert int(model.decoder.posembed_output.cache_index[...]) == 0  # the model is untouched
