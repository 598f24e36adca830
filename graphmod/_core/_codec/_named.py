"""Values recorded by name: roles, enum members, classes, functions, factory calls,
partials and applications. Every import path here is looked up through the caller's
:class:`~graphmod._core._codec.Decoding`, which checks it before anything is imported.
"""

from __future__ import annotations

import enum
import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import TypedDict

from flax import nnx

from graphmod import roles
from graphmod._core._codec._tag import (
    SKIP,
    Decoding,
    Encoding,
    Skip,
    Tag,
    call_text,
    class_path,
    opaque,
)
from graphmod._core._public_path import public_path
from graphmod._core._selection._filter import (
    BoundApplication,
    ClassApplication,
    bound_application,
    class_application,
)
from graphmod.typing import JSON


# The inner records the tags below write (what their text reads).
class _RoleRecord(TypedDict):
    name: str
    parents: list[str]


_EnumRecord = TypedDict("_EnumRecord", {"class": str, "name": str})


class _CallRecord(TypedDict):
    function: str
    kwargs: dict[str, JSON]


class _PartialRecord(TypedDict):
    function: JSON
    args: list[JSON]
    kwargs: dict[str, JSON]


_ClassApplicationRecord = TypedDict("_ClassApplicationRecord", {"class": JSON, "name": str})


class _BoundApplicationRecord(TypedDict):
    brick: JSON
    name: str


class Role(Tag[_RoleRecord]):
    """``{"$role": {"name": ..., "parents": [...]}}``: a role with its chain of parents, so
    a role of your own is registered again when read back.

    Examples:
        >>> from graphmod import roles
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$role"].encode(roles.WEIGHT, repr)
        {'$role': {'name': 'WEIGHT', 'parents': ['PARAMETER', 'PERSISTENT']}}
    """

    name = "$role"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if not isinstance(value, roles.Role):
            return SKIP
        chain: list[JSON] = []
        role = value.parent
        while role is not None:
            chain.append(role.name)
            role = role.parent
        return {self.name: {"name": value.name, "parents": chain}}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        name = decoding.field(inner, "name", where, str)
        parents = decoding.field(inner, "parents", where, (tuple, list))
        if not all(isinstance(p, str) for p in parents):
            decoding.fail(f"rebuild: {where} holds role parents that are not names")
        if decoding.dry:
            return None
        parent = None
        for parent_name in reversed(list(parents)):
            parent = roles.add_role(parent_name, parent)
        return roles.add_role(name, parent)

    def text(self, inner: _RoleRecord, text: Callable[[JSON], str]) -> str:
        return str(inner["name"])


class Enum(Tag[_EnumRecord]):
    """``{"$enum": {"class": ..., "name": ...}}``: a member of a public enum class.

    Examples:
        >>> import enum
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$enum"].text({"class": "mypackage.Mode", "name": "FAST"}, str)
        'mypackage.Mode.FAST'
    """

    name = "$enum"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if not isinstance(value, enum.Enum):
            return SKIP
        path = public_path(type(value))
        return {self.name: {"class": path, "name": value.name}} if path else \
            opaque("enum", value)

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        path = decoding.field(inner, "class", where, str)
        cls = decoding.lookup(path, "class", where)
        name = decoding.field(inner, "name", where, str)
        if decoding.dry:
            return None
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)) \
                or name not in cls.__members__:
            decoding.fail(f"rebuild: {where} names {path}.{name}, which is not a "
                          "member of an enum")
        return cls.__members__[name]

    def text(self, inner: _EnumRecord, text: Callable[[JSON], str]) -> str:
        return f"{inner['class']}.{inner['name']}"


