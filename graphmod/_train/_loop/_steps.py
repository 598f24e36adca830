"""The loop's step driver: batches read ahead, fused-step planning, step calls.

On an accelerator each batch is put on the device one step ahead, so the copy overlaps the
computation; on the CPU, where the device is the host, jit takes the NumPy batch directly
(faster than a put). With ``steps_per_call=k`` up to k steps run in one ``lax.scan``
dispatch whenever no planned template is due inside them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Protocol, TypeAlias, TypeVar, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from graphmod._core._number_checks import is_whole_number
from graphmod._core._program._arguments import (
    argument_names,
    bind_arguments,
    check_arguments,
    check_binds,
    is_key,
)
from graphmod._core._program._rng_arguments import with_random_streams
from graphmod._core._sharding import Placement, mesh_context
from graphmod._train._batch import step_arguments
from graphmod._train._events import On, Template, Time
from graphmod._train._optimize import TrainStep
from graphmod._train._schedule import Schedule
from graphmod._train._train_state import TrainState
from graphmod.typing import ArrayLike, Batch, PyTree

_PLANNABLE = ("step", "epoch", "examples")
_R = TypeVar("_R")

StepMetrics: TypeAlias = Mapping[str, ArrayLike]
"""A step's metrics by name, scalars on the device until read (a step's own dict)."""

Step: TypeAlias = Callable[..., tuple[PyTree, StepMetrics]]
"""``step(state, *batch, **reads) -> (state, metrics)``, e.g. a :func:`graphmod.optimize`."""

Placer: TypeAlias = Callable[[Batch, bool], Batch]
"""``put(batch, stacked)``: a batch (or a stack of them) placed on the devices."""


@runtime_checkable
class EpochSource(Protocol):
    """Data that iterate any epoch from any position (an ``ArraySource``, a
    ``GrainSource``): a loop resumes inside an epoch and reads a first batch ahead."""

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterable[Batch]: ...


@runtime_checkable
class Describes(Protocol):
    """Data that describe themselves (size, shapes, dtypes, content hash, ...)."""

    def describe(self) -> Mapping[str, object]: ...


def batch_size(batch: Batch) -> int:
    """The number of examples in ``batch`` (its first array's leading dimension)."""
    first = batch
    while isinstance(first, dict | tuple | list):  # the common shapes, without flattening
        if not first:
            raise ValueError("a batch holds no arrays")
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return int(np.shape(first)[0])


def call_step(step: Step, state: PyTree, batch: Batch) -> tuple[PyTree, StepMetrics]:
    """``step(state, ...)`` with the batch bound to its arguments."""
    args, kwargs = step_arguments(batch)
    return step(state, *args, **kwargs)


def epoch_batches(data: Iterable[Batch], epoch: int, position: int) -> Iterator[Batch]:
    """The batches of ``epoch`` from batch ``position`` on."""
    if isinstance(data, EpochSource):
        return iter(data.iter_epoch(epoch, start=position))
    iterator = iter(data)
    for _ in range(position):  # resume inside an epoch of a plain iterable
        next(iterator)
    return iterator


def _placement(step: object) -> Placement | None:
    """The mesh placement of a ``graphmod.optimize`` step's program (None: one device)."""
    return step.program.placement if isinstance(step, TrainStep) else None


def step_mesh(step: object) -> contextlib.AbstractContextManager[object]:
    """The mesh of a ``graphmod.optimize`` step's program set as the context mesh for the
    loop's own work on its arrays (nothing for other steps): see ``mesh_context``."""
    return mesh_context(_placement(step))


def batch_placer(step: object) -> Placer | None:
    """How the loop puts batches on the devices ahead of ``step``: split over the mesh of
    a step whose program has one (with several processes, the first batch is compared
    across them, the rest are not: see ``Placement.put_batch``), on the default accelerator
    otherwise, not at all on the CPU (there the device is the host: jit takes NumPy batches
    faster than a put)."""
    placement = _placement(step)
    if placement is not None:
        calls = itertools.count()
        return lambda batch, stacked: placement.put_batch(batch, stacked=stacked,
                                                          compare=next(calls) == 0)
    if jax.default_backend() != "cpu":
        return lambda batch, stacked: jax.device_put(batch)
    return None


def steps_in_flight(step: object) -> int | None:
    """How many calls the loop may dispatch before it waits for one: unbounded (None),
    except for a step on a mesh of several CPU devices, where XLA's CPU all-reduce
    deadlocks with about 50 steps in flight on 8 devices (pure JAX too; jax 0.10)."""
    placement = _placement(step)
    devices = [] if placement is None else list(placement.mesh.devices.flat)
    return 16 if len(devices) > 1 and devices[0].platform == "cpu" else None


def bounded(call: Callable[..., _R], limit: int | None) -> Callable[..., _R]:
    """``call``, waiting for its result every ``limit`` calls (``call`` itself for None)."""
    if limit is None:
        return call
    calls = itertools.count(1)

    def waiting(*args: object) -> _R:
        out = call(*args)
        if next(calls) % limit == 0:
            jax.block_until_ready(out)
        return out

    return waiting


@dataclasses.dataclass(slots=True)
class _Read:
    """One batch read ahead: its number of examples, the batch as read, and the batch
    put on the devices (None: not yet)."""

    size: int
    host: Batch
    device: Batch | None = None


class ReadAhead:
    """The batches of one epoch, read up to ``ahead`` beyond the step being run.

    With ``put`` (an accelerator, or a program on a mesh: ``put(batch, stacked)`` places a
    batch, or a stack of them) the batch after the one taken is put on the devices before
    the taken one's step is dispatched.
    """

    def __init__(self, batches: Iterator[Batch], ahead: int, put: Placer | None) -> None:
        self.produced = False  # whether the epoch yielded any batch
        self._ended = False  # whether the epoch's iterator is exhausted
        self._batches = batches
        self._ahead = ahead
        self._put = put
        self._buffer: collections.deque[_Read] = collections.deque()

    def fill(self) -> list[int]:
        """Reads ahead; the sizes of the buffered batches (none: the epoch is over)."""
        while len(self._buffer) < self._ahead:
            try:
                host = next(self._batches)
            except StopIteration:
                self._ended = True
                break
            self.produced = True
            self._buffer.append(_Read(batch_size(host), host))
        return [entry.size for entry in self._buffer]

    @property
    def over(self) -> bool:
        """Whether every batch of the epoch has been taken."""
        return self._ended and not self._buffer

    def take(self, count: int) -> tuple[int, Batch]:
        """The next ``count`` batches' number of examples and their batch (stacked along a
        new leading axis when ``count > 1``), ready for the step."""
        chunk = [self._buffer.popleft() for _ in range(count)]
        put = self._put or _unplaced
        if count == 1:
            size, device = chunk[0].size, chunk[0].device
            batch = device if device is not None else put(chunk[0].host, False)
        else:
            size = sum(entry.size for entry in chunk)
            batch = put(jax.tree.map(lambda *xs: np.stack(xs), *[e.host for e in chunk]), True)
        if self._put is not None and self._buffer and self._buffer[0].device is None:
            self._buffer[0].device = self._put(self._buffer[0].host, False)
        return size, batch


def _unplaced(batch: Batch, stacked: bool) -> Batch:
    """A batch left where it is (on the CPU, where jit takes NumPy batches directly)."""
    return batch


def steps_to_fuse(templates: list[Template], now: Time, sizes: list[int], per_call: int,
                  max_steps: int | None) -> int:
    """How many of the next steps (of ``sizes`` examples each) can run in one call: at most
    ``per_call``, not past ``max_steps``, and none at which a planned template is due may
    fall inside. Templates whose fields are schedules on the ``step``, ``epoch`` or
    ``examples`` timelines are planned; catch-alls and wall-clock schedules see one event
    per call; a predicate that cannot be evaluated ahead allows one step at a time."""
    limit = min(len(sizes), per_call)
    if max_steps is not None:
        limit = min(limit, max_steps - now.step)
    if limit <= 1:
        return 1
    plans: list[dict[str, Schedule]] = []
    for t in templates:
        if "step" not in t.types():
            continue
        # A template of one issuer, or a predicate, is not planned (one step at a time).
        fields = t.schedules() if isinstance(t, On) and _any_issuer(t) else None
        if fields is None:
            return 1
        if fields and all(k in _PLANNABLE for k in fields):
            plans.append(fields)
    for i in range(1, limit):
        nxt = dataclasses.replace(now, step=now.step + 1, examples=now.examples + sizes[i - 1])
        for plan in plans:
            if all(s(getattr(now, k), getattr(nxt, k)) for k, s in plan.items()):
                return i
        now = nxt
    return limit


def _any_issuer(template: On) -> bool:
    # Read apart: pyright takes ``template.issuer is None`` (declared ``object``) for never.
    issuer = template.issuer
    return issuer is None


def cast_like(new: PyTree, old: PyTree, who: str) -> PyTree:
    """``new`` (a state ``who`` made from ``old``) with each leaf cast to ``old``'s dtype, so
    that the step does not retrace; raises if the structure changed."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise ValueError(f"{who}: update_state(fn) must keep the state's structure")

    def cast(n: object, o: object) -> object:
        dtype = getattr(o, "dtype", None)
        if n is o or dtype is None or is_key(o):
            return n  # a leaf fn kept costs nothing (Anneal touches one of hundreds)
        return jnp.asarray(n, dtype=dtype)

    return jax.tree.map(cast, new, old)


def donated(state: PyTree) -> list[str]:
    """The paths of a state's arrays donated to a step call (``[0]``, ``.variables['model']``
    ...): that call took over their buffers, or never returned."""
    return [jax.tree_util.keystr(path) for path, leaf in
            jax.tree_util.tree_flatten_with_path(state)[0]
            if isinstance(leaf, jax.Array) and leaf.is_deleted()]


def fused_steps(step: Step, own: Step) -> Step:
    """A function running ``step`` over stacked batches in one ``lax.scan`` call; ``own``
    is the loop's step before plugins wrapped it."""
    # A graphmod.optimize step keeps one fused function across loops and resumes.
    if step is own and isinstance(step, TrainStep):
        return step.steps

    def run(state: PyTree, batches: Batch) -> tuple[PyTree, StepMetrics]:
        return jax.lax.scan(lambda s, b: call_step(step, s, b), state, batches)

    return jax.jit(run, donate_argnums=0)


