"""Reading a checkpoint directory through orbax: its steps, meta records and verified arrays.

Orbax is imported when a reader is made, never before (``import graphmod`` loads no orbax).
Every read checks what it reads: the meta record's format and array list, each array's
shape, dtype and checksum (:mod:`graphmod._train._checkpoint._format`); a failure raises a
:class:`CheckpointError` naming the path and the reason.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import re
import stat
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from graphmod._core._number_checks import is_whole_number
from graphmod._core._program._arguments import is_key
from graphmod._core._warn import warn
from graphmod._records._record import Provenance
from graphmod._train._checkpoint._chunks import PartFiles, chunk_members, local_array
from graphmod._train._checkpoint._errors import (
    CheckpointError,
    failure_reason,
    log,
    quiet_orbax,
)
from graphmod._train._checkpoint._format import (
    CHUNKED_FORMAT,
    FORMAT,
    LEGACY_FORMAT,
    MARKER,
    array_list,
    check_arrays,
    check_compatible,
    check_record,
    is_run_id,
    leaf_specs,
    marker_error,
    restored,
    stored_positions,
    stored_specs,
)
from graphmod._train._train_state import TrainState
from graphmod.typing import JSON, PyTree

if TYPE_CHECKING:
    from orbax.checkpoint import args as ocp_args

TMP_SUFFIX = ".orbax-checkpoint-tmp"
PART_SUFFIX = ".graphmod-part"  # a part of a checkpoint of several processes, not assembled
SET_ASIDE = ".unverified"
_STEP = re.compile(r"[0-9]+")  # a step's folder is str(step): zero-padded names are not one
_INCOMPLETE = re.compile(rf"[0-9]+({re.escape(TMP_SUFFIX)}|{re.escape(PART_SUFFIX)}).*")
_SET_ASIDE = re.compile(rf"[0-9]+{re.escape(SET_ASIDE)}.*")
_T = TypeVar("_T")
_State = TypeVar("_State")


class _Missing:
    """What :func:`_json_file` reads where no file is."""


_MISSING = _Missing()  # a JSON file that is not there
_MARKER_BYTES = 4096  # a marker is a line of JSON: a bigger one is not graphmod's


class CheckpointReader:
    """Lists, verifies and restores the checkpoints of one directory; creates nothing.

    ``restore`` verifies what it reads and, when no step is named, falls back to the newest
    checkpoint that verifies, with a warning naming each one skipped and why.

    Examples:
        >>> import tempfile
        >>> from graphmod._train._checkpoint import CheckpointReader
        >>> reader = CheckpointReader(tempfile.mkdtemp())
        >>> reader.steps(), reader.latest(), reader.leftovers()
        ([], None, {})
        >>> reader.close()
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        import orbax.checkpoint as ocp  # opened on first use: importing graphmod stays light

        quiet_orbax()
        self.directory = os.path.abspath(os.fspath(directory))
        self._ocp = ocp
        # Each process reads and writes alone (in a multi-process run every process writes
        # its own part, see Checkpointer): no orbax call waits for another process.
        alone = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                                   active_processes={jax.process_index()})
        handler = ocp.CompositeCheckpointHandler(
            meta=ocp.JsonCheckpointHandler(multiprocessing_options=alone),
            state=ocp.StandardCheckpointHandler(multiprocessing_options=alone),
            composite_options=ocp.CompositeOptions(multiprocessing_options=alone))
        self._orbax = ocp.Checkpointer(handler, multiprocessing_options=alone)
        self._lock = threading.Lock()  # one orbax call at a time (writer thread vs reads)

    def close(self) -> None:
        """Releases orbax."""
        try:
            self._orbax.close()
        except Exception:  # nothing is left to write; orbax's teardown noise stays out
            log.debug("closing orbax's checkpointer failed", exc_info=True)

    # -- the directory --------------------------------------------------------------------
    def _path(self, step: int | str) -> str:
        return os.path.join(self.directory, str(step))

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _examine(self, name: str) -> tuple[str | None, str | None]:
        """``(None, run id)`` if the entry ``name`` is a checkpoint graphmod wrote (its run id
        None: graphmod 0.1's), else ``(why it is not, None)``. Nothing is followed: a link is
        no checkpoint, whatever it points to."""
        path = self._path(name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return "no longer there", None
        if stat.S_ISLNK(mode):
            return f"a symbolic link (to {os.readlink(path)}); graphmod never follows one", None
        if not stat.S_ISDIR(mode):
            return "a file, not a checkpoint's folder", None
        if not _STEP.fullmatch(name):
            return "not the name of a checkpoint's folder", None
        if str(int(name)) != name:
            return (f"not a step's folder name (graphmod names step {int(name)}'s folder "
                    f"{int(name)}, without leading zeros)"), None
        try:
            marker = _json_file(os.path.join(path, MARKER), _MARKER_BYTES)
            if not isinstance(marker, _Missing):
                why = marker_error(marker, int(name))
                run_id = marker.get("run_id") if isinstance(marker, dict) else None
                return (why, None) if why or not isinstance(run_id, str) else (None, run_id)
            meta = _json_file(os.path.join(path, "meta", "metadata"))
        except ValueError as error:
            return str(error), None
        return _written_before_markers(meta, int(name))

    def steps(self) -> list[int]:
        """The steps with a checkpoint graphmod wrote (verified or not), ascending: a folder
        named by its step, holding graphmod's marker of that step (or, written before
        markers, a meta record naming the step); see :meth:`foreign` for the rest."""
        return sorted(int(n) for n in self._names()
                      if _STEP.fullmatch(n) and self._examine(n)[0] is None)

    def latest(self) -> int | None:
        """The newest step with a checkpoint directory, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def leftovers(self) -> dict[str, str]:
        """``{name: what it is}`` of the directories that are no checkpoint but were one's:
        temporary directories of writes cut off, and checkpoints set aside (see
        :mod:`graphmod._train._checkpoint`). Never read, never deleted."""
        return {n: "an incomplete write (cut off, or still in progress); never read"
                if _INCOMPLETE.fullmatch(n) else "a checkpoint that failed verification, set "
                "aside when its step was written again; never read"
                for n in self._names() if _leftover_name(n) and _is_folder(self._path(n))}

    def foreign(self) -> dict[str, str]:
        """``{name: why}`` of the entries named like checkpoints or leftovers (a step number,
        ``00095``, ``8.unverified``, ...) that graphmod did not write: a folder without its
        marker, a link, a file. They are never read, moved or deleted; a run refuses to
        start among them (:class:`graphmod.plugins.Checkpoint`).

        Examples:
            >>> import os, tempfile
            >>> from graphmod._train._checkpoint import CheckpointReader
            >>> directory = tempfile.mkdtemp()
            >>> os.mkdir(os.path.join(directory, "2024"))
            >>> reader = CheckpointReader(directory)
            >>> reader.steps(), list(reader.foreign())
            ([], ['2024'])
            >>> reader.close()
        """
        named = [n for n in self._names() if _STEP.fullmatch(n)
                 or (_leftover_name(n) and not _is_folder(self._path(n)))]
        return {n: why for n in named if (why := self._examine(n)[0]) is not None}

    def run_of(self, step: int) -> str | None:
        """The run id of ``step``'s checkpoint (its marker's; before markers, its meta
        record's), or None where it has none (no checkpoint of graphmod's, or graphmod
        0.1's)."""
        return self._examine(str(step))[1]

    # -- reading and verifying --------------------------------------------------------------
    def _read_meta(self, step: int, *, legacy: bool = False,
                   loop: bool = False) -> dict[str, JSON]:
        """``step``'s meta record, checked for format, a well-formed array list, its step and
        run id (the folder's and its marker's) and a loop's counters (``loop``: required);
        ``legacy``: a format-1 record is returned as it is."""
        path = self._path(step)
        why, run_id = self._examine(str(step))
        if why is not None:
            raise CheckpointError(path, f"not a checkpoint graphmod wrote: {why}")
        link = _link_inside(path)
        if link is not None:
            raise CheckpointError(path, f"holds a symbolic link ({link}): graphmod never "
                                  "follows a link out of a checkpoint")
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
            log.debug("reading the meta record of %s failed", path, exc_info=True)
            raise CheckpointError(
                path, f"the meta record cannot be read ({failure_reason(error)})") from None
        check_record(path, record, legacy=legacy, step=step, loop=loop)
        if record.get("format") == LEGACY_FORMAT:
            return {**record, "step": step}  # format 2 records their step themselves
        if record.get("run_id") != run_id:
            raise CheckpointError(path, f"the meta record's 'run_id' is "
                                  f"{record.get('run_id')!r}, its marker names run {run_id}")
        return record

    def _read_arrays(self, step: int, record: dict[str, JSON],
                     shardings: list[jax.sharding.Sharding | None] | None = None
                     ) -> list[np.ndarray | jax.Array]:
        """The arrays of ``step``, each checked against the meta's shape, dtype, checksum;
        with ``shardings`` (one per array), those of a checkpoint of several processes
        placed by them (see :func:`local_array`)."""
        path = self._path(step)
        entries = array_list(record)
        if record["format"] == CHUNKED_FORMAT:
            with PartFiles(path, entries) as parts:
                return [local_array(path, entry, members, parts, sharding)
                        for entry, members, sharding in zip(
                            entries, chunk_members(entries),
                            shardings or [None] * len(entries), strict=True)]
        empty = [math.prod(shape) == 0 for _, shape, _, _ in entries]
        kept = [entry for entry, no in zip(entries, empty, strict=True) if not no]
        stored = iter(self._read_stored(path, kept) if kept else [])
        arrays = [np.zeros(shape, jnp.dtype(dtype)) if no else np.asarray(next(stored))
                  for (_, shape, dtype, _), no in zip(entries, empty, strict=True)]
        check_arrays(path, entries, arrays)
        return list(arrays)

    def _orbax_restore(self, path: str, what: str, **items: ocp_args.CheckpointArgs
                       ) -> dict[str, Any]:  # orbax's items, as orbax types them
        """Orbax's read of ``items`` from ``path``; a failure is a CheckpointError saying
        that ``what`` cannot be read."""
        try:
            with self._lock:
                return self._orbax.restore(path, args=self._ocp.args.Composite(**items))
        except Exception as error:
            log.debug("reading the %s of %s failed", what, path, exc_info=True)
            raise CheckpointError(path, f"the {what} cannot be read ({failure_reason(error)})") \
                from None

    def _read_stored(self, path: str, entries: list[list[Any]]) -> list[np.ndarray]:
        """Orbax's read of the (non-empty) arrays ``entries`` lists, or a CheckpointError."""
        if not os.path.isdir(os.path.join(path, "state")):
            raise CheckpointError(path, "no state directory: the arrays are missing")
        abstract = [np.zeros(shape, jnp.dtype(dtype)) for _, shape, dtype, _ in entries]
        got = self._orbax_restore(path, "arrays",
                                  state=self._ocp.args.StandardRestore(abstract))["state"]
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

    def _read_legacy(self, step: int, template: PyTree) -> list[np.ndarray]:
        """The arrays of a format-1 checkpoint (one pytree shaped like ``template``), which
        carries no checksums: restored unverified, with a warning."""
        path = self._path(step)
        abstract = [np.zeros(shape, dtype) for shape, dtype in stored_specs(template)]
        tree = jax.tree.unflatten(jax.tree.structure(template), abstract)
        fields = getattr(tree, "_fields", None)  # a TrainState: orbax stored it by field name
        if fields is not None:  # fields added since (None, e.g. loss_scale) are not on disk
            stored = {f: getattr(tree, f) for f in fields if getattr(tree, f) is not None}
            got = self._orbax_restore(path, "arrays",
                                      state=self._ocp.args.StandardRestore(stored))["state"]
            got = type(tree)(**{f: got.get(f) for f in fields})
        else:
            got = self._orbax_restore(path, "arrays",
                                      state=self._ocp.args.StandardRestore(tree))["state"]
        warn(f"{path}: written by graphmod 0.1 (format 1), which stored no checksums: "
             "restored unverified. Checkpoints written from now on are verified")
        return [np.asarray(leaf) for leaf in jax.tree.leaves(got)]

    def meta(self, step: int | None = None, *,
             skipped: Callable[[str], None] | None = None) -> dict[str, JSON]:
        """The meta record of ``step`` (default: the newest one whose meta can be read; each
        newer one that cannot is passed to ``skipped`` as ``"step N: reason"``). Its
        ``"step"`` says which checkpoint it is."""
        read = functools.partial(self._read_meta, legacy=True)
        if step is not None:
            return read(self._step(step))
        return self._first(read, skipped)

    def provenance(self, step: int | None = None) -> Provenance | None:
        """The provenance record saved at ``step`` (default: the latest), or None."""
        record = self.meta(step).get("provenance")
        return None if record is None else Provenance.from_dict(record)

    def restore(self, template: _State, step: int | None = None, *,
                loop: bool = False) -> tuple[_State, dict[str, JSON]]:
        """The state saved at ``step`` shaped like ``template``, and its meta record (whose
        ``"step"`` says which checkpoint it is; ``loop``: one that holds a loop's counters,
        checked). Without ``step``: the newest checkpoint that verifies, warning about each
        newer one skipped and about what in the directory graphmod did not write. Raises
        ``ValueError`` if the checkpoint holds another program's state,
        :class:`CheckpointError` if none verifies.

        A ``template`` placed across the processes of a run (a train state on their mesh)
        makes it collective: every process calls it, the arrays of a checkpoint of several
        processes are placed as the template's leaves are, each process reading only the
        chunks its devices' regions overlap, and a checkpoint is used only if it verifies
        in every process."""
        load = functools.partial(self._load, template=template, loop=loop)
        if any(s is not None and not s.is_fully_addressable for s in _shardings(template)):
            load = _agreed(load, self._path)
        if step is not None:
            record, state = load(self._step(step))
        else:
            skipped: list[str] = []
            record, state = self._first(load, skipped.append)
            if skipped:
                warn(f"{self.directory}: skipped checkpoints that fail verification "
                     f"({'; '.join(skipped)}); using step {record['step']}")
            if foreign := self.foreign():
                warn(f"{self.directory}: not read, and left alone: {_listed(foreign)}")
        return state, record

    def _load(self, step: int, *, template: _State, loop: bool
              ) -> tuple[dict[str, JSON], _State]:
        """``step``'s meta record and verified state, shaped like ``template`` (``loop``: a
        loop's record), each leaf placed as the template's is."""
        record = self._read_meta(step, legacy=True, loop=loop)
        tree = record.get("tree", {})  # a leaf's [shape, dtype] by path
        tree = tree if isinstance(tree, dict) else {}
        template, complete = counted_as_saved(template, tree)
        specs = leaf_specs(template)
        check_compatible(self._path(step), tree, specs)
        if record["format"] == LEGACY_FORMAT:
            return record, complete(restored(template, list(self._read_legacy(step, template))))
        entries = array_list(record)
        positions = stored_positions(self._path(step), entries, list(specs))
        if [(entries[i][1], entries[i][2]) for i in positions] != stored_specs(template):
            raise CheckpointError(self._path(step), "the meta record's array list does not "
                                  "match its tree of leaves")
        # each leaf's sharding, in stored order
        placed: list[jax.sharding.Sharding | None] = [None] * len(positions)
        for stored, sharding in zip(positions, _shardings(template), strict=True):
            placed[stored] = sharding
        arrays = self._read_arrays(step, record, placed)
        return record, complete(restored(template, [arrays[i] for i in positions]))

    def _first(self, load: Callable[[int], _T],
               skipped: Callable[[str], None] | None = None) -> _T:
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
            if os.path.isfile(os.path.join(self.directory, "_CHECKPOINT_METADATA")):
                where = (": it is an orbax checkpoint of its own (Flax's checkpointing guide), "
                         "not graphmod's numbered steps; restore it with orbax, write it into "
                         "the model (nnx.update(model, state)), then compile and init")
            elif foreign := self.foreign():
                where = f" (not graphmod's, left alone: {_listed(foreign)})"
            raise FileNotFoundError(f"no checkpoint in {self.directory}{where}")
        return steps

    def _step(self, step: int) -> int:
        steps = self._step_list()
        if step not in steps:
            why = self._examine(str(step))[0] if is_whole_number(step) else None
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"saved steps: {steps}" + (
                                        f" ({step} is not graphmod's: {why})"
                                        if why and why != "no longer there" else ""))
        return step


