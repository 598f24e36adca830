"""Calling a brick calls its ``apply`` (the subclass's own), a ``__call__`` of the user's is
kept, and few frames stand between a model's call and a brick method inside a program."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles


class Double(gm.Brick):
    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x):
        return 2 * x


class Triple(Double):
    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x):
        return 3 * x


class Custom(Double):
    def __call__(self, x):
        return self.apply(x) + 1


class CustomChild(Custom):
    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x):
        return 5 * x


class Nothing(gm.Brick):
    pass


def test_call_is_the_classes_own_apply() -> None:
    x = jnp.ones(2)
    assert Double()(x).tolist() == [2.0, 2.0]
    assert Triple()(x).tolist() == [3.0, 3.0]  # the subclass's apply, not the parent's


def test_a_defined_call_is_kept_in_subclasses() -> None:
    x = jnp.ones(2)
    assert Custom()(x).tolist() == [3.0, 3.0]
    assert CustomChild()(x).tolist() == [6.0, 6.0]  # Custom.__call__ over the child's apply


def test_a_brick_without_apply_says_so() -> None:
    with pytest.raises(TypeError, match="Nothing has no `apply` application"):
        Nothing()(jnp.ones(2))


def test_a_call_is_an_application_managers_rewrite() -> None:
    program = gm.compile(lambda m, x: m(x), Triple(),
                         managers=[managers.GaussianNoise(1.0, roles=[roles.OUTPUT])])
    variables = program.init(jnp.ones(3))
    out, _ = program.train(variables, jnp.ones(3), rng=nnx.Rngs(0)())
    assert not jnp.allclose(out, 3.0)  # the noise rewrote apply's output
    assert program.infer(variables, jnp.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert {r.tag.name for r in program.graph(jnp.ones(3)).outputs} == {"y"}


def test_few_frames_between_a_models_call_and_a_brick_method() -> None:
    depths: list[int] = []

    class Inner(gm.Brick):
        @gm.application(inputs=["x"], outputs=["y"])
        def apply(self, x):
            frame, depth = inspect.currentframe(), 0
            while frame is not None and frame.f_code.co_name != "model_fn":
                frame, depth = frame.f_back, depth + 1
            depths.append(depth)
            return x

    class Outer(gm.Brick):
        def __init__(self):
            self.inner = Inner()

        @gm.application(inputs=["x"], outputs=["y"])
        def apply(self, x):
            return self.inner(x)

    def model_fn(model, x):
        return model(x)

    gm.compile(model_fn, Outer()).init(jnp.ones(2))
    # Per level: Brick.__call__, the application's wrapper, Chain.run, the chain's
    # innermost layer and the method: JAX records the whole stack of every equation, at a
    # cost per frame.
    assert depths and depths[-1] == 10, depths
