"""What a checkpoint holds, and what verifies it: leaf specs, host arrays, checksums, records.

A state is stored as the flat list of its leaves as host arrays (PRNG keys as their key data;
:func:`storable`), and described in the meta record by each leaf's path, shape and dtype
(:func:`leaf_specs`) and each array's ``[path, shape, dtype, checksum]`` entry
(:func:`array_entries`). Nothing here touches orbax or the disk.

In a run of several processes each process writes the pieces of the arrays it holds
(:func:`owned_chunks`: of an array split over processes, the shards whose first copy is on
its devices), and the meta record's entry of an array lists its chunks instead of one
checksum: ``[path, shape, dtype, [[part, start, shape, checksum], ...]]`` (format 3, with
``"parts"``: how many processes wrote). :func:`check_record` checks, before anything is
read, that the chunks of each array lie inside it and add up to its size;
:mod:`graphmod._train._checkpoint._chunks` puts the chunks read back together, checking
that none overlaps another (so they tile the array exactly) and each one's checksum.

The checksum is CRC-32 (``zlib.crc32``): it exists to detect accidental corruption (flipped
or zeroed bytes, a truncated or swapped file), which it misses with probability 2**-32 per
array and never for an error burst of up to 32 bits, at about 2 GB/s (sha256 runs at about
0.8 GB/s and blake2b at 0.5 on the machines measured; see benchmarks/checkpoint_checksums.py).
A cryptographic hash would not make tampering detectable: whoever can rewrite a checkpoint's
arrays can rewrite the checksums beside them, and a keyed one (an HMAC) only if its key lived
outside the run directory, which a run could then not be resumed without. Safety against
crafted checkpoints comes from elsewhere: nothing graphmod loads executes code (no pickle;
JSON records, arrays of plain dtypes), and every array is checked against the program's
shapes and dtypes before it is used.

Each checkpoint folder holds a marker, ``graphmod-checkpoint.json`` (:func:`marker_record`):
the run id and the step, written last, before the folder is renamed into place. A folder is a
checkpoint only if it carries one naming its own step, or (written before markers, by
graphmod until 2026-12) its meta record names its step (and its run id); anything else is
not graphmod's.
The meta record of a loop's checkpoint holds its counters (``"time"``, ``"position"``,
``"loop"``): :func:`check_record` checks their types before anything uses them.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from graphmod._core._number_checks import is_real_number, is_whole_number
from graphmod._core._program._arguments import is_key
from graphmod._train._checkpoint._errors import CheckpointError
from graphmod.typing import JSON, PyTree

FORMAT = 2
MARKER = "graphmod-checkpoint.json"  # in every checkpoint folder: what makes it graphmod's
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,256}")
CHUNKED_FORMAT = 3  # a multi-process run's: each array in the chunks its processes held
LEGACY_FORMAT = 1  # graphmod 0.1's: one pytree of arrays, no run id, no checksums
Chunk = tuple[int, list[int], np.ndarray]  # (leaf index, start, the piece on the host)
_State = TypeVar("_State")  # a state's tree (a TrainState, a dict), its template's too
# An array's entry in the meta record, [path, shape, dtype, checksum or chunks], is a JSON
# list of mixed types, which Python types as list[Any] (check_record validated it).


def is_run_id(value: object) -> TypeGuard[str]:
    """Whether ``value`` can be a run id: it names files, so only letters, digits, ``_``
    and ``-``, 1 to 256 of them (a uuid4's hex, by default)."""
    return isinstance(value, str) and _RUN_ID.fullmatch(value) is not None


def marker_record(run_id: str, step: int) -> dict[str, JSON]:
    """The marker graphmod writes into the folder of ``step``'s checkpoint (``MARKER``)."""
    return {"graphmod": "checkpoint", "run_id": run_id, "step": step}


def marker_error(marker: JSON, step: int) -> str | None:
    """Why ``marker`` (read from the folder named ``step``) is not graphmod's marker of that
    step, or None.

    Examples:
        >>> from graphmod._train._checkpoint._format import marker_error, marker_record
        >>> marker_error(marker_record("run", 95), 95), marker_error(marker_record("run", 95), 96)
        (None, 'its marker names step 95')
    """
    if not (isinstance(marker, dict) and marker.get("graphmod") == "checkpoint"
            and is_run_id(marker.get("run_id")) and is_whole_number(marker.get("step"))):
        return f"its marker is not graphmod's ({MARKER} holds {marker!r:.60})"
    if marker["step"] != step:
        return f"its marker names step {marker['step']}"
    return None


def leaf_specs(state: PyTree) -> dict[str, JSON]:
    """``{leaf path: [shape, dtype]}`` of a state (a key: its key data's shape, its key dtype).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from graphmod._train._checkpoint._format import leaf_specs
        >>> leaf_specs({"w": jnp.ones((2, 3)), "rng": jax.random.key(0)})
        {"['rng']": [[2], 'key<fry>'], "['w']": [[2, 3], 'float32']}
    """
    out: dict[str, JSON] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if is_key(leaf):  # described by its key data, for arrays and abstract keys alike
            shape, dtype = jax.eval_shape(jax.random.key_data, leaf).shape, str(leaf.dtype)
        else:
            shape, dtype = np.shape(leaf), str(jnp.result_type(leaf))
        out[jax.tree_util.keystr(path)] = [[*shape], dtype]
    return out


def storable(state: PyTree) -> list[np.ndarray]:
    """The state's leaves as whole host NumPy arrays (keys as key data), safe to write
    later (one process: every array is whole on its devices)."""
    # np.array copies: the loop donates the state's buffers at the next step
    return [np.array(_data(leaf)) for leaf in jax.tree.leaves(state)]


def _data(leaf: Any) -> Any:  # a leaf of jax.tree.leaves: an array, a number, a key
    """A leaf as it is stored: a key as its key data, anything else as it is."""
    return jax.random.key_data(leaf) if is_key(leaf) else leaf


def shard_chunks(array: jax.Array) -> list[tuple[list[int], np.ndarray]]:
    """``(start, host copy)`` of each shard of ``array`` on this process's devices that is
    its first copy (``replica_id == 0``): over all processes, every element once.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from graphmod._train._checkpoint._format import shard_chunks
        >>> [(start, piece.shape) for start, piece in shard_chunks(jnp.ones((2, 3)))]
        [([0, 0], (2, 3))]
    """
    return [([cut.start or 0 for cut in shard.index], np.array(shard.data))
            for shard in array.addressable_shards if shard.replica_id == 0]


def owned_chunks(state: PyTree) -> list[Chunk]:
    """The pieces of the state's leaves (keys as key data) this process writes in a run of
    several processes: of an array split over processes, its :func:`shard_chunks`; what
    is whole in every process (a Python number, an array on one process's devices) is
    process 0's to write."""
    out: list[Chunk] = []
    for index, leaf in enumerate(jax.tree.leaves(state)):
        leaf = _data(leaf)
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            out += [(index, start, piece) for start, piece in shard_chunks(leaf)]
        elif jax.process_index() == 0:
            out.append((index, [0] * np.ndim(leaf), np.array(leaf)))
    return out


def stored_specs(template: PyTree) -> list[tuple[list[int], str]]:
    """The shape and dtype each leaf of ``template`` is stored with (keys: their key data)."""
    def one(leaf: Any) -> tuple[list[int], str]:
        if is_key(leaf):
            leaf = jax.eval_shape(jax.random.key_data, leaf)
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype  # as np.array
        return list(np.shape(leaf)), str(np.dtype(dtype))

    return [one(leaf) for leaf in jax.tree.leaves(template)]


def stored_positions(path: str, entries: list[list[Any]], paths: Sequence[str]) -> list[int]:
    """The index in the meta record's array list of each of a template's leaf ``paths``
    (the keys of its :func:`leaf_specs`, in its order), so a state restores whatever order
    its pytree listed its leaves in when it was saved (a ``TrainState`` listed its variables
    before its optimizer state until 2026-11-27). Raises a :class:`CheckpointError` unless
    the list names each leaf once.

    Examples:
        >>> from graphmod._train._checkpoint._format import stored_positions
        >>> entries = [["['b']", [], "float32", "0"], ["['a']", [2], "float32", "0"]]
        >>> stored_positions("ckpt", entries, ["['a']", "['b']"])
        [1, 0]
    """
    index = {entry[0]: i for i, entry in enumerate(entries)}
    if len(index) != len(entries) or sorted(index) != sorted(paths):
        raise CheckpointError(path, "the meta record's array list does not match its tree "
                              "of leaves")
    return [index[leaf] for leaf in paths]


def restored(template: _State, leaves: Sequence[np.ndarray | jax.Array]) -> _State:
    """The stored ``leaves`` as a state shaped like ``template`` (keys wrapped again)."""
    def back(want: Any, got: np.ndarray | jax.Array) -> jax.Array:
        if is_key(want):  # the key's implementation is part of its dtype
            return jax.random.wrap_key_data(jnp.asarray(got), impl=want.dtype._impl)
        if isinstance(got, jax.Array):  # placed across processes already (local_array)
            return got
        return jnp.asarray(got, dtype=getattr(want, "dtype", None))  # a Python number too

    tree = jax.tree.unflatten(jax.tree.structure(template), leaves)
    return jax.tree.map(back, template, tree)


def checksum(array: np.ndarray) -> str:
    """CRC-32 of an array's bytes in C order, as 8 hex digits (zlib releases the GIL)."""
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return f"{zlib.crc32(data.data):08x}"


def checksums(arrays: list[np.ndarray]) -> list[str]:
    """Each array's checksum; in threads when there is much to hash (zlib.crc32 releases
    the GIL), so the checksums of a large state cost a fraction of its write."""
    workers = min(8, os.cpu_count() or 1, len(arrays))
    if workers < 2 or sum(a.nbytes for a in arrays) < 2**24:
        return [checksum(a) for a in arrays]
    with concurrent.futures.ThreadPoolExecutor(workers, "graphmod-checksum") as pool:
        return list(pool.map(checksum, arrays))


def array_list(record: Mapping[str, JSON]) -> list[list[Any]]:
    """The entries of a meta record's array list, which :func:`check_record` validated."""
    arrays = record["arrays"]
    return [entry for entry in arrays if isinstance(entry, list)] \
        if isinstance(arrays, list) else []


def array_entries(paths: list[str], arrays: list[np.ndarray]) -> list[JSON]:
    """The meta record's ``[path, shape, dtype, checksum]`` of each array."""
    return [[p, [*a.shape], str(a.dtype), c]
            for p, a, c in zip(paths, arrays, checksums(arrays), strict=True)]


def check_compatible(directory: str, saved: Mapping[str, JSON],
                     want: Mapping[str, JSON]) -> None:
    """Raises naming the differing leaf paths unless ``want`` (a template's
    :func:`leaf_specs`) is the saved state's."""
    differing = sorted(
        [f"{p} (missing in the checkpoint)" for p in want if p not in saved]
        + [f"{p} (only in the checkpoint)" for p in saved if p not in want]
        + [f"{p}: checkpoint {_spec(saved[p])}, program {_spec(want[p])}"
           for p in want if p in saved and saved[p] != want[p]]
    )
    if differing:
        raise ValueError(
            f"{directory} holds a checkpoint of another program's state; differing paths:\n  "
            + "\n  ".join(differing[:20])
            + (f"\n  ... and {len(differing) - 20} more" if len(differing) > 20 else "")
        )


def check_record(path: str, record: JSON, *, legacy: bool, step: int | None = None,
                 loop: bool = False) -> None:
    """Raises a :class:`CheckpointError` unless ``record`` is a meta record of this format
    with a well-formed array list (``legacy``: a format-1 record passes as it is), naming
    ``step`` when given (its folder's), with a loop's counters of the right types where it
    has any (``loop``: it must have them).

    Examples:
        >>> from graphmod._train._checkpoint._format import check_record
        >>> loop = {"epochs": 1, "steps": None, "steps_per_call": 1}
        >>> record = {"format": 2, "arrays": [], "step": 5, "time": {"step": 5},
        ...           "position": -1, "loop": loop}
        >>> try:
        ...     check_record("runs/a/5", record, legacy=False, step=5)
        ... except ValueError as error:
        ...     print(error.reason[:37])
        the meta record's 'position' is -1, n
    """
    if not isinstance(record, dict):
        raise CheckpointError(path, "the meta record is not a JSON object")
    if record.get("format") == LEGACY_FORMAT and legacy:
        _check_loop_record(path, record, step, loop)
        return
    if record.get("format") not in (FORMAT, CHUNKED_FORMAT):
        old = record.get("format") == LEGACY_FORMAT
        raise CheckpointError(path, "written by graphmod 0.1 without checksums (format 1): "
                              "restorable, but it cannot be verified" if old else
                              f"checkpoint format {record.get('format')!r}, this graphmod "
                              f"reads formats {FORMAT} and {CHUNKED_FORMAT}")
    if "run_id" in record and not is_run_id(record["run_id"]):
        raise CheckpointError(path, f"the meta record's 'run_id' {record['run_id']!r:.80} is "
                              "not a run id (letters, digits, '_' and '-')")
    if step is not None and not (is_whole_number(record.get("step"))
                                 and record["step"] == step):
        raise CheckpointError(path, f"the meta record's 'step' is {record.get('step')!r}, "
                              f"its folder is step {step}'s")
    _check_loop_record(path, record, step, loop)
    arrays = record.get("arrays")
    if not isinstance(arrays, list) or not all(_well_formed(a) for a in arrays):
        raise CheckpointError(path, "the meta record's array list is malformed")
    entries: list[list[Any]] = [a for a in arrays if isinstance(a, list)]  # all: well formed
    if record["format"] == FORMAT:
        if not all(isinstance(a[3], str) for a in entries):
            raise CheckpointError(path, "the meta record's array list is malformed")
        return
    parts = record.get("parts")
    if not _whole(parts, least=1):
        raise CheckpointError(path, f"the meta record's part count {parts!r} is not a whole "
                              "number >= 1")
    for name, shape, _, chunks in entries:
        why = _tiling_error(shape, chunks, parts)
        if why:
            raise CheckpointError(path, f"the chunks of array {name} {why}")


# What a loop keeps in a checkpoint besides the state (graphmod._train._loop._resume's
# loop_record): the fields read back as they are, and their types.
_LOOP_FIELDS = ("time", "position", "loop")
_TIME_COUNTS = ("step", "epoch", "examples")
_TIME_SECONDS = ("seconds", "train_seconds")
_LOOP_LIMITS = {"epochs": 0, "steps": 0, "steps_per_call": 1}  # the least of each
_LISTS = ("data_changes", "setting_changes")
_OBJECTS = ("plugins", "metrics")


def _check_loop_record(path: str, record: dict[str, JSON], step: int | None,
                       required: bool) -> None:
    """Raises a :class:`CheckpointError` naming the first field of a loop's counters
    (those of ``_LOOP_FIELDS`` and beside them) that is missing or of the wrong type."""
    if not required and not any(field in record for field in _LOOP_FIELDS):
        return  # no loop's record (program.save's, a Checkpointer's own)
    missing = [field for field in _LOOP_FIELDS if field not in record]
    if missing:
        raise CheckpointError(path, f"the meta record has no {' or '.join(map(repr, missing))}: "
                              "not the record of a loop's checkpoint (graphmod.plugins."
                              "Checkpoint writes 'time', 'position' and 'loop')")
    time, loop, position = record["time"], record["loop"], record["position"]
    if not isinstance(time, dict) or set(time) - {*_TIME_COUNTS, *_TIME_SECONDS}:
        raise CheckpointError(path, f"the meta record's 'time' is {time!r:.80}, not an object "
                              f"of {', '.join(_TIME_COUNTS + _TIME_SECONDS)}")
    for name in _TIME_COUNTS:
        if name in time and not _whole(time[name]):
            raise CheckpointError(path, f"the meta record's 'time.{name}' is {time[name]!r}, "
                                  "not a whole number >= 0")
    for name in _TIME_SECONDS:
        seconds = time.get(name, 0)
        if not (_real(seconds) and seconds >= 0):
            raise CheckpointError(path, f"the meta record's 'time.{name}' is {seconds!r}, "
                                  "not a number of seconds >= 0")
    if step is not None and time.get("step") != step:
        raise CheckpointError(path, f"the meta record's 'time.step' is {time.get('step')!r}, "
                              f"its folder is step {step}'s")
    if not is_whole_number(position, least=0):
        raise CheckpointError(path, f"the meta record's 'position' is {position!r}, not a "
                              "whole number >= 0 (the batches done in the epoch)")
    if not isinstance(loop, dict) or set(loop) != set(_LOOP_LIMITS):
        raise CheckpointError(path, f"the meta record's 'loop' is {loop!r:.80}, not an object "
                              f"of {', '.join(_LOOP_LIMITS)}")
    for name, least in _LOOP_LIMITS.items():
        if not (is_whole_number(loop[name], least=least)
                or (loop[name] is None and name != "steps_per_call")):
            raise CheckpointError(path, f"the meta record's 'loop.{name}' is {loop[name]!r}, "
                                  f"not a whole number >= {least}"
                                  + (" or null" if name != "steps_per_call" else ""))
    for name, kind in [*((n, list) for n in _LISTS), *((n, dict) for n in _OBJECTS)]:
        if name in record and not isinstance(record[name], kind):
            raise CheckpointError(path, f"the meta record's {name!r} is {record[name]!r:.80}, "
                                  f"not {'a list' if kind is list else 'an object'}")
    if "models" in record:  # a loop of several models (graphmod 0.3 on)
        _check_models(path, record["models"])


_MODEL_FIELDS = ("name", "steps", "schedule", "reads")


def _check_models(path: str, models: JSON) -> None:
    """Raises a :class:`CheckpointError` naming the first malformed part of a loop's
    ``models`` record (a list of objects of name, steps, schedule and reads)."""
    if not isinstance(models, list) or not models:
        raise CheckpointError(path, f"the meta record's 'models' is {models!r:.80}, not a "
                              f"non-empty list of objects of {', '.join(_MODEL_FIELDS)}")
    for i, model in enumerate(models):
        if not isinstance(model, dict) or set(model) != set(_MODEL_FIELDS):
            raise CheckpointError(path, f"the meta record's 'models[{i}]' is {model!r:.80}, "
                                  f"not an object of {', '.join(_MODEL_FIELDS)}")
        reads = model["reads"]
        for key, valid, kind in (
                ("name", isinstance(model["name"], str) and model["name"], "a model's name"),
                ("steps", isinstance(model["steps"], bool), "true or false"),
                ("schedule", model["schedule"] is None or isinstance(model["schedule"], str),
                 "a schedule's description or null"),
                ("reads", isinstance(reads, list) and all(isinstance(r, str) for r in reads),
                 "a list of model names")):
            if not valid:
                raise CheckpointError(path, f"the meta record's 'models[{i}].{key}' is "
                                      f"{model[key]!r:.80}, not {kind}")
    names = [model["name"] for model in models if isinstance(model, dict)]  # all (checked)
    if len(set(names)) != len(names):
        raise CheckpointError(path, f"the meta record's 'models' names a model twice: {names}")


def check_arrays(path: str, entries: list[list[Any]], arrays: list[np.ndarray]) -> None:
    """Raises a :class:`CheckpointError` naming the first array whose shape, dtype or
    checksum differs from its meta record entry."""
    for (name, shape, dtype, _), array in zip(entries, arrays, strict=True):
        if list(array.shape) != shape or str(array.dtype) != dtype:
            raise CheckpointError(path, f"array {name} is stored as {list(array.shape)} "
                                  f"{array.dtype}, its meta record says {shape} {dtype}")
    for (name, _, _, crc), found in zip(entries, checksums(arrays), strict=True):
        if found != crc:
            raise corrupted(path, f"array {name}", found, crc)


def corrupted(path: str, what: str, found: str, recorded: str) -> CheckpointError:
    """The error for ``what`` (an array, or one of its chunks) whose checksum is ``found``
    where the meta record says ``recorded``."""
    return CheckpointError(path, f"{what} fails its checksum (crc32 {found}, recorded "
                           f"{recorded}): the data is corrupted")


def _tiling_error(shape: list[int], chunks: JSON, parts: int) -> str | None:
    """Why ``chunks`` (``[part, start, shape, checksum]`` each, parts below ``parts``) do
    not lie inside an array of ``shape`` and add up to its size, or None (whether they
    overlap is checked as they are read: ``_chunks.read_region``)."""
    def counts(values: JSON) -> TypeGuard[list[int]]:
        return _whole_numbers(values) and len(values) == len(shape)

    if not isinstance(chunks, list):
        return "are not a list"
    sizes = []
    for chunk in chunks:
        if not (isinstance(chunk, list) and len(chunk) == 4 and _whole(chunk[0])
                and chunk[0] < parts and counts(chunk[1]) and counts(chunk[2])
                and isinstance(chunk[3], str)):
            return f"are malformed ({chunk!r:.80})"
        if any(a + n > d for a, n, d in zip(chunk[1], chunk[2], shape, strict=True)):
            return f"reach outside its shape {shape} (at {chunk[1]}, {chunk[2]})"
        sizes.append(math.prod(chunk[2]))
    if sum(sizes) != math.prod(shape):
        return f"do not add up to its shape {shape}"
    return None


def _well_formed(entry: JSON) -> bool:
    """Whether a meta array entry is ``[path, shape, plain dtype name, checksum]`` (the
    checksum a string, or a chunk list that :func:`_tiling_error` checks)."""
    if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
            and isinstance(entry[3], str | list) and isinstance(entry[2], str)
            and _whole_numbers(entry[1])):
        return False
    try:
        return jnp.dtype(entry[2]).kind in "biufcV" and not jnp.dtype(entry[2]).hasobject
    except TypeError:
        return False


def _whole_numbers(values: JSON) -> TypeGuard[list[int]]:
    """Whether a value read from JSON is a list of ints >= 0 (a shape, a start)."""
    return isinstance(values, list) and all(is_whole_number(v, least=0) for v in values)


def _whole(value: JSON, least: int = 0) -> TypeGuard[int]:
    """Whether a value read from JSON is an int >= ``least`` (a bool is no count)."""
    return is_whole_number(value, least=least)


def _real(value: JSON) -> TypeGuard[int | float]:
    """Whether a value read from JSON is a number (a bool is none)."""
    return is_real_number(value)


def _spec(spec: JSON) -> str:
    """A leaf's ``[shape, dtype]`` of a tree record, as a message shows it."""
    return " ".join(map(str, spec)) if isinstance(spec, list) else repr(spec)
