"""``bricks.Embedding``: against ``flax.nnx.Embed`` and plain indexing, eager and compiled."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
from graphmod import roles
from graphmod.bricks import Embedding
from tests.bricks.conftest import model_gradients

IDS = jnp.array([[0, 3, 9], [9, 1, 1]], jnp.int32)


def test_matches_flax_embed_and_plain_indexing() -> None:
    flax_embed = nnx.Embed(10, 4, rngs=nnx.Rngs(0))
    embed = Embedding(10, 4, rngs=nnx.Rngs(1))
    embed.W[...] = flax_embed.embedding[...]
    np.testing.assert_array_equal(embed(IDS), flax_embed(IDS))
    np.testing.assert_array_equal(embed(IDS), np.asarray(embed.W[...])[np.asarray(IDS)])
    query = jax.random.normal(jax.random.key(0), (2, 4))
    np.testing.assert_allclose(embed.attend(query), flax_embed.attend(query), rtol=1e-5, atol=1e-6)


def test_initialization_follows_flax() -> None:
    # Same key, same initializer: the same table as nnx.Embed.
    flax_embed = nnx.Embed(50, 8, rngs=nnx.Rngs(3))
    embed = Embedding(50, 8, rngs=nnx.Rngs(3))
    np.testing.assert_array_equal(embed.W[...], flax_embed.embedding[...])


def test_shapes_and_roles() -> None:
    embed = Embedding(10, 4, rngs=nnx.Rngs(0))
    assert embed.W.shape == (10, 4) and embed.W.role is roles.WEIGHT
    assert isinstance(embed.W, gm.Weight)
    assert embed(jnp.int32(3)).shape == (4,)
    assert embed(IDS).shape == (2, 3, 4)
    assert embed(IDS.astype(jnp.uint8)).shape == (2, 3, 4)


def test_eager_compiled_and_jitted_agree() -> None:
    embed = Embedding(10, 4, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, ids: m.attend(m(ids)), embed)
    variables = program.init(IDS)
    eager = embed.attend(embed(IDS))
    np.testing.assert_allclose(program.infer(variables, IDS), eager, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda i: embed.attend(embed(i)))(IDS), eager,
                               rtol=1e-5, atol=1e-6)
    out = jax.vmap(lambda i: program.infer(variables, i))(jnp.stack([IDS, IDS[::-1]]))
    np.testing.assert_allclose(out[1], embed.attend(embed(IDS[::-1])), rtol=1e-5, atol=1e-6)
    assert program.roles(variables)["model"] == {"W": roles.WEIGHT}


def test_weight_managers_rewrite_the_table_in_both_applications() -> None:
    embed = Embedding(10, 4, rngs=nnx.Rngs(0))

    class Negate(gm.Manager):
        def rewrite_parameter(self, call: Any, name: str, value: jax.Array) -> jax.Array:
            return -value

    with Negate(roles=[roles.WEIGHT], applications=["apply"]):
        program = gm.compile(lambda m, ids: m.attend(m(ids)), embed)
    variables = program.init(IDS)
    # apply reads -W, attend reads W itself: the rewrite belongs to one application call.
    np.testing.assert_allclose(program.infer(variables, IDS), -embed.attend(embed(IDS)),
                               rtol=1e-5, atol=1e-6)
    assert [(r.application, r.name) for r in program.rewrites["infer"]] == [("apply", "W")]


def test_train_gradients_reach_only_looked_up_rows() -> None:
    embed = Embedding(10, 4, rngs=nnx.Rngs(0))
    grads, variables = model_gradients(lambda m, ids: (m(ids) ** 2).sum(), embed, IDS)
    grad = np.asarray(grads["W"])
    table = np.asarray(variables["model"]["W"])
    counts = np.bincount(np.asarray(IDS).ravel(), minlength=10)[:, None]
    np.testing.assert_allclose(grad, 2.0 * counts * table, rtol=1e-5, atol=1e-6)
    assert not np.any(grad[[2, 4, 5, 6, 7, 8]])


@pytest.mark.parametrize(("args", "message"), [
    ((0, 4), r"num_embeddings=0"),
    ((10, -1), r"features=-1"),
    ((10.0, 4), r"num_embeddings=10.0"),
])
def test_bad_constructor_arguments_are_named(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Embedding(*args, rngs=nnx.Rngs(0))


def test_float_ids_and_bad_queries_are_named() -> None:
    embed = Embedding(10, 4, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"input_ must hold integer ids, got dtype float32"):
        embed(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"query of shape \(2, 3\).*features=4"):
        embed.attend(jnp.ones((2, 3)))
