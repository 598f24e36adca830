"""Roles: singletons with a hierarchy; hashable, picklable, deep-copyable; extensible."""

from __future__ import annotations

import copy
import pickle

import pytest

from graphmod import roles


def test_hierarchy_follows_the_design() -> None:
    assert roles.FILTER.is_a(roles.WEIGHT) and roles.WEIGHT.is_a(roles.PARAMETER)
    assert roles.PARAMETER.is_a(roles.PERSISTENT) and roles.STATE.is_a(roles.PERSISTENT)
    assert roles.BIAS.is_a(roles.PARAMETER) and not roles.BIAS.is_a(roles.WEIGHT)
    assert not roles.STATE.is_a(roles.PARAMETER)
    assert not roles.PARAMETER.is_a(roles.WEIGHT)
    for root in (roles.INPUT, roles.OUTPUT, roles.COST, roles.AUXILIARY, roles.TARGET,
                 roles.INITIAL_STATE):
        assert root.parent is None


def test_roles_are_hashable_picklable_and_copy_to_themselves() -> None:
    assert {roles.WEIGHT: 1}[roles.WEIGHT] == 1
    assert pickle.loads(pickle.dumps(roles.WEIGHT)) is roles.WEIGHT
    assert copy.deepcopy(roles.BIAS) is roles.BIAS and copy.copy(roles.BIAS) is roles.BIAS
    with pytest.raises(AttributeError, match="immutable"):
        roles.WEIGHT.name = "W"  # type: ignore[misc]


def test_users_add_sub_roles() -> None:
    gate = roles.add_role("TEST_GATE_WEIGHT", roles.WEIGHT)
    assert gate.is_a(roles.PARAMETER) and roles.get_role("TEST_GATE_WEIGHT") is gate
    assert roles.add_role("TEST_GATE_WEIGHT", roles.WEIGHT) is gate
    with pytest.raises(ValueError, match="already exists with parent WEIGHT"):
        roles.add_role("TEST_GATE_WEIGHT", roles.BIAS)
    with pytest.raises(ValueError, match="unknown role 'NOPE'"):
        roles.get_role("NOPE")
    with pytest.raises(ValueError, match=r"unknown role 'WIEGHT' \(did you mean 'WEIGHT'\?\)"):
        roles.get_role("WIEGHT")
    with pytest.raises(TypeError, match="parent of 'X' must be a Role"):
        roles.add_role("X", "WEIGHT")  # type: ignore[arg-type]
