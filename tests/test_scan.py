"""graphmod.scan carries manager state and monitored values through lax.scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles


class Cell(gm.Brick):
    def __init__(self) -> None:
        self.lin = gm.bricks.Linear(3, 3, rngs=nnx.Rngs(0))

    @gm.application(inputs=["xs"], outputs=["ys"])
    def apply(self, xs: jax.Array) -> jax.Array:
        def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            h = jnp.tanh(self.lin(x) + h)
            return h, h

        return gm.scan(step, jnp.zeros((xs.shape[1], 3)), xs)[1]


def test_outside_a_program_it_is_lax_scan() -> None:
    cell = Cell()
    xs = jnp.ones((4, 2, 3))
    ref = jax.lax.scan(lambda h, x: (jnp.tanh(cell.lin(x) + h),) * 2, jnp.zeros((2, 3)), xs)[1]
    np.testing.assert_allclose(cell(xs), ref, rtol=1e-6)


def test_state_monitors_and_call_ids_through_the_scan() -> None:
    cell = Cell()
    bn = managers.BatchNorm(bricks=[cell.lin], roles=[roles.OUTPUT], momentum=0.5)
    program = gm.compile(lambda m, xs: m(xs), cell, managers=[bn],
                         monitor=gm.VariableFilter(bricks=[cell.lin], roles=[roles.OUTPUT]))
    xs = jax.random.normal(jax.random.key(0), (4, 5, 3))
    variables = program.init(xs)
    assert len(program.rewrites["init"]) == 1  # the body's calls are recorded once
    out, new, monitored = program.train(variables, xs, rng=jax.random.key(0))
    assert monitored["/lin.apply.output"].shape == (4, 5, 3)  # stacked per step
    stats = new["managers"]["batch_norm"]["/lin"]["apply"]
    # Four updates in call order with momentum 0.5, from the initial zero mean.
    W, b = variables["model"]["lin"]["W"], variables["model"]["lin"]["b"]
    h, running = jnp.zeros((5, 3)), jnp.zeros(3)
    for t in range(4):
        pre = xs[t] @ W + b
        running = 0.5 * running + 0.5 * pre.mean(0)
        normed = (pre - pre.mean(0)) / jnp.sqrt(pre.var(0) + 1e-5)
        h = jnp.tanh(normed + h)
    np.testing.assert_allclose(stats["output.mean"], running, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[-1], h, rtol=1e-4, atol=1e-5)
    assert [r.call_id for r in program.rewrites["train"]] == [0]


def test_other_sequence_lengths_are_accepted_after_init() -> None:
    rnn = gm.bricks.SimpleRecurrent(3, 5, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), rnn)
    variables = program.init(jnp.ones((2, 7, 3)))
    assert program.infer(variables, jnp.ones((4, 5, 3))).shape == (4, 5, 5)


def test_init_over_an_empty_sequence() -> None:
    class Cum(gm.Brick):
        @gm.application(inputs=["xs"], outputs=["ys"])
        def apply(self, xs: jax.Array) -> jax.Array:
            return gm.scan(lambda c, x: (c + x, c), jnp.zeros(3), xs)[1]

    program = gm.compile(lambda m, xs: m(xs), Cum())
    variables = program.init(jnp.ones((0, 3)))
    assert program.infer(variables, jnp.ones((0, 3))).shape == (0, 3)
