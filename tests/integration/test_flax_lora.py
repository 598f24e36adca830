"""Flax's own LoRA layers trained as Flax trains them: ``optimize(trainable=...)`` takes
Flax filters (``nnx.LoRAParam``, ``nnx.PathContains``, ``nnx.All``: what
``nnx.Optimizer(..., wrt=...)`` takes) beside graphmod's filters and managers, and the
training record lists the parameters that trained."""

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


class Adapted(nnx.Module):
    """A LoRA-adapted Flax layer and a plain head."""

    def __init__(self) -> None:
        self.body = nnx.LoRALinear(4, 6, lora_rank=2, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(6, 2, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(nnx.relu(self.body(x)))


def cost(model: Adapted, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


X = jnp.linspace(-1.0, 1.0, 20).reshape(5, 4)
Y = jnp.ones((5, 2))
PATHS = {"body.kernel": ("body", "kernel"), "body.bias": ("body", "bias"),
         "lora_a": ("body", "lora", "lora_a"), "lora_b": ("body", "lora", "lora_b"),
         "head.kernel": ("head", "kernel"), "head.bias": ("head", "bias")}


def changed(trainable: Any) -> tuple[set[str], Any]:
    """The parameters three Adam steps changed, and the step."""
    program = gm.compile(cost, Adapted())
    variables = program.init(X, Y)
    step = gm.optimize(program, optax.adam(1e-2), trainable=trainable)
    state = step.init(variables, jax.random.key(0))
    for _ in range(3):
        state, _ = step(state, X, Y)

    def leaf(tree: dict, keys: tuple) -> np.ndarray:
        for key in keys:
            tree = tree[key]
        return np.asarray(tree)

    return {name for name, keys in PATHS.items() if not np.array_equal(
        leaf(variables["model"], keys), leaf(state.variables["model"], keys))}, step


@pytest.mark.parametrize(("trainable", "expected"), [
    (nnx.LoRAParam, {"lora_a", "lora_b"}),
    ([nnx.LoRAParam], {"lora_a", "lora_b"}),
    (nnx.PathContains("head"), {"head.kernel", "head.bias"}),
    (nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)),
     {"body.kernel", "body.bias", "head.kernel", "head.bias"}),
    ([nnx.LoRAParam, gm.VariableFilter(path="/head.bias")], {"lora_a", "lora_b", "head.bias"}),
    (lambda path, value: path[0] == "head", {"head.kernel", "head.bias"}),  # Flax's examples'
    (..., set(PATHS)),  # Flax's literal for everything
])
def test_flax_filters_choose_what_trains_as_in_flax(trainable: Any, expected: set[str]) -> None:
    trained, step = changed(trainable)
    assert trained == expected
    record = step.provenance["trainable"]
    assert sorted(record["model"]) == sorted(
        "/" + ".".join(PATHS[name]).replace("body.lora.", "body/lora.") for name in expected)
    assert list(record["managers"]) == []


def test_without_trainable_everything_trains_and_the_record_says_none() -> None:
    trained, step = changed(None)
    assert trained == set(PATHS)
    assert step.provenance["trainable"] is None


@pytest.mark.parametrize("wrong, why", [
    ("lora", r"a string is a Flax tag filter.*pass nnx.WithTag\('lora'\)"),
    (lambda path: True, r"a function filter takes \(path, value\)"),
    (nnx.Linear, r"Linear is a module class.*VariableFilter\(bricks=\[Linear\]\)"),
    (managers.LoRA, r"pass the LoRA manager itself"),
])
def test_strings_and_other_filters_are_refused_naming_the_fix(wrong: Any, why: str) -> None:
    program = gm.compile(cost, Adapted())
    with pytest.raises(TypeError, match=rf"optimize\(trainable=\.\.\.\): got .*: {why}.* \(a "
                       r"VariableFilter, a manager, or a Flax filter: a Variable type such as "
                       r"nnx.LoRAParam"):
        gm.optimize(program, optax.adam(1e-2), trainable=wrong)
