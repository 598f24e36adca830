"""What a checkpoint holds, and what verifies it: leaf specs, host arrays, checksums, records.

A state is stored as the flat list of its leaves as host arrays (PRNG keys as their key data;
:func:`storable`), and described in the meta record by each leaf's path, shape and dtype
(:func:`leaf_specs`) and each array's ``[path, shape, dtype, checksum]`` entry
(:func:`array_entries`). Nothing here touches orbax or the disk.

The checksum is CRC-32 (``zlib.crc32``): it exists to detect accidental corruption (flipped
or zeroed bytes, a truncated or swapped file), which it misses with probability 2**-32 per
array and never for an error burst of up to 32 bits, at about 2 GB/s (sha256 runs at about
0.8 GB/s and blake2b at 0.5 on the machines measured; see benchmarks/checkpoint_checksums.py).
A cryptographic hash would not make tampering detectable: whoever can rewrite a checkpoint's
arrays can rewrite the checksums beside them. Safety against crafted checkpoints comes from
elsewhere: nothing graphmod loads executes code (no pickle).
"""

from __future__ import annotations

import concurrent.futures
import os
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from graphmod._core._arguments import is_key
from graphmod._train._checkpoint._errors import CheckpointError

FORMAT = 2
LEGACY_FORMAT = 1  # graphmod 0.1's: one pytree of arrays, no run id, no checksums


def leaf_specs(state: Any) -> dict[str, list[Any]]:
    """``{leaf path: [shape, dtype]}`` of a state (a key: its key data's shape, its key dtype).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from graphmod._train._checkpoint._format import leaf_specs
        >>> leaf_specs({"w": jnp.ones((2, 3)), "rng": jax.random.key(0)})
        {"['rng']": [[2], 'key<fry>'], "['w']": [[2, 3], 'float32']}
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if is_key(leaf):  # described by its key data, for arrays and abstract keys alike
            data = jax.eval_shape(jax.random.key_data, leaf)
            shape, dtype = list(data.shape), str(leaf.dtype)
        else:
            shape, dtype = list(np.shape(leaf)), str(jnp.result_type(leaf))
        out[jax.tree_util.keystr(path)] = [shape, dtype]
    return out


def storable(state: Any) -> list[np.ndarray]:
    """The state's leaves as whole host NumPy arrays (keys as key data), safe to write
    later. An array split over several processes is gathered from all of them: in a
    multi-process run every process must call this, at the same step."""
    def host(leaf: Any) -> np.ndarray:
        if is_key(leaf):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.array(leaf)  # a copy: the loop donates the state's buffers next step

    return [host(leaf) for leaf in jax.tree.leaves(state)]


def stored_specs(template: Any) -> list[tuple[list[int], str]]:
    """The shape and dtype each leaf of ``template`` is stored with (keys: their key data)."""
    def one(leaf: Any) -> tuple[list[int], str]:
        if is_key(leaf):
            leaf = jax.eval_shape(jax.random.key_data, leaf)
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype  # as np.array
        return list(np.shape(leaf)), str(np.dtype(dtype))

    return [one(leaf) for leaf in jax.tree.leaves(template)]


def restored(template: Any, leaves: list[np.ndarray]) -> Any:
    """The stored ``leaves`` as a state shaped like ``template`` (keys wrapped again)."""
    def back(want: Any, got: Any) -> Any:
        if is_key(want):  # the key's implementation is part of its dtype
            return jax.random.wrap_key_data(jnp.asarray(got), impl=want.dtype._impl)
        return jnp.asarray(got, dtype=getattr(want, "dtype", None))  # a Python number too

    tree = jax.tree.unflatten(jax.tree.structure(template), leaves)
    return jax.tree.map(back, template, tree)


def checksum(array: np.ndarray) -> str:
    """CRC-32 of an array's bytes in C order, as 8 hex digits (zlib releases the GIL)."""
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return f"{zlib.crc32(data):08x}"


