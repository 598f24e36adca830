"""Managers on Flax's ensembles: members made and called under ``nnx.vmap``.

Each member draws its own masks and holds its own manager variables (one slice per member,
stacked on the first axis like the members' own parameters); what it computes is what a
program over that member alone computes with that slice.
"""

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
from graphmod import roles
from graphmod._core._loops import _loop_keys, _loop_resolution

MEMBERS = 3
KEY = jax.random.key(5)
X = np.random.default_rng(1).normal(size=(6, 4)).astype(np.float32)
TOL = {"rtol": 1e-5, "atol": 1e-6}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(jax.nn.relu(self.l1(x)))


class Ensemble(nnx.Module):
    """Flax's ensemble (the NNX transforms guide): members made and called by nnx.vmap."""

    def __init__(self, members: int = MEMBERS) -> None:
        @nnx.split_rngs(splits=members)
        @nnx.vmap(in_axes=0, out_axes=0)
        def create(rngs: nnx.Rngs) -> MLP:
            return MLP(rngs)

        self.members = create(nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Every member's output, stacked: ``(members, batch, 2)``."""
        return nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(self.members, x)


def member(ensemble: Ensemble, i: int) -> MLP:
    """Member ``i`` as a model of its own, with that member's parameters."""
    alone = MLP(nnx.Rngs(9))
    nnx.update(alone, jax.tree.map(lambda a: a[i], nnx.state(ensemble.members)))
    return alone


def slice_of(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda a: a[i], tree)


def loss(model: nnx.Module, x: jax.Array) -> jax.Array:
    return (model(x) ** 2).sum()


@pytest.mark.parametrize("per_step", [True, False])
def test_each_member_draws_its_own_dropout_mask(per_step: bool) -> None:
    dropout = managers.Dropout(0.5, bricks=[nnx.Linear], roles=[roles.OUTPUT],
                               per_step=per_step)
    program = gm.compile(lambda m, x: m(x), Ensemble(), managers=[dropout])
    out, _ = program.train(program.init(X), X, rng=KEY)
    kept = np.asarray(out) != 0
    assert 0.2 < kept.mean() < 0.8
    for i in range(1, MEMBERS):
        assert (kept[i] != kept[0]).any(), f"member {i} drew member 0's mask"
    again, _ = program.train(program.init(X), X, rng=KEY)
    np.testing.assert_array_equal(again, out)  # the step key sets every member's draw


def test_each_member_draws_its_own_weight_noise() -> None:
    noise = managers.WeightNoise(0.5, roles=[roles.WEIGHT])
    ensemble = Ensemble()
    program = gm.compile(lambda m, x: m(x), ensemble, managers=[noise])
    variables = program.init(X)
    moved = program.train(variables, X, rng=KEY)[0] - program.infer(variables, X)
    for i in range(1, MEMBERS):
        assert not np.allclose(moved[i], moved[0]), f"member {i} drew member 0's noise"


def test_a_draw_under_vmap_is_folded_with_the_mapped_index_outer_vmaps_first() -> None:
    def draw(w: jax.Array) -> jax.Array:
        return jax.random.uniform(_loop_keys.mark(KEY, [w]))

    drawn = _loop_resolution.resolving(lambda w: jax.vmap(jax.vmap(draw))(w))(jnp.zeros((2, 3)))
    expected = [[jax.random.uniform(jax.random.fold_in(jax.random.fold_in(KEY, i), j))
                 for j in range(3)] for i in range(2)]
    np.testing.assert_array_equal(drawn, expected)
    # Unmapped witnesses leave the key as it is (a layer every element shares).
    shared = jax.vmap(lambda x: draw(jnp.zeros(())) + x)(jnp.zeros(2))
    np.testing.assert_array_equal(shared, [jax.random.uniform(KEY)] * 2)


def test_batch_norm_keeps_running_statistics_per_member_as_each_member_alone() -> None:
    ensemble = Ensemble()

    def norm() -> managers.BatchNorm:
        return managers.BatchNorm(bricks=[nnx.Linear], roles=[roles.OUTPUT])

    program = gm.compile(lambda m, x: m(x), ensemble, managers=[norm()])
    variables = program.init(X)
    owned = variables["managers"]["batch_norm"]["/members/l1"]["apply"]
    assert owned["output.mean"].shape == (MEMBERS, 8)
    out, updated = program.train(variables, X, rng=KEY)
    for i in range(MEMBERS):
        alone = gm.compile(lambda m, x: m(x), member(ensemble, i), managers=[norm()])
        own = alone.init(X)
        own["managers"]["batch_norm"] = {
            path.replace("/members", ""): slice_of(by_app, i)
            for path, by_app in variables["managers"]["batch_norm"].items() if path != "hparams"
        } | {"hparams": own["managers"]["batch_norm"]["hparams"]}
        out_i, updated_i = alone.train(own, X, rng=KEY)
        np.testing.assert_allclose(out[i], out_i, **TOL)
        for layer in ("l1", "l2"):
            np.testing.assert_allclose(
                updated["managers"]["batch_norm"][f"/members/{layer}"]["apply"]["output.mean"][i],
                updated_i["managers"]["batch_norm"][f"/{layer}"]["apply"]["output.mean"], **TOL)


def test_lora_gives_each_member_its_own_adapters_and_their_own_gradients() -> None:
    ensemble = Ensemble()
    program = gm.compile(loss, ensemble, managers=[managers.LoRA(rank=2)])
    variables = program.init(X)
    adapters = variables["managers"]["lora"]["/members/l1"]["kernel"]
    assert adapters["a"].shape == (MEMBERS, 4, 2) and adapters["b"].shape == (MEMBERS, 2, 8)
    for i in range(1, MEMBERS):
        assert not np.allclose(adapters["a"][i], adapters["a"][0]), "members share LoRA's A"
    # Give B values so A's gradients are not zero, then compare with each member alone.
    lora = jax.tree.map(lambda a: a + 0.1, variables["managers"]["lora"])
    variables = {**variables, "managers": {**variables["managers"], "lora": lora}}
    grads = jax.grad(lambda v: program.train(v, X, rng=KEY)[0])(variables)["managers"]["lora"]
    for i in range(MEMBERS):
        alone = gm.compile(loss, member(ensemble, i), managers=[managers.LoRA(rank=2)])
        own = alone.init(X)
        own["managers"]["lora"] = {path.replace("/members", ""): slice_of(tree, i)
                                   for path, tree in lora.items() if path != "hparams"
                                   } | {"hparams": own["managers"]["lora"]["hparams"]}
        grads_i = jax.grad(lambda v, p=alone: p.train(v, X, rng=KEY)[0])(own)["managers"]["lora"]
        for layer in ("l1", "l2"):
            for name in ("a", "b"):
                np.testing.assert_allclose(grads[f"/members/{layer}"]["kernel"][name][i],
                                           grads_i[f"/{layer}"]["kernel"][name], **TOL)


def test_a_variable_from_a_parameter_is_one_per_member() -> None:
    ensemble = Ensemble()
    program = gm.compile(lambda m, x: m(x), ensemble, managers=[managers.WeightNorm()])
    variables = program.init(X)
    g = variables["managers"]["weight_norm"]["/members/l1"]["kernel"]["g"]
    np.testing.assert_allclose(g, jnp.linalg.norm(ensemble.members.l1.kernel[...], axis=1),
                               **TOL)
    out, _ = program.train(variables, X, rng=KEY)  # W * g / ||W|| = W at init
    np.testing.assert_allclose(out, ensemble(X), **TOL)


def test_a_cost_sums_over_members_and_a_measurement_is_one_per_member() -> None:
    ensemble = Ensemble()
    stats = managers.ActivationStats(bricks=[nnx.Linear], statistics=["mean"])
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), ensemble,
                         managers=[managers.L2(0.1), stats])
    step = gm.optimize(program, optax.sgd(0.1))
    _, metrics = step(step.init(program.init(X), KEY), X)
    kernels = [ensemble.members.l1.kernel[...], ensemble.members.l2.kernel[...]]
    np.testing.assert_allclose(metrics["l2"], 0.1 * sum((k ** 2).sum() for k in kernels),
                               rtol=1e-5)
    mean = metrics["activation_stats:/members/l1.apply.output.mean"]
    assert np.shape(mean) == (MEMBERS,)
    for i in range(MEMBERS):
        alone = member(ensemble, i)
        np.testing.assert_allclose(mean[i], alone.l1(X).mean(), **TOL)


