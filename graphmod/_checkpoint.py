"""Checkpoints of a run: the train state's arrays (orbax), verified, and a JSON record.

**Layout.** A checkpoint directory holds one sub-directory per saved step, ``<step>/``,
written by orbax: ``state`` (the train state's leaves as a flat list of host arrays, PRNG
keys as their key data; empty arrays live in the record only) and ``meta`` (JSON: the
format, the id of the run that wrote it, the step, each leaf's path, shape, dtype and
checksum, loop counters and timelines, data position, plugin states, and the provenance
record when there is one). Orbax writes into ``<step>.orbax-checkpoint-tmp`` and renames it
when complete, so a save cut off half-way leaves the earlier checkpoints intact; such a
leftover is an incomplete write, never read.

**Verification.** Every array's checksum is computed on the host copy a save makes anyway,
off the training thread, and checked on restore along with its shape and dtype. The
checksum is CRC-32 (``zlib.crc32``): it exists to detect accidental corruption (flipped or
zeroed bytes, a truncated or swapped file), which it misses with probability 2**-32 per
array and never for an error burst of up to 32 bits, at about 2 GB/s (sha256 runs at about
0.8 GB/s and blake2b at 0.5 on the machines measured; see benchmarks/checkpoint_checksums.py).
A cryptographic hash would not make tampering detectable: whoever can rewrite a checkpoint's
arrays can rewrite the checksums beside them. Safety against crafted checkpoints comes from
elsewhere: nothing graphmod loads executes code (no pickle).

**Ownership.** Each writer has a run id (random, made when a run starts writing; a resumed
run continues its id) and prunes only the checkpoints of its own run (``keep``), oldest
write first, once a newer write is complete. It never replaces a step another run wrote; a
step directory that fails verification (one a resumed run skipped) is renamed to
``<step>.unverified`` when its step is written again, never deleted.

**Errors.** A checkpoint that cannot be read or verified raises :class:`CheckpointError`
naming its path and the reason; orbax's own log messages and tracebacks go to the
``graphmod.checkpoint`` logger at debug level, not to the terminal.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
import uuid
import warnings
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphmod._validation import is_key

FORMAT = 2
LEGACY_FORMAT = 1  # graphmod 0.1's: one pytree of arrays, no run id, no checksums
TMP_SUFFIX = ".orbax-checkpoint-tmp"
SET_ASIDE = ".unverified"
_STEP = re.compile(r"[0-9]+")
_LEFTOVER = re.compile(rf"[0-9]+({re.escape(TMP_SUFFIX)}|{re.escape(SET_ASIDE)}).*")
_log = logging.getLogger("graphmod.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, read or verified; names its path and the reason.

    Attributes ``path`` and ``reason`` hold the two parts of the message.

    Examples:
        >>> from graphmod import CheckpointError
        >>> error = CheckpointError("/runs/a/15", "no meta record", "delete the directory")
        >>> str(error), error.reason
        ('/runs/a/15: no meta record; delete the directory', 'no meta record')
    """

    def __init__(self, path: str | os.PathLike, reason: str, fix: str = "") -> None:
        self.path, self.reason, self.fix = os.fspath(path), reason, fix
        super().__init__(f"{self.path}: {reason}" + (f"; {fix}" if fix else ""))


def describe(state: Any) -> dict[str, list[Any]]:
    """``{leaf path: [shape, dtype]}`` of a state (keys described by their key data)."""
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
    """The state's leaves as host NumPy arrays (keys as key data), safe to write later."""
    def host(leaf: Any) -> np.ndarray:
        if is_key(leaf):
            leaf = jax.random.key_data(leaf)
        return np.array(leaf)  # a copy: the loop donates the state's buffers next step

    return [host(leaf) for leaf in jax.tree.leaves(state)]


def _stored(template: Any) -> list[tuple[list[int], str]]:
    """The shape and dtype each leaf of ``template`` is stored with (keys: their key data)."""
    def one(leaf: Any) -> tuple[list[int], str]:
        if is_key(leaf):
            leaf = jax.eval_shape(jax.random.key_data, leaf)
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype  # as np.array
        return list(np.shape(leaf)), str(np.dtype(dtype))

    return [one(leaf) for leaf in jax.tree.leaves(template)]


def _restored(template: Any, leaves: list[np.ndarray]) -> Any:
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


def check_compatible(directory: str, saved: Mapping[str, Any], template: Any) -> None:
    """Raises naming the differing leaf paths if ``template`` is not the saved state's."""
    want = describe(template)
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