def _agreed(load: Callable[[int], _T], path: Callable[[int], str]) -> Callable[[int], _T]:
    """``load`` run by every process of a run together, one step at a time (each reads only
    the chunks its devices hold, so only together do they know whether a checkpoint
    verifies): a step that one process cannot load, none loads."""
    def together(step: int) -> _T:
        failure: BaseException | None = None
        loaded: list[_T] = []  # the step's, where it loads here
        try:
            loaded.append(load(step))
        except Exception as error:  # every process reaches the gather below
            failure = error
        code = 0 if failure is None else 1 if isinstance(failure, CheckpointError) else 2
        codes = np.asarray(multihost_utils.process_allgather(np.int32(code)))
        if codes.max() == 2 and code != 2:  # a process stops: none tries an older step
            raise RuntimeError(f"{path(step)}: process {np.flatnonzero(codes == 2).tolist()} "
                               "failed to read it (its error says why)") from failure
        if failure is not None:
            raise failure
        if codes.any():
            raise CheckpointError(path(step), f"process {np.flatnonzero(codes).tolist()} "
                                  "cannot read or verify its chunks of it")
        return loaded[0]

    return together


def counted_as_saved(template: _State, saved: dict[str, JSON]
                     ) -> tuple[_State, Callable[[_State], _State]]:
    """A train state ``template`` with a skipped-steps count where the checkpoint (its leaf
    specs ``saved``) holds one, and a function completing the restored state: the count a
    run with ``skip_nonfinite`` saved is kept by a run without (checkpoints before
    2026-12-04 always hold one), and a run with it resuming one without counts from 0
    (that run skipped no step). Any other state as it is.

    Examples:
        >>> import jax.numpy as jnp
        >>> from graphmod import TrainState
        >>> state = TrainState({}, (), jnp.int32(3), jnp.zeros(2, jnp.uint32))
        >>> template, complete = counted_as_saved(state, {".skipped": [[], "int32"]})
        >>> template.skipped.shape, complete(template) is template
        ((), True)
        >>> template, complete = counted_as_saved(state._replace(skipped=jnp.int32(5)), {})
        >>> template.skipped, int(complete(template).skipped)
        (None, 0)
    """
    if not isinstance(template, TrainState):
        return template, _as_it_is
    count = _count_spec(saved.get(".skipped"))  # its path: TrainState's GetAttrKey, keystr'd
    if count is not None and template.skipped is None:
        return cast(_State, template._replace(skipped=count)), _as_it_is
    if count is None and template.skipped is not None:
        zeros = jnp.zeros(np.shape(template.skipped), template.skipped.dtype)

        def counted(state: _State) -> _State:  # restored as the template is: a TrainState
            return cast(_State, cast(TrainState, state)._replace(skipped=zeros))

        return cast(_State, template._replace(skipped=None)), counted
    return template, _as_it_is


