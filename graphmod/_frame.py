"""The frame: what one outer trace of a program knows and collects.

A frame is created by a program for each outer trace (``init``, ``train``, ``infer``,
``graph``) and is current while the model function runs. It maps variable identities to the
program's values, holds the stack of application calls in progress, the manager-owned
variables and hyperparameters, and collects the rewrite trace, tagged variables (for the
computation graph) and monitored values.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import jax
import jax.extend
import jax.numpy as jnp

from graphmod import roles as _roles
from graphmod._filter import Tag, VariableFilter
from graphmod._loop_keys import mark, read_slice, stacked, write_slice
from graphmod._manager import Manager
from graphmod._rewrites import Rewrite, describe
from graphmod._variables import identity_of

if TYPE_CHECKING:
    from graphmod._application import ApplicationCall
    from graphmod._layout import Layout

# (manager name, brick path, application, call_id or None, variable name)
OwnedKey = tuple[str, str, str, int | None, str]


def current_trace() -> Any:
    """An opaque token of the JAX trace in progress (equal tokens: same trace)."""
    return jax.extend.core.get_opaque_trace_state(convention="nnx")


def crc32(text: str) -> int:
    """A stable 31-bit hash of ``text`` (Python's ``hash`` is salted per process)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A tagged variable seen in a trace: before a rewrite (``manager`` None) or after."""

    tag: Tag
    shape: tuple[int, ...]
    dtype: str
    manager: str | None


class Frame:
    """Per-trace state of a program (see the module docstring)."""

    def __init__(
        self,
        *,
        layout: Layout,
        mode: str,
        values: dict[str, Any],
        owned: dict[OwnedKey, Any],
        hparams: dict[tuple[str, str], Any],
        managers: tuple[Manager, ...],
        key: Any = None,
        axis_name: Any = None,
        monitor: dict[str, VariableFilter] | None = None,
        record: bool = False,
    ) -> None:
        self.layout = layout
        self.mode = mode
        self.training = mode != "infer"
        self.values = dict(values)
        self.updated: set[str] = set()
        self.owned = dict(owned)
        self.owned_roles: dict[OwnedKey, _roles.Role] = {}
        self.owned_updated: set[OwnedKey] = set()
        # Owned variables met in inner traces (loop bodies): the shape of one iteration's
        # slice, the slice each trace wrote last, the keys created or written there.
        self.owned_slices: dict[OwnedKey, tuple[int, ...]] = {}
        # (keys in owned_pending: created or written in a loop body, stacked at the end)
        self.owned_pending: dict[OwnedKey, tuple[Any, Any]] = {}
        self.owned_shared: set[OwnedKey] = set()  # met in bodies that broadcast the module
        self.hparams = dict(hparams)
        self.managers = managers
        self.key = key
        self.axis_name = axis_name
        self.monitor = monitor or {}
        self.monitored: dict[str, Any] = {}
        self.records: list[Recorded] | None = [] if record else None
        self.rewrites: list[Rewrite] = []
        self.matches: collections.Counter[int] = collections.Counter()
        self.seen_managers: dict[int, Manager] = {id(m): m for m in managers}
        self.calls: list[ApplicationCall] = []
        self.local_managers: list[Manager] = []
        self.call_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.parameter_cache: dict[tuple[Any, ...], list[tuple[Any, Any]]] = {}
        self.scan_indices: list[Any] = []
        self.base_trace = current_trace()
        self.exclusive: dict[tuple[Any, ...], str] = {}
        self.out: Any = None

    # -- model variables -----------------------------------------------------------------
    def holds(self, variable: Any) -> bool:
        """Whether ``variable`` is one of the program's model variables (the model's own
        object, not a copy made by an NNX lifted transform)."""
        identity = identity_of(variable)
        return identity in self.values and self.layout.objects.get(identity) is variable

    def carries(self, variable: Any) -> bool:
        """Whether the program threads ``variable``'s writes through (every one but the
        parameters, which a forward pass never writes: NNX transforms only echo them)."""
        return not self.layout.by_identity[identity_of(variable)].role.is_a(_roles.PARAMETER)

    def stored(self, variable: Any) -> Any:
        """The program's current value of ``variable``, without rewrites."""
        return self.values[identity_of(variable)]

    def read(self, variable: Any) -> tuple[bool, Any]:
        """``(True, value)`` as the innermost application call sees it, else ``(False, None)``.

        A copy of a model variable made by an NNX lifted transform reads its own value (the
        transform's: a layer's slice inside ``nnx.scan``), rewritten like the original's.
        """
        identity = identity_of(variable)
        if identity not in self.values:
            return False, None
        base = self.values[identity] if self.holds(variable) else variable.get_raw_value()
        if self.calls and self.calls[-1].path is not None:
            return True, self.calls[-1].read_parameter(self.layout.by_identity[identity], base)
        return True, base

    def write(self, variable: Any, value: Any) -> None:
        identity = identity_of(variable)
        self.check_base_trace(f"writing {self.layout.by_identity[identity].path}")
        self.values[identity] = value
        self.updated.add(identity)

    def check_base_trace(self, what: str, where: str | None = None) -> None:
        """Raises if a side output would be created under a raw JAX transform."""
        if current_trace() != self.base_trace:
            if where is None and self.calls:
                where = f"application {self.calls[-1].application!r} of {self.calls[-1].path}"
            where = f" in {where}" if where else ""
            raise RuntimeError(
                f"{what}{where} happens inside a raw JAX transform or an NNX lifted transform "
                "(jax.jit, lax.scan, jax.checkpoint, nnx.scan, nnx.vmap, nnx.remat, nnx.RNN...):"
                " the value could not leave it. Use graphmod.scan for recurrences and loops "
                "over layers, or return the value through the transform."
            )

    # -- application calls ----------------------------------------------------------------
    def next_call_id(self, path: str, application: str) -> int:
        key = (path, application)
        call_id = self.call_counts[key]
        self.call_counts[key] += 1
        return call_id

    @contextmanager
    def calling(self, call: ApplicationCall) -> Iterator[None]:
        self.calls.append(call)
        try:
            yield
        finally:
            popped = self.calls.pop()
            assert popped is call, "application stack corrupted"

    @contextmanager
    def using(self, managers: tuple[Manager, ...]) -> Iterator[None]:
        """Managers given with ``use_manager=`` for one call and its children."""
        active = {m.name: m for m in self.chain()}
        for m in managers:
            if not isinstance(m, Manager):
                raise TypeError(f"use_manager: {m!r} is not a graphmod.Manager")
            if m.name in active and active[m.name] is not m:
                raise ValueError(f"use_manager: a manager named {m.name!r} is already active; "
                                 "pass manager_name=... to one of them")
            self.layout.resolve(m.filter.brick_instances(), f"use_manager {m.name!r}")
            self.seen_managers.setdefault(id(m), m)
        self.local_managers.extend(managers)
        try:
            yield
        finally:
            del self.local_managers[len(self.local_managers) - len(managers):]

    def chain(self) -> list[Manager]:
        """Every manager active now, outermost first (stable by priority)."""
        active = [*self.managers, *self.local_managers]
        return sorted(active, key=lambda m: -m.priority)

    # -- randomness -----------------------------------------------------------------------
    def rng(self, parts: tuple[str, ...], call_id: int, *, per_step: bool = True) -> Any:
        """The key of a draw: the step key folded with CRC32 of ``parts`` and the call id,
        then (``per_step``) with ``graphmod.scan``'s step indices, then with the device
        index under ``axis_name``. Inside a loop body that JAX traces once (``nnx.scan``,
        ``nnx.fori_loop``, ``lax.scan``, ...; ``per_step``), finally with the position of
        every such loop around it, outermost first: layer ``i`` of a scan over layers draws
        from ``fold_in(key, i)`` (see ``graphmod._loop_keys``)."""
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
        # One fold for everything known at trace time (call ids are Python ints).
        key = jax.random.fold_in(self.key, crc32("|".join(parts) + f"#{call_id}"))
        for index in self.scan_indices if per_step else ():
            key = jax.random.fold_in(key, index)
        if self.axis_name is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(self.axis_name))
        if per_step and current_trace() != self.base_trace:
            key = mark(key)  # maybe a loop body: resolved by the program's trace
        return key

    # -- manager-owned variables and hyperparameters -----------------------------------------
    def owned_value(self, key: OwnedKey, init: Any, role: _roles.Role,
                    parameter: Any = None, per_iteration: bool = True) -> None:
        """Makes sure owned variable ``key`` exists: created at ``init`` from ``init`` (an
        array, a callable of nothing: shapes only, or given the parameter's value, of it).

        First met inside a loop body that slices its application's parameters (a scan over
        layers: ``per_iteration``), it is one variable per iteration: stored stacked, the
        loops' lengths as leading axes (see :meth:`read_owned`). In a body that sees the
        whole module (a cell broadcast over time steps) it is one variable, shared by every
        iteration, which the body cannot update."""
        inner = current_trace() != self.base_trace
        if inner and not per_iteration:
            self.owned_shared.add(key)
        if key not in self.owned:
            manager, path, application, call_id, name = key
            if self.mode != "init":
                raise KeyError(
                    f"manager {manager!r} has no variable {name!r} for {application!r} of "
                    f"{path}" + (f" (call {call_id})" if call_id is not None else "")
                    + " in these variables: make them with this program's init (or a program "
                    "compiled over the same model and managers)"
                )
            if parameter is not None:
                # From the parameter's value: traced by init's own jit, never in an inner
                # trace whose values could not leave it.
                self.check_base_trace(f"manager {manager!r} creating {name!r} from "
                                      f"parameter {path}.{application}")
                value = jnp.asarray(init(parameter))
            elif not inner:
                # Traced by init's own jit: no eager dispatch per variable.
                value = jnp.asarray(init() if callable(init) else init)
            else:
                # From shapes only: computed eagerly, so a variable first met inside an
                # inner trace (jax.jit, a scan body) does not leak a tracer; stacked over
                # the loops around it at the end of init's trace.
                with jax.ensure_compile_time_eval():
                    value = jnp.asarray(init() if callable(init) else init)
                if isinstance(value, jax.core.Tracer):
                    raise ValueError(
                        f"manager {manager!r}: the initial value of {name!r} at {path} "
                        "depends on traced values; build it from shapes only (e.g. "
                        "jnp.zeros(n)) or, in a rewrite_parameter hook, from the parameter "
                        "(init=lambda w: ...)"
                    )
                if per_iteration:
                    self._write_slice(key, value)
            self.owned[key] = value
            self.owned_roles[key] = role
        elif self.mode == "init" and key in self.owned_pending and inner and (
                self.owned_pending[key][0] != current_trace()):
            self._write_slice(key, self.owned[key])  # JAX may trace a body twice
        elif inner and key not in self.owned_slices:
            self.owned_slices[key] = tuple(
                jax.eval_shape(init, parameter).shape if parameter is not None
                else jax.eval_shape(init).shape if callable(init) else jnp.shape(init))

    def _depth(self, key: OwnedKey) -> int:
        """How many loops ``key`` is stacked over (0 outside loops, or not stacked)."""
        stored = jnp.shape(self.owned[key])
        shape = self.owned_slices.get(key, stored)
        return len(stored) - len(shape) if stored[len(stored) - len(shape):] == shape else 0

    def read_owned(self, key: OwnedKey) -> Any:
        """Owned variable ``key`` as the current trace sees it: in a loop body the
        iteration's slice (its last write in this trace, else the stored stack's slice)."""
        if current_trace() == self.base_trace:
            if key in self.owned_pending and self.mode != "init":
                raise RuntimeError(
                    f"{key[0]} variable {key[4]!r} of application {key[2]!r} of {key[1]} is "
                    "read outside the loop body that updated it in this step")
            return self.owned[key]
        pending = self.owned_pending.get(key)
        if pending is not None and pending[0] == current_trace():
            return pending[1]
        depth = self._depth(key)
        return read_slice(self.owned[key], depth, key) if depth else self.owned[key]

    def set_owned(self, key: OwnedKey, value: Any) -> None:
        old = self.owned[key]
        inner = current_trace() != self.base_trace
        if inner and key in self.owned_shared:
            self.check_base_trace(f"updating {key[0]} variable {key[4]!r}, shared by every "
                                  "iteration of a loop over one module",
                                  f"application {key[2]!r} of {key[1]}")
        shape = old.shape[self._depth(key):] if inner else old.shape
        if jnp.shape(value) != shape:
            raise ValueError(
                f"manager {key[0]!r}: new value of {key[4]!r} at {key[1]} has shape "
                f"{jnp.shape(value)}, expected {shape}"
            )
        value = jnp.asarray(value, old.dtype)
        if inner:
            self._write_slice(key, value)
        else:
            self.owned[key] = value
        self.owned_updated.add(key)

    def _write_slice(self, key: OwnedKey, value: Any) -> None:
        write_slice(value, key)
        self.owned_pending[key] = (current_trace(), value)

    def owned_out(self) -> dict[OwnedKey, Any]:
        """The owned variables at the end of the trace: those created or updated in loop
        bodies as the stack of every iteration's slice."""
        fresh = self.mode == "init"
        return {key: stacked(value, key, fresh=fresh) if key in self.owned_pending else value
                for key, value in self.owned.items()}

    def hparam(self, manager: Manager, name: str) -> Any:
        key = (manager.name, name)
        if key not in self.hparams:
            if self.mode != "init":
                raise KeyError(
                    f"variables hold no hyperparameter {manager.name}.{name}: make them "
                    "with this program's init"
                )
            self.hparams[key] = jnp.float32(getattr(manager, name).value)
        return self.hparams[key]

    # -- what the trace saw ---------------------------------------------------------------
    def record(self, tag: Tag, value: Any, manager: str | None) -> None:
        """Notes a tagged variable for the computation graph (when one is being built)."""
        if self.records is not None:
            self.records.append(Recorded(tag, *describe(value), manager))

    def collect(self, tag: Tag, value: Any, key: str) -> None:
        """Stores ``value`` as a monitored output if a monitor selects ``tag``."""
        for label, monitor_filter in self.monitor.items():
            if monitor_filter.matches(tag, self.layout.instance_paths):
                self.check_base_trace(f"monitoring {tag.path}",
                                      f"application {tag.application!r} of {tag.brick_path}")
                self.monitored[key if label == "" else f"{label}:{key}"] = value
