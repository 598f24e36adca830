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


def default_filter(kwargs: dict[str, Any], **defaults: Any) -> dict[str, Any]:
    """``kwargs`` with the filter fields ``defaults`` added when the caller gave none."""
    if any(kwargs.get(field) is not None for field in _FILTER_FIELDS):
        return kwargs
    return {**kwargs, **defaults}


def fan_in_axes(manager: gm.Manager, call: gm.ApplicationCall, name: str,
                value: Any) -> tuple[int, ...]:
    """The axes of a weight feeding one output unit: all but the last (a Linear's
    ``(in, out)``, a convolution's ``(..., in, out)``). Raises naming the manager and the
    parameter if ``value`` is not floating or has fewer than two axes (a bias)."""
    require_floating(manager, call, name, value)
    if jnp.ndim(value) < 2:
        raise ValueError(
            f"{type(manager).__name__} {manager.name!r} selected {name!r} of shape "
            f"{jnp.shape(value)} at {call.parameter or call.path}: it rewrites weights with an "
            "output axis last and at least one input axis. Narrow its filter (e.g. "
            "roles=[graphmod.roles.WEIGHT]) to leave this variable out.")
    return tuple(range(jnp.ndim(value) - 1))