class Class(Tag[str]):
    """``{"$class": path}``: a brick, manager or Flax module class by its public path.

    Examples:
        >>> import graphmod as gm
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$class"].encode(gm.bricks.Linear, repr)
        {'$class': 'graphmod.bricks.Linear'}
    """

    name = "$class"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if not isinstance(value, type):
            return SKIP
        path = public_path(value)
        return {self.name: path} if path else opaque("class", value)

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        cls = decoding.lookup(inner, "class", where)
        if cls is None or issubclass(cls, decoding.classes):  # None: dry
            return cls
        decoding.fail(f"rebuild: {where} names {inner!r}, which is not a brick, manager or "
                      "Flax module class")

    def text(self, inner: str, text: Callable[[JSON], str]) -> str:
        return str(inner)


class Function(Tag[str]):
    """``{"$callable": path}``: a public function passed as a value (``jax.nn.relu``);
    rebuild hands it to the brick that takes it, never calls it.

    Examples:
        >>> import jax
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$callable"].encode(jax.nn.relu, repr)
        {'$callable': 'jax.nn.relu'}
    """

    name = "$callable"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        path = public_path(value) if callable(value) else None
        return SKIP if path is None else {self.name: path}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        return decoding.lookup(inner, "function", where)

    def text(self, inner: str, text: Callable[[JSON], str]) -> str:
        return str(inner)


def _factory_call(fn: object) -> tuple[str, dict[str, object]] | None:
    """``(factory path, kwargs)`` for a closure made by a public factory function, as
    ``jax.nn.initializers.normal(0.02)`` makes one; None otherwise."""
    qualname = getattr(fn, "__qualname__", "")
    outer, sep, inner = qualname.partition(".<locals>.")
    if not sep or "." in outer or "<" in inner or not inspect.isfunction(fn):
        return None

    factory = getattr(sys.modules.get(fn.__module__), outer, None)
    if not inspect.isfunction(factory):
        return None
    path = public_path(factory)
    if path is None:
        return None
    parameters = inspect.signature(factory).parameters
    kwargs: dict[str, object] = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        if name not in parameters:
            return None
        try:
            kwargs[name] = cell.cell_contents
        except ValueError:
            return None
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.default is not parameter.empty and name in parameters:
            kwargs.setdefault(name, parameter.default)
    return path, kwargs


class Call(Tag[_CallRecord]):
    """``{"$call": {"function": path, "kwargs": {...}}}``: what a listed factory returns
    (an initializer made by ``jax.nn.initializers.normal(0.02)``).

    Examples:
        >>> import jax
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$call"].encode(jax.nn.initializers.normal(0.5), repr)["$call"]["function"]
        'jax.nn.initializers.normal'
    """

    name = "$call"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        made = _factory_call(value) if callable(value) else None
        if made is None:
            return SKIP
        return {self.name: {"function": made[0],
                            "kwargs": {k: encode(v) for k, v in made[1].items()}}}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        path = decoding.field(inner, "function", where, str)
        factory = decoding.lookup(path, "factory", where)
        kwargs = {k: decoding(v, f"{where}.kwargs.{k}")
                  for k, v in decoding.field(inner, "kwargs", where, Mapping).items()}
        if decoding.dry or factory is None:  # None: dry
            return None
        try:
            return factory(**kwargs)
        except Exception as error:
            raise decoding.error(f"rebuild: {where}: calling {path}(...) failed: "
                                 f"{type(error).__name__}: {error}") from error

    def text(self, inner: _CallRecord, text: Callable[[JSON], str]) -> str:
        return call_text(inner["function"], inner["kwargs"], text)


_FUNCTION_TAGS = ("$callable", "$call", "$partial")


