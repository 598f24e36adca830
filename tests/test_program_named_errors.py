"""The program's refusals raise graphmod's named errors (messages as before)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles

X = jnp.ones((8, 4))


def _mlp(hidden: int = 5) -> gm.bricks.MLP:
    return gm.bricks.MLP([4, hidden, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))


def test_a_strict_manager_that_matches_nothing_raises_manager_matched_nothing() -> None:
    with managers.Dropout(0.5, roles=[roles.COST]):
        program = gm.compile(lambda m, x: m(x).sum(), _mlp())
    with pytest.raises(gm.errors.ManagerMatchedNothing, match=r"'dropout'.*matched nothing"):
        program.init(X)


def test_two_managers_with_one_name_raise_manager_conflict() -> None:
    with pytest.raises(gm.errors.ManagerConflict, match=r"two managers are named 'dropout'"):
        gm.compile(lambda m, x: m(x).sum(), _mlp(),
                   managers=[managers.Dropout(0.1), managers.Dropout(0.2)])


@pytest.mark.parametrize("variables", [
    {"model": {}},
    {"model": {}, "managers": {}, "optimizer": {}},
])
def test_variables_of_the_wrong_structure_raise_variables_mismatch(variables: object) -> None:
    program = gm.compile(lambda m, x: m(x).sum(), _mlp())
    program.init(X)
    with pytest.raises(gm.errors.VariablesMismatch, match=r"the dict made by program.init"):
        program.infer(variables, X)


def test_another_models_variables_raise_variables_mismatch() -> None:
    program = gm.compile(lambda m, x: m(x).sum(), _mlp(5))
    other = gm.compile(lambda m, x: m(x).sum(), _mlp(7))
    program.init(X)
    with pytest.raises(gm.errors.VariablesMismatch, match=r"linear_layers/0\.W has shape"):
        program.train(other.init(X), X, rng=jax.random.key(0))
    with pytest.raises(gm.errors.VariablesMismatch, match=r"missing linear_layers/1/b"):
        variables = program.init(X)
        del variables["model"]["linear_layers"][1]["b"]
        program.update_model(variables)
