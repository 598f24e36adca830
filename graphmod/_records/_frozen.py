"""Frozen JSON values: what a provenance record holds, and its canonical text.

A frozen value is ``None``, a bool, an int, a finite float, a str, a tuple of frozen values
or a :class:`FrozenDict` (str keys) of them. Non-finite floats are stored tagged
(``{"$float": "nan"}``), so every frozen value survives a JSON round trip unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import types
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn, TypeAlias

import numpy as np

from graphmod.typing import JSON

Frozen: TypeAlias = "bool | int | float | str | tuple[Frozen, ...] | FrozenDict | None"
"""A frozen JSON value (see the module docstring)."""


# Values are read as Any: records are navigated by the keys their kind holds, like the
# json.loads output they round-trip with (each value is a Frozen one).
class FrozenDict(Mapping[str, Any]):
    """An immutable mapping with str keys (insertion order kept) of frozen values.

    Examples:
        >>> from graphmod._records._frozen import freeze
        >>> d = freeze({"b": [1, 2], "a": None})
        >>> d["b"], list(d)
        ((1, 2), ['b', 'a'])
    """

    __slots__ = ("_data", "_hash")
    _data: types.MappingProxyType[str, Frozen]
    _hash: int | None  # computed when first asked for

    def __init__(self, data: Mapping[str, Frozen]) -> None:
        # A read-only view of a dict nothing else references: no way in to change it.
        object.__setattr__(self, "_data", types.MappingProxyType(dict(data)))
        object.__setattr__(self, "_hash", None)

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError("provenance values are immutable")

    def __delattr__(self, key: str) -> None:
        raise AttributeError("provenance values are immutable")

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._data) == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        known = self._hash
        if known is None:
            known = hash(canonical_json(self))
            object.__setattr__(self, "_hash", known)
        return known

    def __repr__(self) -> str:
        return repr(dict(self._data))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> FrozenDict:
        return self

    def __reduce__(self) -> tuple[type[FrozenDict], tuple[dict[str, Frozen]]]:
        return FrozenDict, (dict(self._data),)


def freeze(value: object, where: str = "value") -> Frozen:
    """``value`` as a frozen JSON value; raises naming ``where`` for anything else."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        number = float(value)
        return number if math.isfinite(number) else FrozenDict({"$float": repr(number)})
    if isinstance(value, FrozenDict):
        return value
    if isinstance(value, Mapping):
        out: dict[str, Frozen] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: provenance keys must be strings, got {key!r}")
            out[key] = freeze(item, f"{where}.{key}")
        return FrozenDict(out)
    if isinstance(value, list | tuple):
        return tuple(freeze(item, f"{where}[{i}]") for i, item in enumerate(value))
    raise TypeError(f"{where}: {type(value).__name__} {value!r} is not a JSON value "
                    "(None, bool, int, float, str, list or dict)")


def thaw(value: Frozen) -> JSON:
    """A frozen value as plain dicts and lists (for ``json.dumps``)."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [thaw(item) for item in value]
    return value


def to_text(value: Frozen, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """JSON text of a frozen value (strict: no NaN)."""
    return json.dumps(thaw(value), indent=indent, sort_keys=sort_keys, allow_nan=False,
                      ensure_ascii=False, separators=None if indent else (",", ":"))


def canonical_json(value: Frozen) -> str:
    """The canonical text of a frozen value: sorted keys, no spaces."""
    return to_text(value, sort_keys=True)


def sha256(text: str) -> str:
    """``"sha256:<hex>"`` of ``text``."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"provenance JSON: {name} is not valid JSON (write non-finite floats as "
                     '{"$float": "nan"})')


def parse(text: str | bytes) -> Frozen:
    """Parses JSON text into a frozen value; only data, never code (no object hooks)."""
    if isinstance(text, bytes):
        text = text.decode()
    if not isinstance(text, str):
        raise TypeError(f"Provenance.from_json: expected JSON text, got {type(text).__name__}")
    return freeze(json.loads(text, parse_constant=_reject_constant), "provenance")
