"""Keys drawn in loop bodies that JAX traces once get each iteration's index folded in."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._loops import _loop_resolution
from graphmod._core._loops._loop_keys import mark
from graphmod._core._loops._loop_resolution import resolving

KEY = jax.random.key(5)
X = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)


def uniform(key: jax.Array) -> jax.Array:
    return jax.random.uniform(key, (3,))


def draws_at(key: jax.Array, *indices: int) -> jax.Array:
    return uniform(functools.reduce(jax.random.fold_in, indices, key))


# -- the mechanism on plain JAX loops ----------------------------------------------------------
@pytest.mark.parametrize("reverse", [False, True])
def test_a_scan_draws_fold_in_of_each_position_in_xs(reverse: bool) -> None:
    def f(key: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, _: (c, uniform(mark(key))), 0, length=4,
                            reverse=reverse)[1]

    ys = jax.jit(resolving(f))(KEY)
    np.testing.assert_array_equal(ys, jnp.stack([draws_at(KEY, i) for i in range(4)]))


def test_nested_loops_fold_the_outer_index_first_and_a_while_loop_counts_from_zero() -> None:
    def f(key: jax.Array, n: jax.Array) -> jax.Array:
        def layer(c: Any, _: Any) -> tuple[Any, jax.Array]:
            def step(state: tuple) -> tuple:
                i, total = state
                return i + 1, total + uniform(mark(key)) * 10.0 ** i
            return c, jax.lax.while_loop(lambda s: s[0] < n, step, (0, jnp.zeros(3)))[1]
        return jax.lax.scan(layer, 0, length=2)[1]

    ys = jax.jit(resolving(f))(KEY, jnp.int32(3))
    expected = [sum(draws_at(KEY, i, j) * 10.0 ** j for j in range(3)) for i in range(2)]
    np.testing.assert_allclose(ys, jnp.stack(expected), rtol=1e-6)


def test_markers_in_cond_jit_and_remat_inside_a_loop_are_resolved() -> None:
    def f(key: jax.Array) -> jax.Array:
        def body(c: Any, i: jax.Array) -> tuple[Any, jax.Array]:
            draw = jax.checkpoint(lambda k: uniform(mark(k)))
            nested = jax.jit(lambda k: jax.lax.cond(i > 0, draw, lambda k: -draw(k), k))
            return c, nested(key)
        return jax.lax.scan(body, 0, jnp.arange(3))[1]

    ys = resolving(f)(KEY)
    np.testing.assert_array_equal(ys, jnp.stack([(1 if i else -1) * draws_at(KEY, i)
                                                 for i in range(3)]))
    assert "loop_key" not in str(jax.make_jaxpr(resolving(f))(KEY))


def test_outside_loops_and_under_vmap_a_marked_key_is_the_key() -> None:
    f = resolving(lambda key, x: (uniform(mark(key)),
                                  jax.vmap(lambda x: uniform(mark(key)) + x)(x)))
    alone, mapped = f(KEY, jnp.zeros(2))
    np.testing.assert_array_equal(alone, uniform(KEY))
    np.testing.assert_array_equal(mapped, jnp.stack([uniform(KEY)] * 2))


def test_gradients_flow_through_a_resolved_function() -> None:
    def f(w: jax.Array, key: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, _: (c * uniform(mark(key)).sum(), None), w, length=2)[0]

    grad = jax.grad(resolving(f))(2.0, KEY)
    np.testing.assert_allclose(grad, draws_at(KEY, 0).sum() * draws_at(KEY, 1).sum(),
                               rtol=1e-6)


def test_a_function_without_markers_keeps_its_jaxpr_and_is_then_traced_as_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def f(x: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, x: (c + x, 2 * x), 0.0, x)[0]

    resolved = resolving(f)
    assert str(jax.make_jaxpr(resolved)(jnp.ones(3))) == str(jax.make_jaxpr(f)(jnp.ones(3)))
    evaluated = []
    monkeypatch.setattr(_loop_resolution, "_evaluate", lambda *a: evaluated.append(a))
    assert str(jax.make_jaxpr(resolved)(jnp.ones(4))) == str(jax.make_jaxpr(f)(jnp.ones(4)))
    assert evaluated == []


# -- in programs -------------------------------------------------------------------------------
class Stack(nnx.Module):
    """Three layers of a linear map scanned over (``nnx.scan``), optionally rematerialised."""

    def __init__(self, remat: bool = False) -> None:
        self.remat = remat

        @nnx.split_rngs(splits=3)
        @nnx.vmap(axis_size=3)
        def create(rngs: nnx.Rngs) -> nnx.Linear:
            return nnx.Linear(4, 4, rngs=rngs)

        self.layers = create(nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        def layer(x: jax.Array, linear: nnx.Linear) -> tuple[jax.Array, None]:
            apply = nnx.remat(lambda m, x: m(x)) if self.remat else (lambda m, x: m(x))
            return jnp.tanh(apply(linear, x)), None

        return nnx.scan(layer)(x, self.layers)[0]


def dropout_program(model: nnx.Module) -> gm.Program:
    drop = managers.Dropout(0.5, bricks=[nnx.Linear], roles=[roles.OUTPUT])
    return gm.compile(lambda m, x: (m(x) ** 2).mean(), model, managers=[drop])


def test_remat_inside_a_scan_body_gives_the_gradients_of_the_same_step_without_remat() -> None:
    plain, rematerialised = dropout_program(Stack()), dropout_program(Stack(remat=True))
    variables = plain.init(X)
    rematerialised.init(X)
    assert "remat" in str(jax.make_jaxpr(rematerialised._train_traced)(variables, KEY, (X,), {}))
    results = [jax.value_and_grad(lambda v, p=p: p.train(v, X, rng=KEY)[0])(variables)
               for p in (plain, rematerialised)]
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Three different masks: a loss unlike the one of one mask for every layer.
    same_mask = dropout_program(Stack())
    same_mask._train_traced = functools.partial(gm.Program._train_traced, same_mask)
    same_mask.init(X)
    assert not np.allclose(same_mask._train_traced(variables, KEY, (X,), {})[0], results[0][0])


def test_a_program_without_randomness_in_loops_has_the_jaxpr_it_had_before() -> None:
    def jaxprs(program: gm.Program) -> tuple[str, str]:
        variables = program.init(X)
        args = (variables, KEY, (X,), {})
        unresolved = functools.partial(gm.Program._train_traced, program)
        return (str(jax.make_jaxpr(program._train_traced)(*args)),
                str(jax.make_jaxpr(unresolved)(*args)))

    resolved, before = jaxprs(gm.compile(lambda m, x: (m(x) ** 2).mean(), Stack()))
    assert resolved == before
    rate_zero = managers.Dropout(0.0, bricks=[nnx.Linear], roles=[roles.OUTPUT])
    resolved, before = jaxprs(gm.compile(lambda m, x: (m(x) ** 2).mean(), Stack(),
                                         managers=[rate_zero]))
    assert resolved == before
    resolved, before = jaxprs(dropout_program(Stack()))
    assert "loop_key" in before and "loop_key" not in resolved


def test_graphmod_scan_keeps_its_own_step_index_and_adds_no_marker() -> None:
    rnn = gm.bricks.SimpleRecurrent(4, 5, rngs=nnx.Rngs(0))
    drop = managers.Dropout(0.5, bricks=[rnn], applications=["step"], roles=[roles.INPUT])
    program = gm.compile(lambda m, xs: m(xs).sum(), rnn, managers=[drop])
    xs = np.ones((2, 5, 4), np.float32)
    variables = program.init(xs)
    jaxpr = str(jax.make_jaxpr(program._train_traced)(variables, KEY, (xs,), {}))
    assert "loop_key" not in jaxpr and "bernoulli" in jaxpr


def test_optimize_steps_draw_per_layer_as_program_train_does() -> None:
    program = dropout_program(Stack())
    variables = program.init(X)
    step = gm.optimize(program, optax.sgd(0.1))
    _, metrics = step(step.init(variables, jax.random.key(11)), X)  # donates its state
    key = jax.random.fold_in(jax.random.key(11), 0)  # the state's key, folded with the step
    np.testing.assert_allclose(metrics["loss"], program.train(variables, X, rng=key)[0],
                               rtol=1e-6)
    unresolved = functools.partial(gm.Program._train_traced, program)
    assert not np.allclose(metrics["loss"], unresolved(variables, key, (X,), {})[0])


def test_a_key_not_folded_with_loops_is_never_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    evaluated = []
    monkeypatch.setattr(_loop_resolution, "_evaluate", lambda *a: evaluated.append(a))
    f = resolving(lambda key: jax.lax.scan(
        lambda c, _: (c, uniform(mark(key, loops=False))), 0, length=3)[1])
    np.testing.assert_array_equal(f(KEY), jnp.stack([uniform(KEY)] * 3))
    assert evaluated == []  # traced as it is: only a vmap folds such a key
