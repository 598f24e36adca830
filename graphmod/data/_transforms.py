"""Transformations fitted on the training data, kept as data and applied by every program.

``Transforms({field: transformation or chain})`` names what to do to each field;
``transforms.fit(training_source)`` gathers the source's :class:`~graphmod.data.Metadata` in
one pass and fits every chain, and is the only way to fit: evaluation data cannot reach a
fit by construction. The :class:`FittedTransforms` it returns is immutable, applies the
same arithmetic with ``jax.numpy`` (``apply``, traceable) or NumPy (``apply_host``), checks
inputs against the metadata, and writes itself as JSON (``record``) that
:meth:`FittedTransforms.from_record` rebuilds through an allow list of graphmod's own kinds,
never by importing a name found in the record.

A chain fits its links in order, each on the output of those before it: with a source that
offers its arrays (``ArraySource``) the statistics of the transformed values are computed
exactly; a streamed source (any other iterable of batches) is read once, so its chains may
hold one transformation each.

Sharp edges: float outputs are float32 unless the input is float64 under ``jax_enable_x64``;
``Vocabulary`` maps a value it never saw to the index of its sorted position (clipped into
range) inside a program, so check label fields with ``Metadata.check_labels`` on the host.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import itertools
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from graphmod._core._display._table import html_table, text_table
from graphmod._core._number_checks import is_real_number, is_whole_number
from graphmod.data._metadata import (
    FieldInfo,
    Metadata,
    batch_fields,
    field_info,
    field_key,
    field_text,
    gather,
    is_numeric,
    key_field,
    numbers_text,
    source_arrays,
)
from graphmod.typing import JSON, Batch

Array: TypeAlias = jax.Array | np.ndarray
Fitted: TypeAlias = dict[str, JSON]
"""The fitted numbers of one transformation: JSON lists and numbers."""
Transformed: TypeAlias = dict[str | int, Array] | tuple[Array, ...] | list[Array] | Array
"""A batch with its fields transformed, in the batch's structure."""


class _Numbers(NamedTuple):
    """A numeric field's per-feature statistics (:class:`FieldInfo`'s)."""

    min: tuple[float, ...]
    max: tuple[float, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]


def _float_dtype(x: Array) -> np.dtype:
    # Only float64 inputs stay float64, and only where JAX holds float64 (x64).
    wide = np.dtype(x.dtype) == np.float64
    return np.dtype(jax.dtypes.canonicalize_dtype(np.float64 if wide else np.float32))


def _per_feature(info: FieldInfo, values: ArrayLike) -> JSON:
    """Per-feature fitted numbers: a list, or one number for a per-example scalar field, so
    that they broadcast against one example as against a batch (under ``jax.vmap``)."""
    numbers = np.asarray(values, np.float64).tolist()
    return numbers[0] if info.shape == () else numbers