def test_state_under_a_vmap_that_shares_the_layer_is_refused_naming_it() -> None:
    layer = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    norm = managers.BatchNorm(bricks=[nnx.Linear], roles=[roles.OUTPUT])
    program = gm.compile(lambda m, x: nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, x),
                         layer, managers=[norm])
    with pytest.raises(gm.errors.StateEscapesTransform,
                       match=r"batch_norm variable 'output.mean', shared by every .*"
                             r"\(every element of a vmap that leaves the module whole"):
        program.train(program.init(X[None]), X[None], rng=KEY)


@pytest.mark.parametrize("case", ["layer shared", "layer also in loops"])
def test_a_slice_under_vmap_is_refused_unless_the_vmap_alone_maps_the_layer(case: str) -> None:
    key = ("m", "/members", "apply", None, "s")
    shared = case == "layer shared"

    def write(w: jax.Array) -> None:  # a value per element, of a layer stacked over 1 or 2
        _loop_keys.write_slice(w.sum(), key, 1 if shared else 2, [jnp.zeros(2)] if shared
                               else [w])

    message = ("does not map the layer's own variables" if shared else
               "belongs to a layer that a vmap maps .* stacked over 2 axes")
    with pytest.raises(gm.errors.StateEscapesTransform,
                       match=r"m variable 's' of /members\.apply.*" + message):
        jax.make_jaxpr(jax.vmap(write))(jnp.zeros((3, 2)))


class WithOwnDropout(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)  # no stream: the program's step key sets the masks

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.linear(x))


def test_flax_dropout_inside_the_members_draws_a_mask_per_member() -> None:
    @nnx.split_rngs(splits=MEMBERS)
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs: nnx.Rngs) -> WithOwnDropout:
        return WithOwnDropout(rngs)

    program = gm.compile(lambda m, x: nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(m, x),
                         create(nnx.Rngs(0)))
    out, _ = program.train(program.init(X), X, rng=KEY)
    kept = np.asarray(out) != 0
    assert 0.2 < kept.mean() < 0.8
    for i in range(1, MEMBERS):
        assert (kept[i] != kept[0]).any(), f"member {i} drew member 0's mask"
