"""Without managers, a brick model compiles to the same operations as hand-written JAX."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import graphmod as gm
from tests.conftest import primitives

_OPCODE = re.compile(r"=\s+\S+\s+([a-z][\w\-]*)\(")


def _hlo_ops(compiled_text: str) -> collections.Counter[str]:
    return collections.Counter(m.group(1) for m in _OPCODE.finditer(compiled_text))


def _jaxpr_ops(jaxpr: object) -> collections.Counter[str]:
    return collections.Counter(p for p in primitives(jaxpr) if p not in ("pjit", "jit"))


def _cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _hand_cost(model: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    layers = model["linear_layers"]
    for i in range(len(layers)):
        h = h @ layers[i]["W"] + layers[i]["b"]
        if i < len(layers) - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def _setup() -> tuple[gm.Program, dict, jax.Array, jax.Array]:
    mlp = gm.bricks.MLP([16, 32, 32, 4], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(_cost, mlp)
    x = jax.random.normal(jax.random.key(0), (8, 16))
    y = jnp.arange(8, dtype=jnp.int32) % 4
    return program, program.init(x, y), x, y


def test_inference_jaxpr_and_hlo_match_the_hand_written_function() -> None:
    program, variables, x, y = _setup()
    ours = jax.make_jaxpr(lambda v, x, y: program.infer(v, x, y))(variables, x, y)
    hand = jax.make_jaxpr(lambda v, x, y: _hand_cost(v["model"], x, y))(variables, x, y)
    assert _jaxpr_ops(ours) == _jaxpr_ops(hand)
    ours_hlo = program._infer.lower(variables, x, y).compile().as_text()
    hand_jit = jax.jit(lambda v, x, y: _hand_cost(v["model"], x, y))
    hand_hlo = hand_jit.lower(variables, x, y).compile()
    assert _hlo_ops(ours_hlo) == _hlo_ops(hand_hlo.as_text())
    assert sum(_hlo_ops(ours_hlo).values()) > 5  # the comparison saw real programs


def test_gradient_step_matches_the_hand_written_one() -> None:
    program, variables, x, y = _setup()
    key = jax.random.key(0)
    # What graphmod.optimize differentiates: the traced training function inside its jit.
    ours = jax.make_jaxpr(jax.grad(lambda v, x, y: program._train_traced(v, key, (x, y), {})[0]))(
        variables, x, y)
    hand = jax.make_jaxpr(jax.grad(lambda v, x, y: _hand_cost(v["model"], x, y)))(
        variables, x, y)
    assert _jaxpr_ops(ours) == _jaxpr_ops(hand)


def test_application_scopes_name_the_brick_path_in_the_hlo() -> None:
    program, variables, x, y = _setup()
    text = program._infer.lower(variables, x, y).as_text(debug_info=True)
    assert "apply/linear_layers/1.apply" in text
