"""Putting the arrays of a checkpoint of several processes (format 3) back together: each
array whole, or only the regions of it that this process's devices hold.

Chunks are read one at a time, when a region needs them, and checked as they are read: that
none overlaps another inside the region, that each holds the bytes its entry says and
matches its checksum, and that together they cover the region. :func:`check_record` has
already checked, before anything was read, that every chunk lies inside its array and that
their sizes add up to the array's: so chunks that never overlap tile it exactly.

Sharp edge: a process that reads only its own regions checks only the chunks that overlap
them, so processes could disagree on whether a checkpoint verifies. The reader makes every
process agree before any of them uses one (``CheckpointReader.restore``).

Examples:
    >>> import numpy as np
    >>> from graphmod._train._checkpoint._chunks import chunk_members, read_region
    >>> from graphmod._train._checkpoint._format import checksum
    >>> halves = [np.arange(3.0), np.arange(3.0, 6.0)]
    >>> entry = ["x", [6], "float64",
    ...          [[0, [0], [3], checksum(halves[0])], [1, [3], [3], checksum(halves[1])]]]
    >>> raw = lambda part, member: halves[part].view(np.uint8)
    >>> row = chunk_members([entry])[0]
    >>> read_region("ckpt", entry, row, raw).tolist(), read_region(
    ...     "ckpt", entry, row, raw, (slice(2, 4),)).tolist()
    ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0])
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from graphmod._train._checkpoint._errors import CheckpointError, failure_reason
from graphmod._train._checkpoint._format import checksum, corrupted
from graphmod._train._checkpoint._parts import open_part, read_piece

if TYPE_CHECKING:
    from numpy.lib.npyio import NpzFile

Region = tuple[slice, ...]
# (part, the chunk's index among that part's chunks) -> the chunk's raw bytes
PieceReader = Callable[[int, int], np.ndarray]


def chunk_members(entries: list[list[Any]]) -> list[list[int]]:
    """Each chunk's index among its part's chunks, per entry: a part holds its chunks in
    the order the entries list them."""
    seen: collections.Counter[int] = collections.Counter()
    rows = []
    for *_, chunks in entries:
        row = []
        for part, *_ in chunks:
            row.append(seen[part])
            seen[part] += 1
        rows.append(row)
    return rows


def read_region(path: str, entry: list[Any], members: list[int], piece: PieceReader,
                region: Region | None = None) -> np.ndarray:
    """The values of ``region`` (slices with starts and stops; default: the whole array) of
    the array of ``entry`` (``[name, shape, dtype, chunks]``), from the chunks overlapping
    it (``members``: their indices in their parts, :func:`chunk_members`); raises a
    :class:`CheckpointError` naming the first chunk that overlaps another in the region
    or whose size or checksum differs from its entry."""
    name, shape, dtype, chunks = entry
    kind = jnp.dtype(dtype)
    lows = [0] * len(shape) if region is None else [cut.start for cut in region]
    highs = list(shape) if region is None else [cut.stop for cut in region]
    out = np.zeros([b - a for a, b in zip(lows, highs, strict=True)], kind)
    # A mask costs at most the region's own memory, and time in its size alone.
    covered = np.zeros(out.shape, bool) if len(chunks) > 1 else None
    for (part, start, size, crc), member in zip(chunks, members, strict=True):
        low = [max(a, s) for a, s in zip(lows, start, strict=True)]
        high = [min(b, s + n) for b, s, n in zip(highs, start, size, strict=True)]
        if any(h <= lo for lo, h in zip(low, high, strict=True)):
            continue  # outside the region (or empty)
        where = f"array {name}'s chunk at {start} (written by process {part})"
        inside = tuple(slice(lo - a, h - a) for lo, h, a in zip(low, high, lows, strict=True))
        if covered is not None:
            if covered[inside].any():
                raise CheckpointError(path, f"{where} overlaps another chunk")
            covered[inside] = True
        data = _checked(path, where, piece(part, member), size, dtype, crc)
        out[inside] = data[tuple(slice(lo - s, h - s)
                                 for lo, h, s in zip(low, high, start, strict=True))]
    if covered is not None and not covered.all():
        raise CheckpointError(path, f"the chunks of array {name} leave part of it uncovered")
    return out


def _checked(path: str, where: str, piece: np.ndarray, size: list[int], dtype: str,
             crc: str) -> np.ndarray:
    """A chunk's raw bytes as an array of ``size`` and ``dtype``, once checked."""
    piece, kind = np.asarray(piece), jnp.dtype(dtype)
    if piece.dtype != np.uint8 or piece.ndim != 1 or \
            piece.size != math.prod(size) * kind.itemsize:
        raise CheckpointError(path, f"{where} holds {piece.nbytes} bytes, the meta record "
                              f"says {size} {dtype}")
    found = checksum(piece)
    if found != crc:
        raise corrupted(path, where, found, crc)
    return piece.view(kind).reshape(size)


