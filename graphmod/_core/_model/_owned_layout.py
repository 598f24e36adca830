"""The manager-variables layout, encoded and decoded in one place.

``variables["managers"]`` is ``{manager: {"hparams": {name: value}, <brick path>:
{<application>: {<variable>: leaf}}}}``; a ``per_call`` variable nests one more level, by
call id: ``{<application>: {<call id>: {<variable>: leaf}}}``. Inside a trace the same
leaves are flat: owned variables by :data:`OwnedKey` ``(manager, path, application, call id
or None, variable)``, hyperparameters by ``(manager, name)``. Every walk of the nested form
(decoding, replacing leaves, mapping them to roles) goes through :func:`map_leaves`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from graphmod._core._model._owned import OwnedKey

__all__ = ["HPARAMS", "decode", "encode", "map_leaves", "replaced"]

HPARAMS = "hparams"

HParamKey: TypeAlias = tuple[str, str]  # (manager, hyperparameter name)
Leaf: TypeAlias = Callable[[OwnedKey | HParamKey, object], object]  # (key, leaf) -> new leaf
# The nested layout, by manager then "hparams" or brick path, then hyperparameter name or
# application (whose entry nests variables, or call ids then variables). Its leaves are the
# variables' own values, typed as the variables type them (graphmod.typing.Variables).
Nested: TypeAlias = Mapping[str, Mapping[str, Mapping[str, object]]]


def encode(owned: Mapping[OwnedKey, object], hparams: Mapping[HParamKey, object]
           ) -> dict[str, dict[str, Any]]:
    """The nested layout of flat owned variables and hyperparameters.

    Examples:
        >>> from graphmod._core._model._owned_layout import encode
        >>> encode({("bn", "/l", "apply", None, "mean"): 0.0}, {("bn", "momentum"): 0.9})
        {'bn': {'hparams': {'momentum': 0.9}, '/l': {'apply': {'mean': 0.0}}}}
    """
    out: dict[str, dict[str, Any]] = {}
    for (manager, name), value in hparams.items():
        out.setdefault(manager, {HPARAMS: {}})[HPARAMS][name] = value
    for (manager, path, application, call_id, name), value in owned.items():
        node = out.setdefault(manager, {HPARAMS: {}}).setdefault(path, {})
        node = node.setdefault(application, {})
        if any(isinstance(k, int) != (call_id is not None) for k in node):
            raise ValueError(f"manager {manager!r} mixes per_call and shared variables in "
                             f"application {application!r} of {path}: use one or the other")
        if call_id is not None:
            node = node.setdefault(call_id, {})
        node[name] = value
    return out


def map_leaves(managers: Nested, leaf: Leaf) -> dict[str, dict[str, dict[str, object]]]:
    """``managers`` in the same nesting, each leaf replaced by ``leaf(key, value)`` (key: an
    :data:`OwnedKey`, or ``(manager, name)`` for a hyperparameter).

    Examples:
        >>> from graphmod._core._model._owned_layout import map_leaves
        >>> tree = {"bn": {"hparams": {"m": 0.9}, "/l": {"apply": {0: {"v": 1}}}}}
        >>> map_leaves(tree, lambda key, value: key)["bn"]["/l"]
        {'apply': {0: {'v': ('bn', '/l', 'apply', 0, 'v')}}}
    """
    return {manager: {path: ({name: leaf((manager, name), value) for name, value in node.items()}
                             if path == HPARAMS else
                             {application: _map_application(leaf, (manager, path, application),
                                                            calls)
                              for application, calls in node.items()})
                      for path, node in entry.items()}
            for manager, entry in managers.items()}


def _map_application(leaf: Leaf, prefix: tuple[str, str, str], node: object
                     ) -> dict[str | int, object]:
    if not isinstance(node, Mapping):
        raise TypeError(f"variables['managers'] holds a {type(node).__name__} at "
                        f"{'/'.join(prefix)}, not the dict of an application's variables")
    return {key: ({name: leaf((*prefix, key, name), v) for name, v in value.items()}
                  if isinstance(key, int) else leaf((*prefix, None, key), value))
            for key, value in node.items()}


def decode(managers: Nested) -> tuple[dict[OwnedKey, Any], dict[HParamKey, Any]]:
    """``(owned, hparams)``: the flat leaves of the nested layout, by key.

    Examples:
        >>> from graphmod._core._model._owned_layout import decode
        >>> decode({"bn": {"hparams": {"m": 0.9}, "/l": {"apply": {"mean": 0.0}}}})
        ({('bn', '/l', 'apply', None, 'mean'): 0.0}, {('bn', 'm'): 0.9})
    """
    owned: dict[OwnedKey, object] = {}
    hparams: dict[HParamKey, object] = {}

    def collect(key: OwnedKey | HParamKey, value: object) -> None:
        if len(key) == 2:
            hparams[key] = value
        else:
            owned[key] = value

    map_leaves(managers, collect)
    return owned, hparams


def replaced(managers: Nested, updates: Mapping[OwnedKey, object]
             ) -> dict[str, dict[str, dict[str, object]]]:
    """``managers`` with the owned leaves in ``updates`` replaced (nesting kept).

    Examples:
        >>> from graphmod._core._model._owned_layout import replaced
        >>> replaced({"bn": {"hparams": {}, "/l": {"apply": {"mean": 0.0}}}},
        ...          {("bn", "/l", "apply", None, "mean"): 1.0})
        {'bn': {'hparams': {}, '/l': {'apply': {'mean': 1.0}}}}
    """
    return map_leaves(managers, lambda key, value: updates.get(key, value) if len(key) == 5
                      else value)
