"""Numbers JSON cannot hold and arrays: non-finite floats, dtypes, arrays, PRNG keys, Rngs.

None of these names an import path: they decode the same way in both passes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Protocol, TypedDict, TypeGuard, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.core import Tracer

from graphmod._core._codec._tag import SKIP, Decoding, Encoding, Skip, Tag, opaque
from graphmod._core._program._arguments import is_key
from graphmod.typing import JSON, ArrayLike

MAX_ARRAY = 4096  # larger arrays are recorded by shape, dtype and hash only
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


# The inner records the tags below write (what their text reads).
class _KeyRecord(TypedDict):
    impl: str
    data: list[int]


class _ArrayRecord(TypedDict):
    kind: str  # "scalar", "numpy" or "jax": what it reads back as
    dtype: str
    shape: list[int]
    data: list[int | float | str]  # non-finite floats as their repr


class _StreamRecord(TypedDict):
    key: _KeyRecord
    count: int


class _Digest(Protocol):
    """What :func:`hash_array` feeds: a ``hashlib`` hash."""

    def update(self, data: bytes, /) -> None: ...


DigestT = TypeVar("DigestT", bound=_Digest)


def host_array(value: ArrayLike) -> np.ndarray:
    """A concrete array on the host; a typed PRNG key as its key data.

    Examples:
        >>> import jax
        >>> from graphmod._core._codec import host_array
        >>> host_array(jax.random.key(0)).dtype
        dtype('uint32')
    """
    return np.asarray(jax.random.key_data(value) if isinstance(value, jax.Array) and is_key(value)
                      else value)


def hash_array(digest: DigestT, array: np.ndarray, header: str = "") -> DigestT:
    """The one array hash of records: feeds ``header`` (what the caller records of the
    array: dtype, shape, path), then the array's bytes in C order, to ``digest`` (a
    ``hashlib`` hash); returns ``digest``.

    Examples:
        >>> import hashlib, numpy as np
        >>> from graphmod._core._codec import hash_array
        >>> hash_array(hashlib.sha256(), np.zeros(2, np.uint8)).hexdigest()[:12]
        '96a296d224f2'
    """
    digest.update(header.encode())
    digest.update(np.ascontiguousarray(array).tobytes())
    return digest


class Float(Tag[str]):
    """A float; ``{"$float": "nan"}`` for the non-finite ones JSON cannot hold.

    Examples:
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$float"].encode(float("inf"), repr)
        {'$float': 'inf'}
    """

    name = "$float"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if not isinstance(value, float):
            return SKIP
        return value if math.isfinite(value) else {self.name: repr(value)}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        return float(str(inner))

    def text(self, inner: str, text: Callable[[JSON], str]) -> str:
        return str(inner)


def _is_dtype(value: object) -> TypeGuard[np.dtype | type]:
    if isinstance(value, np.dtype):
        return True
    return isinstance(value, type) and (issubclass(value, np.generic)
                                        or type(value).__name__ == "_ScalarMeta")


class Dtype(Tag[str]):
    """``{"$dtype": "float32"}``: a numeric or boolean dtype (``jnp.float32`` included).

    Examples:
        >>> import numpy as np
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$dtype"].encode(np.float32, repr)
        {'$dtype': 'float32'}
    """

    name = "$dtype"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        return {self.name: np.dtype(value).name} if _is_dtype(value) else SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        return _dtype(inner, decoding, where)

    def text(self, inner: str, text: Callable[[JSON], str]) -> str:
        return str(inner)


def _dtype(name: object, decoding: Decoding, where: str) -> np.dtype:
    """A numeric or boolean dtype by name; objects, strings and raw bytes are refused."""
    dtype = np.dtype(str(name))
    if dtype != np.bool_ and not jax.numpy.issubdtype(dtype, np.number):
        decoding.fail(f"rebuild: {where} names the dtype {str(name)!r}; only numeric and "
                      "boolean dtypes are recorded")
    return dtype


def key_data_record(key: jax.Array) -> dict[str, JSON]:
    """``{"impl": ..., "data": [...]}`` of a concrete typed PRNG key."""
    return {"impl": str(jax.random.key_impl(key)),
            "data": np.asarray(jax.random.key_data(key)).tolist()}


def _key(inner: object, decoding: Decoding, where: str) -> jax.Array:
    """A typed PRNG key from its implementation's name and key data."""
    impl = decoding.field(inner, "impl", where, str)
    if impl not in _KEY_IMPLS:
        decoding.fail(f"rebuild: {where}: unknown PRNG implementation {impl!r}")
    data = np.asarray(decoding.mapping(inner, where)["data"], np.uint32)
    return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=impl)


