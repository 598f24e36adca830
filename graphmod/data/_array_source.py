"""``ArraySource``: batches from in-memory arrays, deterministic and resumable."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator

import jax
import numpy as np

from graphmod._core._codec import hash_array
from graphmod._core._number_checks import is_whole_number
from graphmod._records._summary import data_text
from graphmod.data._metadata import Metadata
from graphmod.typing import JSON, ArrayTree, Batch


class ArraySource:
    """Batches of ``batch_size`` rows from arrays sharing their first dimension.

    Iterating yields one epoch of batches with the structure of ``arrays`` (a dict, tuple
    or single array of NumPy-convertible arrays). Shuffling is deterministic per
    ``(seed, epoch)``; ``iter_epoch(epoch, start=k)`` resumes at batch ``k``. With
    ``drop_remainder`` (default) the short final batch is dropped in training;
    :meth:`iter_padded` pads it and yields a mask instead, for evaluation.

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource
        >>> source = ArraySource({"x": np.arange(10.0)}, batch_size=4)
        >>> [b["x"].tolist() for b in source]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
        >>> len(source), source.size
        (2, 10)
        >>> source
        ArraySource(arrays, 10 rows, batch 4, shapes [] float64; 2 batches an epoch)
    """

    def __init__(self, arrays: ArrayTree, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                 drop_remainder: bool = True, name: str | None = None) -> None:
        leaves, self._treedef = jax.tree.flatten(arrays)
        if not leaves:
            raise ValueError("ArraySource(arrays): no arrays given")
        self._leaves = [np.asarray(leaf) for leaf in leaves]
        sizes = {leaf.shape[0] for leaf in self._leaves if leaf.ndim}
        if any(leaf.ndim == 0 for leaf in self._leaves) or len(sizes) != 1:
            paths = [jax.tree_util.keystr(p) for p, _ in
                     jax.tree_util.tree_flatten_with_path(arrays)[0]]
            rows = "; ".join(
                f"arrays{p} has {leaf.shape[0]} rows" if leaf.ndim else f"arrays{p} is a scalar"
                for p, leaf in zip(paths, self._leaves, strict=True))
            raise ValueError(f"ArraySource(arrays): the arrays must share their first "
                             f"dimension, one row per example: {rows}. Pass as many rows "
                             "in each (e.g. x[:n] and y[:n])")
        self.size = sizes.pop()
        if self.size == 0:
            raise ValueError("ArraySource(arrays): the arrays are empty (0 rows)")
        if not is_whole_number(batch_size, least=1):  # True is an int to Python, not here
            raise ValueError(f"ArraySource(batch_size={batch_size!r}): must be a positive int, "
                             "the rows of each batch, e.g. batch_size=32")
        if drop_remainder and batch_size > self.size:
            raise ValueError(f"ArraySource(batch_size={batch_size}): larger than the "
                             f"{self.size} rows, so every batch would be dropped")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.name = name or "arrays"
        self._epoch = 0

    def __len__(self) -> int:
        full, rest = divmod(self.size, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    def order(self, epoch: int) -> np.ndarray:
        """The row order of ``epoch`` (a permutation when shuffling)."""
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def _batch(self, rows: np.ndarray) -> Batch:
        return jax.tree.unflatten(self._treedef, [leaf[rows] for leaf in self._leaves])

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """The batches of ``epoch``, from batch ``start`` on."""
        order = self.order(epoch)
        for index in range(start, len(self)):
            yield self._batch(order[index * self.batch_size:(index + 1) * self.batch_size])

    def __iter__(self) -> Iterator[Batch]:
        epoch, self._epoch = self._epoch, self._epoch + 1
        return self.iter_epoch(epoch)

    def iter_padded(self) -> Iterator[tuple[Batch, np.ndarray]]:
        """Every row once, in order, in full batches: ``(batch, mask)``, the last padded by
        repeating its final row, with ``mask`` False on the padding."""
        for begin in range(0, self.size, self.batch_size):
            rows = np.arange(begin, min(begin + self.batch_size, self.size))
            mask = np.ones(self.batch_size, bool)
            if len(rows) < self.batch_size:
                mask[len(rows):] = False
                rows = np.concatenate([rows, np.full(self.batch_size - len(rows), rows[-1])])
            yield self._batch(rows), mask

    def state_dict(self) -> dict[str, int]:
        """The position of plain iteration (the loop tracks its own)."""
        return {"epoch": self._epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch = int(state["epoch"])

    def metadata_arrays(self) -> Batch:
        """The whole arrays, in their structure, for ``Metadata.gather`` to reduce."""
        return jax.tree.unflatten(self._treedef, self._leaves)

    @functools.cached_property
    def metadata(self) -> Metadata:
        """The arrays' :class:`~graphmod.data.Metadata` (gathered once, exactly).

        Examples:
            >>> import numpy as np
            >>> from graphmod.data import ArraySource
            >>> ArraySource({"y": np.array([0, 1, 1])}, batch_size=1).metadata["y"].labels
            ((0, 1), (1, 2))
        """
        return Metadata.gather(self)

    def describe(self) -> dict[str, JSON]:
        """Name, size, shapes, dtypes and a content hash (for provenance)."""
        digest = hashlib.sha256()
        for leaf in self._leaves:
            hash_array(digest, leaf, str((leaf.shape, leaf.dtype.str)))
        return {**self._settings(), "sha256": digest.hexdigest()}

    def _settings(self) -> dict[str, JSON]:
        return {
            "name": self.name,
            "size": self.size,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_remainder": self.drop_remainder,
            "shapes": [list(leaf.shape[1:]) for leaf in self._leaves],
            "dtypes": [leaf.dtype.name for leaf in self._leaves],
        }

    def __repr__(self) -> str:
        return f"ArraySource({data_text(self._settings())}; {len(self)} batches an epoch)"
