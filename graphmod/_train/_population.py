"""Populations: N members of one model trained as one vmapped, jitted, donating train step.

``population(step, members=N)`` turns a :func:`graphmod.optimize` step into a
:class:`PopulationStep` over a *stacked* :class:`TrainState` (every leaf with a leading axis
of N members). One call runs ``jax.vmap`` of the member step's traced function over the
members, on one batch that every member shares; each member draws its own randomness from
its own key (``state.rng[i]``), so member ``i`` computes what a separate run of ``step``
seeded with that key computes (up to float rounding in the batched matrix products).

Per-member hyperparameters
    A *dynamic* hyperparameter lives in the train state, so a population holds one value
    per member, as an ``(N,)`` array, and new values never retrace the step:

    - a manager's (``managers.Dropout(gm.dynamic(0.5), ...).hparam("rate")``: an
      :class:`graphmod.HParam`, stored at ``variables["managers"][manager]["hparams"]``);
    - an optimizer's, made dynamic with ``optax.inject_hyperparams``
      (``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``), named by a string
      (``"learning_rate"``), stored at ``opt_state.hyperparams[name]``. A scheduled one
      (a schedule passed to ``inject_hyperparams``) is recomputed at every step and is
      refused.

    :meth:`PopulationStep.get` reads one, :meth:`PopulationStep.set` writes it (checked
    against the manager's ``hparam_ranges``; a learning rate must not be negative),
    ``init(..., hparams={...})`` sets them at the start.

Sharp edges
    The batch is shared: per-member batches and programs on a mesh are not supported.
    ``Validation`` evaluates one model: evaluate a population with
    :class:`graphmod.plugins.PopulationValidation` (metrics of shape ``(N,)``).
    ``EarlyStopping`` refuses a metric of shape ``(N,)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from graphmod._core._bricks._construction import key_record
from graphmod._core._managers._manager import HParam
from graphmod._core._naming import did_you_mean
from graphmod._core._program._arguments import as_key
from graphmod._train._batch import step_arguments
from graphmod._train._optimize import TrainStep
from graphmod._train._train_state import TrainState
from graphmod.typing import ArrayLike, KeyLike, Metrics, PyTree, Variables

Hyperparameter = HParam | str
"""A manager's dynamic hyperparameter (``manager.hparam("rate")``), or the name of an
optimizer hyperparameter made dynamic by ``optax.inject_hyperparams`` (``"learning_rate"``)."""

Values: TypeAlias = ArrayLike | Sequence[float]
"""A hyperparameter's values: one per member, or one number for every member."""

_Tree = TypeVar("_Tree")

# Valid ranges of optimizer hyperparameters known by name (a manager's come with its HParam).
_OPTIMIZER_RANGES: dict[str, tuple[float, float]] = {"learning_rate": (0.0, math.inf)}

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
_Injected: TypeAlias = optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState


def _is_injected(node: object) -> bool:
    return isinstance(node, _INJECTED)


