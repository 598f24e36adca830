"""StochasticDepth on unmodified Flax residual blocks: the branch is dropped, never the
identity; per example, rescaled; graphmod's own Residual as before."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers


class ResBlock(nnx.Module):
    """A residual block as Flax's guides write one: ``x + branch(x)``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + nnx.relu(self.linear(x))


class BonsaiBlock(nnx.Module):
    """Two branches added in one block (a bonsai-style transformer block's shape)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn, self.mlp = nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Net(nnx.Module):
    def __init__(self, block: type) -> None:
        self.blocks = nnx.List([block(nnx.Rngs(0)), block(nnx.Rngs(1))])
        self.head = nnx.Linear(4, 2, rngs=nnx.Rngs(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


X = jax.random.normal(jax.random.key(0), (16, 4))


@pytest.mark.parametrize("block", [ResBlock, BonsaiBlock])
def test_at_rate_1_a_flax_block_returns_its_input_exactly(block: type) -> None:
    model = block(nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), model,
                         managers=[managers.StochasticDepth(1.0, bricks=[block])])
    variables = program.init(X)
    out, _ = program.train(variables, X, rng=jax.random.key(0))
    np.testing.assert_array_equal(out, X)  # the identity path kept, bitwise
    np.testing.assert_allclose(program.infer(variables, X), model(X), rtol=1e-6)


def test_each_example_keeps_or_drops_its_branch_rescaled() -> None:
    model = ResBlock(nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), model,
                         managers=[managers.StochasticDepth(gm.dynamic(0.5), bricks=[ResBlock])])
    variables = program.init(X)
    branch = np.asarray(model(X) - X)
    outs = np.stack([np.asarray(program.train(variables, X, rng=jax.random.key(i))[0])
                     for i in range(40)])
    dropped = (outs == np.asarray(X)).all(-1)
    kept = np.isclose(outs, np.asarray(X) + 2.0 * branch, atol=1e-5).all(-1)
    assert (kept ^ dropped).all()  # whole examples, the kept ones scaled by 1 / (1 - 0.5)
    assert 0.3 < kept.mean() < 0.7
    assert len({tuple(row) for row in kept}) > 1  # a new draw per step key
    zero = program.managers[0].hparam("rate").set(variables, 0.0)
    np.testing.assert_allclose(program.train(zero, X, rng=jax.random.key(0))[0], model(X),
                               rtol=1e-5, atol=1e-6)


def test_in_a_network_only_the_selected_blocks_drop_and_gradients_stay_finite() -> None:
    net = Net(ResBlock)
    program = gm.compile(lambda m, x: jnp.mean(m(x) ** 2), net,
                         managers=[managers.StochasticDepth(1.0, bricks=[ResBlock])])
    variables = program.init(X)
    loss, _ = program.train(variables, X, rng=jax.random.key(0))
    np.testing.assert_allclose(loss, jnp.mean(net.head(X) ** 2), rtol=1e-6)  # both skipped
    grads = jax.grad(lambda v: program.train(v, X, rng=jax.random.key(0))[0])(variables)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert not np.any(grads["model"]["blocks"][0]["linear"]["kernel"])  # dropped: no gradient


def test_graphmod_residual_branch_and_a_block_whose_shape_changes() -> None:
    block = gm.bricks.Residual(gm.bricks.Linear(4, 4, rngs=nnx.Rngs(0)))
    program = gm.compile(lambda m, x: m(x), block, managers=[managers.StochasticDepth(1.0)])
    out, _ = program.train(program.init(X), X, rng=jax.random.key(0))
    np.testing.assert_array_equal(out, X)  # graphmod's branch output, zeroed: x + 0
    shrink = gm.compile(lambda m, x: m(x), nnx.Linear(4, 2, rngs=nnx.Rngs(0)),
                        managers=[managers.StochasticDepth(0.5, bricks=[nnx.Linear])])
    with pytest.raises(ValueError, match=r"first input \(16, 4\) and its output \(16, 2\)"):
        shrink.train(shrink.init(X), X, rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"rate=1.5"):
        managers.StochasticDepth(1.5)
    with pytest.raises(TypeError, match="block='yes'"):
        managers.StochasticDepth(0.1, block="yes")


def test_a_derived_function_without_rngs_is_not_asked_for_one() -> None:
    def cost(m: nnx.Module, x: jax.Array, rngs: nnx.Rngs) -> jax.Array:
        return jnp.mean(m(x) + jax.random.normal(rngs.default(), x.shape))

    program = gm.compile(cost, ResBlock(nnx.Rngs(0)))
    variables = program.init(X, nnx.Rngs(0))
    predict = program.derive(lambda m, x: m(x))
    assert predict.infer(variables, X).shape == (16, 4)
    assert predict.train(variables, X, rng=jax.random.key(0))[0].shape == (16, 4)
    with pytest.raises(TypeError, match="argument 'rngs'"):  # the compiled one still asks
        program.infer(variables, X)
