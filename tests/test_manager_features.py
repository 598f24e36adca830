"""Manager machinery: owned variables per call, device-folded randomness, inference rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
from graphmod import roles


class Count(gm.Manager):
    """Counts the calls it sees in an owned state variable (per call or shared)."""

    def __init__(self, per_call: bool, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.per_call = per_call

    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: jax.Array):
        count = call.variable("count", lambda: jnp.zeros((), jnp.int32), per_call=self.per_call)
        count.value = count.value + 1
        return value


class TwoCalls(gm.Brick):
    def __init__(self) -> None:
        self.lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))

    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x: jax.Array) -> jax.Array:
        return self.lin(self.lin(x))


@pytest.mark.parametrize("per_call", [False, True])
def test_owned_variables_are_shared_or_per_call(per_call: bool) -> None:
    model = TwoCalls()
    program = gm.compile(lambda m, x: m(x), model,
                         managers=[Count(per_call, bricks=[model.lin], roles=[roles.OUTPUT])])
    x = jnp.ones((1, 2))
    variables = program.init(x)
    entry = variables["managers"]["count"]["/lin"]["apply"]
    _, new = program.train(variables, x, rng=jax.random.key(0))
    counts = new["managers"]["count"]["/lin"]["apply"]
    if per_call:
        assert sorted(entry) == [0, 1]
        assert [int(counts[i]["count"]) for i in (0, 1)] == [1, 1]
    else:
        assert sorted(entry) == ["count"] and int(counts["count"]) == 2
    # Inference never updates state.
    program.infer(variables, x)
    assert program.roles(variables)["managers"]["count"]["/lin"]["apply"] == (
        {0: {"count": roles.STATE}, 1: {"count": roles.STATE}} if per_call
        else {"count": roles.STATE})


class Draw(gm.Manager):
    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: jax.Array):
        return value + jax.random.uniform(call.rng(), value.shape)


def test_axis_name_folds_the_device_index_into_randomness() -> None:
    lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
    folded = gm.compile(lambda m, x: m(x), lin, managers=[Draw(roles=[roles.OUTPUT])],
                        axis_name="devices")
    plain = gm.compile(lambda m, x: m(x), lin, managers=[Draw(roles=[roles.OUTPUT])])
    x = jnp.zeros((3, 1, 2))
    key = jax.random.key(0)
    v_folded, v_plain = folded.init(x[0]), plain.init(x[0])
    per_device = jax.vmap(lambda xi: folded.train(v_folded, xi, rng=key)[0],
                          axis_name="devices")(x)
    shared = jax.vmap(lambda xi: plain.train(v_plain, xi, rng=key)[0])(x)
    assert not np.allclose(per_device[0], per_device[1])
    np.testing.assert_allclose(shared[0], shared[1])


def test_call_rng_in_inference_raises_and_in_init_is_a_placeholder() -> None:
    lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), lin, managers=[Draw(roles=[roles.OUTPUT])])
    variables = program.init(jnp.ones((1, 2)))  # init's trace: placeholder key, no error
    message = r"inference mode \(manager 'draw', application 'apply' of /, OUTPUT 'output'\)"
    with pytest.raises(RuntimeError, match=message):
        program.infer(variables, jnp.ones((1, 2)))


def test_managers_do_nothing_outside_compile() -> None:
    lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2))
    plain = lin(x)
    with Draw(roles=[roles.OUTPUT]):
        np.testing.assert_array_equal(lin(x), plain)


class Pair(gm.Brick):
    def __init__(self) -> None:
        self.a = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
        self.b = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(1))

    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x: jax.Array) -> jax.Array:
        return self.b(self.a(x))


class AddOne(gm.Manager):
    def rewrite_output(self, call: gm.ApplicationCall, name: str, value: jax.Array):
        return value + 1


def test_a_manager_on_a_bound_application_rewrites_that_instance_only() -> None:
    model = Pair()
    x = jnp.ones((1, 2))
    bound = gm.compile(lambda m, x: m(x), model,
                       managers=[AddOne(applications=[model.a.apply], roles=[roles.OUTPUT])])
    variables = bound.init(x)
    assert [r.path for r in bound.rewrites["init"]] == ["/a"]
    np.testing.assert_allclose(bound.infer(variables, x), model.b(model.a(x) + 1), rtol=1e-6)
    unbound = gm.compile(lambda m, x: m(x), model, managers=[
        AddOne(applications=[gm.bricks.Linear.apply], roles=[roles.OUTPUT])])
    unbound.init(x)
    assert [r.path for r in unbound.rewrites["init"]] == ["/a", "/b", "/"]
