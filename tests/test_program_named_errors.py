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


class Encoder(nnx.Module):
    def __init__(self) -> None:
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def encode(self, x: jax.Array) -> jax.Array:
        return self.linear(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.encode(x)


class Basic(nnx.Module):  # Flax's nnx_basics Linear: parameters named w and b
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones((4, 4)))
        self.b = nnx.Param(jnp.zeros((4,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.b


def test_a_role_no_parameter_has_gets_the_roles_there_are_named() -> None:
    program = gm.compile(lambda m, x: m(x).sum(), Basic(),
                         managers=[managers.WeightNoise(0.1, roles=[roles.WEIGHT])])
    with pytest.raises(gm.errors.ManagerMatchedNothing, match=r"The model's parameters are "
                       r"PARAMETER \(b, w\): a parameter's role comes from its name .*select "
                       r"these by roles=\[PARAMETER\] or variable_name=\. Fix"):
        program.init(X)


@pytest.mark.parametrize("manager, hint", [
    (lambda: managers.BatchNorm(bricks=[nnx.Linear], roles=[roles.WEIGHT]),
     r"BatchNorm rewrites the inputs and outputs of application calls, none of "
     r"roles=\['WEIGHT'\]"),
    (lambda: managers.WeightNoise(0.1, roles=[roles.INPUT]),
     r"WeightNoise rewrites the parameters of application calls, none of roles=\['INPUT'\]"),
    (lambda: managers.Remat(roles=[roles.INPUT]),
     r"Remat wraps whole application calls: select them by bricks=, applications= or path="),
    (lambda: managers.Dropout(0.1, path="linear*"), r"Paths start with '/' \(path='/linear\*'"),
    (lambda: managers.Dropout(0.1, path="/linear"),  # as the rewrite trace prints it
     r"path='/linear' names the brick /linear: path= globs the paths of variables \(the "
     r"brick's, a dot, the variable's name: '/linear\.bias'\), so write path='/linear\.\*' "
     r"\(its own\) or path='/linear\*' \(with its children's\)"),
    (lambda: managers.Remat(path="linear"),
     r"path='linear' names the brick /linear: path= globs the paths of calls .*'/linear\.apply'"),
    (lambda: managers.Dropout(0.1, path="/nowhere*"), r"The model's bricks are at /linear\."),
    (lambda: managers.WeightNoise(0.1, path="model/linear/kernel"),  # as a table spells it
     r"A variable's path is its brick's, a dot and its name \(path='/linear\.kernel'\?\)"),
    (lambda: managers.L2(0.1, path="/linear.apply.kernel"),  # a call's path, then the name
     r"its name, with no application \(path='/linear\.kernel'\?\)"),
    (lambda: managers.WeightNoise(0.1, variable_name="w"),
     r"The model's variables are named bias, kernel; an application's inputs are named after"),
    (lambda: managers.Dropout(0.1, applications=["__call__"]),
     r"A module's __call__ is the application named 'apply' \(applications=\['apply'\]\)"),
    (lambda: managers.Dropout(0.1, applications=[Encoder.encode]),
     r"compile\(applications=\{TheClass: \['method'\]\}\) names it"),
    (lambda: managers.WeightNoise(0.1, bricks=[Encoder]),  # the parent of the Linear
     r"bricks= selects those bricks' own calls .*not their children's: select the layers "
     r"inside by class \(bricks=\[nnx\.Conv\]\) or by path \(path='/block/\*'\)"),
    (lambda: managers.LabelSmoothing(0.1),  # no cost brick declares targets here
     r"TARGET variables are the targets of an application that declares them .*apply "
     r"optax\.smooth_labels in the loss"),
])
def test_a_filter_that_matches_nothing_gets_the_likely_slip_named(manager, hint) -> None:
    program = gm.compile(lambda m, x: m(x).sum(), Encoder(), managers=[manager()])
    with pytest.raises(gm.errors.ManagerMatchedNothing, match=hint):
        program.init(X)


def test_a_variable_path_that_matches_is_not_called_a_slip() -> None:
    program = gm.compile(lambda m, x: m(x).sum(), Encoder(), managers=[  # the roles exclude it
        managers.WeightNoise(0.1, path="/linear.kernel", roles=[roles.BIAS])])
    with pytest.raises(gm.errors.ManagerMatchedNothing) as raised:
        program.init(X)
    assert "with no application" not in str(raised.value)


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
