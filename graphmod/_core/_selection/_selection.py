"""Stored variables named by selectors: a :class:`VariableFilter` over the model's
variables (``bricks``, ``roles``, ``name``, ``name_regex``, ``path``: the fields that mean
something for a stored variable), a Flax filter over them (a ``Variable`` type such as
``nnx.LoRAParam``, ``nnx.PathContains``, ``nnx.All``, ...: what Flax's ``wrt=`` takes), or
managers (the variables they own).

Used by ``graphmod.optimize(program, tx, trainable=...)``: LoRA trains its own adapters,
``trainable=[lora]``; a fine-tuned head, ``trainable=VariableFilter(bricks=[model.head])``;
Flax's own LoRA layers, ``trainable=nnx.LoRAParam``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TypeAlias, TypeGuard

from flax import nnx
from flax.nnx import filterlib

from graphmod import roles as _roles
from graphmod._core._managers._manager import Manager
from graphmod._core._model._layout import Key, Layout
from graphmod._core._model._owned_layout import map_leaves
from graphmod._core._selection._filter import Tag, VariableFilter
from graphmod.typing import JSON, Variables

# A VariableFilter, a Manager or a Flax filter (see is_flax_filter).
Selector: TypeAlias = "VariableFilter | Manager | filterlib.Filter"

# Flax's filter objects, and its literals: ``...`` and True (everything), False (nothing).
# A string is a Flax filter too (a tag), but a typo would then select silently: refused.
_FLAX_FILTERS = (filterlib.All, filterlib.Any, filterlib.Not, filterlib.Everything,
                 filterlib.Nothing, filterlib.OfType, filterlib.PathContains, filterlib.PathIn,
                 filterlib.WithTag, bool, type(...))


def is_flax_filter(item: object) -> TypeGuard[filterlib.Filter]:
    """Whether ``item`` is a Flax filter graphmod takes: a ``Variable`` type, one of Flax's
    filter objects or literals, or a function of ``(path, value)`` (Flax's examples'
    ``is_trainable``).

    Examples:
        >>> from flax import nnx
        >>> is_flax_filter(nnx.LoRAParam), is_flax_filter(nnx.PathContains("head"))
        (True, True)
        >>> is_flax_filter(lambda path, value: "head" in path), is_flax_filter(...)
        (True, True)
        >>> is_flax_filter("head"), is_flax_filter(int), is_flax_filter(lambda path: True)
        (False, False, False)
    """
    if isinstance(item, type):
        return issubclass(item, nnx.Variable)
    return isinstance(item, _FLAX_FILTERS) or _is_predicate(item)


def _is_predicate(item: object) -> bool:
    """Whether ``item`` is a function Flax would call as ``item(path, value)``."""
    if not callable(item) or isinstance(item, VariableFilter | Manager):
        return False
    try:
        inspect.signature(item).bind(None, None)
    except (TypeError, ValueError):  # another arity, or no signature to read
        return False
    return True


def _refusal(item: object) -> str:
    """Why ``item`` selects no stored variable, and the fix."""
    if isinstance(item, str):
        return (f"a string is a Flax tag filter, which a typo would leave selecting nothing: "
                f"pass nnx.WithTag({item!r}), or VariableFilter(path=...) for a path")
    if isinstance(item, type) and issubclass(item, nnx.Module):
        return (f"{item.__name__} is a module class, not a Variable type: select its "
                f"parameters with VariableFilter(bricks=[{item.__name__}])")
    if isinstance(item, type) and issubclass(item, Manager):
        return f"pass the {item.__name__} manager itself, the one the program was compiled with"
    if callable(item) and not isinstance(item, type):
        return "a function filter takes (path, value), as Flax's filters do"
    return "not a selector"


def as_selectors(value: object, argument: str) -> tuple[Selector, ...]:
    """``value`` as a tuple of selectors, refused with the argument named if it is not."""
    items = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) \
        else (value,)
    selectors: list[Selector] = []
    for item in items:
        if not (isinstance(item, VariableFilter | Manager) or is_flax_filter(item)):
            raise TypeError(f"{argument}: got {item!r}: {_refusal(item)} (a VariableFilter, "
                            "a manager, or a Flax filter: a Variable type such as "
                            "nnx.LoRAParam, nnx.PathContains(...), nnx.All(...), a function "
                            "of (path, value); or a list of them)")
        if isinstance(item, VariableFilter) and (item.applications is not None
                                                 or item.call_id is not None):
            raise TypeError(f"{argument}: {item!r} selects application calls; a stored "
                            "variable belongs to no call: use bricks=, roles=, name=, "
                            "name_regex= or path=")
        selectors.append(item)
    return tuple(selectors)


def stored_tag(layout: Layout, key: Key) -> Tag:
    """The tag a filter sees for the model variable at ``key`` (of no application call)."""
    info = layout.by_key[key]
    brick_path = info.path.rpartition(".")[0]
    return Tag(info.role, info.name, info.path, brick_path, "", 0,
               layout.bricks_at.get(brick_path))


def selected(variables: Variables, layout: Layout, selectors: tuple[Selector, ...],
             argument: str) -> dict[str, object]:
    """A tree of bools in the nesting of ``variables``: whether a selector names the leaf."""
    owners = {s.name for s in selectors if isinstance(s, Manager)}

    def model(node: object, key: Key) -> object:
        if isinstance(node, Mapping):
            return {k: model(v, (*key, k)) for k, v in node.items()}
        return key in chosen

    chosen = selected_model_keys(layout, selectors, argument)
    return {"model": model(variables["model"], ()),
            "managers": map_leaves(variables["managers"],
                                   lambda key, _: len(key) > 2 and key[0] in owners)}


def selected_model_keys(layout: Layout, selectors: tuple[Selector, ...],
                        argument: str) -> set[Key]:
    """The keys of the model's variables that a VariableFilter or a Flax filter among
    ``selectors`` names (with Flax's arguments: the key path and the variable)."""
    filters = [s for s in selectors if isinstance(s, VariableFilter)]
    for f in filters:
        layout.resolve(f.brick_instances(), argument)
    flax = [filterlib.to_predicate(s) for s in selectors if is_flax_filter(s)]
    return {info.key for info in layout.variables
            if any(f.matches(stored_tag(layout, info.key), layout.instance_paths)
                   for f in filters)
            or any(p(info.key, layout.objects[info.identity]) for p in flax)}


def trained_record(layout: Layout, selectors: tuple[Selector, ...] | None
                   ) -> dict[str, JSON] | None:
    """What ``trainable=`` selects, for a training record: None (every PARAMETER leaf), or
    the paths of the model's parameters and the names of the managers whose parameters
    train."""
    if selectors is None:
        return None
    keys = selected_model_keys(layout, selectors, "optimize(trainable=...)")
    paths: list[JSON] = [info.path for info in layout.variables
                         if info.key in keys and info.role.is_a(_roles.PARAMETER)]
    names: list[JSON] = [*sorted(s.name for s in selectors if isinstance(s, Manager))]
    return {"model": paths, "managers": names}
