"""A program's input transformations (``compile(..., transforms=)``): fields bound to the
compiled function's arguments, checked when a signature is traced, applied before it runs.

A field is a ``str`` (the parameter's name: a dict batch's key) or an ``int`` (its position
after the model: a tuple batch's index). The core knows transformations only through the
``graphmod.typing.InputTransforms`` protocol: ``check`` sees the abstract values (shapes and
canonical dtypes, as ``jit`` sees them) before anything is computed, ``apply`` runs in the
trace, outside the manager chain, so its fitted numbers are constants of the jaxpr.

Sharp edges
    A derived program (``program.derive(fn)``) binds the fields with its own function's
    signature and skips those it lacks (a prediction function takes no labels); only the
    compiled function must name every field.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Literal

import jax

from graphmod.typing import InputTransforms, PyTree

__all__ = ["abstract_value", "apply_transforms", "check_transform_fields",
           "check_transformed"]

Field = str | int
Place = tuple[Literal["args"], int] | tuple[Literal["kwargs"], str]  # ("args", index) or ...


def check_transform_fields(transforms: object, fn: Callable[..., object]) -> None:
    """Raises, at compile, unless ``transforms`` is an ``InputTransforms`` whose every field
    names an argument of ``fn`` after the model (its name, or its position)."""
    if not isinstance(transforms, InputTransforms):
        raise TypeError(
            f"compile(transforms=...): expected fitted transformations (e.g. graphmod.data."
            f"Transforms({{'x': graphmod.data.Standardize()}}).fit(train)), got "
            f"{type(transforms).__name__}; a spec is fitted on the training data first")
    try:
        parameters = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature to bind fields with
        return
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    var_positional = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    for field in transforms.transformed():
        fits = (0 <= field < len(positional) or var_positional) if isinstance(field, int) \
            else (field in named or var_keyword)
        if not fits:
            name = getattr(fn, "__name__", type(fn).__name__)
            shown = ", ".join(f"{i}: {p.name}" for i, p in enumerate(positional)) or "none"
            raise ValueError(
                f"compile(transforms=...): the field {field!r} names no argument of "
                f"{name}(model, {', '.join(p.name for p in parameters)}) (positions after "
                f"the model: {shown}); fit the transformations on data whose fields are "
                f"{name}'s arguments, or name the field after one of them")


def _places(transforms: InputTransforms, names: list[str], args: tuple[PyTree, ...],
            kwargs: dict[str, PyTree]) -> dict[Field, Place]:
    """Where each field of ``transforms`` is in a call (absent fields left out)."""
    places: dict[Field, Place] = {}
    for field in transforms.fields():
        if isinstance(field, int):
            name = names[field] if 0 <= field < len(names) else None
            place: Place | None = ("args", field) if field < len(args) else (
                ("kwargs", name) if name is not None and name in kwargs else None)
        else:
            index = names.index(field) if field in names else None
            place = ("args", index) if index is not None and index < len(args) else (
                ("kwargs", field) if field in kwargs else None)
        if place is not None:
            places[field] = place
    return places


def _value(place: Place, args: tuple[PyTree, ...], kwargs: dict[str, PyTree]) -> PyTree:
    return args[place[1]] if place[0] == "args" else kwargs[place[1]]


def check_transformed(transforms: InputTransforms | None, names: list[str],
                      args: tuple[PyTree, ...], kwargs: dict[str, PyTree], where: str) -> None:
    """``transforms.check`` on the abstract values of the fields in this call."""
    if transforms is None:
        return
    places = _places(transforms, names, args, kwargs)
    if places:
        transforms.check({field: jax.tree.map(abstract_value, _value(place, args, kwargs))
                          for field, place in places.items()}, where)


def apply_transforms(transforms: InputTransforms | None, names: list[str],
                     args: tuple[PyTree, ...], kwargs: dict[str, PyTree]
                     ) -> tuple[tuple[PyTree, ...], dict[str, PyTree]]:
    """``(args, kwargs)`` with each field's value replaced by its transformed value."""
    if transforms is None:
        return args, kwargs
    places = _places(transforms, names, args, kwargs)
    if not places:
        return args, kwargs
    out = transforms.apply({field: _value(place, args, kwargs)
                            for field, place in places.items()})
    new_args, new_kwargs = list(args), dict(kwargs)
    for field, value in out.items():
        place = places[field]
        if place[0] == "args":
            new_args[place[1]] = value
        else:
            new_kwargs[place[1]] = value
    return tuple(new_args), new_kwargs


def abstract_value(value: object) -> jax.ShapeDtypeStruct:
    """The shape and dtype ``jit`` gives ``value`` (float64 is float32 without x64)."""
    aval = jax.typeof(value)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
