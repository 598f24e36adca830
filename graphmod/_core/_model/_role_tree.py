"""Roles of a program's variables as a tree, and the split and merge of variables by role.

The model's roles come from the layout, the managers' from the owned variables' roles
(known once any program over the layout has run ``init``) and ``HYPERPARAMETER`` for
hyperparameters: no trace runs here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from graphmod import roles as _roles
from graphmod._core._model._layout import Layout
from graphmod._core._model._owned import OwnedKey
from graphmod._core._model._owned_layout import map_leaves

__all__ = ["is_one_of", "merge", "role_tree", "select"]


def role_tree(variables: Mapping, layout: Layout,
              owned_roles: Mapping[OwnedKey, _roles.Role]) -> dict:
    """The tree of roles of ``variables`` (same nesting, a Role per leaf)."""

    def model_roles(node: Any, key: tuple) -> Any:
        if isinstance(node, Mapping):
            return {k: model_roles(v, (*key, k)) for k, v in node.items()}
        return layout.by_key[key].role

    def manager_role(key: tuple, _: Any) -> _roles.Role:
        if len(key) == 2:
            return _roles.HYPERPARAMETER
        if key not in owned_roles:
            manager, path, application, _, name = key
            raise KeyError(f"variables hold {manager}/{path}/{application}/{name}, which this "
                           "program's init did not create")
        return owned_roles[key]

    return {"model": model_roles(variables["model"], ()),
            "managers": map_leaves(variables["managers"], manager_role)}


def select(variables: Mapping, marks: Mapping, test: Callable[[Any], bool],
           keep: bool) -> dict:
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


def merge(selected: Mapping, rest: Mapping) -> dict:
    """The inverse of a split: one nested dict from two disjoint ones."""
    out = dict(rest)
    for key, value in selected.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(value, out[key])
        else:
            out[key] = value
    return out


_EMPTY = object()
