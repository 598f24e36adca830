"""``Metadata``: what the training data looked like, gathered in one pass and kept as JSON.

A *field* is one part of a batch: a dict batch's key (``str``), a tuple or list batch's index
(``int``); a batch that is a single array is field ``0``. Per field the metadata holds the
per-example ``shape`` (without the batch axis), the ``dtype``, the ``count`` of examples and,
for numeric fields, ``min``/``max``/``mean``/``std`` per feature: reduced over every axis but
the last (a per-example scalar gives one value; an NHWC image field one value per channel).
Statistics are float64; ``std`` is the population standard deviation (``ddof=0``, as
NumPy's). Label fields (by default integer or bool fields with per-example shape ``()``) also
hold their sorted label set with counts.

Sources: one offering ``metadata_arrays()`` (``ArraySource`` does) is reduced directly with
NumPy, exactly; any other iterable of batches is streamed once, each batch's float64 moments
combined with Chan et al.'s pairwise formula (equal to NumPy's to about 1e-12 relative).

Sharp edges: dtypes are compared as JAX holds them (``jax.dtypes.canonicalize_dtype``), so
float64 training data matches float32 inputs unless ``jax_enable_x64`` is set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike

from graphmod._core._display._table import html_table, text_table
from graphmod.typing import JSON, Batch

LabelValue = int | float | bool | str


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """What one field of the training data held: per-example ``shape``, ``dtype``, ``count``
    of examples, per-feature float64 ``min``/``max``/``mean``/``std`` (None for a field that
    is not numeric) and, for a label field, ``labels``: ``(value, count)`` pairs, sorted.

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource
        >>> info = ArraySource({"x": np.array([[0.0, 2.0], [2.0, 4.0]])}, 1).metadata["x"]
        >>> info.shape, info.dtype, info.count, info.mean, info.std, info.labels
        ((2,), 'float64', 2, (1.0, 3.0), (1.0, 1.0), None)
    """

    shape: tuple[int, ...]
    dtype: str
    count: int
    min: tuple[float, ...] | None = None
    max: tuple[float, ...] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    labels: tuple[tuple[LabelValue, int], ...] | None = None

    def to_dict(self) -> dict[str, JSON]:
        """This info as JSON-safe lists and numbers."""
        out: dict[str, JSON] = {"shape": list(self.shape), "dtype": self.dtype,
                               "count": self.count}
        for name in ("min", "max", "mean", "std"):
            value = getattr(self, name)
            out[name] = None if value is None else list(value)
        out["labels"] = None if self.labels is None else [list(p) for p in self.labels]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FieldInfo:
        """The info :meth:`to_dict` wrote."""
        stats = {name: None if d[name] is None else tuple(float(v) for v in d[name])
                 for name in ("min", "max", "mean", "std")}
        labels = None if d["labels"] is None else tuple((v, int(c)) for v, c in d["labels"])
        return cls(shape=tuple(int(n) for n in d["shape"]), dtype=str(d["dtype"]),
                   count=int(d["count"]), labels=labels, **stats)


def field_key(field: str | int) -> str:
    """A field as a JSON object key: ints as ``"#0"``, a str starting with ``#`` escaped."""
    if isinstance(field, int):
        return f"#{field}"
    return "#" + field if field.startswith("#") else field


def key_field(key: str) -> str | int:
    """The field :func:`field_key` wrote."""
    if key.startswith("##"):
        return key[1:]
    return int(key[1:]) if key.startswith("#") else key


def field_text(field: str | int) -> str:
    """How errors name a field."""
    return f"field {field!r}" if isinstance(field, str) else f"positional field {field}"


