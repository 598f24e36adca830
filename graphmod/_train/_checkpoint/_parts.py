"""The part of a checkpoint one process writes in a run of several processes: one file.

A part is a NumPy ``.npz`` archive (read back with ``allow_pickle=False``: nothing in it can
run code) of the process's chunks as raw bytes, ``c0``, ``c1``, ... (any dtype, bfloat16 and
key data included; the meta record says what they are), and ``chunks``: the JSON list of
``[leaf index, start, shape, checksum]`` process 0 collects into the meta record. It is
written under a temporary name and renamed, so a part exists only whole.

Orbax is not used for parts: its NumPy handler writes only in process 0, whatever the
primary host it is given (orbax-checkpoint 0.12), so another process's host arrays would
be silently dropped.

Examples:
    >>> import json, os, tempfile, numpy as np
    >>> from graphmod._train._checkpoint._parts import read_part, write_part
    >>> path = os.path.join(tempfile.mkdtemp(), "part-1.npz")
    >>> write_part(path, [np.arange(3.0)], [[0, [0], [3], "crc"]])
    >>> listed, pieces = read_part(path)
    >>> listed, pieces[0].view(np.float64)
    ([[0, [0], [3], 'crc']], array([0., 1., 2.]))
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from numpy.lib.npyio import NpzFile


def write_part(path: str, pieces: list[np.ndarray], listed: Sequence[Sequence[object]]
               ) -> None:
    """Writes ``pieces`` (as raw bytes) and their ``listed`` entries to ``path`` at once."""
    members = {f"c{i}": np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
               for i, piece in enumerate(pieces)}
    members["chunks"] = np.frombuffer(json.dumps(listed).encode(), np.uint8)
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as file:
        # The members are c0, c1, ... and chunks: none is savez's own allow_pickle keyword.
        np.savez(file, **members)  # pyright: ignore[reportArgumentType]
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def open_part(path: str) -> tuple[NpzFile, list[Any]]:
    """The archive of the part at ``path`` (a NumPy ``NpzFile``, to close) and its entries
    (JSON lists of mixed types), no chunk read yet; ``OSError`` or ``ValueError`` (saying
    why) if it cannot be read."""
    if not zipfile.is_zipfile(path):  # np.load would take it for a pickle, and refuse it
        raise ValueError("not a whole part (no zip archive)")
    try:
        archive = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, EOFError) as error:
        raise ValueError(f"not a whole part ({type(error).__name__}: {error})") from None
    try:
        listed = json.loads(read_piece(archive, "chunks").tobytes())
        if not isinstance(listed, list):
            raise ValueError("its chunk list is not a list")
    except BaseException:
        archive.close()
        raise
    return archive, listed


def read_piece(archive: NpzFile, member: int | str) -> np.ndarray:
    """Chunk ``member`` (its index among the part's chunks, or a member's name) of an
    :func:`open_part` archive, as raw bytes; ``ValueError`` if the archive does not hold
    it whole."""
    try:
        return archive[member if isinstance(member, str) else f"c{member}"]
    except (KeyError, zipfile.BadZipFile, EOFError, UnicodeDecodeError) as error:
        raise ValueError(f"not a whole part ({type(error).__name__}: {error})") from None


def read_part(path: str, *, pieces: bool = True) -> tuple[list[Any], list[np.ndarray]]:
    """The entries and raw pieces of the part at ``path`` (``pieces=False``: the entries
    alone, nothing else read); ``OSError`` or ``ValueError`` (saying why) if it cannot be
    read."""
    archive, listed = open_part(path)
    with archive:
        return listed, [read_piece(archive, i) for i in range(len(listed) if pieces else 0)]
