"""``GrainSource``: Grain pipelines as loop data, resuming on exactly the batches they yield.

The loop keeps its data position as ``(epoch, position)`` and reads batches ahead of the
step it runs, so a pipeline's iterator is ahead of the loop when a checkpoint is written.
``GrainSource`` therefore asks the iterator for its state (``get_state()``) before each batch
it hands out and keeps the latest of those states by position; the checkpoint stores the
state at the loop's *consumed* position, as JSON text (Grain's states are dicts, or JSON
bytes for a ``DataLoader``; never pickled). On resume that state is ``set_state`` into a
fresh iterator of the pipeline, so a run killed mid-epoch continues on the batches it would
have seen, worker processes included.

Epochs: one epoch is one pass of the pipeline, each from a fresh iterator (a finite pass
repeats: Grain reshuffles from one epoch to the next inside the pipeline,
``shuffle(seed).repeat(n)`` or ``IndexSampler(num_epochs=n)``, whose one pass holds those
n epochs). A pipeline repeated forever never ends its pass: give the loop ``steps=``.

Grain is imported by the pipelines a user builds, never by ``import graphmod``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

import jax
import numpy as np

from graphmod._core._codec import hash_array
from graphmod.typing import JSON, Batch

if TYPE_CHECKING:  # named in annotations only: Grain is the user's import
    import grain

    Pipeline: TypeAlias = grain.MapDataset | grain.IterDataset | grain.DataLoader
    """What :class:`GrainSource` takes: a Grain dataset or loader of batches."""

_State: TypeAlias = "dict[str, JSON] | bytes"
"""A Grain iterator's state: a dict of JSON values, or a ``DataLoader``'s JSON bytes."""
_T = TypeVar("_T")


class _Iterator(Protocol):
    """What :class:`GrainSource` uses of a pipeline's iterator (``grain.DatasetIterator``,
    ``grain.DataLoaderIterator``)."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def get_state(self) -> _State: ...

    # Any: each kind of iterator takes the kind of state it returns (a dict or bytes).
    def set_state(self, state: Any) -> None: ...

_KINDS = ("MapDataset", "IterDataset", "DataLoader")
_KEPT_STATES = 1024  # states by position: far more than the loop ever reads ahead


def is_grain(obj: object) -> bool:
    """Whether ``obj`` is an object of the ``grain`` package or a subclass of its datasets
    and loaders (without importing it: a Grain object means Grain is loaded)."""
    grain = sys.modules.get("grain")
    return type(obj).__module__.split(".")[0] == "grain" or (grain is not None and isinstance(
        obj, tuple(getattr(grain, kind) for kind in _KINDS)))


def as_source(data: _T) -> _T | GrainSource:
    """``data`` as loop, ``fit``, ``evaluate`` and ``Validation`` data: a Grain pipeline
    wrapped in a :class:`GrainSource`, anything else as it is."""
    # Any Grain object: GrainSource refuses one that is no pipeline (an iterator), naming it.
    return GrainSource(data) if is_grain(data) else data  # pyright: ignore[reportArgumentType]


def _kind(pipeline: object) -> str:
    """The kind of Grain pipeline ``pipeline`` is; raises naming any other object."""
    grain = sys.modules.get("grain")
    for kind in _KINDS:
        if grain is not None and isinstance(pipeline, getattr(grain, kind)):
            return kind
    if grain is not None and isinstance(pipeline, grain.DatasetIterator | grain.DataLoaderIterator):
        raise TypeError(
            f"GrainSource(pipeline): a Grain iterator ({type(pipeline).__name__}) is used up "
            "by one pass and cannot start an epoch afresh; pass the dataset or loader it "
            "iterates (GrainSource makes an iterator each epoch and restores its state on "
            "resume)")
    raise TypeError(
        f"GrainSource(pipeline): a {type(pipeline).__module__}.{type(pipeline).__name__} is "
        "no pipeline of batches GrainSource can iterate; pass a grain.MapDataset (e.g. "
        "grain.MapDataset.source(rows).shuffle(seed=0).batch(32)), a grain.IterDataset or "
        "a grain.DataLoader")


