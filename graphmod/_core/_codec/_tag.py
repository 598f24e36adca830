"""What every tag shares: the :class:`Tag` base class, its registry, and :class:`Decoding`.

A tag is written ``{"$name": inner}``. Its class says in one place how a value becomes
``inner`` (:meth:`Tag.encode`), how ``inner`` becomes the value again (:meth:`Tag.decode`,
through a :class:`Decoding` that the caller supplies: it resolves import paths under its
own rules, so the core never imports anything a record names), and how ``inner`` reads as
text (:meth:`Tag.text`). The import paths an entry names are the ones its decoding looks up
(:func:`graphmod._core._codec.import_paths`), so they cannot drift from what decode does.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final, Generic, Literal, NoReturn, Protocol, TypeVar, overload

from flax import nnx

from graphmod._core._public_path import public_path
from graphmod.typing import JSON

# factory: called with recorded arguments; function: a value; partial: a value bound to
# recorded arguments; class: a class.
Kind = Literal["factory", "function", "partial", "class"]
FunctionKind = Literal["factory", "function", "partial"]


class Skip(enum.Enum):
    """The type of :data:`SKIP`, ``Tag.encode``'s answer for a value another tag writes."""

    SKIP = "skip"


SKIP: Final = Skip.SKIP
# A tag's inner record as its encode writes it (what its text reads); Tag[Any]: any tag.
InnerT = TypeVar("InnerT", contravariant=True)
T = TypeVar("T")
V = TypeVar("V")
TAGS: dict[str, Tag[Any]] = {}  # tag name -> its one instance, filled as tags are defined
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Encoding(Protocol):
    """What a tag's ``encode`` calls back: the encoder of nested values and of bricks."""

    def __call__(self, value: object) -> JSON: ...

    def brick(self, brick: object) -> JSON: ...


class Tag(Generic[InnerT]):
    """One provenance tag: encode, decode and text of ``{name: inner}`` together.

    Subclasses set :attr:`name` and the type of their inner record (``Tag[str]``); defining
    one registers its instance in ``TAGS``.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$tuple"].text([1, 2], str)
        '(1, 2)'
    """

    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        TAGS[cls.name] = cls()

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        """The JSON of ``value`` if this tag writes it, else ``SKIP`` (written by another
        tag, or only made by other means: a brick path is written at compile)."""
        return SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        """The value ``inner`` (as a record holds it, unchecked) stands for (None when
        ``decoding.dry``, after checking it)."""
        raise NotImplementedError

    def text(self, inner: InnerT, text: Callable[[JSON], str]) -> str:
        """``inner`` as short text; ``text`` renders nested values."""
        raise NotImplementedError


def join(where: str, key: object) -> str:
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

    def check(self, path: object, kind: Kind, where: str) -> None:
        """Raises unless ``path`` may be resolved as a ``kind``; imports nothing."""
        raise NotImplementedError

    @overload
    def lookup(self, path: object, kind: Literal["class"], where: str) -> type | None: ...

    @overload
    def lookup(self, path: object, kind: FunctionKind, where: str
               ) -> Callable[..., object] | None: ...

    def lookup(self, path: object, kind: Kind, where: str
               ) -> type | Callable[..., object] | None:
        """The object at ``path``, a class or a function as ``kind`` says (None when dry,
        after checking it)."""
        raise NotImplementedError

    def build(self, cls: type, path: str, arguments: dict[str, object], where: str,
              kind: Literal["brick", "manager"]) -> object:
        """The brick or manager ``cls`` (recorded as ``path``) constructed with recorded
        ``arguments``; ``kind`` is ``"brick"`` or ``"manager"``."""
        raise NotImplementedError

    def optimizer(self, name: str, arguments: dict[str, object], where: str) -> object:
        """The optax transformation ``optax.<name>`` made with recorded ``arguments``."""
        raise NotImplementedError

    def dynamic(self, value: object) -> object:
        """A dynamic hyperparameter holding ``value``."""
        raise NotImplementedError

    def brick_at(self, path: str, where: str) -> object:
        """The brick at ``path`` in the model being rebuilt."""
        raise NotImplementedError

    def fail(self, message: str) -> NoReturn:
        """Raises :attr:`error` with ``message`` (which names the field)."""
        raise self.error(message)

    def field(self, inner: object, key: str, where: str,
              kind: type[T] | tuple[type[T], ...]) -> T:
        """``inner[key]``, which must be a ``kind``; raises naming ``where`` otherwise."""
        value = inner.get(key) if isinstance(inner, Mapping) else None
        if not isinstance(value, kind):
            self.fail(f"rebuild: {where} lacks a valid {key!r} entry; the record is damaged "
                      "or crafted")
        return value

    def mapping(self, value: object, where: str) -> Mapping[str, object]:
        """``value``, which must be a mapping; raises naming ``where`` otherwise."""
        if not isinstance(value, Mapping):
            self.fail(f"rebuild: {where} is {type(value).__name__}, not a mapping; the record "
                      "is damaged or crafted")
        return value

    def sequence(self, value: object, where: str) -> Sequence[object]:
        """``value``, which must be a list (or a tuple); raises naming ``where`` otherwise."""
        if not isinstance(value, tuple | list):
            self.fail(f"rebuild: {where} is {type(value).__name__}, not a list; the record is "
                      "damaged or crafted")
        return value

    def items(self, values: Iterable[object], where: str) -> list[object]:
        """Each of ``values`` decoded, at ``where[i]`` (Nones when dry)."""
        return [self(v, join(where, i)) for i, v in enumerate(values)]

    def __call__(self, value: object, where: str) -> object:
        if isinstance(value, Mapping):
            if len(value) == 1 and str(next(iter(value))).startswith("$"):
                (tag, inner), = value.items()
                return self.tagged(tag, inner, where)
            self.fail(f"rebuild: {where} is a mapping without a tag; the record is damaged "
                      "or crafted")
        if isinstance(value, tuple | list):
            return self.items(value, where)
        return value

    def tagged(self, tag: str, inner: object, where: str) -> object:
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


def short_repr(value: object, limit: int = 120) -> str:
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


def opaque(kind: str, value: object, **extra: JSON) -> dict[str, JSON]:
    """The record of a value that cannot be rebuilt: its kind, type and repr."""
    return {"$opaque": {"kind": kind, "type": class_path(type(value)),
                        "repr": short_repr(value), **extra}}


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in an ellipsis when cut."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def call_text(name: object, arguments: Mapping[str, V] | None, text: Callable[[V], str],
              limit: int = 200) -> str:
    """``name(arg=value, ...)`` of recorded arguments, each shown by ``text``."""
    parts = [f"{k}={text(v)}" for k, v in (arguments or {}).items()]
    return cut(f"{name}({', '.join(parts)})", limit)
