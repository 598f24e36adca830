"""MultiHeadAttention against flax.nnx's; Residual, TransformerBlock and StochasticDepth;
the manager library composed on a transformer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles

X = jax.random.normal(jax.random.key(1), (3, 5, 8))


def flax_copy(ours: gm.bricks.MultiHeadAttention) -> nnx.MultiHeadAttention:
    """flax.nnx's attention with our weights (kernels reshaped into heads)."""
    theirs = nnx.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(5))
    for name in ("query", "key", "value"):
        layer = getattr(ours, name)
        getattr(theirs, name).kernel[...] = layer.W[...].reshape(8, 2, 4)
        getattr(theirs, name).bias[...] = layer.b[...].reshape(2, 4)
    theirs.out.kernel[...] = ours.out.W[...].reshape(2, 4, 8)
    theirs.out.bias[...] = ours.out.b[...]
    return theirs


def test_attention_equals_flax_multi_head_attention() -> None:
    ours = gm.bricks.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))
    theirs = flax_copy(ours)
    np.testing.assert_allclose(ours(X), theirs(X), rtol=1e-5, atol=1e-5)
    mask = gm.bricks.causal_mask(5)
    np.testing.assert_allclose(ours(X, mask=mask), theirs(X, mask=mask[:, None]),
                               rtol=1e-5, atol=1e-5)
    causal = gm.bricks.MultiHeadAttention(2, 8, causal=True, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(causal(X), ours(X, mask=mask), rtol=1e-6)
    # A causal position does not see the future: changing the last step keeps the first.
    later = X.at[:, -1].set(0.0)
    np.testing.assert_allclose(causal(later)[:, :-1], causal(X)[:, :-1], rtol=1e-6)


def test_attention_dropout_is_a_manager_on_the_weights() -> None:
    block = gm.bricks.TransformerBlock(8, 2, 16, causal=True, rngs=nnx.Rngs(0))
    dropout = managers.Dropout(0.5, bricks=[gm.bricks.MultiHeadAttention],
                               applications=["attention_weights"], roles=[roles.OUTPUT])
    program = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), block, managers=[dropout])
    variables = program.init(X)
    out, _ = program.train(variables, X, rng=jax.random.key(0))
    assert [(r.path, r.application, r.name) for r in program.rewrites.train] == [
        ("/attention/branch", "attention_weights", "weights")]
    np.testing.assert_allclose(program.infer(variables, X), jnp.mean(block(X) ** 2), rtol=1e-5)
    assert not np.isclose(float(out), float(jnp.mean(block(X) ** 2)))


def test_stochastic_depth_keeps_the_expected_value_and_drops_whole_examples() -> None:
    block = gm.bricks.Residual(gm.bricks.Linear(8, 8, rngs=nnx.Rngs(0)))
    program = gm.compile(lambda m, x: m(x), block,
                         managers=[managers.StochasticDepth(gm.dynamic(0.25))])
    x = jnp.ones((4, 8))
    variables = program.init(x)
    branch = np.asarray(block.residual(x))
    outs = np.stack([np.asarray(program.train(variables, x, rng=jax.random.key(i))[0])
                     for i in range(400)])
    kept = np.isclose(outs - 1.0, branch / 0.75, atol=1e-5).all(-1)
    dropped = np.isclose(outs, 1.0).all(-1)
    assert (kept | dropped).all()  # whole examples, scaled by 1 / (1 - rate)
    np.testing.assert_allclose(kept.mean(), 0.75, atol=0.05)
    np.testing.assert_allclose(outs.mean(0), np.asarray(block(x)), atol=0.4)  # ~4 sigma
    handle = program.managers[0].hparam("rate")
    zero = handle.set(variables, 0.0)
    np.testing.assert_allclose(program.train(zero, x, rng=jax.random.key(0))[0], block(x),
                               rtol=1e-6)
    np.testing.assert_allclose(program.infer(variables, x), block(x), rtol=1e-6)


def test_lora_dropout_precision_remat_and_stochastic_depth_on_a_transformer() -> None:
    model = gm.bricks.Sequence(
        gm.bricks.TransformerBlock(8, 2, 16, causal=True, rngs=nnx.Rngs(0)),
        gm.bricks.TransformerBlock(8, 2, 16, causal=True, rngs=nnx.Rngs(1)))
    # the attention's projections: Linear bricks inside it (bricks= names the bricks whose
    # own applications read the weights)
    lora = managers.LoRA(2, alpha=4.0, bricks=[gm.bricks.Linear], path="*/attention/*",
                         roles=[roles.WEIGHT])
    chosen = [
        managers.Remat(bricks=[gm.bricks.TransformerBlock]),
        managers.Precision("bfloat16", bricks=[gm.bricks.MLP]),
        managers.Dropout(0.1, bricks=[gm.bricks.MultiHeadAttention],
                         applications=["attention_weights"], roles=[roles.OUTPUT]),
        managers.StochasticDepth(0.1),
        lora,
    ]
    program = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), model, managers=chosen)
    variables = program.init(X)
    step = gm.optimize(program, optax.adam(1e-2), trainable=[lora])
    state = step.init(variables, jax.random.key(0))
    losses = []
    for _ in range(5):
        state, metrics = step(state, X)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    for name in ("query", "out"):  # base weights frozen, adapters trained
        before = variables["model"]["layers"][0]["attention"]["branch"][name]["W"]
        after = state.variables["model"]["layers"][0]["attention"]["branch"][name]["W"]
        np.testing.assert_array_equal(before, after)
    order = [(r.manager, r.path, r.application) for r in program.rewrites.train]
    # In the order the model runs: the block Remat wraps, the attention's projections
    # (LoRA), its weights (dropout), the branch (stochastic depth), then the MLP's casts
    # (Precision).
    assert list(dict.fromkeys(m for m, _, _ in order)) == [
        "remat", "lora", "dropout", "stochastic_depth", "precision"]
    assert [p for m, p, _ in order if m == "remat"] == ["/layers/0", "/layers/1"]
    assert ("stochastic_depth", "/layers/1/mlp", "residual") in order
    merged = lora.merge(state.variables)
    plain = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), model,
                       managers=[m for m in chosen if m is not lora])
    np.testing.assert_allclose(plain.infer(merged, X), program.infer(state.variables, X),
                               rtol=2e-2)
