"""Folding a manager's per-parameter variables into the model's: ``LoRA.merge``, ``EMA.merge``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax

import graphmod as gm
from graphmod.typing import Variables

Entries: TypeAlias = Mapping[str, jax.Array]
"""A manager's variables of one parameter (``{"a": ..., "b": ...}``), or its ``hparams``."""


def merged(manager: gm.Manager, variables: Variables,
           fold: Callable[[jax.Array, Entries, Entries], jax.Array],
           stacked: Callable[[Entries], int] = lambda entries: 0) -> Variables:
    """``variables`` with each parameter the manager holds entries for replaced by
    ``fold(parameter, entries, hparams)``, and the manager's variables removed; the
    containers are new, the other arrays shared. Raises
    :class:`graphmod.errors.VariablesMismatch` if ``variables`` hold none of its entries.

    ``stacked(entries)``: how many leading axes a parameter's entries (and the parameter)
    stack layers on, as in a scan over layers (``nnx.scan`` over ``nnx.vmap``-made
    blocks): ``fold`` maps over them, one layer at a time.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm, managers
        >>> from managers._merge import merged
        >>> ema = managers.EMA(0.5)
        >>> variables = {"model": {"lin": {"W": jnp.ones(2)}}, "managers": {"ema": {
        ...     "/lin": {"W": {"average": jnp.zeros(2)}}, "hparams": {}}}}
        >>> merged(ema, variables, lambda w, entries, _: entries["average"])["model"]
        {'lin': {'W': Array([0., 0.], dtype=float32)}}
    """
    if manager.name not in variables.get("managers", {}):
        raise gm.errors.VariablesMismatch(
            f"{type(manager).__name__} {manager.name!r}.merge: these variables hold no "
            f"entries of it (managers: {sorted(variables.get('managers', {}))}). Give the "
            "variables of a program compiled with this manager (program.init or the "
            "trained state's variables).")
    owned = variables["managers"][manager.name]
    hparams = owned.get("hparams", {})
    model = jax.tree.map(lambda leaf: leaf, variables["model"])  # containers copied
    for path, parameters in owned.items():
        if path == "hparams":
            continue
        parent = _node(model, path)
        for name, entries in parameters.items():
            per_layer = fold
            for _ in range(stacked(entries)):
                per_layer = jax.vmap(per_layer, in_axes=(0, 0, None))
            parent[name] = per_layer(parent[name], entries, hparams)
    others = {k: v for k, v in variables["managers"].items() if k != manager.name}
    return {"model": model, "managers": others}


def _node(model: Mapping[str, object], path: str) -> dict[str | int, Any]:
    """The dict of the model's variables at brick path ``path`` (``/layers/0``)."""
    node: Any = model  # nested dicts of arrays, as deep as the path
    for part in (p for p in path.split("/") if p):
        node = node[part] if part in node else node[int(part)]
    return node