class Key(Tag[_KeyRecord]):
    """``{"$key": {"impl": ..., "data": [...]}}``: a typed PRNG key by its key data.

    Examples:
        >>> import jax
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$key"].encode(jax.random.key(0), repr)
        {'$key': {'impl': 'threefry2x32', 'data': [0, 0]}}
    """

    name = "$key"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if isinstance(value, jax.Array) and not isinstance(value, Tracer) and is_key(value):
            return {self.name: key_data_record(value)}
        return SKIP

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        return _key(inner, decoding, where)

    def text(self, inner: _KeyRecord, text: Callable[[JSON], str]) -> str:
        return f"key({list(inner['data'])})"


class Array(Tag[_ArrayRecord]):
    """``{"$array": {"kind", "dtype", "shape", "data"}}``: a small numeric array by value;
    a large one, or one of strings or objects, is opaque with its shape, dtype and hash.

    Examples:
        >>> import numpy as np
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$array"].text(TAGS["$array"].encode(np.ones(2), repr)["$array"], str)
        'array(2,) float64'
    """

    name = "$array"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if not isinstance(value, jax.Array | np.ndarray | np.generic):
            return SKIP
        if isinstance(value, Tracer):
            return opaque("traced array", value, shape=list(value.shape),
                          dtype=str(value.dtype))
        host = np.asarray(value)
        kind = "scalar" if isinstance(value, np.generic) else \
            "numpy" if isinstance(value, np.ndarray) else "jax"
        if host.size > MAX_ARRAY or host.dtype.kind not in "biuf":
            return opaque("array", value, shape=list(host.shape), dtype=host.dtype.name,
                          sha256=hash_array(hashlib.sha256(), host).hexdigest())
        data = host.ravel().tolist()
        if host.dtype.kind == "f":  # non-finite values as strings float() reads back
            data = [v if math.isfinite(v) else repr(v) for v in data]
        return {self.name: {"kind": kind, "dtype": host.dtype.name,
                            "shape": list(host.shape), "data": data}}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        dtype = _dtype(decoding.field(inner, "dtype", where, str), decoding, where)
        data = [float(v) if isinstance(v, str) else v
                for v in decoding.field(inner, "data", where, (tuple, list))]
        if not all(isinstance(v, int | float) for v in data):
            decoding.fail(f"rebuild: {where} holds array data that are not numbers")
        shape = tuple(decoding.field(inner, "shape", where, (tuple, list)))
        array = np.asarray(data, dtype).reshape(shape)
        kind = decoding.mapping(inner, where).get("kind")
        if kind == "scalar":
            return dtype.type(array.item())
        if kind == "jax":
            return jax.numpy.asarray(array)
        return array

    def text(self, inner: _ArrayRecord, text: Callable[[JSON], str]) -> str:
        return f"array{tuple(inner['shape'])} {inner['dtype']}"


class Rngs(Tag[Mapping[str, _StreamRecord]]):
    """``{"$rngs": {stream: {"key": ..., "count": n}}}``: ``nnx.Rngs`` with each stream's
    key data and count as they were at construction.

    Examples:
        >>> from flax import nnx
        >>> from graphmod._core._codec import TAGS
        >>> TAGS["$rngs"].encode(nnx.Rngs(0), repr)["$rngs"]["default"]["count"]
        0
    """

    name = "$rngs"

    def encode(self, value: object, encode: Encoding) -> JSON | Skip:
        if not isinstance(value, nnx.Rngs):
            return SKIP
        streams: dict[str, JSON] = {}
        for name, stream in vars(value).items():
            if not isinstance(stream, nnx.RngStream):
                continue
            key, count = stream.key[...], stream.count[...]
            if isinstance(key, Tracer) or isinstance(count, Tracer):
                return opaque("traced rngs", value)
            streams[name] = {"key": key_data_record(key), "count": int(count)}
        return {self.name: streams}

    def decode(self, inner: object, decoding: Decoding, where: str) -> object:
        streams = decoding.mapping(inner, where)
        rngs = nnx.Rngs(**{
            name: _key(decoding.field(s, "key", f"{where}.{name}", Mapping), decoding,
                       f"{where}.{name}.key")
            for name, s in streams.items()})
        for name, stream in streams.items():
            count = getattr(rngs, name).count
            count[...] = jax.numpy.asarray(
                decoding.field(stream, "count", f"{where}.{name}", int), count[...].dtype)
        return rngs

    def text(self, inner: Mapping[str, _StreamRecord], text: Callable[[JSON], str]) -> str:
        streams = [f"{name}={list(s['key']['data'])}@{s['count']}"
                   for name, s in inner.items()]
        return f"Rngs({', '.join(streams)})"