def checksums(arrays: list[np.ndarray]) -> list[str]:
    """Each array's checksum; in threads when there is much to hash (zlib.crc32 releases
    the GIL), so the checksums of a large state cost a fraction of its write."""
    workers = min(8, os.cpu_count() or 1, len(arrays))
    if workers < 2 or sum(a.nbytes for a in arrays) < 2**24:
        return [checksum(a) for a in arrays]
    with concurrent.futures.ThreadPoolExecutor(workers, "graphmod-checksum") as pool:
        return list(pool.map(checksum, arrays))


def array_entries(paths: list[str], arrays: list[np.ndarray]) -> list[list[Any]]:
    """The meta record's ``[path, shape, dtype, checksum]`` of each array."""
    return [[p, list(a.shape), str(a.dtype), c]
            for p, a, c in zip(paths, arrays, checksums(arrays), strict=True)]


def check_compatible(directory: str, saved: Mapping[str, Any], template: Any) -> None:
    """Raises naming the differing leaf paths if ``template`` is not the saved state's."""
    want = leaf_specs(template)
    differing = sorted(
        [f"{p} (missing in the checkpoint)" for p in want if p not in saved]
        + [f"{p} (only in the checkpoint)" for p in saved if p not in want]
        + [f"{p}: checkpoint {saved[p][0]} {saved[p][1]}, program {want[p][0]} {want[p][1]}"
           for p in want if p in saved and list(saved[p]) != list(want[p])]
    )
    if differing:
        raise ValueError(
            f"{directory} holds a checkpoint of another program's state; differing paths:\n  "
            + "\n  ".join(differing[:20])
            + (f"\n  ... and {len(differing) - 20} more" if len(differing) > 20 else "")
        )


def check_record(path: str, record: Any, *, legacy: bool) -> None:
    """Raises a :class:`CheckpointError` unless ``record`` is a meta record of this format
    with a well-formed array list (``legacy``: a format-1 record passes as it is)."""
    if not isinstance(record, dict):
        raise CheckpointError(path, "the meta record is not a JSON object")
    if record.get("format") == LEGACY_FORMAT and legacy:
        return
    if record.get("format") != FORMAT:
        old = record.get("format") == LEGACY_FORMAT
        raise CheckpointError(path, "written by graphmod 0.1 without checksums (format 1): "
                              "restorable, but it cannot be verified" if old else
                              f"checkpoint format {record.get('format')!r}, this graphmod "
                              f"reads format {FORMAT}")
    arrays = record.get("arrays")
    if not isinstance(arrays, list) or not all(_well_formed(a) for a in arrays):
        raise CheckpointError(path, "the meta record's array list is malformed")


def check_arrays(path: str, entries: list[list[Any]], arrays: list[np.ndarray]) -> None:
    """Raises a :class:`CheckpointError` naming the first array whose shape, dtype or
    checksum differs from its meta record entry."""
    for (name, shape, dtype, _), array in zip(entries, arrays, strict=True):
        if list(array.shape) != shape or str(array.dtype) != dtype:
            raise CheckpointError(path, f"array {name} is stored as {list(array.shape)} "
                                  f"{array.dtype}, its meta record says {shape} {dtype}")
    for (name, _, _, crc), found in zip(entries, checksums(arrays), strict=True):
        if found != crc:
            raise CheckpointError(path, f"array {name} fails its checksum (crc32 {found}, "
                                  f"recorded {crc}): the data is corrupted")


def _well_formed(entry: Any) -> bool:
    """Whether a meta array entry is ``[path, shape, plain dtype name, checksum]``."""
    if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
            and isinstance(entry[3], str) and isinstance(entry[2], str)
            and isinstance(entry[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                    for d in entry[1])):
        return False
    try:
        return jnp.dtype(entry[2]).kind in "biufcV" and not jnp.dtype(entry[2]).hasobject
    except TypeError:
        return False
