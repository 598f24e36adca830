"""Checkpoints written by several processes (format 3): chunks, parts and their checks.

Two processes writing for real: ``tests/distributed/test_distributed.py``. Here one
process holds the eight devices and plays both processes' parts, so every check runs fast.
"""

from __future__ import annotations

import pathlib
import re
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from graphmod._train._checkpoint import Checkpointer, CheckpointError, _reader
from graphmod._train._checkpoint._chunks import chunk_members, read_region
from graphmod._train._checkpoint._format import (
    CHUNKED_FORMAT,
    check_record,
    checksum,
    shard_chunks,
)
from graphmod._train._checkpoint._parts import read_part, write_part


def _split(shape: tuple[int, ...], dtype: str, spec: PartitionSpec) -> jax.Array:
    mesh = jax.make_mesh((8,), ("data",))
    values = np.arange(np.prod(shape)).reshape(shape).astype(jnp.dtype(dtype))
    return jax.device_put(values, NamedSharding(mesh, spec))


@pytest.fixture
def arrays() -> dict[str, jax.Array]:
    """An FSDP-split weight, a bfloat16 one split on its second axis, a replicated vector
    and a scalar: each stored by chunks of the devices holding first copies."""
    return {"a": _split((16, 3), "float32", PartitionSpec("data")),
            "b": _split((2, 8), "bfloat16", PartitionSpec(None, "data")),
            "c": _split((5,), "int32", PartitionSpec()),
            "d": _split((), "float32", PartitionSpec())}