class PopulationStep(TrainStep):
    """``step(state, *batch) -> (state, metrics)`` over a population's stacked train state:
    one ``jax.vmap`` of the member step over the members, jitted, donating ``state``.

    Made by :func:`graphmod.population`. Every leaf of the state and of the metrics has a
    leading axis of :attr:`members`; the batch is shared. It is a :class:`TrainStep` (the
    member step's program, optimizer and provenance), so a ``Loop``, its ``Checkpoint``
    and ``Loop.resume`` take it as they take one model's step; ``steps_per_call=k`` fuses
    steps as for one model. The hyperparameters that may differ between members (a
    manager's dynamic ones, an optimizer's made dynamic with ``optax.inject_hyperparams``)
    are read and written with :meth:`get` and :meth:`set`; the loop guide's "Populations"
    section says more.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
        ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> pop = gm.population(gm.optimize(program, tx), members=3)
        >>> state = pop.init(program.init(jnp.ones((1, 2))), jax.random.split(
        ...     jax.random.key(0), 3), hparams={"learning_rate": [0.0, 0.1, 0.2]})
        >>> before = pop.member(state, 0).variables["model"]["W"]
        >>> state, metrics = pop(state, jnp.ones((4, 2)))
        >>> metrics["loss"].shape, state.variables["model"]["W"].shape
        ((3,), (3, 2, 1))
        >>> bool((pop.member(state, 0).variables["model"]["W"] == before).all())  # lr 0
        True
    """

    def __init__(self, step: TrainStep, members: int) -> None:
        if not isinstance(step, TrainStep) or isinstance(step, PopulationStep):
            raise TypeError(f"population(step, members): step must be one model's train step "
                            f"from graphmod.optimize, got {type(step).__name__}")
        if isinstance(members, bool) or not isinstance(members, int | np.integer) \
                or members < 1:
            raise ValueError(f"population(step, members={members!r}): members must be a "
                             "positive int, the number of models trained side by side")
        if step.program.placement is not None:
            raise ValueError("population(step, ...): the step's program is compiled on a mesh; "
                             "a population runs on one device for now (compile without mesh=)")
        # The member step's settings (program, optimizer, record), shared, not rebuilt: the
        # training record of a population is its member step's, with one key per member.
        vars(self).update(vars(step))
        self.base = step
        self.members = int(members)
        self._step = jax.jit(self._population_step, donate_argnums=0)
        self._steps = jax.jit(self._population_steps, donate_argnums=0)
        self._gather = jax.jit(_gathered)

    def __repr__(self) -> str:
        return (f"PopulationStep: {self.members} members in one vmapped step\n  "
                + repr(self.base).replace("\n", "\n  "))

    # -- the traced functions -------------------------------------------------------------------
    def _population_step(self, state: TrainState, *batch: object, **kwargs: object
                         ) -> tuple[TrainState, Metrics]:
        self._check_stacked(state, "population step")
        return self._vmapped(state, batch, kwargs)

    def _population_steps(self, state: TrainState, batches: object
                          ) -> tuple[TrainState, Metrics]:
        self._check_stacked(state, "population step.steps")
        return jax.lax.scan(lambda s, batch: self._vmapped(s, *step_arguments(batch)),
                            state, batches)

    def _vmapped(self, state: TrainState, batch: tuple[object, ...], kwargs: dict[str, object]
                 ) -> tuple[TrainState, Metrics]:
        """The member step over every member, the batch shared (not mapped)."""
        return jax.vmap(lambda member: self.base._traced(member, batch, kwargs))(state)

    def _check_stacked(self, state: object, who: str) -> None:
        """Refuses (at trace time) a state whose leaves are not stacked over the members."""
        if not isinstance(state, TrainState):
            raise TypeError(f"{who}: expected a stacked graphmod.TrainState (from "
                            f"population.init or population.stack), got {type(state).__name__}")
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != self.members:
                raise ValueError(
                    f"{who}: state{jax.tree_util.keystr(path)} has shape {np.shape(leaf)}, "
                    f"not a leading axis of {self.members} members; make the state with "
                    "population.init(variables, keys) or population.stack(states)")

    # -- states ---------------------------------------------------------------------------------
    def init(self, variables: Variables | Sequence[Variables] | Callable[[jax.Array], Variables],
             rng: KeyLike | Sequence[KeyLike], *,
             hparams: Mapping[Hyperparameter, Values] | None = None) -> TrainState:
        """The first stacked train state: member ``i`` is ``step.init(variables_i, keys[i])``.

        Args:
            variables: one variables dict (every member starts from a copy), a list of one
                per member, or a function of a member's key returning its variables.
            rng: one key per member: a key array of shape ``(members,)``
                (``jax.random.split(key, members)``) or a list of keys.
            hparams: per-member values of dynamic hyperparameters, ``{hparam or name:
                (members,) values}``, e.g. ``{"learning_rate": [1e-3, 3e-3],
                dropout.hparam("rate"): [0.1, 0.3]}``.

        Members whose variables differ in tree or shapes are refused, naming the first
        differing path and both shapes, before any state is made.

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> pop = gm.population(gm.optimize(program, optax.sgd(0.1)), members=2)
            >>> variables = program.init(jnp.ones((1, 2)))
            >>> state = pop.init([variables, variables], jax.random.split(jax.random.key(0), 2))
            >>> state.variables["model"]["W"].shape, state.step.tolist()
            ((2, 2, 1), [0, 0])
        """
        keys = self._keys(rng)
        if callable(variables):
            chosen = [variables(key) for key in keys]
        elif isinstance(variables, Mapping):
            chosen = [variables] * self.members
        elif isinstance(variables, Sequence) and not isinstance(variables, str):
            chosen = list(variables)
            if len(chosen) != self.members:
                raise ValueError(f"population.init(variables): {len(chosen)} variables dicts "
                                 f"for {self.members} members; pass one per member, or one "
                                 "dict that every member starts from")
        else:
            raise TypeError(f"population.init(variables): expected a variables dict, a list of "
                            f"them or a function of a key, got {type(variables).__name__}")
        _check_same_shapes([("variables", v) for v in chosen], "population.init")
        for member in chosen:  # named errors before any copy is made
            self.program._unpack(member)
        states = [self.base.init(v, key) for v, key in zip(chosen, keys, strict=True)]
        state = _stack(states)
        self.train_seed = key_record(state.rng)  # every member's key, for the record
        for hparam, values in (hparams or {}).items():
            state = self.set(state, hparam, values)
        return state

    def _keys(self, rng: KeyLike | Sequence[KeyLike]) -> list[jax.Array]:
        """``rng`` as one typed key per member, else an error naming the fix."""
        if isinstance(rng, Sequence) and not isinstance(rng, str):
            keys = [as_key(k, f"population.init(variables, rng[{i}])") for i, k in enumerate(rng)]
        else:
            array = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
            typed = jnp.issubdtype(array.dtype, jax.dtypes.prng_key)
            if typed and array.ndim == 1:
                keys = list(array)
            elif not typed and array.dtype == jnp.uint32 and array.ndim == 2:
                keys = [jax.random.wrap_key_data(k) for k in array]
            else:
                keys = []
        if len(keys) != self.members:
            raise ValueError(
                f"population.init(variables, rng): needs one key per member ({self.members}), "
                f"got {_key_count(rng)}; pass jax.random.split(jax.random.key(seed), "
                f"{self.members})")
        return keys

    def stack(self, states: Sequence[TrainState]) -> TrainState:
        """One stacked state of ``members`` separate train states (e.g. of the member step),
        copied into new buffers. States whose trees or shapes differ are refused, naming
        the first differing path and both shapes.

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> step = gm.optimize(program, optax.sgd(0.1))
            >>> variables = program.init(jnp.ones((1, 2)))
            >>> states = [step.init(variables, jax.random.key(i)) for i in range(2)]
            >>> pop = gm.population(step, members=2)
            >>> pop.stack(states).rng.shape
            (2, 2)
        """
        states = list(states)
        if len(states) != self.members:
            raise ValueError(f"population.stack(states): {len(states)} states for "
                             f"{self.members} members")
        for i, state in enumerate(states):
            if not isinstance(state, TrainState):
                raise TypeError(f"population.stack(states): states[{i}] is a "
                                f"{type(state).__name__}, not a graphmod.TrainState")
        _check_same_shapes([("state", s) for s in states], "population.stack")
        stacked = _stack(states)
        self.train_seed = key_record(stacked.rng)
        return stacked

    def member(self, state: TrainState, index: int) -> TrainState:
        """Member ``index``'s own train state (a copy), as the member step takes it.

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> pop = gm.population(gm.optimize(program, optax.sgd(0.1)), members=2)
            >>> state = pop.init(program.init(jnp.ones((1, 2))),
            ...                  jax.random.split(jax.random.key(0), 2))
            >>> pop.member(state, 1).variables["model"]["W"].shape
            (2, 1)
        """
        if isinstance(index, bool) or not isinstance(index, int | np.integer) \
                or not -self.members <= index < self.members:
            raise IndexError(f"population.member(state, {index!r}): a member index in "
                             f"[0, {self.members})")
        return jax.tree.map(lambda leaf: jnp.array(leaf[index], copy=True), state)

    def copy(self, state: TrainState, sources: Sequence[int] | np.ndarray) -> TrainState:
        """``state`` where member ``i`` holds member ``sources[i]``'s variables and optimizer
        state (exact copies: one jitted gather on the device); each member keeps its own
        key, step count and skipped count. ``sources = range(members)`` changes nothing.

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> pop = gm.population(gm.optimize(program, optax.sgd(0.1)), members=2)
            >>> state = pop.init(lambda key: program.init(jnp.ones((1, 2)), rng=key),
            ...                  jax.random.split(jax.random.key(0), 2))
            >>> state = pop.copy(state, [1, 1])
            >>> bool((state.variables["model"]["W"][0] == state.variables["model"]["W"][1]).all())
            True
        """
        index = np.asarray(sources)
        if index.shape != (self.members,) or not np.issubdtype(index.dtype, np.integer) \
                or index.min() < 0 or index.max() >= self.members:
            raise ValueError(f"population.copy(state, sources={np.asarray(sources).tolist()}):"
                             f" sources must hold {self.members} member indices in "
                             f"[0, {self.members})")
        return self._gather(state, jnp.asarray(index, jnp.int32))

    # -- hyperparameters ------------------------------------------------------------------------
    def get(self, state: TrainState, hparam: Hyperparameter) -> jax.Array:
        """The ``(members,)`` values of a dynamic hyperparameter (an :class:`HParam`, or the
        name of an optimizer hyperparameter made dynamic by ``optax.inject_hyperparams``).

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
            >>> pop = gm.population(gm.optimize(program, tx), members=2)
            >>> state = pop.init(program.init(jnp.ones((1, 2))),
            ...                  jax.random.split(jax.random.key(0), 2))
            >>> pop.get(state, "learning_rate").shape  # opt_state.hyperparams["learning_rate"]
            (2,)
        """
        if isinstance(hparam, HParam):
            return hparam.get(state.variables)
        name = _name(hparam)
        return jnp.asarray(_injected(state.opt_state, name, "population.get").hyperparams[name])

    def set(self, state: TrainState, hparam: Hyperparameter, values: Values) -> TrainState:
        """``state`` with a dynamic hyperparameter set to ``values``, one per member (a number
        sets every member), cast to the stored dtype: the step never retraces.

        Host numbers outside the hyperparameter's valid range (a manager's
        ``hparam_ranges``, e.g. a dropout rate in [0, 1]; a learning rate >= 0) are refused,
        naming it; a ``jax.Array`` is written unchecked (reading it would wait).

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm, managers
            >>> from flax import nnx
            >>> mlp = gm.bricks.MLP([2, 4, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
            >>> dropout = managers.Dropout(gm.dynamic(0.1), bricks=mlp.linear_layers[1:],
            ...                            roles=[gm.roles.INPUT])
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(), mlp, managers=[dropout])
            >>> pop = gm.population(gm.optimize(program, optax.sgd(0.1)), members=2)
            >>> state = pop.init(program.init(jnp.ones((1, 2))),
            ...                  jax.random.split(jax.random.key(0), 2))
            >>> pop.get(pop.set(state, dropout.hparam("rate"), [0.2, 0.5]),
            ...         dropout.hparam("rate")).tolist()
            [0.20000000298023224, 0.5]
        """
        old = self.get(state, hparam)
        if isinstance(values, jax.Array):
            new = jnp.broadcast_to(values.astype(old.dtype), old.shape)
        else:
            host = np.asarray(values, dtype=np.float64)
            if host.shape not in ((), old.shape):
                raise ValueError(f"population.set({label(hparam)}): {host.shape} values for "
                                 f"{self.members} members; pass one per member")
            low, high = valid_range(hparam) or (-math.inf, math.inf)
            outside = host[(host < low) | (host > high) | np.isnan(host)]
            if outside.size:
                raise ValueError(f"population.set({label(hparam)}): {outside.tolist()} outside "
                                 f"its valid range [{low}, {high}]; clip the values")
            new = jnp.asarray(np.broadcast_to(host, old.shape), dtype=old.dtype)
        if isinstance(hparam, HParam):
            return state._replace(variables=hparam.set(state.variables, new))
        return state._replace(opt_state=_with_injected(state.opt_state, hparam, new))

    def abstract_state(self, *example_args: object, **example_kwargs: Any) -> TrainState:
        """The shapes and dtypes of the stacked train state (no array is computed), e.g. the
        template ``Loop.resume`` restores a population's checkpoint into.

        Examples:
            >>> import jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> pop = gm.population(gm.optimize(program, optax.sgd(0.1)), members=5)
            >>> pop.abstract_state(jnp.ones((1, 2))).variables["model"]["W"].shape
            (5, 2, 1)
        """
        member = self.base.abstract_state(*example_args, **example_kwargs)
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((self.members, *leaf.shape),
                                                              leaf.dtype), member)

    def place(self, state: TrainState) -> TrainState:
        """``state`` itself: a population runs on one device (the loop places the state it
        starts from with this).

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> pop = gm.population(gm.optimize(program, optax.sgd(0.1)), members=2)
            >>> state = pop.init(program.init(jnp.ones((1, 2))),
            ...                  jax.random.split(jax.random.key(0), 2))
            >>> pop.place(state) is state
            True
        """
        return state

    def steps(self, state: TrainState, batches: object) -> tuple[TrainState, Metrics]:
        """Several population steps in one ``lax.scan`` over ``batches`` stacked on a
        leading axis; metrics stacked per step, then per member.

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> pop = gm.population(gm.optimize(program, optax.sgd(0.1)), members=2)
            >>> state = pop.init(program.init(jnp.ones((1, 2))),
            ...                  jax.random.split(jax.random.key(0), 2))
            >>> state, metrics = pop.steps(state, (jnp.ones((3, 4, 2)),))  # 3 fused steps
            >>> state.step.tolist(), metrics["loss"].shape
            ([3, 3], (3, 2))
        """
        return self._steps(state, batches)