def check_loop_settings(step: object, data: object, **counts: int | None) -> None:
    """Refuses a step, data or counts ``Loop`` cannot run, naming the argument."""
    if not callable(step):
        raise TypeError(f"Loop(step, data): step must be callable, got {step!r}")
    if not isinstance(data, Iterable):
        raise TypeError(f"Loop(step, data): data must be iterable, got {type(data).__name__}")
    if isinstance(data, Sized) and len(data) == 0:
        raise ValueError("Loop(step, data): the data source is empty (no batch per epoch)")
    if isinstance(data, Iterator) and (counts.get("epochs") or 1) > 1:
        raise ValueError(
            f"Loop(step, data, epochs={counts['epochs']}): data is a {type(data).__name__}, "
            "an iterator that its first epoch uses up; pass data that iterates again each "
            "epoch (a list of batches, a graphmod.data.ArraySource, a DataLoader, or an "
            "object whose __iter__ returns a new generator), or run one pass (epochs=1)")
    for label, value in counts.items():
        if value is not None and not is_whole_number(value, least=1):  # True is no count
            raise ValueError(f"Loop({label}={value!r}): must be a positive int, e.g. "
                             f"{label}=10")


def _identity(description: Mapping[str, object]) -> object:
    """What tells a data source from another: its content hash (``ArraySource``), else its
    whole description but the name (a Grain pipeline's lineage, seeds, first batch hash)."""
    if description.get("sha256") is not None:
        return description["sha256"]
    return {k: v for k, v in description.items() if k != "name"}