def _length(pipeline: object) -> int | None:
    """The batches of one pass, where the pipeline knows them (not for one repeated
    forever: Grain gives those ``sys.maxsize``)."""
    if not isinstance(pipeline, Sized):
        return None
    try:
        length = len(pipeline)
    except TypeError:
        return None
    return None if length >= sys.maxsize else length


def _text(obj: object) -> str:
    """How Grain prints a dataset or transformation, without what differs from one process
    to another (an object's address, a function's file and line, which move as a script is
    edited): provenance compares it on resume."""
    text = str(obj)
    if " object at 0x" in text:
        return type(obj).__name__
    return re.sub(r" @ [^)\s]+", "", text)


def _lineage(pipeline: object) -> list[str]:
    """A pipeline's transformations, from its source to itself: a dataset's parents, a
    ``DataLoader``'s data source, operations and sampler."""
    import grain  # loaded: the pipeline is Grain's

    if isinstance(pipeline, grain.DataLoader):  # its settings, not its inner datasets
        source = pipeline._data_source  # Grain's sources print their files; a list, itself
        parts = [f"data_source={_text(source) if is_grain(source) else type(source).__name__}",
                 *(_text(op) for op in pipeline._operations), _text(pipeline._sampler)]
        return [*parts, f"worker_count={pipeline.multiprocessing_options.num_workers}"]
    out: list[str] = []
    for parent in getattr(pipeline, "parents", ()):
        out += _lineage(parent)
    return [*out, _text(pipeline)]


def _seeds(pipeline: object) -> list[int]:
    """The seeds a pipeline's random transformations (or a ``DataLoader``'s sampler) were
    given, where Grain keeps them."""
    node = getattr(pipeline, "_sampler", pipeline)
    found = [int(seed) for seed in (getattr(node, "_seed", None),
                                    getattr(node, "_seed_rng_seed", None)) if seed is not None]
    for parent in getattr(pipeline, "parents", ()):
        found = _seeds(parent) + found
    return found


def _rows(batch: Batch) -> int:
    return int(np.shape(jax.tree.leaves(batch)[0])[0])


class _Cursor:
    """One live iterator of the pipeline: the epoch it reads, the position of its next
    batch, and its latest batch (kept so that the loop's first-batch check and the epoch
    it then runs read the pipeline once)."""

    def __init__(self, iterator: _Iterator, epoch: int, position: int) -> None:
        self.iterator, self.epoch, self.position = iterator, epoch, position
        self.last: tuple[int, Batch] | None = None