def _as_it_is(state: _State) -> _State:
    return state


def _count_spec(spec: JSON) -> np.ndarray | None:
    """A template leaf for a count the meta record lists as ``[shape, dtype]`` (a scalar,
    or one per member of a population; an integer dtype), else None. A view of one zero:
    a crafted shape allocates nothing, and the restore compares it with the array list."""
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], list)
            and len(spec[0]) <= 1 and all(type(n) is int and n >= 0 for n in spec[0])
            and spec[1] in ("int32", "int64")):
        return None
    shape = [n for n in spec[0] if isinstance(n, int)]
    return np.broadcast_to(np.zeros((), str(spec[1])), shape)


def _shardings(template: PyTree) -> list[jax.sharding.Sharding | None]:
    """Where each leaf of ``template`` is placed: a state is restored as its template is,
    so in a run of several processes each reads its own chunks."""
    return [None if is_key(leaf) else _concrete(getattr(leaf, "sharding", None))
            for leaf in jax.tree.leaves(template)]


def _concrete(sharding: object) -> jax.sharding.Sharding | None:
    """``sharding`` if it names devices; None for one over an abstract mesh (a template
    traced under ``jax.set_mesh``): such leaves are restored as unplaced arrays, which the
    step places as it runs."""
    if not isinstance(sharding, jax.sharding.Sharding) or isinstance(
            getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
        return None
    return sharding


def _listed(entries: dict[str, str]) -> str:
    """``{name: why}`` as one phrase for a message."""
    return "; ".join(f"{name} ({why})" for name, why in entries.items())


def _leftover_name(name: str) -> bool:
    """Whether ``name`` is one graphmod gives a temporary or set-aside checkpoint folder."""
    return bool(_INCOMPLETE.fullmatch(name) or _SET_ASIDE.fullmatch(name))


def _is_folder(path: str) -> bool:
    """Whether ``path`` is a directory itself (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _json_file(path: str, limit: int | None = None) -> JSON | _Missing:
    """The JSON value in the file at ``path`` (``_MISSING`` if there is none), read without
    following a link (the file's, or its folder's); ``ValueError`` saying why it is not
    graphmod's (``limit``: the most bytes it may hold)."""
    folder, name = os.path.split(path)
    what = os.path.join(os.path.basename(folder), name) if name == "metadata" else name
    if os.path.islink(folder):
        raise ValueError(f"its {os.path.basename(folder)} is a symbolic link; graphmod "
                         "never follows one")
    try:  # O_NONBLOCK: a FIFO in its place must not block the read
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return _MISSING
    except OSError as error:
        raise ValueError(f"its {what} is a symbolic link; graphmod never follows one"
                         if error.errno == errno.ELOOP else
                         f"its {what} cannot be read ({error.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"its {what} is not a file")
        if limit is not None and info.st_size > limit:
            raise ValueError(f"its {what} holds {info.st_size} bytes: not graphmod's")
        data = file.read()
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"its {what} is not JSON") from None


def _written_before_markers(meta: JSON | _Missing, step: int
                            ) -> tuple[str | None, str | None]:
    """What :meth:`CheckpointReader._examine` says of the folder of ``step`` that has no
    marker and whose meta record is ``meta``: graphmod's checkpoint, written before markers,
    if the record names that step (graphmod 0.1's in its counters, where it has them)."""
    if isinstance(meta, _Missing):
        return f"no graphmod marker ({MARKER}) and no meta record", None
    if not isinstance(meta, dict):
        return f"no graphmod marker ({MARKER}), and its meta record is not graphmod's", None
    time = meta.get("time")
    if meta.get("format") == LEGACY_FORMAT and isinstance(meta.get("tree"), dict):
        named = time.get("step") if isinstance(time, dict) else step
    elif meta.get("format") in (FORMAT, CHUNKED_FORMAT) and is_run_id(meta.get("run_id")):
        named = meta.get("step")
    else:
        return f"no graphmod marker ({MARKER}), and its meta record is not graphmod's", None
    if not (is_whole_number(named) and named == step):
        return f"no graphmod marker ({MARKER}), and its meta record names step {named!r}", None
    run_id = meta.get("run_id")  # a run id (checked), or none in graphmod 0.1's
    return None, run_id if isinstance(run_id, str) else None


def _link_inside(path: str) -> str | None:
    """The first symbolic link inside the folder ``path`` (relative to it), or None."""
    for root, folders, files in os.walk(path):  # os.walk follows no link
        for name in folders + files:
            if os.path.islink(os.path.join(root, name)):
                return os.path.relpath(os.path.join(root, name), path)
    return None
