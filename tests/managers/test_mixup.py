"""Mixup: one mixing weight and one permutation per call, shared by inputs and targets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import graphmod as gm
import managers
from tests.managers.helpers import key, normal
from tests.test_application_roles import Classifier  # a Linear(3, 4) and its cost


class Joined(gm.Brick):
    """``[x, y]`` side by side: what a selected call's inputs and targets became."""

    @gm.application(inputs=["x"], targets=["y"], outputs=["joined"])
    def apply(self, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.concatenate([x, y], axis=-1)


def joined_program(alpha: float | gm.Dynamic = 0.4) -> gm.Program:
    return gm.compile(lambda m, x, y: m(x, y), Joined(),
                      managers=[managers.Mixup(alpha, bricks=[Joined])])


def test_inputs_and_targets_are_mixed_with_one_weight_and_one_permutation() -> None:
    x = normal(0, 16, 4)
    relation = np.asarray(normal(1, 4, 3))
    y = x @ relation  # a linear relation survives only a shared weight and permutation
    program = joined_program()
    variables = program.init(x, y)
    for seed in range(3):
        out, _ = program.train(variables, x, y, rng=key(seed))
        mixed_x, mixed_y = np.asarray(out[:, :4]), np.asarray(out[:, 4:])
        assert not np.allclose(mixed_x, x)
        np.testing.assert_allclose(mixed_y, mixed_x @ relation, rtol=1e-4, atol=1e-5)
        # a convex mix of a permutation of the batch keeps the batch's mean
        np.testing.assert_allclose(mixed_x.mean(0), np.asarray(x).mean(0), atol=1e-5)
    np.testing.assert_array_equal(program.infer(variables, x, y),
                                  np.concatenate([x, y], axis=-1))
    assert [(r.manager, r.name) for r in program.rewrites.train] == [
        ("mixup", "x"), ("mixup", "y")]


def test_the_mixing_weight_follows_beta_alpha_alpha() -> None:
    x = np.zeros((16, 1), np.float32)
    x[0, 0] = 1.0  # row 0 alone: its mixed value shows lam (or 1 - lam, where it is drawn)
    program = joined_program(gm.dynamic(1.0))  # Beta(1, 1): uniform
    variables = program.init(x, x)
    largest = []
    for seed in range(300):
        out = np.asarray(program.train(variables, x, x, rng=key(seed))[0][:, 0])
        if not np.isclose(out.max(), 1.0):  # row 0 was not paired with itself
            largest.append(out.max())
    assert len(largest) > 250
    np.testing.assert_allclose(np.mean(largest), 0.75, atol=0.04)  # max(lam, 1 - lam)
    tight = program.managers[0].hparam("alpha").set(variables, 200.0)  # lam near 1/2
    out = np.asarray(program.train(tight, x, x, rng=key(0))[0][:, 0])
    assert out.max() < 0.6 or np.isclose(out.max(), 1.0)


def test_a_classifier_with_integer_labels_trains_on_mixed_one_hot_targets() -> None:
    labels = jnp.array([0, 1, 2, 3, 0, 1, 2, 3])
    x = normal(2, 8, 3)
    program = gm.compile(lambda m, x, y: m(x, y), Classifier(),
                         managers=[managers.Mixup(0.2, num_classes=4, bricks=[Classifier])])
    step = gm.optimize(program, optax.sgd(0.5))
    state = step.init(program.init(x, labels), key(0))
    losses = []
    for _ in range(5):
        state, metrics = step(state, x, labels)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    assert {r.shape_out for r in program.rewrites.train if r.name == "y"} == {(8, 4)}


def test_bad_configurations_name_the_fix() -> None:
    with pytest.raises(TypeError, match=r"bricks=, applications= or path="):
        managers.Mixup(0.2)
    with pytest.raises(ValueError, match=r"alpha=0.*float > 0"):
        managers.Mixup(0.0, bricks=[Joined])
    with pytest.raises(ValueError, match=r"num_classes=1"):
        managers.Mixup(0.2, num_classes=1, bricks=[Joined])
    labels = jnp.array([0, 1, 2, 0])
    program = joined_program()
    with pytest.raises(ValueError, match=r"'y' of / holds integer labels; pass num_classes="):
        program.init(normal(0, 4, 2), labels)
    ids = gm.compile(lambda m, x, y: m(x, y), Joined(),
                     managers=[managers.Mixup(0.2, num_classes=3, bricks=[Joined])])
    with pytest.raises(TypeError, match=r"Mixup 'mixup' selected INPUT 'x' .* of dtype int32"):
        ids.init(labels[:, None], labels)