def population(step: TrainStep, members: int) -> PopulationStep:
    """``members`` models of one program trained side by side as one vmapped train step.

    Args:
        step: one model's train step, from :func:`graphmod.optimize`. Its optimizer's
            hyperparameters may differ per member once made dynamic with
            ``optax.inject_hyperparams`` (e.g. ``"learning_rate"``), as may the dynamic
            hyperparameters of its managers (``gm.dynamic``).
        members: the number of members (the leading axis of every leaf of the state).

    Returns:
        A :class:`PopulationStep`: ``init(variables, keys, hparams=...)``, ``step(state,
        *batch)``, ``member(state, i)``, ``stack(states)``, ``get``/``set`` of per-member
        hyperparameters and ``copy`` of members (what :class:`graphmod.plugins.PBT` uses).

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
        ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> pop = gm.population(step, members=4)
        >>> state = pop.init(program.init(jnp.ones((1, 2))), jax.random.split(
        ...     jax.random.key(0), 4))
        >>> state, metrics = pop(state, jnp.ones((8, 2)))
        >>> state.step.tolist(), metrics["loss"].shape
        ([1, 1, 1, 1], (4,))
    """
    return PopulationStep(step, members)


# -- helpers ------------------------------------------------------------------------------------

def label(hparam: Hyperparameter) -> str:
    """A hyperparameter's name in records: ``manager.name`` or the optimizer's name."""
    return f"{hparam.manager}.{hparam.name}" if isinstance(hparam, HParam) else hparam


