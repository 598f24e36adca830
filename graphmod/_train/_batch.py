"""How a batch becomes a function's arguments: one module for the train step, the fused
step, the loop, ``Validation`` and ``evaluate``.

Two rules. A train step takes the whole batch (:func:`step_arguments`: a dict by name, a
tuple or list by position, anything else as the one argument). An inference function
``fn(model, ...)`` takes the fields its signature names (:func:`bind`): a dict batch's
fields by argument name, a tuple batch's first entries by position; the fields left over
are where evaluation finds the targets (:func:`target_field`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

Field: TypeAlias = str | int | None
"""A field of a batch: a dict's key, a tuple's or list's index, None for the batch itself."""


def step_arguments(batch: object) -> tuple[tuple[object, ...], dict[str, Any]]:
    """``(args, kwargs)`` a batch is passed as: a dict by name, a tuple or list by
    position, anything else as the one argument (the fields, forwarded verbatim).

    Examples:
        >>> from graphmod._train._batch import step_arguments
        >>> step_arguments({"x": 1}), step_arguments((1, 2)), step_arguments(3)
        (((), {'x': 1}), ((1, 2), {}), ((3,), {}))
    """
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, tuple | list):
        return tuple(batch), {}
    return (batch,), {}


def fields_of(batch: object) -> list[Field]:
    """The fields of a batch: a dict's keys, a tuple's indices, ``[None]`` for one array."""
    if isinstance(batch, Mapping):
        return list(batch)
    if isinstance(batch, tuple | list):
        return list(range(len(batch)))
    return [None]


def pick(batch: object, field: Field) -> Any:
    """The field of a batch (``None``: the batch itself): the user's data as it is, for the
    user's function or metric.

    Examples:
        >>> from graphmod._train._batch import pick
        >>> pick({"x": 1}, "x"), pick((1, 2), 1), pick(3, None)
        (1, 2, 3)
    """
    if field is None:
        return batch
    if isinstance(batch, Mapping):
        return batch[field]
    if isinstance(batch, tuple | list) and isinstance(field, int):
        return batch[field]
    raise TypeError(f"a {type(batch).__name__} batch has no field {field!r}: only a dict "
                    "batch has named fields and a tuple or list batch numbered ones")


@dataclasses.dataclass(frozen=True)
class Binding:
    """Which fields of a batch a function gets, in order: by name, or by position.

    Examples:
        >>> from graphmod._train._batch import Binding
        >>> Binding(("x",), by_name=True).arguments({"x": 1, "y": 2})
        ((), {'x': 1})
        >>> Binding((0,)).arguments((1, 2))
        ((1,), {})
    """

    fields: tuple[Field, ...]
    by_name: bool = False

    def arguments(self, batch: object) -> tuple[tuple[object, ...], dict[str, Any]]:
        """``(args, kwargs)`` for the function, from ``batch`` (forwarded verbatim)."""
        if self.by_name:  # bind names only string fields (keywords are strings)
            return (), {field: pick(batch, field) for field in self.fields
                        if isinstance(field, str)}
        return tuple(pick(batch, field) for field in self.fields), {}


@dataclasses.dataclass(frozen=True)
class _Parameters:
    """Of ``fn(model, ...)``: positional names, names passable by name, required names."""

    positional: tuple[str, ...]
    named: tuple[str, ...]
    required: tuple[str, ...]
    var_args: bool
    var_kwargs: bool


def _parameters(fn: Callable[..., object]) -> _Parameters:
    try:
        parameters = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return _Parameters((), (), (), True, True)  # unknown: it gets the whole batch
    kinds = inspect.Parameter
    return _Parameters(
        positional=tuple(p.name for p in parameters
                         if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)),
        named=tuple(p.name for p in parameters
                    if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)),
        required=tuple(p.name for p in parameters if p.default is kinds.empty
                       and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)),
        var_args=any(p.kind is kinds.VAR_POSITIONAL for p in parameters),
        var_kwargs=any(p.kind is kinds.VAR_KEYWORD for p in parameters))


def bind(fn: Callable[..., object], batch: object, *, who: str, source: str, spare: int = 0,
         hint: str = "") -> Binding:
    """The :class:`Binding` of ``batch``'s fields to ``fn(model, ...)``'s arguments.

    A dict batch gives the fields named like the arguments (all of them for ``**kwargs``),
    a tuple batch its first entries (for ``*args``: all but the last ``spare``, the
    targets evaluation keeps), one array is the one argument. Raises naming the missing
    fields, ``who`` (the caller) and ``source`` (the data's name), ending with ``hint``.

    Examples:
        >>> from graphmod._train._batch import bind
        >>> bind(lambda m, x: m(x), {"y": 0, "x": 1}, who="demo", source="toy")
        Binding(fields=('x',), by_name=True)
        >>> bind(lambda m, x: m(x), (1, 2), who="demo", source="toy").fields
        (0,)
    """
    takes = _parameters(fn)
    if isinstance(batch, Mapping):
        if takes.var_kwargs:
            unnamed = [field for field in batch if not isinstance(field, str)]
            if unnamed:
                raise ValueError(f"{who}: the fields {unnamed} of the source {source!r} are not "
                                 "strings, and the program's **kwargs takes fields by name; "
                                 "name them with strings")
            return Binding(tuple(batch), by_name=True)
        missing = [name for name in takes.required if name not in batch]
        if missing:
            raise ValueError(
                f"{who}: the program's inputs {list(takes.named)} are not all fields of the "
                f"source {source!r} (fields: {_shown(batch)}; missing: {missing}). Rename the "
                f"fields{hint}")
        return Binding(tuple(n for n in takes.named if n in batch), by_name=True)
    if isinstance(batch, tuple | list):
        needed = sum(name in takes.required for name in takes.positional)
        if needed > len(batch):
            raise ValueError(f"{who}: the program takes {needed} inputs "
                             f"({list(takes.positional)}) but the source {source!r} yields "
                             f"{len(batch)} arrays")
        count = max(len(batch) - spare, 1) if takes.var_args \
            else min(len(takes.positional), len(batch))
        return Binding(tuple(range(count)))
    return Binding((None,))


def bind_fields(batch: object, inputs: Sequence[Field], *, who: str, source: str) -> Binding:
    """The :class:`Binding` of the named fields, passed by position (``inputs=``).

    Examples:
        >>> from graphmod._train._batch import bind_fields
        >>> bind_fields({"a": 1, "b": 2}, ["b"], who="demo", source="toy").arguments(
        ...     {"a": 1, "b": 2})
        ((2,), {})
    """
    fields = fields_of(batch)
    for field in inputs:
        if field not in fields:
            raise ValueError(f"{who}: inputs= names {field!r}, which is not a field of the "
                             f"source {source!r} (fields: {_shown(batch)})")
    return Binding(tuple(inputs))


def target_field(batch: object, binding: Binding, targets: Field, *, who: str,
                 source: str) -> Field:
    """The field of the targets: ``targets`` if given (checked), else the one field the
    binding leaves over (None when there is none, or several).

    Examples:
        >>> from graphmod._train._batch import Binding, target_field
        >>> target_field((1, 2), Binding((0,)), None, who="demo", source="toy")
        1
    """
    fields = fields_of(batch)
    if targets is None:
        rest = [f for f in fields if f not in binding.fields and f is not None]
        return rest[0] if len(rest) == 1 else None
    if targets not in fields:
        raise ValueError(f"{who}: targets={targets!r} is not a field of the source "
                         f"{source!r} (fields: {_shown(batch)})")
    return targets


def _shown(batch: object) -> str:
    return ", ".join(map(repr, fields_of(batch)))
