"""A train step's keys: each draw's key is the step key folded with CRC32 of the draw's place
(manager, path, application, role, name, call id), so the masks and noise are a function of
(step key, path) only; and the draws a trace of the program made before (``init``'s) are
keyed in one batched fold of the step key, the very keys one ``fold_in`` each gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import graphmod as gm
import managers
from graphmod._core._tracing._frame import crc32
from tests.conftest import primitives

KEY = jax.random.key(7)
X = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)


def _noisy_program() -> tuple[gm.Program, gm.bricks.MLP]:
    mlp = gm.bricks.MLP([3, 4, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), mlp,
                         managers=[managers.WeightNoise(0.1, roles=[gm.roles.WEIGHT])])
    return program, mlp


def test_each_draw_is_the_step_key_folded_with_its_place() -> None:
    program, mlp = _noisy_program()
    variables = program.init(X)
    out, _ = program.train(variables, X, rng=KEY)

    noisy = nnx.clone(mlp)  # by hand: the same noise on each W, from the documented keys
    for i, layer in enumerate(noisy.linear_layers):
        key = jax.random.fold_in(KEY, crc32(f"weight_noise|/linear_layers/{i}.W||WEIGHT|W#0"))
        layer.W[...] += 0.1 * jax.random.normal(key, layer.W.shape)
    np.testing.assert_allclose(out, noisy(X), rtol=1e-6, atol=1e-6)


def test_a_step_keys_every_draw_in_one_batched_fold() -> None:
    program, _ = _noisy_program()
    variables = program.init(X)
    jaxpr = jax.make_jaxpr(lambda v, k: program.train(v, X, rng=k))(variables, KEY)
    rewritten = [r for r in program.rewrites["train"] if r.manager == "weight_noise"]
    assert len(rewritten) == 3  # three draws (one W each) ...
    folds = primitives(jaxpr).count("random_fold_in")  # nested jaxprs' equations too
    assert folds == 1, jaxpr  # ... keyed by one fold of the step key


def test_a_draw_no_earlier_trace_made_gets_the_same_key() -> None:
    # A manager that draws in no trace but the train step's (init's trace draws nothing): its
    # key is folded on its own, and is the one the batched fold would give.
    traces: list[str] = []

    class LaterOnly(gm.Manager):
        def rewrite_output(self, call: gm.typing.HookContext, name: str, value: jax.Array
                           ) -> jax.Array:
            traces.append(name)
            if len(traces) == 1:  # init's trace
                return value
            return value + jax.random.normal(call.rng(), value.shape)

    lin = gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), lin,
                         managers=[LaterOnly(manager_name="later", roles=[gm.roles.OUTPUT])])
    variables = program.init(X)
    out, _ = program.train(variables, X, rng=KEY)
    assert len(traces) == 2
    key = jax.random.fold_in(KEY, crc32("later|/|apply|OUTPUT|output#0"))
    expected = lin(X) + jax.random.normal(key, (5, 2))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