def valid_range(hparam: Hyperparameter) -> tuple[float, float] | None:
    """A hyperparameter's valid range (a manager's ``hparam_ranges``), None when unknown."""
    if isinstance(hparam, HParam):
        return hparam.valid
    return _OPTIMIZER_RANGES.get(hparam)


def _name(hparam: object) -> str:
    if not isinstance(hparam, str):
        raise TypeError(f"expected a graphmod.HParam (manager.hparam(name)) or the name of an "
                        f"optimizer hyperparameter (e.g. 'learning_rate'), got {hparam!r}")
    return hparam


def _injected(opt_state: optax.OptState, name: str, who: str) -> _Injected:
    """The ``optax.inject_hyperparams`` state holding ``name``, else an error with the fix."""
    found = [node for node in jax.tree.leaves(opt_state, is_leaf=_is_injected)
             if isinstance(node, _INJECTED)]
    holding = [node for node in found if name in node.hyperparams]
    if len(holding) != 1:
        known = sorted({k for node in found for k in node.hyperparams})
        why = (f"{len(holding)} injected states hold it (set it on one optimizer only)"
               if holding else f"no optimizer hyperparameter {name!r} is dynamic"
               f"{did_you_mean(name, known)} (dynamic ones: {known})")
        raise ValueError(f"{who}({name!r}): {why}; make it dynamic with optax."
                         f"inject_hyperparams, e.g. optax.inject_hyperparams(optax.adam)("
                         f"{name}=1e-3), or pass a manager's HParam")
    node = holding[0]
    if name in getattr(node, "hyperparams_states", {}):
        raise ValueError(f"{who}({name!r}): the optimizer's {name} is a schedule, recomputed "
                         "at every step; pass a constant to optax.inject_hyperparams to set "
                         "it per member")
    return node


