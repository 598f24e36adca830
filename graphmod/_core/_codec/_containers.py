"""Containers JSON has no type for: tuples, dicts (kept apart from records), other mappings."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from graphmod._core._codec._tag import SKIP, Decoding, Encoding, Skip, Tag, join
from graphmod.typing import JSON


class Tuple(Tag[Sequence[JSON]]):
    """``{"$tuple": [...]}``: a tuple (not a named tuple).

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$tuple"].encode((1, 2), lambda v: v)
        {'$tuple': [1, 2]}
    """

    name = "$tuple"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {self.name: [encode(v) for v in value]}
        return SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        return tuple(decoding.items(decoding.sequence(inner, where), where))

    def text(self, inner: Sequence[JSON], text: Callable[[JSON], str]) -> str:
        items = [text(v) for v in inner]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


class Dict(Tag[Mapping[str, JSON]]):
    """``{"$dict": {...}}``: a mapping with string keys.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$dict"].text({"a": 1}, str)
        "{'a': 1}"
    """

    name = "$dict"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return {self.name: {k: encode(v) for k, v in value.items()}}
        return SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        items = {k: decoding(v, join(where, k))
                 for k, v in decoding.mapping(inner, where).items()}
        return None if decoding.dry else items

    def text(self, inner: Mapping[str, JSON], text: Callable[[JSON], str]) -> str:
        return "{" + ", ".join(f"{k!r}: {text(v)}" for k, v in inner.items()) + "}"


class Items(Tag[Sequence[Sequence[JSON]]]):
    """``{"$items": [[key, value], ...]}``: a mapping with other keys (lists read back as
    tuples, so they can be keys again).

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$items"].text([[1, "a"]], repr)
        "{1: 'a'}"
    """

    name = "$items"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if isinstance(value, Mapping):
            return {self.name: [[encode(k), encode(v)] for k, v in value.items()]}
        return SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        pairs: list[tuple[object, object]] = []
        for i, pair in enumerate(decoding.sequence(inner, where)):
            k, v = decoding.sequence(pair, f"{where}[{i}]")
            pairs.append((decoding(k, f"{where}[{i}]"), decoding(v, f"{where}[{i}]")))
        return None if decoding.dry else {_hashable(k): v for k, v in pairs}

    def text(self, inner: Sequence[Sequence[JSON]], text: Callable[[JSON], str]) -> str:
        return "{" + ", ".join(f"{text(k)}: {text(v)}" for k, v in inner) + "}"


def _hashable(value: object) -> object:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