class GrainSource:
    """A Grain pipeline of batches as loop data, resuming exactly from checkpoints.

    Takes a ``grain.MapDataset``, ``grain.IterDataset`` (e.g. one with ``mp_prefetch``
    worker processes) or ``grain.DataLoader`` whose elements are batches. One epoch is one
    pass of the pipeline from a fresh iterator; a checkpoint holds the pipeline iterator's
    own state at the loop's position, and a resumed run restores it (``set_state``), so it
    continues on exactly the batches it would have seen. ``Loop``, ``fit``, ``evaluate``
    and ``Validation`` wrap a Grain pipeline in one themselves. A pipeline whose iterator
    cannot report its state is refused here, before anything runs.

    Args:
        pipeline: the Grain dataset or loader, yielding batches (dicts or tuples of arrays).
        name: the data's name in provenance (default: the pipeline's kind).

    Examples:
        >>> import grain, numpy as np
        >>> from graphmod.data import GrainSource
        >>> rows = [{"x": np.full(2, i, np.float32)} for i in range(10)]
        >>> source = GrainSource(grain.MapDataset.source(rows).batch(4, drop_remainder=True))
        >>> [b["x"][:, 0].tolist() for b in source.iter_epoch(0, start=1)]
        [[4.0, 5.0, 6.0, 7.0]]
        >>> len(source), source.describe()["pipeline"]
        (2, ['SourceMapDataset(source=list)', 'BatchMapDataset(batch_size=4, drop_remainder=True)'])
    """

    def __new__(cls, pipeline: Pipeline, *, name: str | None = None) -> GrainSource:
        # A pipeline of known length has len(), one without has none (a loop asks hasattr).
        if cls is GrainSource and _length(pipeline) is not None:
            return object.__new__(_SizedGrainSource)  # GrainSource's base is object
        return super().__new__(cls)

    def __init__(self, pipeline: Pipeline, *, name: str | None = None) -> None:
        self.kind = _kind(pipeline)
        self.pipeline = pipeline
        self.name = name or self.kind
        self.length = _length(pipeline)
        self._states: collections.OrderedDict[tuple[int, int], _State] = \
            collections.OrderedDict()  # the state before each batch handed out, by position
        # A checkpoint's (epoch, position) and the state there.
        self._resume: tuple[int, int, _State | None] | None = None
        self._description: dict[str, JSON] | None = None
        self._epoch = 0  # of plain iteration
        self._cursor: _Cursor | None = _Cursor(self._fresh(), 0, 0)
        self._reader: object | None = None  # the generator reading the cursor
        self._check_state(self._cursor.iterator)

    def _fresh(self) -> _Iterator:
        """A new iterator of the pipeline, at its start."""
        _parse_flags()
        return iter(self.pipeline)

    def _check_state(self, iterator: _Iterator) -> None:
        """Refuses a pipeline whose iterator cannot report and restore its state."""
        try:
            if not callable(getattr(iterator, "set_state", None)):
                raise NotImplementedError("it has no set_state method")
            _encoded(iterator.get_state())
        except (AttributeError, NotImplementedError, TypeError, ValueError) as error:
            raise TypeError(
                f"GrainSource({self.name}): the pipeline's iterator, a "
                f"{type(iterator).__name__}, cannot report its state ({error}), so a resumed "
                "run could not continue on the batches it would have seen. Build the pipeline "
                "from Grain's own datasets, or give the iterator get_state() returning a "
                "JSON dict and set_state(state) (subclass grain.DatasetIterator)") from None

    # -- the loop's protocol ------------------------------------------------------------
    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """The batches of ``epoch``, from batch ``start`` on."""
        cursor = self._cursor
        if cursor is None or cursor.epoch != epoch or start not in (
                cursor.position, cursor.last and cursor.last[0]):
            cursor = self._open(epoch, start)
        return self._batches(cursor, start)

    def _open(self, epoch: int, position: int) -> _Cursor:
        """A cursor at ``(epoch, position)``: a fresh iterator, given the state recorded
        there (by a checkpoint or while iterating), else read up to it."""
        state = self._states.get((epoch, position))
        if self._resume is not None and self._resume[:2] == (epoch, position):
            state = self._resume[2]
        iterator = self._fresh()
        if state is not None:
            iterator.set_state(state)
        else:
            for _ in range(position):  # no state kept: the pipeline is deterministic
                next(iterator)
        self._close()
        self._cursor = _Cursor(iterator, epoch, position)
        return self._cursor

    def _close(self) -> None:
        """Closes the live iterator (its worker processes, for ``mp_prefetch``)."""
        close = getattr(self._cursor and self._cursor.iterator, "close", None)
        if callable(close):
            close()
        self._cursor = None

    def _batches(self, cursor: _Cursor, position: int) -> Iterator[Batch]:
        self._reader = reader = object()  # the newest reader of the live iterator owns it
        if cursor.last is not None and cursor.last[0] == position:
            yield cursor.last[1]
            position += 1
        while True:
            if self._cursor is not cursor or self._reader is not reader:  # another took it
                cursor, self._reader = self._open(cursor.epoch, position), reader
            state = cursor.iterator.get_state()
            try:
                batch = next(cursor.iterator)
            except StopIteration:
                return
            self._states[(cursor.epoch, position)] = state
            if len(self._states) > _KEPT_STATES:
                self._states.popitem(last=False)
            cursor.last, cursor.position = (position, batch), position + 1
            position += 1
            yield batch

    def __iter__(self) -> Iterator[Batch]:
        epoch, self._epoch = self._epoch, self._epoch + 1
        return self.iter_epoch(epoch)

    def state_at(self, epoch: int, position: int) -> dict[str, JSON]:
        """The pipeline iterator's state before batch ``position`` of ``epoch`` (the loop's
        consumed position, behind what it read ahead), as JSON for a checkpoint."""
        state = self._states.get((epoch, position))
        if self._resume is not None and self._resume[:2] == (epoch, position):
            state = self._resume[2]
        return {"epoch": epoch, "position": position,
                **(_encoded(state) if state is not None and position else {"state": None})}

    def load_state_dict(self, record: Mapping[str, Any]) -> None:
        """Continues from :meth:`state_at`'s record: the next epoch read at its position
        starts from its state."""
        try:
            text, encoding = record["state"], record.get("encoding", "json")
            state = None if text is None else (
                text.encode() if encoding == "json-bytes" else json.loads(text))
            self._resume = (int(record["epoch"]), int(record["position"]), state)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"GrainSource({self.name}).load_state_dict: the checkpoint's "
                             f"data record {record!r} is no GrainSource position ({error}); "
                             "resume with the data the run was trained on") from None

    # -- evaluation -------------------------------------------------------------------------
    def iter_padded(self) -> Iterator[tuple[Batch, np.ndarray]]:
        """Every batch of one pass, from a fresh iterator: ``(batch, mask)``, a batch
        shorter than the first padded by repeating its last row, ``mask`` False on the
        padding (build an evaluation pipeline with ``drop_remainder=False``)."""
        size = None
        for batch in self._fresh():
            rows = _rows(batch)
            size = rows if size is None else size
            if rows > size:
                raise ValueError(f"GrainSource({self.name}).iter_padded: a batch of {rows} "
                                 f"rows after a first of {size}; evaluation takes batches "
                                 "of one size, the last one shorter")
            mask = np.arange(size) < rows
            if rows < size:
                pad = size - rows
                batch = jax.tree.map(
                    lambda a, pad=pad: np.concatenate([a, np.repeat(a[-1:], pad, 0)]), batch)
            yield batch, mask

    # -- provenance -------------------------------------------------------------------------
    def describe(self) -> dict[str, JSON]:
        """Name, kind, length (None: unknown), the pipeline's transformations as Grain
        prints them, the seeds it was given, and the first batch's shapes, dtypes and a
        content hash (for provenance; JSON)."""
        if self._description is None:
            first = next(self.iter_epoch(0), None)
            leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(first)]
            digest = hashlib.sha256()
            for leaf in leaves:
                hash_array(digest, leaf, str((leaf.shape, leaf.dtype.str)))
            description: dict[str, JSON] = {
                "name": self.name, "kind": self.kind, "length": self.length,
                # Lists of JSON values (a list of str is no list of JSON to the checker).
                "pipeline": list(_lineage(self.pipeline)), "seeds": list(_seeds(self.pipeline)),
                "shapes": [list(leaf.shape) for leaf in leaves],
                "dtypes": [leaf.dtype.name for leaf in leaves],
                "first_batch_sha256": digest.hexdigest()}
            self._description = description
        return dict(self._description)

    def __repr__(self) -> str:
        length = "length unknown" if self.length is None else f"{self.length} batches a pass"
        return f"GrainSource({self.name}, {length})"


class _SizedGrainSource(GrainSource):
    """A :class:`GrainSource` whose pipeline knows its length."""

    def __len__(self) -> int:
        assert self.length is not None
        return self.length


def _encoded(state: _State) -> dict[str, str]:
    """A Grain iterator state as JSON text (bytes: a ``DataLoader``'s JSON already)."""
    if isinstance(state, bytes):
        return {"state": state.decode(), "encoding": "json-bytes"}
    return {"state": json.dumps(state, sort_keys=True), "encoding": "json"}


def _parse_flags() -> None:
    """Marks absl's flags parsed where no absl app parsed them: Grain 0.2.18's worker
    processes read a flag, which raises before (google/grain#1355, fixed after it)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