def local_array(path: str, entry: list[Any], members: list[int], piece: PieceReader,
                sharding: jax.sharding.Sharding | None) -> np.ndarray | jax.Array:
    """The array of ``entry`` placed by ``sharding`` across processes, read from the
    regions this process's devices hold (each distinct one once); whole on the host when
    ``sharding`` is None or places it on this process's devices alone."""
    if sharding is None or sharding.is_fully_addressable:
        return read_region(path, entry, members, piece)
    shape = tuple(entry[1])
    regions: dict[tuple, np.ndarray] = {}

    def region(index: Region | None) -> np.ndarray:
        assert index is not None  # a shard's index: JAX asserts so itself before calling
        bounds = tuple(cut.indices(n)[:2] for cut, n in zip(index, shape, strict=True))
        if bounds not in regions:
            regions[bounds] = read_region(path, entry, members, piece,
                                          tuple(slice(a, b) for a, b in bounds))
        return regions[bounds]

    return jax.make_array_from_callback(shape, sharding, region)


class PartFiles:
    """The parts of the checkpoint at ``path``, each opened when a chunk of it is first
    needed and checked then (a whole archive holding as many chunks as ``entries`` list
    for it); called as ``parts(part, member)`` for a chunk's raw bytes. Closes them on
    leaving its ``with`` block."""

    def __init__(self, path: str, entries: list[list[Any]]) -> None:
        self.path = path
        self._counts = collections.Counter(part for *_, chunks in entries
                                           for part, *_ in chunks)
        self._open: dict[int, NpzFile] = {}

    def __enter__(self) -> PartFiles:
        return self

    def __exit__(self, *_: object) -> None:
        for archive in self._open.values():
            archive.close()
        self._open.clear()

    def __call__(self, part: int, member: int) -> np.ndarray:
        archive = self._open.get(part)
        if archive is None:
            archive = self._opened(part)
        try:
            return read_piece(archive, member)
        except (OSError, ValueError) as error:
            raise self._unreadable(part, error) from None

    def _opened(self, part: int) -> NpzFile:
        name = f"part-{part}.npz"
        where = os.path.join(self.path, name)
        if not os.path.isfile(where):
            raise CheckpointError(self.path, f"the part process {part} wrote ({name}) is missing")
        try:
            archive, listed = open_part(where)
        except (OSError, ValueError) as error:
            raise self._unreadable(part, error) from None
        self._open[part] = archive
        if len(listed) != self._counts[part]:
            raise CheckpointError(self.path, f"the part process {part} wrote ({name}) holds "
                                  f"{len(listed)} chunks, the meta record lists "
                                  f"{self._counts[part]}")
        return archive

    def _unreadable(self, part: int, error: BaseException) -> CheckpointError:
        return CheckpointError(self.path, f"the part process {part} wrote (part-{part}.npz) "
                               f"cannot be read ({failure_reason(error)})")
