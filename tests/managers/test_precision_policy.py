"""``managers.MixedPrecision`` and ``managers.Precision`` on a brick and everything under it:
the matrix products and convolutions inside run in the compute dtype (read from the jaxpr of
the gradient step), parameters and gradients stay float32, normalisation layers are kept.

Models: Flax's lm1b ``TransformerLM`` as published (its layers fix ``dtype=float32``), a
bonsai-style Qwen3 decoder (``nnx.Linear`` without a dtype, ``nnx.RMSNorm``, an ``MLP``
parent of three projections), and a small convolutional block.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from examples.flax_nnx import lm1b, scan_over_layers
from graphmod import roles
from tests.integration.test_flax_examples import cross_entropy, transformer_lm

PRODUCTS = ("dot_general", "conv_general_dilated")


def products(jaxpr: Any, scope: str = "") -> list[tuple[str, str, tuple[str, ...]]]:
    """``(scope, primitive, operand dtypes)`` of every matrix product and convolution in
    ``jaxpr`` and its sub-jaxprs; ``scope`` is the whole name stack (the brick paths)."""
    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        here = f"{scope}/{eqn.source_info.name_stack}"
        if eqn.primitive.name in PRODUCTS:
            found.append((here, eqn.primitive.name,
                          tuple(str(v.aval.dtype) for v in eqn.invars)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    found += products(sub, here)
    return found


def gradient_step(program: gm.Program, *args: Any) -> tuple[Any, dict, dict]:
    """The jaxpr of the training gradient of the PARAMETER leaves, the variables and the
    gradients (abstract: traced, not compiled)."""
    variables = program.init(*args)
    params, rest = program.split(variables, roles.PARAMETER)

    def grad(p: dict) -> dict:
        return jax.grad(lambda p: program.train(program.merge(p, rest), *args,
                                                rng=jax.random.key(0))[0])(p)

    return jax.make_jaxpr(grad)(params), variables, jax.eval_shape(grad, params)


def float_dtypes(tree: Any) -> set[str]:
    return {str(leaf.dtype) for leaf in jax.tree.leaves(tree)
            if jnp.issubdtype(leaf.dtype, jnp.floating)}


# -- a bonsai-style Qwen3 decoder (jax-ml/bonsai's layout, tiny) --------------------------
class MLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        self.gate_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nnx.Module):
    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs) -> None:
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nnx.Linear(dim, dim, use_bias=False, rngs=rngs) for _ in range(4))
        self.q_norm = nnx.RMSNorm(self.head_dim, rngs=rngs)
        self.k_norm = nnx.RMSNorm(self.head_dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        split = lambda y: y.reshape(*y.shape[:-1], self.heads, self.head_dim)
        q, k = self.q_norm(split(self.q_proj(x))), self.k_norm(split(self.k_proj(x)))
        v = split(self.v_proj(x))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.o_proj(out.reshape(x.shape))


class DecoderLayer(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs) -> None:
        self.input_layernorm = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = Attention(dim, 2, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(dim, rngs=rngs)
        self.mlp = MLP(dim, 2 * dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nnx.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2, *,
                 rngs: nnx.Rngs) -> None:
        self.embedder = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(dim, rngs=rngs) for _ in range(layers)])
        self.final_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.final_norm(x))


def lm_loss(model: Any, tokens: jax.Array) -> jax.Array:
    return cross_entropy(model(tokens), tokens)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 32, (2, 8)))


def test_a_policy_on_an_lm1b_block_runs_every_product_inside_it_in_bfloat16() -> None:
    model = transformer_lm()  # as Flax's example builds it: every layer fixes dtype=float32
    policy = managers.MixedPrecision(bricks=[model.decoder.encoderdecoderblock_0])
    program = gm.compile(lm_loss, model, managers=[policy])
    jaxpr, variables, grads = gradient_step(program, TOKENS)
    inside = [dtypes for scope, _, dtypes in products(jaxpr)
              if "/encoderdecoderblock_0.apply" in scope]
    outside = [dtypes for scope, _, dtypes in products(jaxpr)
               if "/encoderdecoderblock_0.apply" not in scope]
    # forward and backward: 4 projections, 2 attention products, 2 MLP layers
    assert len(inside) == 3 * 8 and {d for ds in inside for d in ds} == {"bfloat16"}
    assert outside and {d for ds in outside for d in ds} == {"float32"}
    assert float_dtypes(variables) == float_dtypes(grads) == {"float32"}
    # Flax's own dtype is presented only during the call: the model is as it was
    assert model.decoder.encoderdecoderblock_0.mlp.linear1.dtype == jnp.float32
    casts = {(r.path.rsplit("/", 1)[-1], r.role, r.dtype_out)
             for r in program.rewrites["train"] if r.manager == "mixed_precision"}
    assert ("ln1", "INPUT", "float32") in casts  # the layer norms are kept in float32
    assert ("ln1", "OUTPUT", "bfloat16") in casts
    assert ("encoderdecoderblock_0", "OUTPUT", "float32") in casts  # the block's output


@pytest.mark.parametrize("make", [
    lambda: managers.MixedPrecision(bricks=[MLP]),
    lambda: managers.Precision("bfloat16", bricks=[MLP]),  # on a parent: the same reach
], ids=["MixedPrecision", "Precision"])
def test_a_policy_on_a_qwen3_mlp_reaches_its_child_projections(make: Any) -> None:
    model = Qwen3(rngs=nnx.Rngs(0))
    program = gm.compile(lm_loss, model, managers=[make()])
    jaxpr, variables, grads = gradient_step(program, TOKENS)
    found = products(jaxpr)
    mlp = [dtypes for scope, _, dtypes in found if "/mlp.apply" in scope]
    assert len(mlp) == 2 * 3 * 3  # two layers, three projections, forward and backward
    assert {d for ds in mlp for d in ds} == {"bfloat16"}
    assert {d for scope, _, ds in found if "/mlp.apply" not in scope for d in ds} == {"float32"}
    assert float_dtypes(variables) == float_dtypes(grads) == {"float32"}


def test_a_policy_on_every_decoder_layer_keeps_the_rms_norms_in_float32() -> None:
    model = Qwen3(rngs=nnx.Rngs(0))
    program = gm.compile(lm_loss, model, managers=[managers.MixedPrecision(
        bricks=[DecoderLayer])])
    jaxpr, _, _ = gradient_step(program, TOKENS)
    found = products(jaxpr)
    assert {d for scope, _, ds in found if "layers/" in scope for d in ds} == {"bfloat16"}
    assert {d for scope, _, ds in found if "layers/" not in scope for d in ds} == {"float32"}
    norms = {(r.path.rsplit("/", 1)[-1], r.role, r.dtype_out)
             for r in program.rewrites["train"] if "norm" in r.path}
    assert {("q_norm", "INPUT", "float32"), ("q_norm", "OUTPUT", "bfloat16"),
            ("input_layernorm", "INPUT", "float32")} <= norms
    assert not any(r.role == "WEIGHT" and "norm" in r.path for r in program.rewrites["train"])
    step = gm.optimize(program, optax.adam(1e-2))
    state = step.init(program.init(TOKENS), jax.random.key(0))
    losses = []
    for _ in range(3):
        state, metrics = step(state, TOKENS)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] and np.isfinite(losses).all()
    assert float_dtypes(state.opt_state) == {"float32"}


class ConvBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.conv2 = nnx.Conv(4, 2, (3, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.conv2(jax.nn.relu(self.norm(self.conv1(x))))


def test_convolutions_inside_the_region_run_in_float16_and_batch_norm_stays_float32() -> None:
    block = ConvBlock(rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), block, managers=[
        managers.MixedPrecision("float16", bricks=[block])])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 6, 1)), jnp.float32)
    jaxpr, variables, grads = gradient_step(program, x)
    convs = [ds for _, name, ds in products(jaxpr) if name == "conv_general_dilated"]
    assert len(convs) >= 2 + 3 and {d for ds in convs for d in ds} == {"float16"}
    assert float_dtypes(grads) == {"float32"}
    _, new = jax.eval_shape(lambda v: program.train(v, x, rng=jax.random.key(0)), variables)
    assert new["model"]["norm"]["mean"].dtype == jnp.float32  # statistics stored as they were
    assert jax.eval_shape(program.infer, variables, x).dtype == jnp.float32


def test_a_policy_on_the_layers_of_a_scan_over_layers_reaches_each_iteration() -> None:
    model = scan_over_layers.ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), model, managers=[
        managers.MixedPrecision(bricks=[scan_over_layers.Block])])
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 4)), jnp.float32)
    jaxpr, variables, grads = gradient_step(program, x)
    found = products(jaxpr)
    assert found and {d for _, _, ds in found for d in ds} == {"bfloat16"}
    assert float_dtypes(variables) == float_dtypes(grads) == {"float32"}
    assert {r.path for r in program.rewrites["train"] if r.role == "WEIGHT"} == {
        "/layers/linear"}  # the kernel each iteration reads; BatchNorm's scale kept


def test_a_policy_selected_inside_another_region_wins_there() -> None:
    model = Qwen3(rngs=nnx.Rngs(0))
    program = gm.compile(lm_loss, model, managers=[
        managers.MixedPrecision(bricks=[DecoderLayer]),
        managers.MixedPrecision("float16", output=None, bricks=[MLP], manager_name="mlp16")])
    jaxpr, _, _ = gradient_step(program, TOKENS)
    found = products(jaxpr)
    assert {d for scope, _, ds in found if "/mlp.apply" in scope for d in ds} == {"float16"}
    assert {d for scope, _, ds in found if "/attn.apply" in scope for d in ds} == {"bfloat16"}


class Wrong(nnx.Module):
    """A parent whose child fixes ``dtype=float32`` and is called with the wrong width."""

    def __init__(self) -> None:
        self.child = nnx.Linear(3, 2, dtype=jnp.float32, rngs=nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.child(x[:, :2])


def test_a_flax_layer_gets_its_own_dtype_back_when_its_call_raises() -> None:
    model = Wrong()
    program = gm.compile(lambda m, x: m(x).sum(), model,
                         managers=[managers.MixedPrecision(bricks=[Wrong])])
    with pytest.raises(TypeError, match="dot_general"):
        program.init(jnp.ones((1, 3)))
    assert model.child.dtype == jnp.float32


def test_bad_dtypes_and_variable_filters_name_the_manager_and_argument() -> None:
    with pytest.raises(ValueError, match=r"MixedPrecision\(compute=\.\.\.\): int8 is not a "
                                         r"floating-point dtype"):
        managers.MixedPrecision("int8")
    with pytest.raises(TypeError, match=r"MixedPrecision\(output=\.\.\.\): 'bfloat17' is not"):
        managers.MixedPrecision(output="bfloat17")
    with pytest.raises(ValueError, match=r"MixedPrecision\(compute=\.\.\.\): this JAX computes "
                                         r"no float64.*jax_enable_x64"):
        managers.MixedPrecision("float64")
    with pytest.raises(ValueError, match=r"Precision\(compute_dtype=\.\.\.\): int32"):
        managers.Precision("int32")
    with pytest.raises(TypeError, match=r"MixedPrecision: a policy selects application calls"):
        managers.MixedPrecision(bricks=[MLP], roles=[roles.WEIGHT])
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"MixedPrecision\(keep=\.\.\.\): .*Linear.* is neither"):
        managers.MixedPrecision(keep=[layer])
    with pytest.raises(ValueError, match=r"MixedPrecision\(keep=\.\.\.\): a filter of calls"):
        managers.MixedPrecision(keep=gm.VariableFilter(roles=[roles.WEIGHT]))


def test_a_policy_whose_bricks_are_not_called_raises_naming_it() -> None:
    model = Qwen3(rngs=nnx.Rngs(0))
    program = gm.compile(lm_loss, model, managers=[managers.MixedPrecision(bricks=[
        lm1b.MlpBlock])])
    with pytest.raises(Exception, match="mixed_precision"):
        program.init(TOKENS)
