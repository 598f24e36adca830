"""Checks shared by the built-in managers."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

import graphmod as gm


def require_floating(manager: gm.Manager, call: gm.ApplicationCall, name: str,
                     value: Any) -> None:
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


def _given(kwargs: dict[str, Any], fields: tuple[str, ...]) -> bool:
    return any(kwargs.get(field) is not None for field in fields)


def chooses_variables(kwargs: dict[str, Any]) -> bool:
    """Whether a filter field among ``kwargs`` chooses variables of an application (not
    only the applications: ``bricks=``, ``applications=``, ``call_id=``)."""
    return _given(kwargs, _VARIABLE_FIELDS)


def default_filter(kwargs: dict[str, Any], **defaults: Any) -> dict[str, Any]:
    """``kwargs`` with the filter fields ``defaults`` added when the caller gave none."""
    return kwargs if _given(kwargs, _FILTER_FIELDS) else {**kwargs, **defaults}


def roles_by_default(kwargs: dict[str, Any],
                     roles: tuple[Any, ...] = (gm.roles.WEIGHT,)) -> dict[str, Any]:
    """``kwargs`` with ``roles=roles`` (the weights unless told) added when no filter field
    chooses variables of an application (only ``bricks=``, ``applications=`` or
    ``call_id=``, or none): a manager that rewrites weights, given ``bricks=[nnx.Conv]``,
    leaves their biases out."""
    return kwargs if chooses_variables(kwargs) else {**kwargs, "roles": list(roles)}