def _with_injected(opt_state: optax.OptState, name: str, value: jax.Array) -> optax.OptState:
    """``opt_state`` with the injected hyperparameter ``name`` replaced by ``value``."""
    def replace(node: object) -> object:
        if isinstance(node, _INJECTED) and name in node.hyperparams:
            return node._replace(hyperparams={**node.hyperparams, name: value})
        return node

    return jax.tree.map(replace, opt_state, is_leaf=_is_injected)


def _gathered(state: TrainState, index: jax.Array) -> TrainState:
    """Member ``i`` of the variables and optimizer state taken from member ``index[i]``."""
    take = lambda tree: jax.tree.map(lambda leaf: leaf[index], tree)
    return state._replace(variables=take(state.variables), opt_state=take(state.opt_state))


def _stack(trees: Sequence[_Tree]) -> _Tree:
    """One tree whose leaves stack the trees' leaves on a new leading axis (new buffers)."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _check_same_shapes(named: Sequence[tuple[str, PyTree]], who: str) -> None:
    """Raises naming the first path where a member's tree, shape or dtype differs from
    member 0's."""
    head, first = named[0]
    reference = {jax.tree_util.keystr(p): leaf
                 for p, leaf in jax.tree_util.tree_flatten_with_path(first)[0]}
    for i, (_, tree) in enumerate(named[1:], start=1):
        leaves = {jax.tree_util.keystr(p): leaf
                  for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
        for path in [*reference, *(p for p in leaves if p not in reference)]:
            a, b = reference.get(path), leaves.get(path)
            if a is None or b is None:
                where = "member 0 lacks it" if a is None else f"member {i} lacks it"
                raise ValueError(f"{who}: members differ at {head}{path}: {where}; every "
                                 "member must have the same variables")
            if np.shape(a) != np.shape(b) or jnp.result_type(a) != jnp.result_type(b):
                raise ValueError(
                    f"{who}: members differ at {head}{path}: member 0 has shape "
                    f"{np.shape(a)} ({jnp.result_type(a)}), member {i} has shape "
                    f"{np.shape(b)} ({jnp.result_type(b)}); every member must have the "
                    "same shapes and dtypes")


def _key_count(rng: KeyLike | Sequence[KeyLike]) -> str:
    if isinstance(rng, Sequence) and not isinstance(rng, str):
        return f"{len(rng)} keys"
    try:
        return f"an array of shape {np.shape(rng)} ({jnp.result_type(rng)})"
    except TypeError:
        return repr(rng)
