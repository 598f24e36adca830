"""What one trace collects beside its result (:class:`Collected`: updated variables,
monitored values, costs, new manager variables) and the snapshot a ``graphmod.scan`` body
starts from."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import jax.numpy as jnp

from graphmod._core._loops._loop_keys import Layer, stacked, write_slice
from graphmod._core._selection._filter import Tag
from graphmod._core._tracing._rewrites import Rewrite
from graphmod.typing import ArrayLike

__all__ = ["Collected", "LoopSnapshot", "Recorded"]


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A tagged variable seen in a trace: before a rewrite (``manager`` None) or after."""

    tag: Tag
    shape: tuple[int, ...]
    dtype: str
    manager: str | None


@dataclasses.dataclass(frozen=True)
class LoopSnapshot:
    """What a ``graphmod.scan`` body restores before each trace of it (JAX may trace a body
    twice: its calls are counted and recorded once)."""

    call_counts: dict[tuple[str, str], int]
    rewrites: int
    records: int


@dataclasses.dataclass
class Collected:
    """What a trace collects beside its result (``records`` None: no graph is built)."""

    records: list[Recorded] | None
    monitored: dict[str, object] = dataclasses.field(default_factory=dict)
    # auxiliary costs (COST auxiliary variables) by owner, then by key: optimize adds them
    costs: dict[str, dict[str, ArrayLike]] = dataclasses.field(default_factory=dict)
    # ("cost", owner, key) or ("measured", key) -> the loops' lengths, for a cost or
    # measurement made in loops over stacked layers (one layer's value)
    layered: dict[tuple[str, ...], tuple[int, ...]] = dataclasses.field(default_factory=dict)
    measured: dict[str, ArrayLike] = dataclasses.field(default_factory=dict)  # call.report()
    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)
    matches: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    # manager name -> the (brick path, application, call id, variable path) it matched and
    # left as they were (a read, or inference); a set, as JAX may trace a loop body twice
    unchanged: dict[str, set[tuple[str, str, int, str]]] = dataclasses.field(
        default_factory=dict)
    # (brick path, application, call id, variable path) -> the manager rewriting it alone
    exclusive: dict[tuple[str, str, int, str], str] = dataclasses.field(default_factory=dict)
    # manager -> the (brick path, application, call id) of the calls it rewrote a value of
    rewritten_calls: dict[str, set[tuple[str, str, int]]] = dataclasses.field(
        default_factory=dict)

    def add_cost(self, owner: str, key: str, value: ArrayLike, layers: tuple[int, ...],
                 layer: Layer = tuple) -> None:
        """Notes an auxiliary cost; in loops over ``layers`` stacked layers (or an
        ensemble's members) one layer's (see :meth:`costs_out`)."""
        self.costs.setdefault(owner, {})[key] = value
        self._by_layer(("cost", owner, key), value, layers, layer)

    def add_measurement(self, key: str, value: ArrayLike, layers: tuple[int, ...],
                        layer: Layer = tuple) -> None:
        """Notes a measurement; in loops over ``layers`` stacked layers (or an ensemble's
        members) one layer's (see :meth:`measured_out`)."""
        self.measured[key] = value
        self._by_layer(("measured", key), value, layers, layer)

    def costs_out(self) -> dict[str, dict[str, ArrayLike]]:
        """The costs, each made in loops over stacked layers summed over the layers."""
        return {owner: {key: self._stack(("cost", owner, key), value, total=True)
                        for key, value in by_key.items()}
                for owner, by_key in self.costs.items()}

    def measured_out(self) -> dict[str, ArrayLike]:
        """The measurements, each made in loops over stacked layers stacked: one per layer."""
        return {key: self._stack(("measured", key), value, total=False)
                for key, value in self.measured.items()}

    def _by_layer(self, name: tuple[str, ...], value: ArrayLike, layers: tuple[int, ...],
                  layer: Layer) -> None:
        """A layer's value leaves its loops as a slice (``graphmod._core._loops._loop_keys``)."""
        if layers:  # a value of a loop body: a tracer already (asarray leaves it as it is)
            write_slice(jnp.asarray(value), name, len(layers), layer())
            self.layered[name] = layers

    def _stack(self, name: tuple[str, ...], value: ArrayLike, *, total: bool
               ) -> ArrayLike:
        layers = self.layered.get(name)
        if layers is None:
            return value
        zeros = jnp.zeros((*layers, *jnp.shape(value)), jnp.result_type(value))
        stack = stacked(zeros, name, fresh=False)
        return stack.sum() if total else stack

    def note_match(self, manager_id: int, by: str, left: Tag | None) -> None:
        """Counts a match of manager ``by``; ``left``: a variable it left as it was."""
        self.matches[manager_id] += 1
        if left is not None:
            self.unchanged.setdefault(by, set()).add(
                (left.brick_path, left.application, left.call_id, left.path))

    def note_rewritten_call(self, by: str, tag: Tag) -> None:
        """Notes that ``by`` rewrote a value of the call ``tag`` belongs to."""
        self.rewritten_calls.setdefault(by, set()).add(
            (tag.brick_path, tag.application, tag.call_id))

    def rewrote_in(self, by: str, calls: Iterable[tuple[str, str, int]]) -> bool:
        """Whether ``by`` rewrote a value of one of ``calls`` (brick path, application,
        call id)."""
        done = self.rewritten_calls.get(by, ())
        return any(call in done for call in calls)
