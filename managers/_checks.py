"""Checks shared by the built-in managers, and the options they pass on to the base."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, TypedDict, Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod.roles import Role
from graphmod.typing import ArrayLike, HookContext

if TYPE_CHECKING:  # what the filter fields take, as graphmod.Manager names it
    from graphmod._core._selection._filter import ApplicationSelector, BrickSelector


class OptionsWithoutBricks(TypedDict, total=False):
    """:class:`ManagerOptions` without ``bricks=``: what a manager taking the bricks as an
    argument of its own (``LayerFreezing``) passes on.

    Examples:
        >>> import graphmod as gm, managers
        >>> from flax import nnx
        >>> from managers._checks import OptionsWithoutBricks
        >>> options: OptionsWithoutBricks = {"manager_name": "freeze"}
        >>> mlp = gm.bricks.MLP([2, 3, 1], rngs=nnx.Rngs(0))
        >>> managers.LayerFreezing(mlp.linear_layers, **options).name
        'freeze'
    """

    roles: Role | Iterable[Role] | None
    applications: ApplicationSelector | Iterable[ApplicationSelector] | None
    path: str | None
    variable_name: str | None
    name_regex: str | None
    call_id: int | Iterable[int] | None
    filter: gm.VariableFilter | None
    priority: int
    manager_name: str | None
    strict: bool
    name: str | None


class ManagerOptions(OptionsWithoutBricks, total=False):
    """The keyword arguments of :class:`graphmod.Manager` that every built-in manager takes
    after its own and passes on (``**kwargs``): the filter fields, ``priority``,
    ``manager_name``, ``strict`` and the deprecated ``name``. The filter fields take what
    :class:`graphmod.VariableFilter` takes (one value or several, as the base's signature
    types them), checked there.

    Examples:
        >>> import graphmod as gm, managers
        >>> from managers._checks import ManagerOptions
        >>> options: ManagerOptions = {"roles": [gm.roles.OUTPUT], "manager_name": "drop"}
        >>> managers.Dropout(0.1, **options).name
        'drop'
    """

    bricks: BrickSelector | Iterable[BrickSelector] | None


def require_floating(manager: gm.Manager, call: HookContext, name: str,
                     value: ArrayLike | jax.ShapeDtypeStruct) -> None:
    """Raises a TypeError naming the manager, variable and path if ``value`` is not floating.

    Dropout, noise and normalization of integer values (token ids, counters) are undefined;
    a filter that selects them is too broad.
    """
    dtype = jnp.result_type(value)
    if not jnp.issubdtype(dtype, jnp.floating):
        role = call.role.name if call.role is not None else "variable"
        raise TypeError(
            f"{type(manager).__name__} {manager.name!r} selected {role} {name!r} of "
            f"application {call.application!r} at {call.path}, of dtype {dtype}: it rewrites "
            "floating-point values only. Narrow its filter (bricks=, roles=, variable_name=, "
            "path=) to leave this variable out."
        )


_FILTER_FIELDS = ("bricks", "roles", "applications", "path", "variable_name", "name_regex",
                  "call_id", "filter")


# The filter fields that choose variables of an application (not the applications).
_VARIABLE_FIELDS = ("roles", "path", "variable_name", "name_regex", "filter")


def _given(kwargs: Mapping[str, object], fields: tuple[str, ...]) -> bool:
    return any(kwargs.get(field) is not None for field in fields)


def chooses_variables(kwargs: Mapping[str, object]) -> bool:
    """Whether a filter field among ``kwargs`` chooses variables of an application (not
    only the applications: ``bricks=``, ``applications=``, ``call_id=``)."""
    return _given(kwargs, _VARIABLE_FIELDS)


def default_filter(kwargs: ManagerOptions, **defaults: Unpack[ManagerOptions]
                   ) -> ManagerOptions:
    """``kwargs`` with the filter fields ``defaults`` added when the caller gave none."""
    return kwargs if _given(kwargs, _FILTER_FIELDS) else {**kwargs, **defaults}


def roles_by_default(kwargs: ManagerOptions, roles: tuple[Role, ...] = (gm.roles.WEIGHT,)
                     ) -> ManagerOptions:
    """``kwargs`` with ``roles=roles`` (the weights unless told) added when no filter field
    chooses variables of an application (only ``bricks=``, ``applications=`` or
    ``call_id=``, or none): a manager that rewrites weights, given ``bricks=[nnx.Conv]``,
    leaves their biases out."""
    return kwargs if chooses_variables(kwargs) else {**kwargs, "roles": list(roles)}
