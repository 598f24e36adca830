"""What every tag shares: the :class:`Tag` base class, its registry, and :class:`Decoding`.

A tag is written ``{"$name": inner}``. Its class says in one place how a value becomes
``inner`` (:meth:`Tag.encode`), how ``inner`` becomes the value again (:meth:`Tag.decode`,
through a :class:`Decoding` that the caller supplies: it resolves import paths under its
own rules, so the core never imports anything a record names), and how ``inner`` reads as
text (:meth:`Tag.text`). The import paths an entry names are the ones its decoding looks up
(:func:`graphmod._core._codec.import_paths`), so they cannot drift from what decode does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, NoReturn, Protocol

from flax import nnx

from graphmod._core._public_path import public_path

# factory: called with recorded arguments; function: a value; partial: a value bound to
# recorded arguments; class: a class.
Kind = Literal["factory", "function", "partial", "class"]
SKIP: Any = object()  # Tag.encode's answer for a value of another tag
TAGS: dict[str, Tag] = {}  # tag name -> its one instance, filled as tag classes are defined
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Encoding(Protocol):
    """What a tag's ``encode`` calls back: the encoder of nested values and of bricks."""

    def __call__(self, value: Any) -> Any: ...

    def brick(self, brick: Any) -> Any: ...


class Tag:
    """One provenance tag: encode, decode and text of ``{name: inner}`` together.

    Subclasses set :attr:`name`; defining one registers its instance in ``TAGS``.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$tuple"].text([1, 2], str)
        '(1, 2)'
    """

    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        TAGS[cls.name] = cls()

    def encode(self, value: Any, encode: Encoding) -> Any:
        """The JSON of ``value`` if this tag writes it, else ``SKIP`` (written by another
        tag, or only made by other means: a brick path is written at compile)."""
        return SKIP

    def decode(self, inner: Any, decoding: Decoding, where: str) -> Any:
        """The value ``inner`` stands for (None when ``decoding.dry``, after checking it)."""
        raise NotImplementedError

    def text(self, inner: Any, text: Callable[[Any], str]) -> str:
        """``inner`` as short text; ``text`` renders nested values."""
        raise NotImplementedError


def join(where: str, key: Any) -> str:
    """The location of ``key`` inside ``where``: ``a[0]``, ``a.b``."""
    return f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"


class Decoding:
    """Walks a recorded value, decoding each tag by its class.

    The caller supplies what the core must not decide: :meth:`lookup` and :meth:`check`
    (import paths, under the caller's safety rules), :meth:`build` (constructing a brick or
    manager), :meth:`optimizer`, :meth:`dynamic`, :meth:`brick_at`, the :attr:`classes` a
    ``$class`` may name and the :attr:`error` raised for a bad entry. With ``dry=True`` it
    only checks: tags return None and nothing named is imported, built or called.
    """

    error: type[Exception] = ValueError
    classes: tuple[type, ...] = (nnx.Module,)

    def __init__(self, *, dry: bool) -> None:
        self.dry = dry

    def check(self, path: Any, kind: Kind, where: str) -> None:
        """Raises unless ``path`` may be resolved as a ``kind``; imports nothing."""
        raise NotImplementedError

    def lookup(self, path: Any, kind: Kind, where: str) -> Any:
        """The object at ``path`` (None when dry, after checking it)."""
        raise NotImplementedError

    def build(self, cls: type, path: str, arguments: dict[str, Any], where: str,
              kind: str) -> Any:
        """The brick or manager ``cls`` (recorded as ``path``) constructed with recorded
        ``arguments``; ``kind`` is ``"brick"`` or ``"manager"``."""
        raise NotImplementedError

    def optimizer(self, name: str, arguments: dict[str, Any], where: str) -> Any:
        """The optax transformation ``optax.<name>`` made with recorded ``arguments``."""
        raise NotImplementedError

    def dynamic(self, value: Any) -> Any:
        """A dynamic hyperparameter holding ``value``."""
        raise NotImplementedError

    def brick_at(self, path: str, where: str) -> Any:
        """The brick at ``path`` in the model being rebuilt."""
        raise NotImplementedError

    def fail(self, message: str) -> NoReturn:
        """Raises :attr:`error` with ``message`` (which names the field)."""
        raise self.error(message)

    def field(self, inner: Any, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
        """``inner[key]``, which must be a ``kind``; raises naming ``where`` otherwise."""
        if not isinstance(inner, Mapping) or not isinstance(inner.get(key), kind):
            self.fail(f"rebuild: {where} lacks a valid {key!r} entry; the record is damaged "
                      "or crafted")
        return inner[key]

    def mapping(self, value: Any, where: str) -> Mapping[str, Any]:
        """``value``, which must be a mapping; raises naming ``where`` otherwise."""
        if not isinstance(value, Mapping):
            self.fail(f"rebuild: {where} is {type(value).__name__}, not a mapping; the record "
                      "is damaged or crafted")
        return value

    def __call__(self, value: Any, where: str) -> Any:
        if isinstance(value, Mapping):
            if len(value) == 1 and str(next(iter(value))).startswith("$"):
                (tag, inner), = value.items()
                return self.tagged(tag, inner, where)
            self.fail(f"rebuild: {where} is a mapping without a tag; the record is damaged "
                      "or crafted")
        if isinstance(value, tuple | list):
            return [self(v, join(where, i)) for i, v in enumerate(value)]
        return value

    def tagged(self, tag: str, inner: Any, where: str) -> Any:
        """The value of ``{tag: inner}``; a malformed entry raises :attr:`error`."""
        if tag not in TAGS:
            self.fail(f"rebuild: {where} holds an unknown tag {tag!r}; the record was written "
                      "by a newer graphmod, or is damaged")
        try:
            return TAGS[tag].decode(inner, self, where)
        except self.error:
            raise
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
            raise self.error(f"rebuild: {where} holds a malformed {tag} entry "
                             f"({type(error).__name__}: {error}); the record is damaged or "
                             "crafted") from error


def short_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` without memory addresses, cut to ``limit`` characters.

    Examples:
        >>> from graphmod._core._codec import short_repr
        >>> short_repr(object())
        '<object object>'
    """
    try:
        text = _ADDRESS.sub("", repr(value))
    except Exception:  # a broken __repr__ must not break construction
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def class_path(cls: type) -> str:
    """A class's public import path, or ``module.qualname`` when it has none.

    Examples:
        >>> import graphmod as gm
        >>> from graphmod._core._codec import class_path
        >>> class_path(gm.bricks.Linear)
        'graphmod.bricks.Linear'
    """
    return public_path(cls) or f"{cls.__module__}.{cls.__qualname__}"


def opaque(kind: str, value: Any, **extra: Any) -> dict[str, Any]:
    """The record of a value that cannot be rebuilt: its kind, type and repr."""
    return {"$opaque": {"kind": kind, "type": class_path(type(value)),
                        "repr": short_repr(value), **extra}}


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in an ellipsis when cut."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def call_text(name: Any, arguments: Mapping[str, Any] | None, text: Callable[[Any], str],
              limit: int = 200) -> str:
    """``name(arg=value, ...)`` of recorded arguments, each shown by ``text``."""
    parts = [f"{k}={text(v)}" for k, v in (arguments or {}).items()]
    return cut(f"{name}({', '.join(parts)})", limit)
