"""Names that cannot be mistaken: a manager's own name vs. a filter on variable names, and
``program.graph`` leaving the program as it was."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles


def _linear() -> gm.bricks.Linear:
    return gm.bricks.Linear(3, 2, rngs=nnx.Rngs(0))


def _rewritten(manager: gm.Manager) -> list[tuple[str, str]]:
    program = gm.compile(lambda m, x: m(x), _linear(), managers=[manager])
    program.init(jnp.ones((1, 3)))
    return [(r.manager, r.name) for r in program.rewrites["init"]]


def test_variable_name_selects_variables_and_manager_name_names_the_manager() -> None:
    noise = managers.WeightNoise(0.1, roles=[roles.PARAMETER], variable_name="W",
                                 manager_name="w_noise")
    assert noise.name == "w_noise"
    assert _rewritten(noise) == [("w_noise", "W")]
    assert _rewritten(managers.WeightNoise(0.1, roles=[roles.PARAMETER])) == [
        ("weight_noise", "W"), ("weight_noise", "b")]


def test_the_old_name_spelling_warns_naming_both_intents_at_the_callers_line() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        noise = managers.WeightNoise(0.1, roles=[roles.PARAMETER], name="b")
    message = str(caught[0].message)
    assert "manager_name='b'" in message and "variable_name='b'" in message
    assert caught[0].filename == __file__  # past Dropout's and Manager's __init__
    # It keeps its old meaning: the manager is named "b" and still rewrites every parameter.
    assert noise.name == "b"
    assert _rewritten(noise) == [("b", "W"), ("b", "b")]


def test_the_new_spellings_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        managers.Dropout(0.5, variable_name="W", manager_name="drop_w")


def test_name_and_manager_name_together_or_a_bad_variable_name_raise() -> None:
    with pytest.raises(TypeError, match=r"name='a', manager_name='b'.*manager_name= only"):
        managers.Dropout(0.5, name="a", manager_name="b")
    with pytest.raises(TypeError, match=r"variable_name=3.*e\.g\. 'W'"):
        managers.Dropout(0.5, variable_name=3)
    with pytest.raises(ValueError, match=r"manager_name=\.\.\.\): 'not a name'"):
        managers.Dropout(0.5, manager_name="not a name")
    with pytest.raises(TypeError, match=r"filter= or the filter fields \(variable_name\)"):
        managers.Dropout(0.5, variable_name="W", filter=gm.VariableFilter(name="W"))


def test_graph_changes_neither_the_argument_checks_nor_the_provenance() -> None:
    x, other = jnp.ones((2, 3)), jnp.ones((4, 5, 3))
    make = lambda: gm.compile(lambda m, x: m(x).sum(), _linear(),
                              managers=[managers.Dropout(0.5, roles=[roles.INPUT])])
    program = make()
    variables = program.init(x)
    fingerprint = program.provenance.fingerprint
    shapes = program.provenance["example_shapes"]
    train_rewrites = program.train(variables, x, rng=jax.random.key(0)) and \
        program.rewrites["train"]
    inputs = program.graph(other).filter(gm.VariableFilter(roles=[roles.INPUT]))
    assert inputs and {r.shape for r in inputs} == {(4, 5, 3)}
    # Calls are still checked against init's example, not graph's arguments.
    with pytest.raises(ValueError, match=r"expected shape \(batch, 3\)"):
        program.infer(variables, other)
    assert program.infer(variables, x).shape == ()
    assert program.rewrites["train"] == train_rewrites
    assert program.provenance.fingerprint == fingerprint
    assert program.provenance["example_shapes"] == shapes
    # A program graphed before its provenance is assembled has the same fingerprint.
    graphed = make()
    graphed.init(x)
    graphed.graph(other, mode="infer")
    assert graphed.provenance.fingerprint == fingerprint