def batch_fields(batch: object, where: str) -> dict[str | int, np.ndarray]:
    """The fields of one batch (or of a source's whole arrays) as NumPy arrays."""
    items: Iterable[tuple[str | int, object]]
    if isinstance(batch, Mapping):
        bad = [k for k in batch if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{where}: a dict batch needs str keys (the fields), got {bad!r}")
        items = batch.items()
    elif isinstance(batch, tuple | list):
        items = enumerate(batch)
    else:
        items = [(0, batch)]
    out = {}
    for field, value in items:
        array = np.asarray(value)
        if array.dtype == object or array.ndim == 0:
            raise ValueError(f"{where}: {field_text(field)} is {type(value).__name__} "
                             f"{array.shape}, not an array with a batch axis; give each "
                             "field as one array whose first axis runs over the examples")
        out[field] = array
    return out


def is_numeric(dtype: np.dtype) -> bool:
    """Whether a field of ``dtype`` gets min/max/mean/std."""
    # JAX's issubdtype: bfloat16 and the other ml_dtypes floats count as floating.
    return bool(jnp.issubdtype(dtype, np.integer)
                or jnp.issubdtype(dtype, np.floating) or dtype == np.bool_)


def _stored(dtype: np.dtype) -> str:
    """A dtype as metadata names it: ``"float64"``; strings as ``"str"`` or ``"bytes"``,
    whatever their width."""
    return dtype.name if is_numeric(dtype) else {"U": "str", "S": "bytes"}.get(dtype.kind,
                                                                                dtype.str)


def _held(dtype: DTypeLike) -> str:
    """A dtype as JAX holds it (float64 is float32 without x64): what checks compare."""
    dtype = np.dtype(dtype)
    return _stored(np.dtype(jax.dtypes.canonicalize_dtype(dtype)) if is_numeric(dtype)
                   else dtype)


def _feature_axes(array: np.ndarray) -> tuple[int, ...]:
    # Every axis but the last; a per-example scalar (ndim 1) reduces its batch axis only.
    return tuple(range(array.ndim - 1)) if array.ndim > 1 else (0,)


def _label_pairs(values: np.ndarray, counts: np.ndarray) -> tuple[tuple[LabelValue, int], ...]:
    return tuple((v.item(), int(c)) for v, c in zip(values, counts, strict=True))


def _floats(values: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in np.atleast_1d(values))


def field_info(array: np.ndarray, labels: bool) -> FieldInfo:
    """The exact info of a field's whole ``array`` (batch axis first)."""
    low = high = mean = std = None
    if is_numeric(array.dtype) and array.size:
        wide = array.astype(np.float64)
        axes = _feature_axes(array)
        low, high, mean, std = (_floats(reduce(wide, axis=axes))
                                for reduce in (np.min, np.max, np.mean, np.std))
    pairs = _label_pairs(*np.unique(array, return_counts=True)) if labels else None
    return FieldInfo(shape=tuple(array.shape[1:]), dtype=_stored(array.dtype),
                     count=int(array.shape[0]), min=low, max=high, mean=mean, std=std,
                     labels=pairs)


class _Moments:
    """Running per-feature float64 moments of one streamed field (Chan et al.)."""

    def __init__(self, first: np.ndarray, labels: bool) -> None:
        self.shape, self.dtype = first.shape[1:], first.dtype
        self.count, self.n = 0, 0
        self.numeric = is_numeric(first.dtype)
        self.mean = self.m2 = self.low = self.high = np.zeros(0)
        self.labels: dict[LabelValue, int] | None = {} if labels else None

    def add(self, array: np.ndarray) -> None:
        self.count += array.shape[0]
        if self.labels is not None:
            for value, count in zip(*np.unique(array, return_counts=True), strict=True):
                self.labels[value.item()] = self.labels.get(value.item(), 0) + int(count)
        if not self.numeric or not array.size:
            return
        wide = array.astype(np.float64)
        axes = _feature_axes(array)
        n = array.size // (wide.shape[-1] if array.ndim > 1 else 1)
        mean = np.atleast_1d(wide.mean(axis=axes))
        m2 = np.atleast_1d(((wide - mean) ** 2).sum(axis=axes))
        low, high = np.atleast_1d(wide.min(axis=axes)), np.atleast_1d(wide.max(axis=axes))
        if self.n == 0:
            self.n, self.mean, self.m2, self.low, self.high = n, mean, m2, low, high
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.n * n / total)
        self.low, self.high = np.minimum(self.low, low), np.maximum(self.high, high)
        self.n = total

    def info(self) -> FieldInfo:
        low = high = mean = std = None
        if self.n:
            low, high, mean, std = (_floats(a) for a in (self.low, self.high, self.mean,
                                                         np.sqrt(self.m2 / self.n)))
        labels = None if self.labels is None else tuple(
            (v, self.labels[v]) for v in sorted(self.labels))
        return FieldInfo(shape=tuple(self.shape), dtype=_stored(self.dtype), count=self.count,
                         min=low, max=high, mean=mean, std=std, labels=labels)


