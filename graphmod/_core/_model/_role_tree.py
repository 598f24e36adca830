"""Roles of a program's variables as a tree, and the split and merge of variables by role.

The model's roles come from the layout, the managers' from the owned variables' roles
(known once any program over the layout has run ``init``) and ``HYPERPARAMETER`` for
hyperparameters: no trace runs here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from graphmod import roles as _roles
from graphmod._core._model._layout import Key, Layout
from graphmod._core._model._owned import OwnedKey
from graphmod._core._model._owned_layout import HParamKey, map_leaves
from graphmod.typing import Variables

__all__ = ["is_one_of", "merge", "role_tree", "select"]


def role_tree(variables: Variables, layout: Layout,
              owned_roles: Mapping[OwnedKey, _roles.Role]) -> dict[str, object]:
    """The tree of roles of ``variables`` (same nesting, a Role per leaf)."""

    def model_roles(node: object, key: Key) -> object:
        if isinstance(node, Mapping):
            return {k: model_roles(v, (*key, k)) for k, v in node.items()}
        return layout.by_key[key].role

    def manager_role(key: OwnedKey | HParamKey, _: object) -> _roles.Role:
        if len(key) == 2:
            return _roles.HYPERPARAMETER
        if key not in owned_roles:
            manager, path, application, _, name = key
            raise KeyError(f"variables hold {manager}/{path}/{application}/{name}, which this "
                           "program's init did not create")
        return owned_roles[key]

    return {"model": model_roles(variables["model"], ()),
            "managers": map_leaves(variables["managers"], manager_role)}


# The trees below are nested dicts typed as graphmod.typing.Variables types its leaves.
def select(variables: Mapping[str, object], marks: Mapping[str, Any],
           test: Callable[[_roles.Role], bool] | Callable[[bool], bool], keep: bool
           ) -> dict[str, Any]:
    """The leaves of ``variables`` whose mark (in ``marks``, same nesting: a role, a bool)
    passes ``test`` (``keep``) or does not, in the original nesting (empty branches
    dropped)."""
    parts = {k: (select(v, marks[k], test, keep) if isinstance(v, Mapping)
                 else v if test(marks[k]) == keep else _EMPTY)
             for k, v in variables.items()}
    return {k: v for k, v in parts.items() if v is not _EMPTY}


def is_one_of(wanted: Sequence[_roles.Role]) -> Callable[[_roles.Role], bool]:
    """A test for :func:`select`: a role is one of ``wanted`` or a sub-role."""
    return lambda role: any(role.is_a(r) for r in wanted)


def merge(selected: Mapping[str, object], rest: Mapping[str, object]) -> dict[str, Any]:
    """The inverse of a split: one nested dict from two disjoint ones."""
    out: dict[str, object] = dict(rest)
    for key, value in selected.items():
        other = out.get(key)
        if isinstance(value, Mapping) and isinstance(other, Mapping):
            out[key] = merge(value, other)
        else:
            out[key] = value
    return out


_EMPTY = object()
