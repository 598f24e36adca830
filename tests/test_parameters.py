"""Parameter rewrites are overrides: every access path sees them, once per call."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
from graphmod import roles


class AddOne(gm.Manager):
    """Adds 1 to every selected parameter; counts rewrites through program.rewrites."""

    def rewrite_parameter(self, call: gm.ApplicationCall, name: str, value: jax.Array):
        return value + 1.0


class Noise(gm.Manager):
    def rewrite_parameter(self, call: gm.ApplicationCall, name: str, value: jax.Array):
        if not call.training:
            return value
        return value + jax.random.normal(call.rng(), value.shape, value.dtype)


class Reader(gm.Brick):
    """Reads W through one access path."""

    def __init__(self, read: Callable[[jax.Array, jax.Array], jax.Array]) -> None:
        self.W = gm.Weight(jnp.arange(6.0).reshape(2, 3))
        self.read = read

    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x: jax.Array) -> jax.Array:
        return self.read(x, self.W)


ACCESS_PATHS: dict[str, Callable] = {
    "matmul": lambda x, W: x @ W,
    "rmatmul": lambda x, W: (W.T @ x.T).T,
    "getitem": lambda x, W: x @ W[...],
    "transpose": lambda x, W: x @ W.T.T,
    "reshape": lambda x, W: x @ W.reshape(2, 3),
    "astype": lambda x, W: x @ W.astype(jnp.float32),
    "sum": lambda x, W: x @ jnp.ones((2, 3)) * W.sum(),
    "jnp": lambda x, W: jnp.dot(x, W),
    "get_value": lambda x, W: x @ W.get_value(),
}


@pytest.mark.parametrize("access", sorted(ACCESS_PATHS))
def test_every_access_path_sees_the_rewrite(access: str) -> None:
    read = ACCESS_PATHS[access]
    brick = Reader(read)
    program = gm.compile(lambda m, x: m(x), brick, managers=[AddOne(roles=[roles.WEIGHT])])
    x = jnp.array([[1.0, 2.0]])
    variables = program.init(x)
    expected = read(x, gm.Weight(jnp.arange(6.0).reshape(2, 3) + 1.0))
    np.testing.assert_allclose(program.infer(variables, x), expected)
    np.testing.assert_allclose(program.train(variables, x, rng=jax.random.key(0))[0], expected)
    # The stored parameter is unchanged: in the variables and in the model.
    np.testing.assert_array_equal(variables["model"]["W"], np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(brick.W.get_value(), np.arange(6.0).reshape(2, 3))


class WithFlaxLinear(gm.Brick):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.dense = nnx.Linear(3, 2, rngs=rngs)
        self.norm = nnx.BatchNorm(2, rngs=rngs)

    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x: jax.Array) -> jax.Array:
        return self.norm(self.dense(x))


def test_plain_flax_layers_inside_a_brick_are_rewritable_by_role() -> None:
    model = WithFlaxLinear(rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), model, managers=[AddOne(roles=[roles.WEIGHT])])
    x = jnp.ones((4, 3))
    variables = program.init(x)
    roles_tree = program.roles(variables)["model"]
    assert roles_tree["dense"]["kernel"] is roles.WEIGHT
    assert roles_tree["dense"]["bias"] is roles.BIAS
    assert roles_tree["norm"]["mean"] is roles.STATE
    # The nnx.Linear call is an application of its own, at the Flax module's path.
    assert [(r.path, r.name) for r in program.rewrites["init"]] == [("/dense", "kernel")]
    kernel = variables["model"]["dense"]["kernel"]
    bias = variables["model"]["dense"]["bias"]
    model.norm.use_running_average = True
    expected = model.norm(x @ (kernel + 1.0) + bias)
    model.norm.use_running_average = False
    out = program.infer(variables, x)
    # In inference the nnx.BatchNorm uses its running averages, whatever its own flag says.
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(model.dense.kernel.get_value()), np.asarray(kernel))


def test_flax_batch_stats_updated_inside_a_program_come_out_as_variables() -> None:
    model = WithFlaxLinear(rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x).sum(), model)
    x = jax.random.normal(jax.random.key(1), (8, 3))
    variables = program.init(x)
    _, new = program.train(variables, x, rng=jax.random.key(0))
    before, after = variables["model"]["norm"]["mean"], new["model"]["norm"]["mean"]
    batch_mean = (x @ variables["model"]["dense"]["kernel"]).mean(0)
    np.testing.assert_allclose(after, 0.99 * before + 0.01 * batch_mean, rtol=1e-5, atol=1e-6)
    # The model's own statistics are untouched.
    np.testing.assert_array_equal(model.norm.mean.get_value(), before)


class Tied(gm.Brick):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.a = gm.bricks.Linear(3, 3, use_bias=False, rngs=rngs)
        self.b = gm.bricks.Linear(3, 3, use_bias=False, rngs=rngs)
        self.b.W = self.a.W  # tied: one variable, two paths

    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x: jax.Array) -> jax.Array:
        return self.b(self.a(x))


def test_tied_weight_is_one_variable_with_aliases_perturbed_once_per_call() -> None:
    model = Tied(rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), model, managers=[Noise(roles=[roles.WEIGHT])])
    x = jnp.eye(3)
    variables = program.init(x)
    assert list(variables["model"]) == ["a"]  # stored once, at its canonical path
    info = program.layout.by_key[("a", "W")]
    assert info.aliases == ("/b.W",)
    out, _ = program.train(variables, x, rng=jax.random.key(0))
    rewrites = program.rewrites["train"]
    assert [(r.path, r.name) for r in rewrites] == [("/a", "W"), ("/b", "W")]
    # Two calls read the same weight: two different noises (one per application call).
    W = variables["model"]["a"]["W"]
    noisy_a = jnp.linalg.solve(jnp.eye(3), out)  # out = (x @ Wa') @ Wb' with x = I
    assert not np.allclose(noisy_a, W @ W, atol=1e-3)


def test_a_weight_read_twice_in_one_call_is_rewritten_once() -> None:
    brick = Reader(lambda x, W: x @ W + x @ W.get_value())
    program = gm.compile(lambda m, x: m(x), brick, managers=[Noise(roles=[roles.WEIGHT])])
    x = jnp.array([[1.0, 0.0]])
    variables = program.init(x)
    out, _ = program.train(variables, x, rng=jax.random.key(0))
    assert len(program.rewrites["train"]) == 1
    row = out[0] / 2  # both reads saw the same noisy W
    assert not np.allclose(row, variables["model"]["W"][0])


class Pair(gm.Brick):
    def __init__(self, first: gm.Brick, second: gm.Brick) -> None:
        self.first = first
        self.second = second

    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x: jax.Array) -> jax.Array:
        return self.second(self.first(x))


def test_deep_copies_are_distinct_variables() -> None:
    import copy

    a = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
    gm.compile(lambda m, x: m(x), a)  # gives a's variables identities
    twin = copy.deepcopy(a)  # copies the identities too
    program = gm.compile(lambda m, x: m(x), Pair(a, twin),
                         managers=[AddOne(bricks=[twin], roles=[roles.WEIGHT])])
    identities = {info.identity for info in program.layout.variables}
    assert len(identities) == len(program.layout.variables) == 4
    x = jnp.ones((1, 2))
    variables = program.init(x)
    W = variables["model"]["first"]["W"]
    b = variables["model"]["first"]["b"]
    expected = (x @ W + b) @ (W + 1.0) + b
    np.testing.assert_allclose(program.infer(variables, x), expected, rtol=1e-6)
