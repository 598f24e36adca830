"""VariableFilter: Blocks semantics over tagged variables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import graphmod as gm
from graphmod import roles


def _graph() -> tuple[gm.ComputationGraph, gm.bricks.MLP]:
    mlp = gm.bricks.MLP([3, 4, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    return gm.compile(lambda m, x: m(x), mlp).graph(jnp.ones((2, 3))), mlp


def paths(records: list) -> list[str]:
    return [r.tag.path for r in records]


def test_roles_match_sub_roles_and_each_role_requires_all() -> None:
    cg, _ = _graph()
    assert paths(cg.filter(gm.VariableFilter(roles=[roles.PARAMETER]))) == [
        "/linear_layers/0.W", "/linear_layers/0.b", "/linear_layers/1.W",
        "/linear_layers/1.b", "/linear_layers/2.W", "/linear_layers/2.b"]
    both = gm.VariableFilter(roles=[roles.PARAMETER, roles.WEIGHT], each_role=True)
    assert paths(cg.filter(both)) == ["/linear_layers/0.W", "/linear_layers/1.W",
                                      "/linear_layers/2.W"]


def test_brick_instances_match_their_own_applications_not_their_childrens() -> None:
    cg, mlp = _graph()
    own = cg.filter(gm.VariableFilter(bricks=[mlp], roles=[roles.INPUT]))
    assert paths(own) == ["/.apply.input_"]
    layer = cg.filter(gm.VariableFilter(bricks=[mlp.linear_layers[1]], roles=[roles.OUTPUT]))
    assert paths(layer) == ["/linear_layers/1.apply.output"]
    by_class = cg.filter(gm.VariableFilter(bricks=[gm.bricks.MLP]))
    assert {r.tag.brick_path for r in by_class} == {"/"}


def test_name_regex_path_glob_applications_and_call_id() -> None:
    cg, _ = _graph()
    assert len(cg.filter(gm.VariableFilter(name="W"))) == 3
    assert len(cg.filter(gm.VariableFilter(name_regex="^[Wb]$"))) == 6
    assert paths(cg.filter(gm.VariableFilter(path="/linear_layers/2.*"))) == [
        "/linear_layers/2.apply.input_", "/linear_layers/2.W", "/linear_layers/2.b",
        "/linear_layers/2.apply.output"]
    # Applications match by name (Blocks): MLP.apply and Linear.apply are both "apply".
    assert len(cg.filter(gm.VariableFilter(applications=[gm.bricks.Linear.apply]))) == 14
    assert cg.filter(gm.VariableFilter(call_id=1)) == []
    assert len(cg.filter(gm.VariableFilter(call_id=[0]))) == len(cg)


def test_filters_print_their_fields() -> None:
    f = gm.VariableFilter(roles=roles.WEIGHT, path="*.W")
    assert repr(f) == "VariableFilter(roles=(WEIGHT,), path='*.W')"
