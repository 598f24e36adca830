"""Stored variables named by selectors: a :class:`VariableFilter` over the model's
variables (``bricks``, ``roles``, ``name``, ``name_regex``, ``path``: the fields that mean
something for a stored variable), or managers (the variables they own).

Used by ``graphmod.optimize(program, tx, trainable=...)``: LoRA trains its own adapters,
``trainable=[lora]``; a fine-tuned head, ``trainable=VariableFilter(bricks=[model.head])``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from graphmod._core._filter import Tag, VariableFilter
from graphmod._core._layout import Layout
from graphmod._core._manager import Manager
from graphmod._core._owned_layout import map_leaves

Selector = VariableFilter | Manager


def as_selectors(value: Any, argument: str) -> tuple[Selector, ...]:
    """``value`` as a tuple of selectors, refused with the argument named if it is not."""
    items = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) \
        else (value,)
    for item in items:
        if not isinstance(item, VariableFilter | Manager):
            raise TypeError(f"{argument}: expected a VariableFilter, a manager or a list of "
                            f"them, got {item!r}")
        if isinstance(item, VariableFilter) and (item.applications is not None
                                                 or item.call_id is not None):
            raise TypeError(f"{argument}: {item!r} selects application calls; a stored "
                            "variable belongs to no call: use bricks=, roles=, name=, "
                            "name_regex= or path=")
    return items


def stored_tag(layout: Layout, key: tuple) -> Tag:
    """The tag a filter sees for the model variable at ``key`` (of no application call)."""
    info = layout.by_key[key]
    brick_path = info.path.rpartition(".")[0]
    return Tag(info.role, info.name, info.path, brick_path, "", 0,
               layout.bricks_at.get(brick_path))


def selected(variables: Mapping, layout: Layout, selectors: tuple[Selector, ...],
             argument: str) -> dict:
    """A tree of bools in the nesting of ``variables``: whether a selector names the leaf."""
    filters = [s for s in selectors if isinstance(s, VariableFilter)]
    owners = {s.name for s in selectors if isinstance(s, Manager)}
    for f in filters:
        layout.resolve(f.brick_instances(), argument)

    def model(node: Any, key: tuple) -> Any:
        if isinstance(node, Mapping):
            return {k: model(v, (*key, k)) for k, v in node.items()}
        tag = stored_tag(layout, key)
        return any(f.matches(tag, layout.instance_paths) for f in filters)

    return {"model": model(variables["model"], ()),
            "managers": map_leaves(variables["managers"],
                                   lambda key, _: len(key) > 2 and key[0] in owners)}
