"""Values that are built again from their records: dynamic hyperparameters, bricks (by
configuration, by path, or by place until compile), filters and optimizers; and the opaque
values that cannot be rebuilt.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, TypedDict, TypeGuard

from flax import nnx

from graphmod import roles
from graphmod._core._codec._tag import (
    SKIP,
    Decoding,
    Encoding,
    Skip,
    Tag,
    call_text,
    join,
    opaque,
)
from graphmod._core._selection._filter import VariableFilter
from graphmod.typing import JSON

_FILTER_FIELDS = tuple(f.name for f in dataclasses.fields(VariableFilter))


# The inner records the tags below write (what their text reads): a brick's recorded
# construction (``_construction``), an optimizer's (``_records._optimizer``), an opaque value.
_BrickRecord = TypedDict("_BrickRecord", {"class": str, "arguments": dict[str, JSON]},
                         total=False)


class _OptimizerRecord(TypedDict, total=False):
    name: str
    arguments: dict[str, JSON]


class _OpaqueRecord(TypedDict, total=False):
    kind: str
    type: str
    repr: str


class Dynamic(Tag[JSON]):
    """``{"$dynamic": value}``: a hyperparameter made with ``graphmod.dynamic``.

    Examples:
        >>> import graphmod as gm
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$dynamic"].encode(gm.dynamic(0.5), lambda v: v)
        {'$dynamic': 0.5}
    """

    name = "$dynamic"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        return {self.name: encode(value.value)} if _is_dynamic(value) else SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        value = decoding(inner, where)
        return None if decoding.dry else decoding.dynamic(value)

    def text(self, inner: JSON, text: Callable[[JSON], str]) -> str:
        return f"dynamic({text(inner)})"


class _Dynamic(Protocol):
    value: float


def _is_dynamic(value: object) -> TypeGuard[_Dynamic]:
    """Whether ``value`` is a ``graphmod.dynamic`` hyperparameter (known by its mark: the
    managers' module imports this one)."""
    return bool(getattr(value, "__graphmod_dynamic__", False))


def construct(config: object, decoding: Decoding, where: str,
              kind: Literal["brick", "manager"], fix: str = "") -> object:
    """A brick or manager from its recorded configuration (None when dry, after checking
    its class path and arguments); ``fix`` is said when it cannot be."""
    config = decoding.mapping(config, where)
    if config.get("recorded") is False or "error" in config or "arguments" not in config:
        reason = config.get("error") or "its construction was not recorded (not a graphmod " \
                                        "Brick or Manager)"
        decoding.fail(f"rebuild: {where} ({config.get('class')}) cannot be rebuilt: {reason}"
                      + (f"; {fix}" if fix else ""))
    cls = decoding.lookup(config.get("class"), "class", f"{where}.class")
    arguments = {k: decoding(v, f"{where}.arguments.{k}") for k, v in
                 decoding.mapping(config["arguments"], f"{where}.arguments").items()}
    if decoding.dry or cls is None:  # None: dry
        return None
    return decoding.build(cls, str(config["class"]), arguments, where, kind)


class Brick(Tag[_BrickRecord]):
    """``{"$brick": config}``: a brick given to a brick, by its own recorded construction.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$brick"].text({"class": "graphmod.bricks.Linear",
        ...                      "arguments": {"in_features": 2}}, str)
        'graphmod.bricks.Linear(in_features=2)'
    """

    name = "$brick"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        # Any module: one a manager names is recorded by its path (a Flax model's too);
        # given to a brick, only a brick's construction can be.
        if isinstance(value, nnx.Module) or (getattr(value, "__graphmod_brick__", False)
                                             and not isinstance(value, type)):
            return encode.brick(value)
        return SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        return construct(inner, decoding, where, "brick")

    def text(self, inner: _BrickRecord, text: Callable[[JSON], str]) -> str:
        return call_text(inner.get("class"), inner.get("arguments", {}), text)


class BrickInstance(Tag[int]):
    """``{"$brick_instance": i}``: the ``i``-th brick a manager was given, which compile
    turns into a ``$brick_path``; a record never holds one.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$brick_instance"].text(0, str)
        'brick #0 (before compile)'
    """

    name = "$brick_instance"

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        decoding.fail(f"rebuild: {where} names a brick by its place among a manager's "
                      "arguments, which only compile turns into a path; the record is damaged "
                      "or crafted")

    def text(self, inner: int, text: Callable[[JSON], str]) -> str:
        return f"brick #{inner} (before compile)"


class BrickPath(Tag[str]):
    """``{"$brick_path": "/layers/0"}``: a brick of the compiled model, by its path.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$brick_path"].text("/layers/0", str)
        '/layers/0'
    """

    name = "$brick_path"

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        if not isinstance(inner, str):
            decoding.fail(f"rebuild: {where} holds a brick path that is not a string")
        return None if decoding.dry else decoding.brick_at(inner, where)

    def text(self, inner: str, text: Callable[[JSON], str]) -> str:
        return str(inner)


def filter_fields(variable_filter: VariableFilter, encode: Callable[[object], JSON]
                  ) -> dict[str, JSON]:
    """The one encoding of a filter: its fields that differ from the defaults, encoded."""
    return {f.name: encode(getattr(variable_filter, f.name))
            for f in dataclasses.fields(variable_filter)
            if getattr(variable_filter, f.name) != f.default}


def plain_filter(fields: Mapping[str, JSON]) -> dict[str, JSON]:
    """:func:`filter_fields` as program records write it: lists for tuples, roles by name
    (their parents are registered by the program's own roles).

    Examples:
        >>> from graphmod._core._codec import plain_filter
        >>> plain_filter({"roles": {"$tuple": [{"$role": {"name": "INPUT", "parents": []}}]}})
        {'roles': ['INPUT']}
    """
    def plain(value: JSON) -> JSON:
        if isinstance(value, Mapping) and set(value) == {"$tuple"}:
            items = value["$tuple"]
            return [plain(v) for v in items] if isinstance(items, list) else value
        if isinstance(value, Mapping) and set(value) == {"$role"}:
            role = value["$role"]
            return role["name"] if isinstance(role, Mapping) else value
        return value

    return {k: plain(v) for k, v in fields.items()}


class Filter(Tag[Mapping[str, JSON]]):
    """``{"$filter": {field: value}}``: a ``VariableFilter`` by the fields it sets (roles as
    ``$role`` entries or, in program records, by name).

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$filter"].text({"name": "W"}, repr)
        "VariableFilter(name='W')"
    """

    name = "$filter"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if not isinstance(value, VariableFilter):
            return SKIP
        return {self.name: filter_fields(value, encode)}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        # Checked by VariableFilter itself: a bad field raises TypeError or ValueError.
        fields: dict[str, Any] = {k: decoding(v, join(where, k))
                                  for k, v in decoding.mapping(inner, where).items()}
        unknown = sorted(set(fields) - set(_FILTER_FIELDS))
        if unknown:
            decoding.fail(f"rebuild: {where} holds unknown filter fields {unknown}")
        if decoding.dry:
            return None
        if isinstance(fields.get("roles"), list):
            fields["roles"] = [_role(r, decoding, join(where, "roles")) if isinstance(r, str)
                               else r for r in fields["roles"]]
        try:
            return VariableFilter(**fields)
        except (TypeError, ValueError) as error:
            raise decoding.error(f"rebuild: {where}: {error}") from None

    def text(self, inner: Mapping[str, JSON], text: Callable[[JSON], str]) -> str:
        return "VariableFilter(" + ", ".join(f"{k}={text(v)}" for k, v in inner.items()) + ")"


def _role(name: str, decoding: Decoding, where: str) -> roles.Role:
    """The registered role ``name``."""
    try:
        return roles.get_role(name)
    except (KeyError, ValueError) as error:
        raise decoding.error(f"rebuild: {where}: {error}") from None


class Optimizer(Tag[_OptimizerRecord]):
    """``{"$optimizer": {"name": ..., "arguments": ...}}``: an optax transformation or
    schedule made with ``graphmod.provenance.optimizer``.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$optimizer"].text({"name": "adam", "arguments": {"learning_rate": 0.1}}, str)
        'adam(learning_rate=0.1)'
    """

    name = "$optimizer"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        recorded = getattr(value, "_graphmod_optimizer", None)
        return SKIP if recorded is None else {self.name: json.loads(recorded)}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        name = decoding.field(inner, "name", where, str)
        # Checked, not resolved: a listed optax name is made by the caller's optimizer().
        decoding.check(f"optax.{name}", "factory", f"{where}.name")
        recorded = decoding.mapping(inner, where).get("arguments", {})
        arguments = {k: decoding(v, f"{where}.arguments.{k}") for k, v in
                     decoding.mapping(recorded, f"{where}.arguments").items()}
        return None if decoding.dry else decoding.optimizer(name, arguments, where)

    def text(self, inner: _OptimizerRecord, text: Callable[[JSON], str]) -> str:
        return call_text(inner.get("name"), inner.get("arguments", {}), text)


class Opaque(Tag[_OpaqueRecord]):
    """``{"$opaque": {"kind", "type", "repr"}}``: a value that cannot be rebuilt (a lambda,
    a traced or large array, a module that is not a brick); reading it back raises.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$opaque"].text({"kind": "callable", "repr": "<lambda>"}, str)
        '<opaque <lambda>>'
    """

    name = "$opaque"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        return opaque("module", value) if isinstance(value, nnx.Module) else SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        inner = inner if isinstance(inner, Mapping) else {}
        decoding.fail(
            f"rebuild: {where} was recorded as opaque ({inner.get('kind')}: "
            f"{inner.get('repr', inner.get('type'))}), so it cannot be rebuilt. "
            + ("Define it at module level in an importable module (a lambda, a local function "
               "or a function of a script has no import path)."
               if inner.get("kind") == "callable" else
               "Pass values graphmod can record: numbers, strings, lists, roles, bricks, "
               "public functions."))

    def text(self, inner: _OpaqueRecord, text: Callable[[JSON], str]) -> str:
        return f"<opaque {inner.get('repr', inner.get('type'))}>"
