"""``Anneal``: sets a dynamic manager hyperparameter from the loop's time, without retracing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, Self, TypeGuard, runtime_checkable

import numpy as np

from graphmod._core._managers._manager import HParam
from graphmod._train._events import Event, On, Template, Time
from graphmod._train._loop._models import model_state, with_model_state
from graphmod._train._plugin import Plugin
from graphmod.plugins._common import loop_time, template_or
from graphmod.typing import ArrayLike, LoopLike, PyTree, Variables

HParamValue = ArrayLike
"""A hyperparameter's value as ``fn(time)`` returns it: a Python or NumPy number (checked
against the valid range), or a ``jax.Array`` (written unchecked)."""


class Anneal(Plugin):
    """Sets ``hparam`` to ``fn(time)`` on every due event, and before the first step.

    ``hparam`` is the handle of a *dynamic* manager hyperparameter
    (``managers.Dropout(gm.dynamic(0.5), ...).hparam("rate")``), a float32 scalar in the
    train state's variables; the new value goes in through ``loop.update_state``, cast to
    the stored dtype, so the compiled step never retraces. The value set on an event is
    the one the following steps use; a value equal to the one last written (a Python or
    NumPy number) is not written again, so an epoch-wise schedule costs one write per
    epoch, not one per step. With ``steps_per_call=k`` a plain ``On("step")`` sees one
    event per fused dispatch, so the value changes every k steps. A value outside the
    hyperparameter's valid range (a manager's ``hparam_ranges``: a dropout rate in [0, 1])
    is refused before it is written, naming the manager, the hyperparameter, the value and
    the range; a ``jax.Array`` value is written unchecked (reading it would wait for the
    device).

    Args:
        hparam: a :class:`graphmod.HParam`, from ``manager.hparam(name)``.
        fn: ``fn(time) -> value``, ``time`` a :class:`graphmod.Time` (``.step``, ``.epoch``,
            ``.examples``, ...).
        every: the events on which the value is set (default: every step event).
        name: the plugin's name (default: ``anneal_<manager>_<hyperparameter>``).
        model: in a loop over several models, the one whose program holds ``hparam``.

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm, managers
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import Anneal
        >>> mlp = gm.bricks.MLP([2, 8, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> dropout = managers.Dropout(gm.dynamic(0.5), bricks=mlp.linear_layers[1:],
        ...                            roles=[gm.roles.INPUT])
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), mlp,
        ...                      managers=[dropout])
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> rate = dropout.hparam("rate")
        >>> anneal = Anneal(rate, lambda t: 0.5 * (1 - t.step / 8))
        >>> state = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=2,
        ...                 plugins=[anneal]).run(state)
        >>> float(rate.get(state.variables))
        0.0
    """

    def __init__(self, hparam: HParam, fn: Callable[[Time], HParamValue | None], *,
                 every: Template | str | None = None, name: str | None = None,
                 model: str | None = None) -> None:
        if not isinstance(hparam, HParam):
            raise TypeError(f"Anneal(hparam): expected a graphmod.HParam from "
                            f"manager.hparam(name), got {hparam!r}")
        if not callable(fn):
            raise TypeError(f"Anneal(hparam, fn): fn must be callable as fn(time), got {fn!r}")
        super().__init__(name=name or f"anneal_{hparam.manager}_{hparam.name}",
                         every=template_or(every, On("step"), "Anneal"))
        self.hparam = hparam
        self.fn = fn
        self.model = model
        self.value: HParamValue | None = None

    def setup(self, loop: LoopLike) -> None:
        # A fresh run's first step uses fn(start). A resumed run keeps the value its
        # checkpoint holds: recomputing it from the restored time would differ from the
        # uninterrupted run (which last set it at a step event).
        self.value = None  # this run's state may hold another value: write the first one
        model_state(loop, loop.state, self.model, "Anneal")  # a model named, if need be
        if loop.time.step == 0:
            self.set(loop, loop_time(loop))

    def __call__(self, event: Event) -> None:
        self.set(event.loop, event.time)

    def set(self, loop: LoopLike, time: Time) -> None:
        """Writes ``fn(time)`` into the loop's train state."""
        value = self.fn(time)
        if value is None:
            raise ValueError(f"{self.name}: fn({time}) returned None; it must return the "
                             f"value of {self.hparam.manager}.{self.hparam.name}")
        if _host_number(value) and _host_number(self.value) and value == self.value:
            return  # the state holds it already
        self._check_range(value, time)

        def write(state: PyTree) -> PyTree:
            own = model_state(loop, state, self.model, "Anneal")
            new = _with_variables(own, self.hparam.set(_variables(own, self.name), value))
            return with_model_state(loop, state, self.model, new)

        loop.update_state(write)
        self.value = value


    def _check_range(self, value: HParamValue, time: Time) -> None:
        """Raises if the host number ``value`` lies outside the hyperparameter's range."""
        valid = self.hparam.valid
        if valid is None or not _host_number(value) or valid[0] <= value <= valid[1]:
            return
        low, high = valid
        raise ValueError(
            f"{self.name}: fn({time}) returned {value!r}, outside the valid range [{low}, "
            f"{high}] of hyperparameter {self.hparam.name!r} of manager "
            f"{self.hparam.manager!r}; make fn return values in [{low}, {high}] (e.g. clip "
            f"them: min(max(value, {low}), {high}))")


def _host_number(value: object) -> TypeGuard[int | float | np.number]:
    # Comparing these never waits for the device (a jax.Array would).
    return isinstance(value, int | float | np.number) and not isinstance(value, bool)


@runtime_checkable
class _Replaces(Protocol):
    """A NamedTuple state (a graphmod.TrainState): a copy with fields replaced."""

    def _replace(self, **fields: object) -> Self: ...


def _variables(state: PyTree, who: str) -> Variables:
    variables = getattr(state, "variables", state)
    if not isinstance(variables, dict) or "managers" not in variables:
        raise TypeError(f"{who}: the loop's train state has no program variables (expected "
                        f"a graphmod.TrainState with .variables, got {type(state).__name__})")
    return variables


def _with_variables(state: PyTree, variables: Variables) -> PyTree:
    if isinstance(state, _Replaces):  # graphmod.TrainState and other NamedTuples
        return state._replace(variables=variables)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return dataclasses.replace(state, variables=variables)
    return variables  # the state is the variables themselves