def _reason(error: BaseException) -> str:
    """A short, plain reason for a failed write or read (disk full, permission, ...)."""
    seen: BaseException | None = error
    for _ in range(8):  # the error and its causes
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"disk full ({seen.strerror or seen})"
        if isinstance(seen, PermissionError):
            return f"permission denied ({seen})"
        seen = seen.__cause__ or seen.__context__
    text = str(error).strip().splitlines()
    first = text[0].split(" [tensorstore_spec")[0] if text else ""  # the spec is a page long
    return f"{type(error).__name__}: {first}".rstrip(": ")


_ORBAX_READ = re.compile(r"OCDBT|tensorstore|orbax")


class _OrbaxToDebug(logging.Filter):
    """Sends orbax's log records (warnings, tracebacks) to graphmod's debug log, and
    asyncio's reports of orbax reads whose errors no one retrieved (a failed restore stops
    waiting for the other arrays' reads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname and not (
                record.name == "asyncio" and "never retrieved" in str(record.msg)
                and _ORBAX_READ.search(record.getMessage())):
            return True
        _log.debug("orbax: %s", record.getMessage(), exc_info=record.exc_info)
        return False


def _quiet_orbax() -> None:
    """Keeps orbax's internals out of the terminal (once per process): its log records go
    to the debug log, and so do the errors of tensorstore reads that finish after a failed
    restore has closed orbax's event loop."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OrbaxToDebug) for f in logger.filters):
            logger.addFilter(_OrbaxToDebug())
    previous = sys.unraisablehook
    if getattr(previous, "graphmod_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            _log.debug("orbax: a read finished after its restore failed", exc_info=error)
            return
        previous(unraisable)

    hook.graphmod_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class Checkpointer:
    """Writes, verifies and restores the checkpoints of one directory.

    ``save`` copies the state to the host and returns; the checksums and the write happen in
    a background thread (``asynchronous=False``: before ``save`` returns). ``restore``
    verifies what it reads and, when no step is named, falls back to the newest checkpoint
    that verifies, with a warning naming each one skipped and why. ``keep`` prunes only the
    checkpoints of this writer's ``run_id`` (set it before the first save to continue a run).
    A directory is created only by a save.

    Examples:
        >>> import tempfile, jax, jax.numpy as jnp
        >>> from graphmod._checkpoint import Checkpointer
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=2)
        >>> state = {"w": jnp.ones(2), "rng": jax.random.key(1)}
        >>> ckpt.save(3, state, {"note": "hi"})
        >>> ckpt.wait()
        >>> restored, meta = ckpt.restore(state)
        >>> meta["note"], meta["step"], bool((restored["w"] == 1).all()), ckpt.verify(3)
        ('hi', 3, True, None)
        >>> ckpt.close()
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3,
                 asynchronous: bool = True, run_id: str | None = None) -> None:
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool)
                                 or keep < 1):
            raise ValueError(f"keep={keep!r}: must be a positive int or None (keep all)")
        import orbax.checkpoint as ocp

        _quiet_orbax()
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = keep
        self.asynchronous = asynchronous
        self.run_id = run_id or uuid.uuid4().hex
        self._ocp = ocp
        self._orbax = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
        self._lock = threading.Lock()  # one orbax call at a time (writer thread vs reads)
        self._own: list[int] | None = None  # this run's steps, oldest write first
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    # -- the directory --------------------------------------------------------------------
    def _path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def steps(self) -> list[int]:
        """The steps with a checkpoint directory (verified or not), ascending."""
        return sorted(int(n) for n in self._names()
                      if _STEP.fullmatch(n) and os.path.isdir(self._path(int(n))))

    def latest(self) -> int | None:
        """The newest step with a checkpoint directory, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def leftovers(self) -> dict[str, str]:
        """``{name: what it is}`` of the directories that are no checkpoint but were one's:
        temporary directories of writes cut off, and checkpoints set aside (module docs)."""
        return {n: "an incomplete write (cut off, or still in progress); never read"
                if TMP_SUFFIX in n else "a checkpoint that failed verification, set aside when "
                "its step was written again; never read"
                for n in self._names() if _LEFTOVER.fullmatch(n)}

    def run_of(self, step: int) -> str | None:
        """The run id recorded in ``step``'s meta, or None where it cannot be read."""
        try:
            return self._read_meta(step).get("run_id")
        except CheckpointError:
            return None

    def others(self) -> list[int]:
        """The steps this writer's run did not write (unreadable ones included)."""
        return [s for s in self.steps() if self.run_of(s) != self.run_id]

    def discard(self, steps: list[int]) -> None:
        """Deletes ``steps``' checkpoints and every leftover (see :meth:`leftovers`)."""
        self.wait()
        for name in [str(s) for s in steps] + list(self.leftovers()):
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        self._own = None

    # -- writing --------------------------------------------------------------------------
    def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
        """Starts writing ``state`` and ``meta`` for ``step``: copies the arrays to the host
        and returns (the previous write is waited for first, and its error raised)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r}: a checkpoint's step must be an int >= 0")
        tree = describe(state)
        arrays = storable(state)
        self.wait()
        record = {**meta, "format": FORMAT, "run_id": self.run_id, "step": step, "tree": tree}
        if not self.asynchronous:
            self._write(step, list(tree), arrays, record)
            return

        def work() -> None:
            try:
                self._write(step, list(tree), arrays, record)
            except BaseException as error:  # raised by the next wait()
                self._failure = error

        self._thread = threading.Thread(target=work, name=f"graphmod-checkpoint-{step}",
                                        daemon=True)  # a second Ctrl-C must not wait for it
        self._thread.start()

    def _write(self, step: int, paths: list[str], arrays: list[np.ndarray],
               record: dict[str, Any]) -> None:
        """Checksums, writes and prunes (in the writer thread when asynchronous)."""
        record["arrays"] = [[p, list(a.shape), str(a.dtype), c] for p, a, c
                            in zip(paths, arrays, checksums(arrays), strict=True)]
        own = self._owned()
        target = self._path(step)
        if os.path.exists(target):
            self._make_room(step, own)
        ocp = self._ocp
        items = {"meta": ocp.args.JsonSave(record)}
        stored = [a for a in arrays if a.size]  # orbax writes no empty array: meta has them
        if stored:
            items["state"] = ocp.args.StandardSave(stored)
        before = set(threading.enumerate())
        try:
            os.makedirs(self.directory, exist_ok=True)
            with self._lock:
                self._orbax.save(target, args=ocp.args.Composite(**items))
        except Exception as error:
            _log.debug("writing %s failed", target, exc_info=True)
            _settle(before)  # orbax's threads of this write may still be writing into it
            for name in self._names():
                if name.startswith(f"{step}{TMP_SUFFIX}"):  # this write's own leftover
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            older = [s for s in own if s != step]
            intact = f"the checkpoint of step {older[-1]} is intact" if older else \
                "no earlier checkpoint of this run exists"
            reason = _reason(error)
            fix = "free space, then resume" if reason.startswith("disk full") else \
                "see the 'graphmod.checkpoint' debug log for orbax's traceback"
            raise CheckpointError(target, f"could not write the checkpoint of step {step}: "
                                  f"{reason}; {intact}", fix) from None
        own.append(step)
        while self.keep is not None and len(own) > self.keep:
            shutil.rmtree(self._path(own.pop(0)), ignore_errors=True)

    def _make_room(self, step: int, own: list[int]) -> None:
        """Clears the way for a new write of ``step``: this run's own older write is
        replaced; a checkpoint that fails verification (a resumed run skipped it) is set
        aside as ``<step>.unverified``; another run's checkpoint is never touched."""
        target = self._path(step)
        if step in own:
            shutil.rmtree(target)
            own.remove(step)
            return
        why = self.verify(step)
        if why is None:
            raise CheckpointError(
                target, "holds a checkpoint another run wrote",
                "write to another directory, or move it away (nothing was overwritten)")
        aside, count = target + SET_ASIDE, 1
        while os.path.exists(aside):
            count += 1
            aside = f"{target}{SET_ASIDE}-{count}"
        os.rename(target, aside)
        _log.warning("%s fails verification (%s): set aside as %s", target, why, aside)

    def _owned(self) -> list[int]:
        """This run's steps in the directory, oldest write first (read once per writer)."""
        if self._own is None:
            self._own = [s for s in self.steps() if self.run_of(s) == self.run_id]
        return self._own

    def wait(self) -> None:
        """Blocks until the started write is on disk; raises its error (a CheckpointError
        naming the path and the reason) if it failed."""
        if self._thread is not None:
            self._thread.join()  # a Ctrl-C here leaves the thread to finish on its own
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Waits for the started write (raising its error), then releases orbax."""
        try:
            self.wait()
        finally:
            try:
                self._orbax.close()
            except Exception:  # nothing is left to write; orbax's teardown noise stays out
                _log.debug("closing orbax's checkpointer failed", exc_info=True)

    # -- reading and verifying --------------------------------------------------------------
    def _read_meta(self, step: int, *, legacy: bool = False) -> dict[str, Any]:
        """``step``'s meta record, checked for format and a well-formed array list
        (``legacy``: a format-1 record is returned as it is)."""
        path = self._path(step)
        if not os.path.isdir(path):
            raise CheckpointError(path, "no such checkpoint directory")
        if not os.listdir(path):
            raise CheckpointError(path, "empty directory: not a checkpoint")
        if not os.path.isdir(os.path.join(path, "meta")):
            raise CheckpointError(path, "no meta record: not a graphmod checkpoint, or one "
                                  "whose write was cut off")
        ocp = self._ocp
        try:
            with self._lock:
                record = self._orbax.restore(
                    path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except json.JSONDecodeError as error:
            raise CheckpointError(path, f"the meta record is not valid JSON ({error})") from None
        except Exception as error:
            _log.debug("reading the meta record of %s failed", path, exc_info=True)
            raise CheckpointError(path, f"the meta record cannot be read ({_reason(error)})") \
                from None
        if not isinstance(record, dict):
            raise CheckpointError(path, "the meta record is not a JSON object")
        if record.get("format") == LEGACY_FORMAT and legacy:
            return {**record, "step": step}  # format 2 records their step themselves
        if record.get("format") != FORMAT:
            old = record.get("format") == LEGACY_FORMAT
            raise CheckpointError(path, "written by graphmod 0.1 without checksums (format 1): "
                                  "restorable, but it cannot be verified" if old else
                                  f"checkpoint format {record.get('format')!r}, this graphmod "
                                  f"reads format {FORMAT}")
        arrays = record.get("arrays")
        if not isinstance(arrays, list) or not all(_well_formed(a) for a in arrays):
            raise CheckpointError(path, "the meta record's array list is malformed")
        return record

    def _read_arrays(self, step: int, record: dict[str, Any]) -> list[np.ndarray]:
        """The arrays of ``step``, each checked against the meta's shape, dtype, checksum."""
        path = self._path(step)
        entries = record["arrays"]
        empty = [math.prod(shape) == 0 for _, shape, _, _ in entries]
        kept = [entry for entry, no in zip(entries, empty, strict=True) if not no]
        got = self._read_stored(path, kept) if kept else []
        stored = iter(got)
        out = []
        for (name, shape, dtype, _), no in zip(entries, empty, strict=True):
            array = np.zeros(shape, jnp.dtype(dtype)) if no else np.asarray(next(stored))
            if list(array.shape) != shape or str(array.dtype) != dtype:
                raise CheckpointError(path, f"array {name} is stored as {list(array.shape)} "
                                      f"{array.dtype}, its meta record says {shape} {dtype}")
            out.append(array)
        for (name, _, _, crc), found in zip(entries, checksums(out), strict=True):
            if found != crc:
                raise CheckpointError(path, f"array {name} fails its checksum (crc32 {found}, "
                                      f"recorded {crc}): the data is corrupted")
        return out

    def _read_stored(self, path: str, entries: list[list[Any]]) -> list[Any]:
        """Orbax's read of the (non-empty) arrays ``entries`` lists, or a CheckpointError."""
        if not os.path.isdir(os.path.join(path, "state")):
            raise CheckpointError(path, "no state directory: the arrays are missing")
        ocp = self._ocp
        try:
            abstract = [np.zeros(shape, jnp.dtype(dtype)) for _, shape, dtype, _ in entries]
            with self._lock:
                got = self._orbax.restore(path, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as error:
            _log.debug("reading the arrays of %s failed", path, exc_info=True)
            raise CheckpointError(path, f"the arrays cannot be read ({_reason(error)})") \
                from None
        if not isinstance(got, list) or len(got) != len(entries):
            raise CheckpointError(path, f"the state holds {len(got)} arrays, the meta record "
                                  f"lists {len(entries)}")
        return got

    def verify(self, step: int) -> str | None:
        """None if ``step``'s checkpoint reads back whole (meta, every array's shape, dtype
        and checksum), else the reason it does not."""
        try:
            self._read_arrays(step, self._read_meta(step))
        except CheckpointError as error:
            return error.reason
        return None

    def _read_legacy(self, step: int, template: Any) -> list[np.ndarray]:
        """The arrays of a format-1 checkpoint (one pytree shaped like ``template``), which
        carries no checksums: restored unverified, with a warning."""
        path = self._path(step)
        abstract = [np.zeros(shape, dtype) for shape, dtype in _stored(template)]
        ocp = self._ocp
        try:
            with self._lock:
                got = self._orbax.restore(path, args=ocp.args.Composite(state=ocp.args.
                    StandardRestore(jax.tree.unflatten(jax.tree.structure(template),
                                                       abstract))))["state"]
        except Exception as error:
            _log.debug("reading the arrays of %s failed", path, exc_info=True)
            raise CheckpointError(path, f"the arrays cannot be read ({_reason(error)})") \
                from None
        warnings.warn(f"{path}: written by graphmod 0.1 (format 1), which stored no checksums: "
                      "restored unverified. Checkpoints written from now on are verified",
                      stacklevel=4)
        return [np.asarray(leaf) for leaf in jax.tree.leaves(got)]

    def meta(self, step: int | None = None, *,
             skipped: Callable[[str], None] | None = None) -> dict[str, Any]:
        """The meta record of ``step`` (default: the newest one whose meta can be read; each
        newer one that cannot is passed to ``skipped`` as ``"step N: reason"``). Its
        ``"step"`` says which checkpoint it is."""
        read = functools.partial(self._read_meta, legacy=True)
        if step is not None:
            return read(self._step(step))
        return self._first(read, skipped)

    def provenance(self, step: int | None = None) -> Any:
        """The provenance record saved at ``step`` (default: the latest), or None."""
        from graphmod.provenance._record import Provenance

        record = self.meta(step).get("provenance")
        return None if record is None else Provenance.from_dict(record)

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """The state saved at ``step`` shaped like ``template``, and its meta record (whose
        ``"step"`` says which checkpoint it is). Without ``step``: the newest checkpoint that
        verifies, warning about each newer one skipped. Raises ``ValueError`` if the
        checkpoint holds another program's state, :class:`CheckpointError` if none verifies."""
        want = _stored(template)

        def load(s: int) -> tuple[dict[str, Any], list[np.ndarray]]:
            record = self._read_meta(s, legacy=True)
            check_compatible(self._path(s), record.get("tree", {}), template)
            if record["format"] == LEGACY_FORMAT:
                return record, self._read_legacy(s, template)
            listed = [(shape, dtype) for _, shape, dtype, _ in record["arrays"]]
            if listed != want:
                raise CheckpointError(self._path(s), "the meta record's array list does not "
                                      "match its tree of leaves")
            return record, self._read_arrays(s, record)

        if step is not None:
            record, arrays = load(self._step(step))
        else:
            skipped: list[str] = []
            record, arrays = self._first(load, skipped.append)
            if skipped:
                warnings.warn(f"{self.directory}: skipped checkpoints that fail verification "
                              f"({'; '.join(skipped)}); using step {record['step']}",
                              stacklevel=2)
        return _restored(template, arrays), record

    def _first(self, load: Callable[[int], Any],
               skipped: Callable[[str], None] | None = None) -> Any:
        """What ``load`` gives for the newest step it accepts; each newer one it refuses is
        passed to ``skipped`` as ``"step N: reason"``."""
        refused = []
        for step in reversed(self._step_list()):
            try:
                return load(step)
            except CheckpointError as error:
                refused.append(f"step {step}: {error.reason}")
                if skipped is not None:
                    skipped(refused[-1])
        raise CheckpointError(self.directory, "no checkpoint verifies (" + "; ".join(refused)
                              + ")", "start a new run in a new directory, or restore a copy")

    def _step_list(self) -> list[int]:
        steps = self.steps()
        if not steps:
            where = "" if os.path.isdir(self.directory) else " (the directory does not exist)"
            raise FileNotFoundError(f"no checkpoint in {self.directory}{where}")
        return steps

    def _step(self, step: int) -> int:
        steps = self._step_list()
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"saved steps: {steps}")
        return step


def _settle(before: set[threading.Thread], timeout: float = 30.0) -> None:
    """Waits (boundedly) for orbax's threads started since ``before`` (its own, and its
    event loops' executors) to end; they re-raise their errors when joined: those go to
    the debug log."""
    deadline = time.monotonic() + timeout
    for thread in set(threading.enumerate()) - before - {threading.current_thread()}:
        if not (type(thread).__module__.startswith("orbax")
                or thread.name.startswith("asyncio_")):
            continue  # another part of the program's thread
        try:
            thread.join(max(0.0, deadline - time.monotonic()))
        except Exception:
            _log.debug("an orbax thread of a failed write ended with an error", exc_info=True)


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
