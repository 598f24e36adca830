"""The frame: what one outer trace of a program knows and collects.

A frame is created by a program for each outer trace (``init``, ``train``, ``infer``,
``graph``) and is current while the model function runs. It maps variable identities to the
program's values, holds the stack of application calls in progress, the manager-owned
variables (:class:`~graphmod._core._model._owned.OwnedStore`) and hyperparameters, and collects the
rewrite trace, tagged variables (for the computation graph) and monitored values.

The frame owns its state: other modules read it through read-only properties and change it
through its verbs only (writing variables, keeping the parameter reads of the trace, noting
matches, rewrites and exclusive claims, and the snapshot, carry and restore of a
``graphmod.scan`` step). The read of a model variable itself, from the frame to the
managers' hooks, is :func:`graphmod._core._tracing._parameter_read.read_parameter`.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from graphmod import roles as _roles
from graphmod._core._loops._loop_keys import Layer, mark
from graphmod._core._managers._manager import Manager
from graphmod._core._managers._order import resolve_order
from graphmod._core._model._owned import OwnedKey, OwnedStore
from graphmod._core._selection._filter import Tag, VariableFilter
from graphmod._core._tracing._rewrites import Rewrite, shape_and_dtype
from graphmod._core._tracing._side_outputs import Collected, LoopSnapshot, Recorded
from graphmod._core._tracing._trace import TraceScope, current_trace
from graphmod._core._tracing._variables import identity_of
from graphmod.errors import ManagerConflict, StateEscapesTransform
from graphmod.typing import ArrayLike

if TYPE_CHECKING:
    from graphmod._core._model._layout import Layout, VariableInfo
    from graphmod.typing import AxisName

__all__ = ["CallInProgress", "Frame", "OwnedInit", "OwnedKey", "crc32"]

# What ``call.variable(name, init)`` starts from: an array, a callable of nothing (computed
# from the shapes it sees) or, in a parameter hook, of the parameter's initial value.
OwnedInit: TypeAlias = ArrayLike | Callable[[], ArrayLike] | Callable[[jax.Array], ArrayLike]
V = TypeVar("V")  # a value a hook rewrites into one of its kind

# What a loop step may change: the model's values (but the parameters') and the owned ones.
Carry: TypeAlias = tuple[dict[str, jax.Array], dict[OwnedKey, jax.Array]]
# A parameter read of one call: (brick path, application, call id, variable identity).
ReadKey: TypeAlias = tuple[str, str, int, str]


class CallInProgress(Protocol):
    """An application call in progress as the frame holds it: its chain runner
    (``graphmod._core._tracing._chain.Chain``, which imports this module), as the parameter
    read (``graphmod._core._tracing._parameter_read``) uses it."""

    path: str
    application: str
    call_id: int
    managers: tuple[Manager, ...]

    def tag(self, role: _roles.Role, name: str, path: str | None = None,
            aliases: tuple[str, ...] = ()) -> Tag: ...

    def monitor_key(self, name: str) -> str: ...

    def rewrite(self, manager: Manager, hook: str, tag: Tag, value: V,
                parameter: tuple[str, jax.Array] | None = None) -> V: ...


def crc32(text: str) -> int:
    """A stable 31-bit hash of ``text``: what keys are folded with (Python's ``hash`` is
    salted per process)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class Frame:
    """Per-trace state of a program (see the module docstring)."""

    def __init__(
        self, *, layout: Layout, mode: str, values: Mapping[str, jax.Array],
        owned: dict[OwnedKey, jax.Array], hparams: Mapping[tuple[str, str], jax.Array],
        managers: tuple[Manager, ...], key: jax.Array | None = None,
        axis_name: AxisName | None = None, mesh: jax.sharding.Mesh | None = None,
        monitor: dict[str, VariableFilter] | None = None, record: bool = False,
        costs: bool = False, folds: Sequence[int] = (),
    ) -> None:
        self.layout = layout
        self.mode = mode
        self.training = mode != "infer"
        self.managers = managers  # as the program holds them (a ManagerOrder: listed)
        # The chain of application calls, outermost first: the managers with a hook of
        # theirs, constraints resolved and then priority (see graphmod._core._managers._order).
        self._call_managers = [m for m in resolve_order(managers) if m.applies_to_calls]
        self.key = key
        # The draws a trace of the program made before (``folds``: CRC32s), keyed in one
        # batched fold of the step key: the very keys one ``fold_in`` each would give (the
        # hash is elementwise), in one hash for all instead of one per draw.
        self._folds: dict[int, None] = {}  # what this trace draws, in order (key_folds)
        self._fold_index = {fold: i for i, fold in enumerate(folds)}
        self._folded = (jax.vmap(jax.random.fold_in, (None, 0))(
            key, jnp.asarray(folds, jnp.uint32)) if key is not None and folds else None)
        self.axis_name = axis_name
        self.mesh = mesh  # the program's device mesh (compile(mesh=...)), else None
        self.monitor = monitor or {}
        self.collects_costs = costs  # optimize's trace: auxiliary costs are kept
        self._out: object = None  # what the traced function returned (see returned)
        self._scope = TraceScope()
        self._values = dict(values)
        self._updated: set[str] = set()
        self._owned = OwnedStore(owned, mode, self._scope, self.check_base_trace)
        self._hparams = dict(hparams)
        self._seen = Collected([] if record else None)
        self._seen_managers: dict[int, Manager] = {id(m): m for m in managers}
        # The application calls in progress (their chain runners, innermost last).
        self._calls: list[CallInProgress] = []
        self._local_managers: list[Manager] = []
        self._call_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        # The parameter reads of this trace: per call and variable, (JAX trace, value) pairs.
        self._parameter_cache: dict[ReadKey, list[tuple[object, jax.Array]]] = {}
        self._scan_indices: list[jax.Array] = []
        self._held_off: dict[str, str] = {}  # path -> the module flag keeping it in eval mode

    # -- read-only views ------------------------------------------------------------------
    @property
    def key_folds(self) -> tuple[int, ...]:
        """The CRC32s of the draws this trace made (:meth:`rng`), in order: the next trace
        of the program folds them in one batch (``Frame(folds=...)``)."""
        return tuple(self._folds)

    @property
    def values(self) -> dict[str, jax.Array]:
        """Model variables' values by identity."""
        return self._values

    @property
    def hparams(self) -> dict[tuple[str, str], jax.Array]:
        """Hyperparameters by (manager, name)."""
        return self._hparams

    @property
    def monitored(self) -> dict[str, object]:
        """Monitored values by key."""
        return self._seen.monitored

    @property
    def costs(self) -> dict[str, dict[str, ArrayLike]]:
        """Auxiliary costs by owner, then by key."""
        return self._seen.costs_out()

    @property
    def measured(self) -> dict[str, ArrayLike]:
        """Measurements (``call.report``) by key."""
        return self._seen.measured_out()

    @property
    def records(self) -> list[Recorded] | None:
        """Tagged variables (graph traces only)."""
        return self._seen.records

    @property
    def rewrites(self) -> list[Rewrite]:
        """The rewrites the trace made, in order."""
        return self._seen.rewrites

    @property
    def matches(self) -> collections.Counter[int]:
        """Matches per ``id(manager)``."""
        return self._seen.matches

    @property
    def unchanged(self) -> dict[str, set[tuple[str, str, int, str]]]:
        """Variables left as they were, by manager."""
        return self._seen.unchanged

    @property
    def seen_managers(self) -> dict[int, Manager]:
        """Managers met, by id."""
        return self._seen_managers

    @property
    def calls(self) -> Sequence[CallInProgress]:
        """The application calls in progress (their chain runners), innermost last."""
        return self._calls

    @property
    def base_trace(self) -> object:
        """The JAX trace side outputs leave from."""
        return self._scope.base

    @property
    def owned_roles(self) -> dict[OwnedKey, _roles.Role]:
        """Owned variables' roles."""
        return self._owned.roles

    @property
    def owned_updated(self) -> set[OwnedKey]:
        """Owned keys the trace wrote."""
        return self._owned.updated

    @property
    def out(self) -> object:
        """What the traced function returned."""
        return self._out

    @property
    def held_off(self) -> dict[str, str]:
        """Layers a module flag held in eval mode: path -> flag."""
        return self._held_off

    def returned(self, out: object) -> None:
        """Keeps what the traced function returned (``frame.out``)."""
        self._out = out

    def inner(self) -> bool:
        """Whether the trace in progress is inside a transform of the frame's base trace."""
        return self._scope.inner()

    # -- model variables -----------------------------------------------------------------
    def variable_info(self, variable: nnx.Variable) -> VariableInfo | None:
        """What the layout knows of ``variable`` if it is one of the program's model
        variables or a copy an NNX lifted transform made of one, else None."""
        identity = identity_of(variable)
        if identity is None or identity not in self._values:
            return None
        return self.layout.by_identity[identity]

    def holds(self, variable: nnx.Variable) -> bool:
        """Whether ``variable`` is one of the program's model variables (the model's own
        object, not a copy made by an NNX lifted transform)."""
        identity = identity_of(variable)
        return (identity is not None and identity in self._values
                and self.layout.objects.get(identity) is variable)

    def carries(self, variable: nnx.Variable) -> bool:
        """Whether the program threads ``variable``'s writes through (every one but the
        parameters, which a forward pass never writes: NNX transforms only echo them)."""
        return not self._info(variable).role.is_a(_roles.PARAMETER)

    def stored(self, variable: nnx.Variable) -> jax.Array:
        """The program's current value of ``variable``, without rewrites."""
        return self._values[self._info(variable).identity]

    def read_before(self, key: ReadKey) -> jax.Array | None:
        """What parameter read ``key`` (a call and a variable) gave in the JAX trace in
        progress (see :meth:`note_read`), None if it was not made there."""
        trace = current_trace()
        for cached_trace, value in self._parameter_cache.get(key, ()):
            if cached_trace == trace:  # trace states are not hashable
                return value
        return None

    def note_read(self, key: ReadKey, value: jax.Array) -> None:
        """Keeps ``value``, what parameter read ``key`` gave in the JAX trace in progress: a
        value rewritten inside an inner trace (a scan body) must not leak out of it."""
        self._parameter_cache.setdefault(key, []).append((current_trace(), value))

    def write(self, variable: nnx.Variable, value: ArrayLike) -> None:
        """Sets the program's value of ``variable``: ``value`` as an array (a traced array
        is kept as it is; a number written, ``self.count = 0``, is one as jit returns it)."""
        info = self._info(variable)
        self.check_base_trace(f"writing {info.path}")
        self._values[info.identity] = jnp.asarray(value)
        self._updated.add(info.identity)

    def _info(self, variable: nnx.Variable) -> VariableInfo:
        """What the layout knows of model variable ``variable`` (or a transform's copy)."""
        identity = identity_of(variable)
        if identity is None:
            raise KeyError(f"{type(variable).__name__} is none of the program's variables")
        return self.layout.by_identity[identity]

    def check_base_trace(self, what: str, where: str | None = None) -> None:
        """Raises :class:`~graphmod.errors.StateEscapesTransform` if a side output would be
        created under a raw JAX transform."""
        if where is None and self._calls and self._scope.inner():
            where = f"application {self._calls[-1].application!r} of {self._calls[-1].path}"
        self._scope.check(what, f" in {where}" if where else "")

    # -- application calls ----------------------------------------------------------------
    def next_call_id(self, path: str, application: str) -> int:
        key = (path, application)
        call_id = self._call_counts[key]
        self._call_counts[key] += 1
        return call_id

    @contextmanager
    def calling(self, call: CallInProgress) -> Iterator[None]:
        self._calls.append(call)
        try:
            yield
        finally:
            popped = self._calls.pop()
            assert popped is call, "application stack corrupted"

    @contextmanager
    def using(self, managers: tuple[Manager, ...]) -> Iterator[None]:
        """Managers given with ``use_manager=`` for one call and its children."""
        active = {m.name: m for m in (*self.managers, *self._local_managers)}
        for m in managers:
            if not isinstance(m, Manager):
                raise TypeError(f"use_manager: {m!r} is not a graphmod.Manager")
            if m.name in active and active[m.name] is not m:
                raise ManagerConflict(f"use_manager: a manager named {m.name!r} is already "
                                      "active; pass manager_name=... to one of them")
            self.layout.resolve(m.filter.brick_instances(), f"use_manager {m.name!r}")
            self._seen_managers.setdefault(id(m), m)
        self._local_managers.extend(managers)
        try:
            yield
        finally:
            del self._local_managers[len(self._local_managers) - len(managers):]

    def chain(self) -> list[Manager]:
        """Every manager of application calls active now, outermost first: the program's
        in their resolved order, with those of ``use_manager=`` resolved among them
        (stable by priority, declared constraints satisfied)."""
        if not self._local_managers:
            return self._call_managers
        order = resolve_order((*self.managers, *self._local_managers))
        return [m for m in order if m.applies_to_calls]

    def note_match(self, manager: Manager, left: Tag | None = None) -> None:
        """Counts a match of ``manager`` (a strict manager must match something); ``left``:
        the variable it matched and left as it was, for the rewrite trace."""
        self._seen.note_match(id(manager), manager.name, left)

    def claim_exclusive(self, tag: Tag, manager: Manager) -> None:
        """Claims ``tag`` of its call for ``manager``'s exclusive rewrite; raises
        :class:`~graphmod.errors.ManagerConflict` if another manager holds it."""
        claim = (tag.brick_path, tag.application, tag.call_id, tag.path)
        other = self._seen.exclusive.setdefault(claim, manager.name)
        if other != manager.name:
            raise ManagerConflict(
                f"managers {other!r} and {manager.name!r} both make exclusive rewrites of "
                f"{tag.role} {tag.name!r} in application {tag.application!r} of "
                f"{tag.brick_path}: narrow one of their filters"
            )

    @contextmanager
    def inference_pass(self) -> Iterator[None]:
        """Runs the block as inference sees the program, inside this training trace (the
        ranking pass of ``managers.SelectiveBackprop``): its application calls are in
        inference mode (no draws, no state written: the model's writes are dropped), their
        call ids and parameter rewrites their own; what it rewrites, records, monitors,
        costs and measures is dropped, so the rest of the trace sees none of it."""
        if not self.training:
            yield
            return
        seen = self._seen
        saved = (self.mode, self.monitor, self.collects_costs, self._parameter_cache,
                 collections.Counter(self._call_counts), dict(self._values), set(self._updated),
                 len(seen.rewrites), None if seen.records is None else len(seen.records),
                 {by: set(left) for by, left in seen.unchanged.items()},
                 {by: set(calls) for by, calls in seen.rewritten_calls.items()})
        self.mode, self.training, self.monitor, self.collects_costs = "infer", False, {}, False
        self._parameter_cache = {}
        try:
            yield
        finally:
            (self.mode, self.monitor, self.collects_costs, self._parameter_cache,
             self._call_counts, self._values, self._updated, rewrites, records,
             seen.unchanged, seen.rewritten_calls) = saved
            self.training = True
            del seen.rewrites[rewrites:]
            if seen.records is not None:
                del seen.records[records:]

    # -- randomness -----------------------------------------------------------------------
    def rng(self, parts: tuple[str, ...], call_id: int, *, per_step: bool = True,
            witnesses: Callable[[], Sequence[jax.Array]] = tuple) -> jax.Array:
        """The key of a draw: the step key folded with CRC32 of ``parts`` and the call id,
        then (``per_step``) with ``graphmod.scan``'s step indices, with the device index
        under ``axis_name``; inside a loop body JAX traces once (``nnx.scan``, ``lax.scan``,
        ...; ``per_step``) with the position of every loop around it, outermost first, and
        under ``vmap`` (``per_step`` or not) with the mapped index if a ``witnesses()``
        array is mapped (see ``graphmod._core._loops._loop_keys``)."""
        fold = crc32("|".join(parts) + f"#{call_id}")  # known at trace time (ids are ints)
        self._folds[fold] = None
        if self.mode == "init":
            return jax.random.key(0)  # placeholder: init only needs shapes
        if not self.training:
            raise RuntimeError(
                f"call.rng() in inference mode (manager {parts[0]!r}, application "
                f"{parts[2]!r} of {parts[1]}, {parts[3]} {parts[4]!r}): stochastic rewrites "
                "belong to training; check call.training before drawing randomness"
            )
        if self.key is None:
            raise RuntimeError("this program was traced without a key: pass rng= to train")
        batched = self._fold_index.get(fold)
        key = (jax.random.fold_in(self.key, fold) if self._folded is None or batched is None
               else self._folded[batched])
        for index in self._scan_indices if per_step else ():
            key = jax.random.fold_in(key, index)
        if self.axis_name is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(self.axis_name))
        if self._scope.inner():  # maybe a loop body or a vmap: resolved by the program's trace
            key = mark(key, witnesses(), loops=per_step)
        return key

    # -- manager-owned variables and hyperparameters -----------------------------------------
    def owned_value(self, key: OwnedKey, init: OwnedInit, role: _roles.Role,
                    parameter: jax.Array | None = None, stacked: int = 1,
                    layer: Layer = tuple) -> None:
        """Makes sure owned variable ``key`` exists (see :meth:`OwnedStore.ensure`)."""
        self._owned.ensure(key, init, role, parameter, stacked, layer)

    def read_owned(self, key: OwnedKey, stored: bool = False, layer: Layer = tuple
                   ) -> jax.Array:
        """Owned variable ``key`` as the current trace sees it, or found it (``stored``)."""
        return self._owned.stored(key, layer) if stored else self._owned.read(key, layer)

    def set_owned(self, key: OwnedKey, value: jax.Array, layer: Layer = tuple) -> None:
        """Sets owned variable ``key`` (see :meth:`OwnedStore.write`)."""
        self._owned.write(key, value, layer)

    def owned_out(self) -> dict[OwnedKey, jax.Array]:
        """The owned variables at the end of the trace (see :meth:`OwnedStore.out`)."""
        return self._owned.out()

    def hparam(self, manager: Manager, name: str) -> jax.Array:
        key = (manager.name, name)
        if key not in self._hparams:
            if self.mode != "init":
                raise KeyError(
                    f"variables hold no hyperparameter {manager.name}.{name}: make them "
                    "with this program's init"
                )
            self._hparams[key] = jnp.float32(getattr(manager, name).value)
        return self._hparams[key]

    # -- what the trace saw ---------------------------------------------------------------
    def record(self, tag: Tag, value: object, manager: str | None) -> None:
        """Notes a tagged variable for the computation graph (when one is being built)."""
        if self._seen.records is not None:
            self._seen.records.append(Recorded(tag, *shape_and_dtype(value), manager))

    def note_rewrite(self, by: str, tag: Tag, before: object, after: object) -> None:
        """Notes ``by``'s rewrite of ``tag`` (``by``: a manager, or ``nnx.Dropout``)."""
        self._seen.rewrites.append(Rewrite.of(by, tag, before, after))
        self.record(tag, after, by)
        self._seen.note_rewritten_call(by, tag)

    def note_wrap(self, by: str, path: str, application: str, call_id: int) -> None:
        """Notes in the rewrite trace that ``by``'s ``wrap`` ran around an application call."""
        self._seen.rewrites.append(Rewrite.wrap(by, path, application, call_id))

    def rewrote_around(self, by: str) -> bool:
        """Whether ``by`` rewrote a value of an application call in progress around this."""
        return self._seen.rewrote_in(by, ((c.path, c.application, c.call_id)
                                          for c in self._calls))

    def note_held_off(self, path: str, flag: str) -> None:
        """Notes that the Flax layer at ``path`` stays in eval mode in a training trace by a
        flag on the module (``deterministic=True``: ``model.eval()``); the program warns."""
        self._held_off[path] = flag

    def add_cost(self, owner: str, key: str, value: ArrayLike, *,
                 layers: tuple[int, ...] = (), layer: Layer = tuple) -> None:
        """Notes an auxiliary cost of ``owner`` (a manager, or an application's variable),
        once per ``key`` in a trace (a parameter's cost, read by several calls, counts once;
        a layer's in loops over ``layers`` stacked layers: summed). Only optimize keeps costs."""
        if self._keeps(f"the auxiliary cost {key}", layers):
            self._seen.add_cost(owner, key, value, layers, layer)

    def add_measurement(self, key: str, value: ArrayLike, *, layers: tuple[int, ...] = (),
                        layer: Layer = tuple) -> None:
        """Notes a measurement (``call.report``): optimize's metric ``key`` (a layer's: stacked)."""
        if self._keeps(f"the measurement {key}", layers):
            self._seen.add_measurement(key, value, layers, layer)

    def _keeps(self, what: str, layers: tuple[int, ...]) -> bool:
        """Whether optimize keeps this trace's values; raises if ``what`` cannot leave it."""
        if not self.collects_costs:
            return False
        if self._scan_indices:
            raise StateEscapesTransform(
                f"{what} is made inside a loop body (graphmod.scan, nnx.scan, ...), which "
                "cannot return it to optimize. Select what is computed outside loops, or "
                "compute it in the model's function instead")
        if not layers:
            self.check_base_trace(what)
        return True

    def collect(self, tag: Tag, value: object, key: str) -> None:
        """Stores ``value`` as a monitored output if a monitor selects ``tag``."""
        for label, monitor_filter in self.monitor.items():
            if monitor_filter.matches(tag, self.layout.instance_paths):
                self.check_base_trace(f"monitoring {tag.path}",
                                      f"application {tag.application!r} of {tag.brick_path}")
                self._seen.monitored[key if label == "" else f"{label}:{key}"] = value

    # -- graphmod.scan: snapshot, carry, restore ---------------------------------------------
    def snapshot(self) -> LoopSnapshot:
        """What each trace of a loop body starts from (see :meth:`loop_body`)."""
        return LoopSnapshot(dict(self._call_counts), len(self._seen.rewrites),
                            len(self._seen.records) if self._seen.records is not None else 0)

    def carry(self) -> Carry:
        """The state a loop step may change: the model's variables but the parameters,
        and the owned variables."""
        model = {identity: value for identity, value in self._values.items()
                 if not self.layout.by_identity[identity].role.is_a(_roles.PARAMETER)}
        return model, dict(self._owned.values)

    @contextmanager
    def loop_body(self, snapshot: LoopSnapshot, carry: Carry) -> Iterator[None]:
        """Traces one step of a loop: from ``snapshot``'s calls, with ``carry``'s values,
        the step's trace as the base (its side outputs leave through the carry) and its
        own monitored values."""
        self._call_counts.clear()
        self._call_counts.update(snapshot.call_counts)
        del self._seen.rewrites[snapshot.rewrites:]
        if self._seen.records is not None:
            del self._seen.records[snapshot.records:]
        model, owned = carry
        self._values.update(model)
        self._owned.values.update(owned)
        saved, self._seen.monitored = self._seen.monitored, {}
        try:
            with self._scope.moved_here():
                yield
        finally:
            self._seen.monitored = saved

    def carried(self, carry: Carry) -> tuple[Carry, dict[str, object]]:
        """The new values of ``carry``'s entries after a step, and the step's monitored
        values (inside :meth:`loop_body`)."""
        model, owned = carry
        new = ({i: self._values[i] for i in model}, {k: self._owned.values[k] for k in owned})
        return new, self._seen.monitored

    def after_loop(self, carry: Carry, monitored: dict[str, object], *,
                   owned_written: bool) -> None:
        """Takes a loop's final carry and its stacked monitored values; the owned variables
        count as written if ``owned_written`` (at ``init`` they are the values from before
        the loop)."""
        model, owned = carry
        self._values.update(model)
        self._updated.update(model)
        self._owned.carried(owned, updated=owned_written)
        self._seen.monitored.update(monitored)

    @contextmanager
    def loop_step(self, index: jax.Array) -> Iterator[None]:
        """Folds a loop's step ``index`` into every draw of the block (see :meth:`rng`).

        Each step rewrites parameters anew: without ``jit`` (``jax.disable_jit``) every
        step runs in one trace, and a cached rewrite would repeat step 0's draw."""
        self._scan_indices.append(index)
        saved, self._parameter_cache = self._parameter_cache, {}
        try:
            yield
        finally:
            self._scan_indices.pop()
            self._parameter_cache = saved