def _is_default_label(array: np.ndarray) -> bool:
    return array.ndim == 1 and (np.issubdtype(array.dtype, np.integer)
                                or array.dtype == np.bool_)


def _label_fields(fields: Mapping[str | int, np.ndarray], labels: Sequence[str | int] | None,
                  also: Iterable[str | int]) -> set[str | int]:
    if labels is None:
        chosen = {f for f, a in fields.items() if _is_default_label(a)}
    else:
        if isinstance(labels, str | int) or not isinstance(labels, Sequence):
            raise ValueError(f"Metadata.gather(labels={labels!r}): pass a sequence of fields, "
                             "e.g. labels=('y',)")
        missing = [f for f in labels if f not in fields]
        if missing:
            raise ValueError(f"Metadata.gather(labels=...): the data has no "
                             f"{', '.join(map(field_text, missing))}; its fields are "
                             f"{list(fields)}")
        chosen = set(labels)
    return chosen | (set(also) & set(fields))


def source_arrays(source: object) -> Batch | None:
    """A source's whole arrays when it offers them (``metadata_arrays()``), else None."""
    offer = getattr(source, "metadata_arrays", None)
    return None if offer is None else offer()


def gather(source: Iterable[Batch], labels: Sequence[str | int] | None,
           also: Iterable[str | int] = ()) -> Metadata:
    """:meth:`Metadata.gather`, also gathering the label sets of the fields in ``also``."""
    where = "Metadata.gather(source)"
    arrays = source_arrays(source)
    if arrays is not None:
        fields = batch_fields(arrays, where)
        chosen = _label_fields(fields, labels, also)
        if not next(iter(fields.values())).shape[0]:
            raise ValueError(f"{where}: the source is empty (0 examples); nothing to gather")
        return Metadata({f: field_info(a, f in chosen) for f, a in fields.items()})
    if isinstance(source, Mapping | np.ndarray | jax.Array) or not isinstance(source, Iterable):
        raise ValueError(f"{where}: got {type(source).__name__}, not a source of batches; "
                         "wrap arrays in graphmod.data.ArraySource(arrays, batch_size)")
    moments: dict[str | int, _Moments] = {}
    for index, batch in enumerate(source):
        fields = batch_fields(batch, f"{where}, batch {index}")
        if index == 0:
            chosen = _label_fields(fields, labels, also)
            moments = {f: _Moments(a, f in chosen) for f, a in fields.items()}
        elif fields.keys() != moments.keys():
            raise ValueError(f"{where}: batch {index} has the fields {list(fields)}, batch 0 "
                             f"had {list(moments)}; every batch needs the same fields")
        for field, array in fields.items():
            known = moments[field]
            if (array.shape[1:], _stored(array.dtype)) != (known.shape, _stored(known.dtype)):
                raise ValueError(
                    f"{where}: batch {index} {field_text(field)} is {array.dtype.name} with "
                    f"per-example shape {array.shape[1:]}, batch 0 was {known.dtype.name} "
                    f"{known.shape}; every batch needs the same shape and dtype per field")
            known.add(array)
    if not moments or not sum(m.count for m in moments.values()):
        raise ValueError(f"{where}: the source is empty (no examples); nothing to gather")
    return Metadata({f: m.info() for f, m in moments.items()})


def _shape(value: object) -> tuple[int, ...]:
    """``np.shape(value)``, of an array or of an abstract ``jax.ShapeDtypeStruct``."""
    shape = getattr(value, "shape", None)
    return tuple(np.asarray(value).shape if shape is None else shape)


def _batched(shape: tuple[int, ...]) -> str:
    return str((-1, *shape)).replace("-1", "batch")