def _written(directory: pathlib.Path, arrays: dict[str, jax.Array]) -> dict:
    """The meta record of ``arrays`` written as two processes would: devices 0-3's chunks
    by process 0, devices 4-7's by process 1, each part a file in ``directory``."""
    devices = {d: i // 4 for i, d in enumerate(jax.devices())}
    parts: list[list] = [[], []]
    entries = []
    for name, array in arrays.items():
        chunks = []
        for shard in array.addressable_shards:
            if shard.replica_id:
                continue
            start = [cut.start or 0 for cut in shard.index]
            piece = np.array(shard.data)
            part = devices[shard.device]
            parts[part].append(piece)
            chunks.append([part, start, list(piece.shape), checksum(piece)])
        entries.append([name, list(array.shape), str(array.dtype), chunks])
    for part, pieces in enumerate(parts):
        write_part(str(directory / f"part-{part}.npz"), pieces, [[0, [], [], "-"]] * len(pieces))
    return {"format": CHUNKED_FORMAT, "parts": 2, "arrays": entries}


def _pieces(directory: pathlib.Path) -> dict[int, list[np.ndarray]]:
    return {part: read_part(str(directory / f"part-{part}.npz"))[1] for part in (0, 1)}


def assemble(path: str, entries: list, pieces: dict[int, list[np.ndarray]]) -> list:
    """Every array of ``entries`` whole, from ``pieces`` (each part's chunks, in order)."""
    return [read_region(path, entry, members, lambda part, member: pieces[part][member])
            for entry, members in zip(entries, chunk_members(entries), strict=True)]


def test_shard_chunks_hold_every_element_once(arrays: dict[str, jax.Array]) -> None:
    starts = [start for start, _ in shard_chunks(arrays["a"])]
    assert starts == [[2 * i, 0] for i in range(8)]  # one row pair per device
    assert len(shard_chunks(arrays["c"])) == 1  # replicated: its first copy only
    assert [piece.shape for _, piece in shard_chunks(arrays["b"])] == [(2, 1)] * 8


def test_chunks_of_two_parts_assemble_bit_for_bit(tmp_path: pathlib.Path,
                                                  arrays: dict[str, jax.Array]) -> None:
    record = _written(tmp_path, arrays)
    check_record(str(tmp_path), record, legacy=False)
    assert {c[0] for c in record["arrays"][0][3]} == {0, 1}  # a: both processes wrote
    assert [c[0] for c in record["arrays"][2][3]] == [0]  # c (replicated): process 0 alone
    whole = assemble(str(tmp_path), record["arrays"], _pieces(tmp_path))
    for got, want in zip(whole, arrays.values(), strict=True):
        assert got.dtype == want.dtype  # bfloat16 too: parts hold raw bytes
        np.testing.assert_array_equal(got, np.asarray(want))


def test_a_corrupted_chunk_is_named_by_array_start_and_process(
        tmp_path: pathlib.Path, arrays: dict[str, jax.Array]) -> None:
    record = _written(tmp_path, arrays)
    pieces = _pieces(tmp_path)
    pieces[1][0] = pieces[1][0].copy()
    pieces[1][0][3] ^= 1  # one bit of a's rows 8-9
    with pytest.raises(CheckpointError, match=re.escape(
            "array a's chunk at [8, 0] (written by process 1) fails its checksum")):
        assemble(str(tmp_path), record["arrays"], pieces)
    pieces[1][0] = pieces[1][0][:-4]
    with pytest.raises(CheckpointError, match=r"holds 20 bytes, the meta record says \[2, 3\]"):
        assemble(str(tmp_path), record["arrays"], pieces)


def test_overlapping_chunks_are_refused_as_they_are_read(
        tmp_path: pathlib.Path, arrays: dict[str, jax.Array]) -> None:
    # Rows 2-3 twice, rows 14-15 never: the sizes add up, so only reading finds it.
    record = _written(tmp_path, arrays)
    pieces = _pieces(tmp_path)
    chunks = record["arrays"][0][3]
    chunks[-1][1] = [2, 0]
    chunks[-1][3] = chunks[1][3]
    pieces[1][3] = pieces[0][1]  # a's last chunk in part 1 now holds rows 2-3
    check_record(str(tmp_path), record, legacy=False)
    with pytest.raises(CheckpointError, match=re.escape(
            "array a's chunk at [2, 0] (written by process 1) overlaps another chunk")):
        assemble(str(tmp_path), record["arrays"], pieces)


def _chunks(record: dict, change) -> dict:
    change(record["arrays"][0][3])  # a's chunks
    return record


TILINGS = {
    "a chunk missing": (lambda c: c.pop(), "do not add up to its shape [16, 3]"),
    "a chunk outside": (lambda c: c[-1].__setitem__(1, [15, 0]), "reach outside its shape"),
    "a part beyond the count": (lambda c: c[0].__setitem__(0, 2), "are malformed"),
    "a start of another rank": (lambda c: c[0].__setitem__(1, [0]), "are malformed"),
    "a checksum where chunks belong": (lambda c: (c.clear(), c.append("00ff00ff")),
                                       "are malformed"),
}


@pytest.mark.parametrize("name", list(TILINGS))
def test_chunks_that_do_not_tile_their_array_are_refused_before_any_read(
        tmp_path: pathlib.Path, arrays: dict[str, jax.Array], name: str) -> None:
    change, reason = TILINGS[name]
    record = _chunks(_written(tmp_path, arrays), change)
    with pytest.raises(CheckpointError, match=re.escape(f"the chunks of array a {reason}")):
        check_record(str(tmp_path), record, legacy=False)


def test_a_bad_part_count_and_mixed_formats_are_refused(
        tmp_path: pathlib.Path, arrays: dict[str, jax.Array]) -> None:
    record = _written(tmp_path, arrays)
    with pytest.raises(CheckpointError, match=r"part count True is not a whole number"):
        check_record(str(tmp_path), {**record, "parts": True}, legacy=False)
    with pytest.raises(CheckpointError, match=r"array list is malformed"):
        check_record(str(tmp_path), {**record, "format": 2}, legacy=False)  # chunks in 2


def test_a_part_holding_objects_or_no_archive_is_refused_without_running_code(
        tmp_path: pathlib.Path) -> None:
    crafted = tmp_path / "crafted.npz"
    np.savez(crafted, chunks=np.frombuffer(b"[[0, [], [], \"x\"]]", np.uint8),
             c0=np.array([print], dtype=object))  # a pickle inside
    with pytest.raises(ValueError, match="allow_pickle=False"):
        read_part(str(crafted))
    (tmp_path / "junk.npz").write_text("not an archive")
    with pytest.raises(ValueError, match="not a whole part"):
        read_part(str(tmp_path / "junk.npz"))
    with zipfile.ZipFile(tmp_path / "empty.npz", "w"):
        pass
    with pytest.raises(ValueError, match=r"not a whole part \(KeyError"):
        read_part(str(tmp_path / "empty.npz"))


def test_a_reader_restores_a_checkpoint_of_two_parts_and_names_a_missing_one(
        tmp_path: pathlib.Path, arrays: dict[str, jax.Array]) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    writer = Checkpointer(tmp_path / "run", keep=None)
    tree = {f"['{name}']": [list(a.shape), str(a.dtype)] for name, a in arrays.items()}
    record = {"run_id": writer.run_id, "step": 3, "tree": tree, **_written(parts, arrays)}
    record["arrays"] = [[f"['{e[0]}']", *e[1:]] for e in record["arrays"]]
    step = tmp_path / "run" / "3"
    writer._orbax_save(str(step), record, [])  # the meta record alone, as process 0 writes
    for part in parts.iterdir():
        part.rename(step / part.name)
    template = {name: jnp.zeros(a.shape, a.dtype) for name, a in arrays.items()}
    restored, meta = writer.restore(template)
    assert meta["step"] == 3 and writer.verify(3) is None
    for name, array in arrays.items():
        np.testing.assert_array_equal(restored[name], np.asarray(array))
    (step / "part-0.npz").unlink()
    assert writer.verify(3) == "the part process 0 wrote (part-0.npz) is missing"
    writer.close()


def test_chunks_listed_in_another_order_are_placed_by_their_paths(
        tmp_path: pathlib.Path, arrays: dict[str, jax.Array],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Stored d, c, b, a; restored into a template listing a, b, c, d placed on the mesh.
    placed = {}

    def local_array(path: str, entry: list, members: list, piece: Any, sharding: Any) -> Any:
        placed[entry[0]] = sharding  # what a process of a real multi-process run places by
        return read_region(path, entry, members, piece)

    monkeypatch.setattr(_reader, "local_array", local_array)
    parts = tmp_path / "parts"
    parts.mkdir()
    writer = Checkpointer(tmp_path / "run", keep=None)
    stored = dict(reversed(arrays.items()))
    tree = {f"['{name}']": [list(a.shape), str(a.dtype)] for name, a in stored.items()}
    record = {"run_id": writer.run_id, "step": 1, "tree": tree, **_written(parts, stored)}
    record["arrays"] = [[f"['{e[0]}']", *e[1:]] for e in record["arrays"]]
    step = tmp_path / "run" / "1"
    writer._orbax_save(str(step), record, [])
    for part in parts.iterdir():
        part.rename(step / part.name)
    template = {name: jax.device_put(jnp.zeros(a.shape, a.dtype), a.sharding)
                for name, a in arrays.items()}
    restored, _ = writer.restore(template)
    for name, array in arrays.items():
        assert placed[f"['{name}']"] == array.sharding, name
        np.testing.assert_array_equal(restored[name], np.asarray(array))
    record["arrays"][1][0] = record["arrays"][0][0]  # a path listed twice, one missing
    writer._orbax_save(str(tmp_path / "run" / "2"), {**record, "step": 2}, [])
    with pytest.raises(CheckpointError, match="array list does not match its tree"):
        writer.restore(template, step=2)
    writer.close()


def test_a_region_reads_and_checks_only_the_chunks_that_overlap_it(
        tmp_path: pathlib.Path, arrays: dict[str, jax.Array]) -> None:
    # What a process restoring only its own devices' regions reads (a: rows 8-15 by process 1).
    record = _written(tmp_path, arrays)
    pieces = _pieces(tmp_path)
    entry, members = record["arrays"][0], chunk_members(record["arrays"])[0]
    read: list[int] = []

    def piece(part: int, member: int) -> np.ndarray:
        read.append(part)
        return pieces[part][member]

    a = np.asarray(arrays["a"])
    pieces[0][0] = pieces[0][0] ^ np.uint8(1)  # process 0's rows 0-1: never read below
    got = read_region(str(tmp_path), entry, members, piece, (slice(8, 12), slice(0, 3)))
    np.testing.assert_array_equal(got, a[8:12])
    assert read == [1, 1]  # two row pairs, both in process 1's part
    np.testing.assert_array_equal(
        read_region(str(tmp_path), entry, members, piece, (slice(3, 6), slice(1, 3))),
        a[3:6, 1:3])  # across chunk boundaries: a part of each
    with pytest.raises(CheckpointError, match=re.escape(
            "array a's chunk at [0, 0] (written by process 0) fails its checksum")):
        read_region(str(tmp_path), entry, members, piece, (slice(0, 4), slice(0, 3)))


def test_a_region_that_chunks_overlap_or_leave_uncovered_is_refused(
        tmp_path: pathlib.Path, arrays: dict[str, jax.Array]) -> None:
    # Rows 2-3 twice, rows 14-15 never (the sizes add up): each region read finds its part.
    record = _written(tmp_path, arrays)
    pieces = _pieces(tmp_path)
    chunks = record["arrays"][0][3]
    chunks[-1][1], chunks[-1][3] = [2, 0], chunks[1][3]
    pieces[1][3] = pieces[0][1]
    entry, members = record["arrays"][0], chunk_members(record["arrays"])[0]
    piece = lambda part, member: pieces[part][member]
    with pytest.raises(CheckpointError, match=re.escape(
            "array a's chunk at [2, 0] (written by process 1) overlaps another chunk")):
        read_region(str(tmp_path), entry, members, piece, (slice(0, 4), slice(0, 3)))
    with pytest.raises(CheckpointError, match="the chunks of array a leave part of it uncovered"):
        read_region(str(tmp_path), entry, members, piece, (slice(12, 16), slice(0, 3)))
    np.testing.assert_array_equal(  # a region the crafted chunks do not touch reads well
        read_region(str(tmp_path), entry, members, piece, (slice(4, 12), slice(0, 3))),
        np.asarray(arrays["a"])[4:12])


def test_a_part_whose_archive_index_is_damaged_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "part-0.npz"
    write_part(str(path), [np.arange(64.0)], [[0, [0], [64], "-"]])
    data = bytearray(path.read_bytes())
    start = int.from_bytes(data[-6:-2], "little")  # where the central directory begins
    data[start:start + 4] = bytes(4)  # its first entry's signature
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"not a whole part \(BadZipFile"):
        read_part(str(path))


def test_processes_load_a_checkpoint_only_together(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two processes played by one: the other's outcome (0 loaded, 1 a checkpoint that does
    # not verify there, 2 any other error) comes through the faked gather.
    other = [0]
    monkeypatch.setattr(_reader.multihost_utils, "process_allgather",
                        lambda code: np.array([int(code), other[0]]))

    def corrupted(step: int) -> None:
        raise CheckpointError(f"run/{step}", "array a's chunk at [0, 0] fails its checksum")

    def together(load: Any) -> Any:
        return _reader._agreed(load, lambda step: f"run/{step}")

    assert together(lambda step: "state")(3) == "state"
    with pytest.raises(CheckpointError, match="fails its checksum"):
        together(corrupted)(3)  # its own reason, when the other loaded
    other[0] = 1
    with pytest.raises(CheckpointError, match=re.escape(
            "process [1] cannot read or verify its chunks of it")):
        together(lambda step: "state")(3)  # the next older step is tried, by both
    other[0] = 2
    for load in (lambda step: "state", corrupted):  # the other stops: none goes on
        with pytest.raises(RuntimeError, match=re.escape("run/3: process [1] failed to read")):
            together(load)(3)