class Partial(Tag[_PartialRecord]):
    """``{"$partial": {"function": ..., "args": [...], "kwargs": {...}}}``: a
    ``functools.partial`` of a recorded function.

    Examples:
        >>> import functools, jax
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$partial"].text({"function": {"$callable": "jax.nn.gelu"}}, str)
        "partial({'$callable': 'jax.nn.gelu'}, ...)"
    """

    name = "$partial"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if not isinstance(value, functools.partial):
            return SKIP
        return {self.name: {"function": encode(value.func),
                            "args": [encode(a) for a in value.args],
                            "kwargs": {k: encode(v) for k, v in value.keywords.items()}}}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        function = decoding.field(inner, "function", where, Mapping)
        if len(function) != 1 or next(iter(function)) not in _FUNCTION_TAGS:
            decoding.fail(f"rebuild: {where}.function must be a recorded function "
                          f"({', '.join(_FUNCTION_TAGS)}); the record is damaged or crafted")
        (tag, path), = function.items()
        # Bound to recorded arguments, a function value is held to the allow list everywhere.
        bound = decoding.lookup(path, "partial", f"{where}.function") \
            if tag == "$callable" else decoding(function, f"{where}.function")
        args = decoding.items(decoding.field(inner, "args", where, (tuple, list)),
                              f"{where}.args")
        kwargs = {k: decoding(v, f"{where}.kwargs.{k}")
                  for k, v in decoding.field(inner, "kwargs", where, Mapping).items()}
        if decoding.dry:
            return None
        if not callable(bound):  # a factory's product
            decoding.fail(f"rebuild: {where}.function makes a {type(bound).__name__}, not a "
                          "function")
        return functools.partial(bound, *args, **kwargs)

    def text(self, inner: _PartialRecord, text: Callable[[JSON], str]) -> str:
        return f"partial({text(inner['function'])}, ...)"


class Application(Tag[str]):
    """``{"$application": name}``: an application of every brick, by name (an unbound
    ``@graphmod.application`` method).

    Examples:
        >>> import graphmod as gm
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$application"].encode(gm.bricks.Linear.apply, repr)
        {'$application': 'apply'}
    """

    name = "$application"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        name = getattr(value, "__graphmod_application__", None)
        return {self.name: name} if isinstance(name, str) else SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        return str(inner)

    def text(self, inner: str, text: Callable[[JSON], str]) -> str:
        return f"application {inner!r}"


class ClassApplicationTag(Tag[_ClassApplicationRecord]):
    """``{"$class_application": {"class": {"$class": ...}, "name": ...}}``: an unbound Flax
    method (``nnx.Linear.__call__``), by its class: every instance's application.

    Examples:
        >>> from flax import nnx
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$class_application"].encode(nnx.Linear.__call__, repr)
        {'$class_application': {'class': {'$class': 'flax.nnx.nn.linear.Linear'}, 'name': 'apply'}}
    """

    name = "$class_application"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        application = class_application(value)
        if application is None:
            return SKIP
        return {self.name: {"class": {"$class": class_path(application.owner)},
                            "name": application.name}}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        cls = decoding(decoding.field(inner, "class", where, Mapping), f"{where}.class")
        name = decoding.field(inner, "name", where, str)
        if decoding.dry:
            return None
        if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
            decoding.fail(f"rebuild: {where} names {cls!r}, which is not a flax.nnx.Module "
                          "class")
        return ClassApplication(cls, name)

    def text(self, inner: _ClassApplicationRecord, text: Callable[[JSON], str]) -> str:
        return f"{text(inner['class'])}.{inner['name']}"


class BoundApplicationTag(Tag[_BoundApplicationRecord]):
    """``{"$bound_application": {"brick": ..., "name": ...}}``: one brick instance's
    application (a bound method), recorded with the brick.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$bound_application"].text(
        ...     {"brick": {"$brick_path": "/layers/0"}, "name": "apply"}, str)
        "{'$brick_path': '/layers/0'}.apply"
    """

    name = "$bound_application"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        bound = bound_application(value)
        if bound is None:
            return SKIP
        return {self.name: {"brick": encode.brick(bound.brick), "name": bound.name}}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        brick = decoding(decoding.field(inner, "brick", where, Mapping), f"{where}.brick")
        name = decoding.field(inner, "name", where, str)
        return None if decoding.dry else BoundApplication(brick, name)

    def text(self, inner: _BoundApplicationRecord, text: Callable[[JSON], str]) -> str:
        return f"{text(inner['brick'])}.{inner['name']}"