def check_transforms_source(steps: Iterable[object], data: object, allowed: bool) -> None:
    """Refuses a step whose program's transforms were fitted on other data than ``data``
    (by the sources' descriptions: content hashes where they have one), unless the caller
    ``allowed`` it; sources that do not describe themselves are not compared."""
    fitted = [getattr(getattr(step, "program", None), "transforms", None) for step in steps]
    recorded = [t.record().get("source") for t in fitted if t is not None]
    sources = [source for source in recorded if isinstance(source, Mapping) and source]
    if allowed or not sources or not isinstance(data, Describes):
        return
    now = dict(data.describe())  # hashes the data: only when there is something to compare
    for source in sources:
        if _identity(source) == _identity(now):
            continue
        differ = sorted(k for k in set(source) | set(now)
                        if k != "name" and source.get(k) != now.get(k))
        raise ValueError(
            f"Loop(step, data): the program's transforms were fitted on other data "
            f"({source.get('name')!r}) than the loop trains on ({now.get('name')!r}): their "
            f"descriptions differ in {', '.join(differ)}. Fit them on the training data: "
            "compile(..., transforms=graphmod.data.Transforms(spec).fit(train)), or pass "
            "allow_data_change=True to train on these data anyway")


def check_first_batch(step: object, data: Iterable[Batch], epoch: int, position: int) -> None:
    """Refuses data whose batches the step's function cannot take (a dict batch's keys
    that are not its arguments; arrays whose rank, feature size or dtype differ from
    ``init``'s examples), before any plugin sets up: nothing is written. Reads the first
    batch of a resumable source (``iter_epoch``, deterministic by its contract); a plain
    iterable is not read ahead (the step's own trace names the mismatch)."""
    if not (isinstance(step, TrainStep) and isinstance(data, EpochSource)):
        return
    first = next(iter(data.iter_epoch(epoch, start=position)), None)
    if first is not None:
        check_batch(step, first)


