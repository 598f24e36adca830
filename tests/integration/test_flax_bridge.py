"""Linen modules inside an NNX model through Flax's ``nnx.bridge.ToNNX``, as Flax's guide
"Use Flax NNX and Linen together" writes them: a ``ToNNX`` module is one application, its
Linen parameters are its variables (shown by their place, ``Dense_0.kernel``), and its
``apply(..., mutable=["batch_stats"])`` updates (a new dict of variables rebinding its
collection) are program state.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._tracing._frame import crc32
from tests.integration.test_flax_transforms import assert_trees_close

TOL = {"rtol": 1e-5, "atol": 1e-5}
X = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
KEY = jax.random.key(3)


def loss(model: Any, x: jax.Array) -> jax.Array:
    return (model(x) ** 2).mean()


class PlainLinen(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


class PlainBridged(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.body = nnx.bridge.ToNNX(PlainLinen(), rngs=rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.body(x))


def plain_bridged() -> PlainBridged:
    model = PlainBridged(nnx.Rngs(0))
    nnx.bridge.lazy_init(model.body, X)
    return model


def test_linen_modules_through_the_nnx_bridge_take_managers_like_nnx_modules() -> None:
    model = plain_bridged()
    noise = managers.WeightNoise(0.1, roles=[roles.WEIGHT])
    program = gm.compile(loss, model, managers=[noise])
    variables = program.init(X)
    out, _ = program.train(variables, X, rng=KEY)
    # Each Linen kernel is shown by its place in the ToNNX module.
    assert sorted((r.path, r.name, r.role, r.shape_in) for r in program.rewrites["train"]) == [
        ("/body", "Dense_0.kernel", "WEIGHT", (8, 3)),  # Linen names layers as it builds them
        ("/body", "Dense_1.kernel", "WEIGHT", (4, 8)), ("/head", "kernel", "WEIGHT", (3, 2))]
    assert "Dense_1.kernel" in str(program.graph(X))

    # By hand: Flax's own model with the same noise on its kernels, then eagerly as before.
    noisy = nnx.clone(model)
    for path, kernel in (("/body/Dense_0.kernel", noisy.body.Dense_0["kernel"]),
                         ("/body/Dense_1.kernel", noisy.body.Dense_1["kernel"]),
                         ("/head.kernel", noisy.head.kernel)):
        key = jax.random.fold_in(KEY, crc32(f"weight_noise|{path}||WEIGHT|kernel#0"))
        kernel[...] += 0.1 * jax.random.normal(key, kernel.shape)
    np.testing.assert_allclose(out, loss(noisy, X), **TOL)
    np.testing.assert_allclose(program.infer(variables, X), loss(model, X), **TOL)
    with managers.WeightNoise(0.1, roles=[roles.WEIGHT], path="/body/Dense_1*"):
        one = gm.compile(loss, model)  # a Linen layer selected by its place
    one.train(one.init(X), X, rng=KEY)
    assert [r.name for r in one.rewrites["train"]] == ["Dense_1.kernel"]


def test_a_bridged_linen_model_trains_and_writes_back_into_the_nnx_module() -> None:
    model = plain_bridged()
    program = gm.compile(loss, model, managers=[
        managers.Dropout(0.2, bricks=[model.body], roles=[roles.INPUT])])
    variables = program.init(X)
    step = gm.optimize(program, optax.adam(3e-2))
    state = step.init(variables, KEY)
    first = float(program.infer(variables, X))
    for _ in range(20):
        state, _ = step(state, X)
    trained = float(program.infer(state.variables, X))
    assert trained < 0.5 * first
    program.update_model(state.variables)
    np.testing.assert_allclose(loss(model, X), trained, **TOL)  # eagerly, through Linen
    np.testing.assert_array_equal(model.body.Dense_0["kernel"][...],
                                  state.variables["model"]["body"]["Dense_0"]["kernel"])
    assert jnp.isfinite(trained)


class LinenBody(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(4)(nn.relu(x))


class Bridged(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, mutable: bool | tuple[str, ...]) -> None:
        self.body = nnx.bridge.ToNNX(LinenBody(), rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)
        self.mutable = mutable

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        mutable = (self.mutable if isinstance(self.mutable, bool) else list(self.mutable)
                   ) if train else False
        return self.head(nnx.relu(self.body(x, train, mutable=mutable)))


def bridged(mutable: bool | tuple[str, ...] = ("batch_stats",)) -> Bridged:
    model = Bridged(nnx.Rngs(0, dropout=1), mutable)
    nnx.bridge.lazy_init(model.body, X, False)
    return model


def train_loss(model: Any, x: jax.Array) -> jax.Array:
    return (model(x, True) ** 2).mean()


# mutable=True: Linen returns every collection, its parameters as it read them.
@pytest.mark.parametrize("mutable", [("batch_stats",), True])
def test_linen_batch_norm_and_dropout_train_in_a_program_as_in_eager_flax(
        mutable: bool | tuple[str, ...]) -> None:
    model = bridged(mutable)
    program = gm.compile(train_loss, model)
    variables = program.init(X)
    (out, trained), grads = jax.value_and_grad(
        lambda v: program.train(v, X, rng=KEY), has_aux=True, allow_int=True)(variables)
    eager = nnx.clone(model)
    expected, eager_grads = nnx.jit(nnx.value_and_grad(train_loss))(eager, X)
    np.testing.assert_allclose(out, expected, **TOL)
    # The batch statistics Linen's BatchNorm updated and the dropout stream's count.
    assert_trees_close(trained["model"], nnx.to_pure_dict(nnx.state(eager)))
    assert not np.allclose(trained["model"]["body"]["BatchNorm_0"]["mean"], 0.0)
    flat = dict(nnx.traversals.flatten_mapping(grads["model"]))
    for path, grad in nnx.traversals.flatten_mapping(nnx.to_pure_dict(eager_grads)).items():
        np.testing.assert_allclose(flat[path], grad, **TOL, err_msg=str(path))
    # The model keeps its own dict and variables, unchanged.
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)),
                       nnx.to_pure_dict(nnx.state(bridged(mutable))))
    predict = program.derive(lambda m, x: m(x, False))
    evaluated = nnx.clone(eager)
    np.testing.assert_allclose(predict.infer(trained, X), evaluated(X, False), **TOL)


def test_noisy_linen_parameters_returned_by_mutable_true_are_not_written() -> None:
    model = bridged(True)
    with managers.WeightNoise(0.1, roles=[roles.WEIGHT]):
        program = gm.compile(train_loss, model)
    variables = program.init(X)
    out, trained = program.train(variables, X, rng=KEY)
    quiet = gm.compile(train_loss, model)
    assert not np.allclose(out, quiet.train(variables, X, rng=KEY)[0])  # the noise acts
    for layer in ("Dense_0", "Dense_1"):  # as stored, not as the noisy read Linen returned
        np.testing.assert_array_equal(trained["model"]["body"][layer]["kernel"],
                                      variables["model"]["body"][layer]["kernel"])
    assert not np.allclose(trained["model"]["body"]["BatchNorm_0"]["mean"], 0.0)


class Holder(nnx.Module):
    """Keeps running statistics in a dict and rebinds it, as ToNNX does its collections."""

    def __init__(self, rebind: Any) -> None:
        self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.stats = nnx.data({"mean": nnx.BatchStat(jnp.zeros(3)),
                               "scale": nnx.Param(jnp.ones(3))})
        self.rebind = rebind

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.linear(x) * self.stats["scale"][...]
        self.stats = nnx.data(self.rebind(self.stats, y.mean(0)))
        return y


@pytest.mark.parametrize(("rebind", "expected"), [
    (lambda s, m: {"mean": nnx.BatchStat(m), "other": nnx.BatchStat(m)},
     r"/stats was rebound in a program to a container with variables at \['mean'\], "
     r"\['other'\] in place of \['mean'\], \['scale'\]: rebind it only with"),
    (lambda s, m: {**s, "mean": nnx.BatchStat(m[:2])},
     r"/stats\['mean'\] was rebound in a program to BatchStat \(2,\) float32 in place of "
     r"BatchStat \(3,\) float32: rebind it only"),
    (lambda s, m: {**s, "scale": nnx.Param(m)},
     r"/stats\['scale'\] was rebound .* a parameter, which a forward pass does not write"),
], ids=["other places", "other shape", "a parameter"])
def test_a_rebinding_that_is_no_update_is_refused_naming_the_place(rebind: Any,
                                                                   expected: str) -> None:
    model = Holder(rebind)
    stats = model.stats
    with pytest.raises(TypeError, match=expected):
        gm.compile(lambda m, x: m(x).sum(), model).init(X)
    assert model.stats is stats and float(jnp.abs(stats["mean"][...]).max()) == 0.0


def test_a_rebinding_with_new_variables_at_the_same_places_writes_their_values() -> None:
    model = Holder(lambda s, m: {**s, "mean": nnx.BatchStat(m)})
    stats = model.stats
    program = gm.compile(lambda m, x: m(x).sum(), model)
    _, trained = program.train(program.init(X), X, rng=KEY)
    eager = nnx.clone(model)
    np.testing.assert_allclose(trained["model"]["stats"]["mean"],
                               eager.linear(X).mean(0), **TOL)
    assert model.stats is stats and float(jnp.abs(stats["mean"][...]).max()) == 0.0