class Transformation(abc.ABC):
    """A transformation of one field, fitted on the training data's :class:`FieldInfo`.

    Subclasses are frozen dataclasses: their fields are the configuration, ``fit`` returns
    the fitted numbers as JSON, and one arithmetic serves ``apply`` (``jax.numpy``) and
    ``apply_host`` (NumPy). Only graphmod's own kinds round-trip through
    :meth:`FittedTransforms.from_record`.

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import Metadata, Standardize, Transformation
        >>> info = Metadata.gather([np.array([1.0, 3.0])])[0]
        >>> scale = Standardize()
        >>> isinstance(scale, Transformation), scale.fit(info)
        (True, {'mean': 2.0, 'std': 1.0})
        >>> scale.apply_host(np.array([3.0]), scale.fit(info))
        array([1.], dtype=float32)
    """

    needs_labels: ClassVar[bool] = False  # fitted on the field's label set

    @property
    def kind(self) -> str:
        """The name a record stores."""
        return type(self).__name__

    def config(self) -> dict[str, JSON]:
        """The configuration as JSON (the dataclass fields)."""
        if not dataclasses.is_dataclass(self):
            raise TypeError(f"{self.kind}: a Transformation is a frozen dataclass, its fields "
                            "the configuration; decorate the class with "
                            "@dataclasses.dataclass(frozen=True)")
        return {f.name: _json(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @abc.abstractmethod
    def fit(self, info: FieldInfo) -> Fitted:
        """The fitted numbers for a field described by ``info`` (``ValueError`` when the
        field is not one this transformation takes)."""

    @abc.abstractmethod
    def _run(self, xp: types.ModuleType, x: Array, p: Mapping[str, np.ndarray]) -> Array:
        """The arithmetic, with ``xp`` NumPy or ``jax.numpy``."""

    # The asarray calls return ``_run``'s array as it is (no copy, no traced operation):
    # they say which kind of array ``xp`` made.
    def apply(self, x: Array, fitted: Mapping[str, JSON]) -> jax.Array:
        """``x`` transformed with ``jax.numpy`` (traceable)."""
        return jnp.asarray(self._run(jnp, jnp.asarray(x), _params(fitted)))

    def apply_host(self, x: Array, fitted: Mapping[str, JSON]) -> np.ndarray:
        """``x`` transformed with NumPy, the same arithmetic as :meth:`apply`."""
        return np.asarray(self._run(np, np.asarray(x), _params(fitted)))

    def _numeric(self, info: FieldInfo) -> _Numbers:
        """The field's per-feature statistics; raises unless it is numeric."""
        if info.min is None or info.max is None or info.mean is None or info.std is None:
            raise ValueError(f"{self.kind} takes numbers, but the field is {info.dtype}")
        return _Numbers(info.min, info.max, info.mean, info.std)

    def _integers(self, info: FieldInfo) -> list[JSON]:
        """The field's label values, sorted; raises unless it is an integer label field."""
        dtype = np.dtype(info.dtype)
        if not (np.issubdtype(dtype, np.integer) or dtype == np.bool_):
            raise ValueError(f"{self.kind} takes integer or bool values (labels, tokens), but "
                             f"the field is {info.dtype}; Bin turns numbers into integers")
        if info.labels is None:
            raise ValueError(f"{self.kind} needs the field's label set, which its metadata "
                             "lacks; gather it with labels=(field,)")
        return [value for value, _ in info.labels]


def _json(value: JSON | tuple[JSON, ...]) -> JSON:
    return list(value) if isinstance(value, tuple) else value


def _params(fitted: Mapping[str, JSON]) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in fitted.items()}


@dataclasses.dataclass(frozen=True)
class Standardize(Transformation):
    """``(x - mean) / max(std, eps)`` per feature, with the training mean and population std.

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource, Standardize, Transforms
        >>> x = np.array([[0.0, 10.0], [2.0, 30.0]])
        >>> fitted = Transforms({0: Standardize()}).fit(ArraySource((x,), 1))
        >>> fitted.apply_host((x,))[0]
        array([[-1., -1.],
               [ 1.,  1.]], dtype=float32)
    """

    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not is_real_number(self.eps) or self.eps <= 0:
            raise ValueError(f"Standardize(eps={self.eps!r}): must be a positive number, "
                             "the smallest std divided by, e.g. eps=1e-8")

    def fit(self, info: FieldInfo) -> Fitted:
        numbers = self._numeric(info)
        return {"mean": _per_feature(info, numbers.mean), "std": _per_feature(info, numbers.std)}

    def _run(self, xp: types.ModuleType, x: Array, p: Mapping[str, np.ndarray]) -> Array:
        dt = _float_dtype(x)
        # A multiplication by the reciprocal: XLA rewrites a division by a constant into one,
        # so NumPy on the host computes bit for bit what a compiled program does.
        scale = (1.0 / np.maximum(p["std"], self.eps)).astype(dt)
        return (x.astype(dt) - p["mean"].astype(dt)) * scale


@dataclasses.dataclass(frozen=True)
class MinMax(Transformation):
    """Scales each feature's training range ``min..max`` onto ``low..high`` (a constant
    feature maps to ``low``).

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource, MinMax, Transforms
        >>> x = np.array([1.0, 3.0, 5.0])
        >>> Transforms({0: MinMax(-1.0, 1.0)}).fit(ArraySource(x, 1)).apply_host(x)
        array([-1.,  0.,  1.], dtype=float32)
    """

    low: float = 0.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if not (is_real_number(self.low) and is_real_number(self.high)
                and self.low < self.high):
            raise ValueError(f"MinMax(low={self.low!r}, high={self.high!r}): need numbers "
                             "with low < high, e.g. MinMax(0.0, 1.0)")

    def fit(self, info: FieldInfo) -> Fitted:
        numbers = self._numeric(info)
        return {"min": _per_feature(info, numbers.min), "max": _per_feature(info, numbers.max)}

    def _run(self, xp: types.ModuleType, x: Array, p: Mapping[str, np.ndarray]) -> Array:
        dt = _float_dtype(x)
        span = p["max"] - p["min"]
        scale = (self.high - self.low) / np.where(span == 0, 1.0, span)
        # (x - min) * scale + low as one subtraction and one multiplication: a multiply-add
        # may be fused (rounded once) in a compiled program but never by NumPy.
        shift = p["min"] - self.low / scale
        return (x.astype(dt) - shift.astype(dt)) * scale.astype(dt)


@dataclasses.dataclass(frozen=True)
class Clip(Transformation):
    """Clips each feature into ``low..high``; a bound left out is the training min or max.
    The output keeps the input's dtype.

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource, Clip, Transforms
        >>> x = np.array([1.0, 2.0, 3.0])
        >>> fitted = Transforms({0: Clip(high=2.5)}).fit(ArraySource(x, 1))
        >>> fitted.apply_host(np.array([0.0, 9.0]))
        array([1. , 2.5])
    """

    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        bad = [b for b in (self.low, self.high) if b is not None and not is_real_number(b)]
        if bad or (self.low is not None and self.high is not None and self.low > self.high):
            raise ValueError(f"Clip(low={self.low!r}, high={self.high!r}): need numbers (or "
                             "None for the training min/max) with low <= high")

    def fit(self, info: FieldInfo) -> Fitted:
        numbers = self._numeric(info)
        return {"low": self.low if self.low is not None else _per_feature(info, numbers.min),
                "high": self.high if self.high is not None else _per_feature(info, numbers.max)}

    def _run(self, xp: types.ModuleType, x: Array, p: Mapping[str, np.ndarray]) -> Array:
        return xp.clip(x, p["low"].astype(x.dtype), p["high"].astype(x.dtype))


def _integer_view(x: Array) -> Array:
    # Searches and comparisons on bool values run on their ints.
    return x.astype(np.int32) if np.dtype(x.dtype) == np.bool_ else x


@dataclasses.dataclass(frozen=True)
class Vocabulary(Transformation):
    """Integer labels or tokens → dense int32 indices ``0..k-1`` in the sorted order of the
    values the training data held (``jnp.searchsorted`` over them); :meth:`inverse` maps
    indices back.

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource, Transforms, Vocabulary
        >>> y = np.array([10, 30, 20, 30])
        >>> fitted = Transforms({0: Vocabulary()}).fit(ArraySource(y, 1))
        >>> fitted.apply_host(y)
        array([0, 2, 1, 2], dtype=int32)
        >>> fitted.inverse(0, np.array([2, 0]))
        array([30, 10])
    """

    needs_labels: ClassVar[bool] = True

    def fit(self, info: FieldInfo) -> Fitted:
        return {"values": self._integers(info)}

    def _run(self, xp: types.ModuleType, x: Array, p: Mapping[str, np.ndarray]) -> Array:
        x = _integer_view(x)
        values = p["values"].astype(x.dtype)
        return xp.clip(xp.searchsorted(values, x), 0, len(values) - 1).astype(np.int32)

    def inverse(self, indices: Array, fitted: Mapping[str, JSON]) -> np.ndarray:
        """The values at ``indices`` (NumPy, on the host)."""
        return np.asarray(fitted["values"])[np.asarray(indices)]


@dataclasses.dataclass(frozen=True)
class OneHot(Transformation):
    """Integer labels → float32 one-hot vectors over the training label set (sorted); the
    output gains a last axis of its size.

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource, OneHot, Transforms
        >>> y = np.array([3, 5, 3])
        >>> Transforms({0: OneHot()}).fit(ArraySource(y, 1)).apply_host(np.array([5, 3]))
        array([[0., 1.],
               [1., 0.]], dtype=float32)
    """

    needs_labels: ClassVar[bool] = True

    def fit(self, info: FieldInfo) -> Fitted:
        return {"values": self._integers(info)}

    def _run(self, xp: types.ModuleType, x: Array, p: Mapping[str, np.ndarray]) -> Array:
        x = _integer_view(x)
        return (x[..., None] == p["values"].astype(x.dtype)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Bin(Transformation):
    """Numbers → int32 bin indices: the count of edges ``<= x``. Fixed ``edges`` (increasing,
    shared by every feature: ``len(edges) + 1`` bins) or ``bins`` equal-width bins over each
    feature's training ``min..max`` (indices ``0..bins-1``).

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource, Bin, Transforms
        >>> x = np.array([0.0, 1.0, 2.0, 4.0])
        >>> Transforms({0: Bin(bins=4)}).fit(ArraySource(x, 1)).apply_host(x)
        array([0, 1, 2, 3], dtype=int32)
        >>> Bin(edges=(0.5, 1.5)).apply_host(x, {"edges": [0.5, 1.5]})
        array([0, 1, 2, 2], dtype=int32)
    """

    edges: tuple[float, ...] | None = None
    bins: int | None = None

    def __post_init__(self) -> None:
        if (self.edges is None) == (self.bins is None):
            raise ValueError(f"Bin(edges={self.edges!r}, bins={self.bins!r}): give exactly "
                             "one, e.g. Bin(edges=(0.0, 1.0)) or Bin(bins=10)")
        if self.edges is not None:
            edges = self.edges
            if (isinstance(edges, str) or not isinstance(edges, Sequence) or not edges
                    or not all(map(is_real_number, edges))
                    or any(a >= b for a, b in itertools.pairwise(edges))):
                raise ValueError(f"Bin(edges={edges!r}): need a strictly increasing sequence "
                                 "of numbers, e.g. edges=(0.0, 0.5, 1.0)")
            object.__setattr__(self, "edges", tuple(edges))
        elif not is_whole_number(self.bins, least=1):
            raise ValueError(f"Bin(bins={self.bins!r}): must be a positive int, e.g. bins=10")

    def fit(self, info: FieldInfo) -> Fitted:
        numbers = self._numeric(info)
        if self.edges is not None:
            return {"edges": list(self.edges)}
        assert self.bins is not None  # __post_init__: edges or bins, exactly one
        inner = [np.linspace(lo, hi, self.bins + 1)[1:-1]
                 for lo, hi in zip(numbers.min, numbers.max, strict=True)]
        return {"edges": _per_feature(info, inner)}

    def _run(self, xp: types.ModuleType, x: Array, p: Mapping[str, np.ndarray]) -> Array:
        dt = _float_dtype(x)
        return (x.astype(dt)[..., None] >= p["edges"].astype(dt)).sum(-1).astype(np.int32)


_KINDS: dict[str, type[Transformation]] = {
    kind.__name__: kind for kind in (Standardize, MinMax, Clip, Vocabulary, OneHot, Bin)}
"""The allow list ``from_record`` rebuilds from: graphmod's own kinds, nothing imported."""

Chain = tuple[tuple[Transformation, Fitted], ...]


class Transforms:
    """What to do to each field: ``{field: transformation or sequence of them}``, fitted on
    the training source by :meth:`fit` (the one way to fit).

    A field is a dict batch's key (``str``) or a tuple batch's index (``int``; a single-array
    batch is field ``0``). A sequence is a chain, applied in order.

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource, Clip, Standardize, Transforms, Vocabulary
        >>> source = ArraySource({"x": np.array([[1.0], [3.0]]), "y": np.array([7, 9])}, 1)
        >>> transforms = Transforms({"x": [Clip(high=2.0), Standardize()], "y": Vocabulary()})
        >>> fitted = transforms.fit(source)
        >>> fitted.apply_host({"x": np.array([[1.0], [5.0]]), "y": np.array([9, 7])})
        {'x': array([[-1.],
               [ 1.]], dtype=float32), 'y': array([1, 0], dtype=int32)}
    """

    def __init__(self, spec: Mapping[str | int, Transformation | Sequence[Transformation]]
                 ) -> None:
        if not isinstance(spec, Mapping):
            raise TypeError(f"Transforms(spec): got {type(spec).__name__}, need a dict "
                            "{field: transformation}, e.g. {'x': Standardize()}")
        self._spec: dict[str | int, tuple[Transformation, ...]] = {}
        for field, value in spec.items():
            if isinstance(field, bool) or not isinstance(field, str | int):
                raise TypeError(f"Transforms(spec): the key {field!r} is not a field; name a "
                                "dict batch's key (str) or a tuple batch's index (int)")
            given: tuple[object, ...] = (
                tuple(value) if isinstance(value, list | tuple) else (value,))
            chain = tuple(t for t in given if isinstance(t, Transformation))
            if len(chain) != len(given) or not chain:
                raise TypeError(f"Transforms(spec): {field_text(field)} maps to {value!r}, not "
                                "a transformation or a sequence of them; use e.g. "
                                "graphmod.data.Standardize()")
            self._spec[field] = chain

    def fit(self, source: Iterable[Batch], *, labels: Sequence[str | int] | None = None
            ) -> FittedTransforms:
        """Gathers ``source``'s metadata (one pass) and fits every chain on it.

        Args:
            source: the training source: an ``ArraySource``, a source offering
                ``metadata_arrays()``, or any iterable of batches (then one
                transformation per field).
            labels: the label fields, as :meth:`Metadata.gather` takes them.

        Returns:
            The :class:`FittedTransforms`; a field the data lacks, an empty source, or a
            field a transformation cannot take is refused first, naming the field.

        Examples:
            >>> import numpy as np
            >>> from graphmod.data import MinMax, Transforms
            >>> fitted = Transforms({"x": MinMax()}).fit([{"x": np.array([2.0, 4.0])}])
            >>> fitted.record()["transforms"]["x"][0]["fitted"]
            {'min': 2.0, 'max': 4.0}
        """
        arrays = source_arrays(source)
        also = [f for f, chain in self._spec.items() if chain[0].needs_labels]
        metadata = gather(source, labels, also)
        missing = [f for f in self._spec if f not in metadata]
        if missing:
            raise ValueError(f"Transforms.fit: the data has no "
                             f"{', '.join(map(field_text, missing))}; its fields are "
                             f"{list(metadata.fields)}")
        long = [f for f, chain in self._spec.items() if len(chain) > 1]
        if arrays is None and long:
            raise ValueError(f"Transforms.fit: {field_text(long[0])} chains "
                             f"{len(self._spec[long[0]])} transformations, but the source "
                             "streams its batches, so only a first one can be fitted; use an "
                             "ArraySource (or a source with metadata_arrays()), or one "
                             "transformation per field")
        values = batch_fields(arrays, "Transforms.fit") if arrays is not None else {}
        chains = {f: _fit_chain(f, chain, metadata[f], values.get(f))
                  for f, chain in self._spec.items()}
        describe = getattr(source, "describe", None)
        return FittedTransforms(chains, metadata, describe() if describe else None)

    def __repr__(self) -> str:
        spec = {f: c[0] if len(c) == 1 else list(c) for f, c in self._spec.items()}
        return f"Transforms({spec!r})"


def _fit_chain(field: str | int, chain: tuple[Transformation, ...], info: FieldInfo,
               values: np.ndarray | None) -> Chain:
    """Fits each link on the output of those before it (``values`` None: one link only)."""
    fitted = []
    for index, link in enumerate(chain):
        if index:
            assert values is not None  # Transforms.fit: a chain of several has the arrays
            info = field_info(values, labels=link.needs_labels)
        try:
            numbers = link.fit(info)
        except ValueError as error:
            raise ValueError(f"Transforms.fit: {field_text(field)}: {error}") from None
        arrays = {name: np.asarray(number) for name, number in numbers.items()}
        bad = sorted(name for name, array in arrays.items()
                     if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all())
        if bad:  # NaN or inf in the training data: every transformed value would be NaN
            raise ValueError(
                f"Transforms.fit: {field_text(field)} holds non-finite values (NaN or inf), so "
                f"{link.kind}'s fitted {', '.join(bad)} would not be finite; clean or impute "
                "the training data first (e.g. np.nan_to_num), or leave the field untransformed")
        fitted.append((link, numbers))
        if values is not None and index + 1 < len(chain):
            values = link.apply_host(values, numbers)
    return tuple(fitted)


class FittedTransforms:
    """Transformations fitted on a training source, with its metadata: what a program
    applies to its arguments (``compile(..., transforms=)``) and records as JSON.

    Made by :meth:`Transforms.fit` or rebuilt by :meth:`from_record`; immutable.
    ``apply`` runs ``jax.numpy`` (inside a program), ``apply_host`` the same arithmetic with
    NumPy on a batch; ``check`` refuses inputs unlike the training data.

    Examples:
        >>> import json
        >>> import numpy as np
        >>> from graphmod.data import ArraySource, FittedTransforms, Standardize, Transforms
        >>> source = ArraySource({"x": np.array([[1.0], [3.0]])}, batch_size=1, name="toy")
        >>> fitted = Transforms({"x": Standardize()}).fit(source)
        >>> fitted.apply({"x": np.array([[3.0]])})["x"]
        Array([[1.]], dtype=float32)
        >>> fitted.source["name"], fitted.fields()
        ('toy', ('x',))
        >>> FittedTransforms.from_record(json.loads(json.dumps(fitted.record()))) == fitted
        True
    """

    __slots__ = ("_chains", "_params", "_source", "metadata")
    _chains: dict[str | int, Chain]
    _params: dict[str | int, tuple[dict[str, np.ndarray], ...]]
    _source: dict[str, JSON] | None
    metadata: Metadata

    def __init__(self, chains: Mapping[str | int, Chain], metadata: Metadata,
                 source: Mapping[str, JSON] | None = None) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)
        # Copies, so that nothing handed in or out can change the numbers applied.
        set_("_chains", {f: tuple((t, copy.deepcopy(dict(n))) for t, n in c)
                         for f, c in chains.items()})
        set_("_params", {f: tuple(_params(n) for _, n in c) for f, c in self._chains.items()})
        set_("_source", copy.deepcopy(None if source is None else dict(source)))
        set_("metadata", metadata)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"FittedTransforms is immutable: cannot set {name!r}")

    @property
    def source(self) -> dict[str, JSON] | None:
        """The training source's ``describe()`` (name, size, sha256, ...), or None."""
        return copy.deepcopy(self._source)

    def fields(self) -> tuple[str | int, ...]:
        """The fields checked (every field of the metadata); those transformed are a part."""
        return self.metadata.fields

    def transformed(self) -> tuple[str | int, ...]:
        """The fields a chain of transformations changes (a part of :meth:`fields`)."""
        return tuple(self._chains)

    def check(self, arguments: Mapping[str | int, object], where: str) -> None:
        """:meth:`Metadata.check` of the training data's metadata."""
        self.metadata.check(arguments, where)

    def apply(self, arguments: Mapping[str | int, Array]) -> dict[str | int, Array]:
        """The fields given, each transformed by its chain (``jax.numpy``; traceable); fields
        without one pass through."""
        return {f: self._run(jnp, f, v) for f, v in arguments.items()}

    def apply_host(self, batch: Batch) -> Transformed:
        """``batch`` (a dict, tuple, list or one array, as a source yields it) with its fields
        transformed by NumPy, the same arithmetic as :meth:`apply`."""
        fields = batch_fields(batch, "FittedTransforms.apply_host(batch)")
        out = {f: self._run(np, f, v) for f, v in fields.items()}
        if isinstance(batch, Mapping):
            return out
        if isinstance(batch, tuple | list):
            return type(batch)(out.values())
        return out[0]

    def _run(self, xp: types.ModuleType, field: str | int, value: Array) -> Array:
        if field not in self._chains:
            return value
        value = xp.asarray(value)
        for (link, _), params in zip(self._chains[field], self._params[field], strict=True):
            value = link._run(xp, value, params)
        return value

    def inverse(self, field: str | int, indices: Array) -> np.ndarray:
        """The values that ``field``'s chain, ending in :class:`Vocabulary`, mapped to
        ``indices`` (NumPy)."""
        chain = self._chains.get(field)
        link, numbers = chain[-1] if chain else (None, {})
        if not isinstance(link, Vocabulary):
            raise ValueError(f"FittedTransforms.inverse: {field_text(field)} has no chain "
                             "ending in Vocabulary, so its indices have no inverse")
        return link.inverse(indices, numbers)

    def record(self) -> dict[str, JSON]:
        """JSON: ``{"transforms": {field: [{"kind", "config", "fitted"}]}, "metadata": ...,
        "source": <the training source's describe() or None>}``."""
        return {
            "transforms": {field_key(f): [{"kind": t.kind, "config": t.config(),
                                           "fitted": copy.deepcopy(n)}
                                          for t, n in chain]
                           for f, chain in self._chains.items()},
            "metadata": self.metadata.to_dict(),
            "source": self.source,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> FittedTransforms:
        """The transforms :meth:`record` wrote, rebuilt only from graphmod's own kinds
        (``Standardize``, ``MinMax``, ``Clip``, ``Vocabulary``, ``OneHot``, ``Bin``); any
        other kind is refused, naming it."""
        missing = [k for k in ("transforms", "metadata") if k not in record]
        if missing:
            raise ValueError(f"FittedTransforms.from_record: the record lacks {missing}; pass "
                             "what FittedTransforms.record() wrote")
        chains = {}
        for key, links in record["transforms"].items():
            chain = []
            for link in links:
                kind = _KINDS.get(link["kind"])
                if kind is None:
                    raise ValueError(f"FittedTransforms.from_record: unknown transformation "
                                     f"kind {link['kind']!r} for {field_text(key_field(key))}; "
                                     f"known kinds are {sorted(_KINDS)}")
                try:
                    made = kind(**link["config"])
                except TypeError as error:
                    raise ValueError(f"FittedTransforms.from_record: {link['kind']} config "
                                     f"{link['config']!r}: {error}") from None
                chain.append((made, dict(link["fitted"])))
            chains[key_field(key)] = tuple(chain)
        return cls(chains, Metadata.from_dict(record["metadata"]), record.get("source"))

    # Equal by value, holding dicts: unhashable (Python sets __hash__ to None for a class
    # that defines __eq__ alone).
    def __eq__(self, other: object) -> bool:
        return isinstance(other, FittedTransforms) and other.record() == self.record()

    def _rows(self) -> list[list[str]]:
        return [[repr(f), " → ".join(_link_text(t) for t, _ in chain),
                 "; ".join(_fitted_text(n) for _, n in chain)]
                for f, chain in self._chains.items()]

    def _caption(self) -> str:
        name = (self.source or {}).get("name", "a source without describe()")
        return (f"FittedTransforms of {len(self._chains)} fields, fitted on {name!r} "
                f"({len(self.metadata.fields)} fields checked)")

    def __repr__(self) -> str:
        return self._caption() + "\n" + text_table(("field", "transforms", "fitted"),
                                                   self._rows())

    def _repr_html_(self) -> str:
        return html_table(("field", "transforms", "fitted"), self._rows(), self._caption())


def _link_text(link: Transformation) -> str:
    return f"{link.kind}({', '.join(map(repr, link.config().values()))})"


def _fitted_text(numbers: Fitted) -> str:
    parts = []
    for name, value in numbers.items():
        flat = np.ravel(np.asarray(value))
        if name == "values" or not is_numeric(flat.dtype):
            parts.append(f"{flat.size} {name}")
        else:
            parts.append(f"{name} {numbers_text(flat.tolist())}")
    return ", ".join(parts)