def check_batch(step: TrainStep, batch: Batch, reads: Mapping[str, PyTree] | None = None,
                who: str = "Loop.run") -> None:
    """Refuses a batch (with the variables of the models the step ``reads``, passed by
    name) that ``step``'s function cannot take, naming the mismatch; see
    :func:`check_first_batch`."""
    fn, examples = step.program.fn, step.program.record.examples
    args, kwargs = step_arguments(batch)
    kwargs = {**kwargs, **(reads or {})}
    if examples is not None:  # the nnx.Rngs arguments the step makes need no data
        args, kwargs = with_random_streams(fn, examples, args, kwargs, jax.random.key(0),
                                           who)
    check_binds(fn, args, kwargs, f"{who}: the data's batches")
    if examples is not None:
        try:
            check_arguments(examples, bind_arguments(argument_names(fn), args, kwargs,
                                                     lambda leaf: leaf))
        except ValueError as error:
            raise ValueError(f"{who}: the data's batches do not fit the program: {error}"
                             ) from None


def check_start_state(step: object, state: PyTree, who: str = "Loop.run(state)") -> None:
    """Refuses a state the step cannot take, naming the argument (``who``) and the fix."""
    if state is None:
        raise TypeError(f"{who}: state is None; pass the train state to start from,"
                        " e.g. state = step.init(program.init(*example_batch), key)")
    if isinstance(step, TrainStep) and not isinstance(state, TrainState):
        raise TypeError(f"{who}: a graphmod.optimize step takes a "
                        f"graphmod.TrainState, got {type(state).__name__}; make one with "
                        "state = step.init(variables, jax.random.key(0))")
    deleted = donated(state)
    if deleted:
        raise ValueError(
            f"{who}: the state's arrays were donated to an earlier step call "
            f"(state{deleted[0]}, and {len(deleted) - 1} more): a graphmod.optimize step "
            "takes over the buffers of the state it is given, also in a Loop; start from "
            "the state that run or call returned, or keep a copy made before it, "
            "jax.tree.map(jnp.copy, state)")