def numbers_text(values: Sequence[float] | None) -> str:
    """Per-feature numbers in a table cell: one value, or the range of them."""
    if values is None:
        return "-"
    low, high = f"{min(values):.3g}", f"{max(values):.3g}"
    return low if low == high else f"{low}..{high}"


def _labels_text(labels: tuple[tuple[LabelValue, int], ...] | None) -> str:
    if labels is None:
        return "-"
    shown = ", ".join(f"{v!r} ({c})" for v, c in labels[:3])
    return f"{len(labels)}: {shown}" + (", …" if len(labels) > 3 else "")


class Metadata:
    """The training data's fields: per field a :class:`FieldInfo` (shape, dtype, count,
    per-feature statistics, label set), immutable and made of JSON values only.

    Gathered once from the training source (:meth:`gather`, or ``ArraySource.metadata``),
    frozen into a program's provenance through its transforms, and used to refuse inputs
    that do not fit: another per-example shape or dtype (:meth:`check`), a label the
    training data never held (:meth:`check_labels`).

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource, Metadata
        >>> source = ArraySource({"x": np.array([[1.0], [3.0]]), "y": np.array([0, 1])}, 1)
        >>> meta = Metadata.gather(source)
        >>> meta.fields, meta["x"].mean, meta["y"].labels
        (('x', 'y'), (2.0,), ((0, 1), (1, 1)))
        >>> Metadata.from_dict(meta.to_dict()) == meta
        True
    """

    __slots__ = ("_infos",)

    def __init__(self, infos: Mapping[str | int, FieldInfo]) -> None:
        object.__setattr__(self, "_infos", dict(infos))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Metadata is immutable: cannot set {name!r}")

    @classmethod
    def gather(cls, source: Iterable[Batch], *, labels: Sequence[str | int] | None = None
               ) -> Metadata:
        """The metadata of ``source``'s training examples, in one pass.

        Args:
            source: an ``ArraySource`` (reduced exactly from its arrays), a source offering
                ``metadata_arrays()``, or any iterable of batches (streamed once).
            labels: the label fields, e.g. ``("y",)``; by default the integer and bool
                fields with per-example shape ``()``.

        Returns:
            The :class:`Metadata`; ``ValueError`` for an empty source or unknown labels.

        Examples:
            >>> import numpy as np
            >>> from graphmod.data import Metadata
            >>> batches = [{"x": np.array([1.0, 2.0])}, {"x": np.array([3.0])}]
            >>> info = Metadata.gather(batches)["x"]
            >>> info.count, info.mean, info.min, info.max
            (3, (2.0,), (1.0,), (3.0,))
        """
        return gather(source, labels)

    @property
    def fields(self) -> tuple[str | int, ...]:
        """The fields, in the batches' order."""
        return tuple(self._infos)

    def __getitem__(self, field: str | int) -> FieldInfo:
        if field not in self._infos:
            raise KeyError(f"the metadata has no {field_text(field)}; its fields are "
                           f"{list(self._infos)}")
        return self._infos[field]

    def __contains__(self, field: object) -> bool:
        return field in self._infos

    def to_dict(self) -> dict[str, JSON]:
        """JSON-safe: ``{"fields": {key: info}}``, int fields written ``"#0"``.

        Examples:
            >>> import numpy as np
            >>> from graphmod.data import Metadata
            >>> Metadata.gather([(np.array([1.5]),)]).to_dict()["fields"]["#0"]["mean"]
            [1.5]
        """
        return {"fields": {field_key(f): i.to_dict() for f, i in self._infos.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Metadata:
        """The metadata :meth:`to_dict` wrote.

        Examples:
            >>> import numpy as np
            >>> from graphmod.data import Metadata
            >>> meta = Metadata.gather([(np.array([1.5]),)])
            >>> Metadata.from_dict(meta.to_dict()).fields
            (0,)
        """
        return cls({key_field(k): FieldInfo.from_dict(v) for k, v in d["fields"].items()})

    def check(self, arguments: Mapping[str | int, object], where: str) -> None:
        """Refuses values that do not fit the training data's fields (``ValueError``).

        Args:
            arguments: field → array or ``jax.ShapeDtypeStruct``, with the leading batch
                axis; a field the metadata lacks is refused, a field absent is not checked.
            where: the caller, first in the message.

        Examples:
            >>> import numpy as np
            >>> from graphmod.data import Metadata
            >>> meta = Metadata.gather([{"x": np.ones((4, 3), np.float32)}])
            >>> meta.check({"x": np.ones((2, 3), np.float32)}, "evaluate")
            >>> meta.check({"x": np.ones((2, 5), np.float32)}, "evaluate")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: evaluate: field 'x' has per-example shape (5,), but the training data had...
        """
        for field, value in arguments.items():
            if field not in self._infos:
                raise ValueError(f"{where}: {field_text(field)} is not in the training data's "
                                 f"metadata (fields {list(self._infos)}); pass only those "
                                 "fields, or fit the transforms on data that has it")
            info, shape = self._infos[field], _shape(value)
            if len(shape) < 1:
                raise ValueError(f"{where}: {field_text(field)} is a scalar; pass a batch, "
                                 f"shaped {_batched(info.shape)}")
            if shape[1:] != info.shape:
                raise ValueError(
                    f"{where}: {field_text(field)} has per-example shape {shape[1:]}, but the "
                    f"training data had {info.shape}; pass inputs shaped "
                    f"{_batched(info.shape)}, as in training, or fit the transforms on data "
                    "like these")
            dtype = getattr(value, "dtype", None)
            if dtype is None:
                dtype = np.asarray(value).dtype
            got, expected = _held(dtype), _held(info.dtype)
            if got != expected:
                raise ValueError(
                    f"{where}: {field_text(field)} has dtype {_stored(np.dtype(dtype))}, but "
                    f"the training data had {info.dtype}; convert it (x.astype({expected!r})) "
                    "or fit the transforms on data of this dtype")

    def check_labels(self, arguments: Mapping[str | int, object], where: str) -> None:
        """Refuses label values the training data never held (``ValueError``), on the host.

        Examples:
            >>> import numpy as np
            >>> from graphmod.data import Metadata
            >>> meta = Metadata.gather([{"y": np.array([0, 1, 1])}])
            >>> meta.check_labels({"y": np.array([1, 0])}, "evaluate")
            >>> meta.check_labels({"y": np.array([1, 3])}, "evaluate")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: evaluate: field 'y' holds labels the training data never held: [3] ...
        """
        for field, value in arguments.items():
            info = self._infos.get(field)
            if info is None or info.labels is None:
                continue
            known = np.array([v for v, _ in info.labels])
            unseen = np.setdiff1d(np.unique(np.asarray(value)), known)
            if unseen.size:
                shown = [v.item() for v in unseen[:10]]
                more = f" and {unseen.size - 10} more" if unseen.size > 10 else ""
                held = [v for v, _ in info.labels[:10]]
                raise ValueError(
                    f"{where}: {field_text(field)} holds labels the training data never held: "
                    f"{shown}{more} (it held {held}{', …' if len(info.labels) > 10 else ''}); "
                    "evaluate on data with the training labels, or train on data with these")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Metadata) and other._infos == self._infos

    def __hash__(self) -> int:
        return hash(tuple(self._infos.items()))

    def _rows(self) -> list[list[str]]:
        return [[repr(f), str(i.shape), i.dtype, numbers_text(i.mean), numbers_text(i.std),
                 "-" if i.min is None else f"{numbers_text(i.min)} / {numbers_text(i.max)}",
                 _labels_text(i.labels)]
                for f, i in self._infos.items()]

    _HEADERS = ("field", "shape", "dtype", "mean", "std", "min / max", "labels")

    def _caption(self) -> str:
        counts = sorted({i.count for i in self._infos.values()})
        return (f"Metadata of {len(self._infos)} fields, "
                f"{'/'.join(map(str, counts))} examples")

    def __repr__(self) -> str:
        return self._caption() + "\n" + text_table(self._HEADERS, self._rows())

    def _repr_html_(self) -> str:
        return html_table(self._HEADERS, self._rows(), self._caption())
