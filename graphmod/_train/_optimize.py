"""``optimize``: a jitted, buffer-donating train step from a program and an optax optimizer."""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from graphmod import roles as _roles
from graphmod._core._bricks._construction import key_record
from graphmod._core._managers._manager import Manager
from graphmod._core._model._role_tree import select
from graphmod._core._program._arguments import as_key
from graphmod._core._selection._selection import as_selectors, selected
from graphmod._core._sharding import Placement, on_mesh, put
from graphmod._records._collect import training_provenance
from graphmod._records._optimizer import optimizer_record
from graphmod._records._record import Provenance
from graphmod._records._summary import optimizer_text
from graphmod._train._batch import step_arguments
from graphmod._train._optimizer_placement import OptimizerPlacement
from graphmod._train._program import Program
from graphmod._train._train_state import TrainState
from graphmod._train._trainable import check_own_managers, parameter_owners, warn_frozen_managers
from graphmod.typing import (
    JSON,
    KeyLike,
    LossScale,
    Metrics,
    PyTree,
    ShardingRule,
    Variables,
)

_Tree = TypeVar("_Tree")

Loss: TypeAlias = Callable[[Variables], tuple[jax.Array, tuple[Metrics, Variables]]]
"""The cost at the trained parameters, with the step's metrics and new variables."""


def _split_output(out: object, fn: Callable[..., object]) -> tuple[object, Metrics]:
    """The cost and metrics of what the function returned: a cost or ``(cost, metrics)``."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return out[0], dict(out[1])
    if isinstance(out, tuple | list):  # (loss, logits): the aux of jax.value_and_grad
        name = getattr(fn, "__name__", "fn")
        raise TypeError(
            f"optimize: {name} returned a {type(out).__name__} of {len(out)}; a train "
            "step's function returns its cost, or (cost, metrics) with metrics a dict of "
            f"arrays: return (loss, {{'logits': logits}}) to see them in the metrics, or "
            "predict with program.derive(lambda model, x: model(x))")
    return out, {}


class TrainStep:
    """``step(state, *batch) -> (state, metrics)``, jitted, donating ``state``.

    Calling the step calls its jitted function directly. On a mesh the batch is split
    inside it: pass NumPy or uncommitted arrays, or batches the ``Loop`` (or
    ``program.placement.put_batch``) placed; JAX refuses an array committed to other
    devices.

    Optax sees exactly the PARAMETER leaves of the variables, in their original nesting.
    Each step's key is ``fold_in(state.rng, state.step)``, so a resumed run draws the same
    randomness. Metrics are ``{"loss": cost, **metrics, **monitored}`` (plus
    ``"skipped_steps"`` with ``skip_nonfinite=True``). ``provenance`` is the training
    record: the program's, with the optimizer (``optimizer_record``) and the train seed
    (``train_seed``: the key data of the last state :meth:`init` made, None before).

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
        ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(jnp.ones((1, 2))), jax.random.key(0))
        >>> state, metrics = step.steps(state, (jnp.ones((3, 4, 2)),))  # 3 fused steps
        >>> int(state.step), metrics["loss"].shape
        (3, (3,))
    """

    def __init__(self, program: Program, tx: optax.GradientTransformation | optax.MultiSteps,
                 skip_nonfinite: bool, config: Mapping[str, JSON] | None = None,
                 trainable: object = None, grad_norms: bool = False,
                 optimizer_rules: Sequence[ShardingRule] = (),
                 loss_scale: LossScale | None = None) -> None:
        if not isinstance(program, Program):
            raise TypeError(f"optimize(program, tx): expected a graphmod Program, got "
                            f"{type(program).__name__}")
        if isinstance(tx, optax.MultiSteps):  # gradient accumulation, as optax writes it
            tx = tx.gradient_transformation()
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"optimize(program, tx): tx must be an optax "
                            f"GradientTransformation (e.g. optax.adam(1e-3)), got "
                            f"{type(tx).__name__}")
        if loss_scale is not None and not isinstance(loss_scale, LossScale):
            raise TypeError(f"optimize(loss_scale=...): expected a loss scale with init, scale, "
                            f"unscale and adjust (e.g. managers.DynamicLossScale()), got "
                            f"{type(loss_scale).__name__}")
        self.program = program
        self.tx = tx
        self.skip_nonfinite = skip_nonfinite
        self.loss_scale = loss_scale
        self.trainable = None if trainable is None else as_selectors(
            trainable, "optimize(trainable=...)")
        check_own_managers(self.trainable or (), program)
        self.grad_norms = bool(grad_norms)
        self.optimizer_placement = OptimizerPlacement(program.placement, program.layout,
                                                      optimizer_rules)
        self.optimizer_record = optimizer_record(tx, config)
        self.train_seed: dict[str, JSON] | None = None
        self._step = jax.jit(on_mesh(self._train_step, program.placement), donate_argnums=0)
        self._steps = jax.jit(on_mesh(self._scanned, program.placement), donate_argnums=0)

    def __repr__(self) -> str:
        chosen = "every parameter" if self.trainable is None else "the parameters of " + \
            ", ".join(s.name if isinstance(s, Manager) else repr(s) for s in self.trainable)
        flags = "".join(f", {name}" for name, on in (("skip_nonfinite", self.skip_nonfinite),
                                                     ("grad_norms", self.grad_norms),
                                                     ("loss_scale", self.loss_scale)) if on)
        return (f"TrainStep: trains {chosen}{flags}\n  optimizer: "
                f"{optimizer_text(self.optimizer_record)}\n  "
                + "".join(f"{line}\n  " for line in self.optimizer_placement.lines())
                + repr(self.program).replace("\n", "\n  "))

    # ``step(state, *batch)`` calls the jitted step itself, found by a property made of C
    # functions: no Python frame and no look at the batch before JAX's C++ dispatch. A small
    # step is bound by its dispatch on a GPU, where a Python ``__call__`` placing the batch
    # cost 2-8% of the digits step (H200, 2026-11-26).
    if TYPE_CHECKING:  # what the property below gives: the jitted step, called
        def __call__(self, state: TrainState, *batch: object, **kwargs: object
                     ) -> tuple[TrainState, Metrics]: ...
    else:
        __call__ = property(operator.attrgetter("_step"))

    @property
    def __signature__(self) -> inspect.Signature:
        """``step(state, *batch, **kwargs)``, for ``help(step)`` and ``inspect.signature``."""
        return inspect.signature(self._step)

    @property
    def provenance(self) -> Provenance:
        """The training record (no data or loop: see ``graphmod.provenance.capture(loop)``).

        Examples:
            >>> import jax, jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> step = gm.optimize(program, gm.provenance.optimizer("sgd", 0.1))
            >>> _ = step.init(program.init(jnp.ones((4, 2))), jax.random.key(3))
            >>> prov = step.provenance
            >>> prov["optimizer"]["name"], prov["seeds"]["train"]["data"]
            ('sgd', (0, 3))
        """
        return training_provenance(self)

    def init(self, variables: Variables, rng: KeyLike) -> TrainState:
        """The first train state (copies ``variables`` and the key, so donation never frees
        yours).

        ``variables`` are checked against the program's layout and ``rng`` must be a key
        (e.g. ``jax.random.key(0)``), before anything is copied."""
        key = as_key(rng, "step.init(variables, rng)")
        self.program._unpack(variables)
        variables = _copied(variables)
        params, _ = self._parameters(variables)
        _check_differentiable(params)
        warn_frozen_managers(variables, self.trainable, self.program)
        data = jnp.array(jax.random.key_data(key), copy=True)  # key_data shares the buffer
        seed = key_record(key)
        if seed is not None:  # not under a trace (abstract_state)
            self.train_seed = seed
        # Copied too: an optimizer may keep the parameters themselves in its state
        # (optax.lbfgs), and a step donates every buffer of the state once.
        opt_state = _copied(self.tx.init(params))
        scale = None if self.loss_scale is None else _copied(self.loss_scale.init())
        # The skipped-steps count only where steps are skipped: a leaf costs every call.
        skipped = jnp.int32(0) if self.skip_nonfinite else None
        return self.place(TrainState(variables, opt_state, jnp.int32(0), data, skipped,
                                     scale))

    def place(self, state: TrainState) -> TrainState:
        """``state`` put on the program's mesh as :meth:`init` places it (its arrays as they
        are for a program on one device): e.g. a state restored from a checkpoint, which
        holds whole arrays whatever mesh saved it. The loop places the state it starts
        from. A step with ``skip_nonfinite`` adds a count of skipped steps (0) to a state
        without one (one another step made), as its first call would, so the loop's step
        compiles for one tree."""
        if self.skip_nonfinite and state.skipped is None:
            state = state._replace(skipped=jnp.int32(0))
        placement = self.program.placement
        if placement is None:
            return state
        return put(state, self._shardings(state, placement))

    def _shardings(self, state: TrainState, placement: Placement) -> TrainState:
        """The placement of every leaf of ``state`` on the program's mesh (``placement``):
        the variables by the program's rules, the optimizer's copies of a parameter (Adam's
        moments) as that parameter or as :class:`OptimizerPlacement` says, everything else
        replicated."""
        layout = self.program.layout
        variables = placement.variables(state.variables, layout)
        whole = placement.replicated()
        copies = self.optimizer_placement.copies(
            self._parameters(state.variables)[0], self._parameters(variables)[0], layout)
        opt = optax.tree_map_params(self.tx, lambda _, sharding: sharding, state.opt_state,
                                    copies, transform_non_params=lambda _: whole)
        skipped, scale = jax.tree.map(lambda _: whole, (state.skipped, state.loss_scale))
        # The state's tree with a sharding at each leaf, as put and with_sharding_constraint
        # take it (the fields' annotations describe a state of arrays).
        return TrainState(variables, opt, whole, whole, skipped, scale)  # pyright: ignore[reportArgumentType]

    def abstract_state(self, *example_args: object, **example_kwargs: Any) -> TrainState:
        """The shapes and dtypes of this step's train state (no array is computed)."""
        return jax.eval_shape(lambda: self.init(
            self.program.init(*example_args, **example_kwargs), jax.random.key(0)))

    def steps(self, state: TrainState, batches: object) -> tuple[TrainState, Metrics]:
        """Several steps in one ``lax.scan`` dispatch over ``batches`` stacked on a leading
        axis (a tuple is passed positionally, a dict by name); metrics stacked per step.
        One jitted function per train step, so the loop's fused runs compile once per
        number of steps."""
        return self._steps(state, batches)

    def _train_step(self, state: TrainState, *batch: object, **kwargs: object
                    ) -> tuple[TrainState, Metrics]:
        return self._traced(state, batch, kwargs)  # the program splits a batch on its mesh

    def _scanned(self, state: TrainState, batches: object) -> tuple[TrainState, Metrics]:
        def one(state: TrainState, batch: object) -> tuple[TrainState, Metrics]:
            return self._traced(state, *step_arguments(batch))

        placement = self.program.placement
        if placement is not None:  # each step's slice is split by the program, the stack here
            batches = placement.constrain_batch(batches, stacked=True)
        return jax.lax.scan(one, state, batches)

    def _parameters(self, variables: Variables) -> tuple[Variables, Variables]:
        """``(trained, rest)``: the PARAMETER leaves optax sees (those ``trainable``
        selects, when given), and every other leaf."""
        program = self.program
        params, rest = program.split(variables, _roles.PARAMETER)
        if self.trainable is None:
            return params, rest
        chosen = selected(params, program.record.layout, self.trainable,
                          "optimize(trainable=...)")
        trained = select(params, chosen, bool, True)
        if not jax.tree.leaves(trained):
            owners = parameter_owners(program, variables)
            hint = (f"; a manager's parameters are chosen by the manager itself "
                    f"(trainable=[{owners[0]}])" if owners else "")
            raise ValueError(f"optimize(trainable={list(self.trainable)!r}) selects no "
                             "PARAMETER leaf of the program's variables; see program.roles("
                             f"variables) for what there is{hint}")
        return trained, program.merge(select(params, chosen, bool, False), rest)

    def _loss(self, key: jax.Array, batch: tuple[object, ...], kwargs: dict[str, object],
              rest: Variables, params: Variables) -> tuple[jax.Array, tuple[Metrics, Variables]]:
        """The cost to differentiate (the function's plus every auxiliary cost), and the
        metrics and new variables."""
        program = self.program
        out, new_variables, monitored, costs, measured = program._train_traced(
            program.merge(params, rest), key, batch, kwargs, with_costs=True)
        cost, metrics = _split_output(out, program.fn)
        name = getattr(program.fn, "__name__", "fn")
        if not isinstance(cost, jax.Array | np.ndarray | np.generic | float | int):  # a dict
            raise TypeError(
                f"optimize: {name} returned a {type(cost).__name__}, not a cost: a train "
                "step needs a float scalar, or (cost, {'name': metric, ...}); reduce the "
                "outputs to a loss in the function (program.derive keeps the outputs)")
        if jnp.ndim(cost) != 0 or not jnp.issubdtype(jnp.result_type(cost), jnp.floating):
            raise ValueError(
                f"optimize: the cost returned by {name} must be a float scalar to "
                f"differentiate; got shape {jnp.shape(cost)} and dtype "
                f"{jnp.result_type(cost)} (reduce it, e.g. with .mean())")
        cost = jnp.asarray(cost)  # a traced cost as it is
        owned = {owner: sum(by_key.values()) for owner, by_key in costs.items()}
        total = cost + sum(owned.values()) if owned else cost
        return total, ({**metrics, **owned, **measured, **monitored}, new_variables)

    def _traced(self, state: TrainState, batch: tuple[object, ...], kwargs: dict[str, object]
                ) -> tuple[TrainState, Metrics]:
        program = self.program
        program._unpack(state.variables)  # named errors before split meets a stranger
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        params, rest = self._parameters(state.variables)
        loss: Loss = functools.partial(self._loss, key, batch, kwargs, rest)
        finite = None  # with a loss scale: whether the gradients are all finite
        adjusted = None  # and the loss scale's next state
        if self.loss_scale is None:
            (cost, (metrics, new_variables)), grads = jax.value_and_grad(
                loss, has_aux=True)(params)
        else:
            if state.loss_scale is None:
                raise ValueError(
                    "optimize(loss_scale=...): this train state has no loss scale (a step "
                    "without loss_scale= made it, or it was restored from such a "
                    "checkpoint); make the first state with this step's init")
            (_, (cost, (metrics, new_variables))), grads = jax.value_and_grad(
                _scaled(loss, self.loss_scale, state.loss_scale), has_aux=True)(params)
            grads = self.loss_scale.unscale(state.loss_scale, grads)
            finite = _all_finite(grads)
            adjusted = self.loss_scale.adjust(state.loss_scale, finite)
        if self.grad_norms:
            metrics = {**metrics, **_norms(grads)}
        updates, opt_state = self.tx.update(grads, state.opt_state, params,
                                            **_extra_args(self.tx, cost, grads, loss))
        # optax returns the parameters' own tree (its stub: any tree).
        new_params: Variables = optax.apply_updates(params, updates)  # pyright: ignore[reportAssignmentType]
        new_params, opt_state = _keep_frozen(self, state, params, new_params, opt_state)
        _, new_rest = self._parameters(new_variables)
        variables = program.merge(new_params, new_rest)
        skipped, applied, scale = state.skipped, finite, state.loss_scale
        if self.skip_nonfinite:
            if skipped is None:  # a state a step without skip_nonfinite made: from 0
                skipped = jnp.zeros((), jnp.int32)
            good = jnp.isfinite(cost) & _all_finite(updates)
            # A step whose scaled gradients overflowed is the loss scale's to count.
            bad = ~good if finite is None else ~good & finite
            applied = good if finite is None else good & finite
            skipped = skipped + bad.astype(skipped.dtype)
            metrics = {**metrics, "skipped_steps": skipped}
        if applied is not None:
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(applied, a, b), new, old)
            variables = keep(variables, state.variables)
            opt_state = keep(opt_state, state.opt_state)
        if adjusted is not None:
            scale = adjusted
            metrics = {**metrics, **{f"loss_scale/{k}": v for k, v in scale.items()}}
        new_state = TrainState(variables, opt_state, state.step + 1, state.rng, skipped, scale)
        if program.placement is not None:  # outputs placed as inputs: nothing moves
            new_state = jax.lax.with_sharding_constraint(
                new_state, self._shardings(new_state, program.placement))
        return new_state, {"loss": cost, **metrics}


def _scaled(loss: Loss, loss_scale: LossScale, state: Mapping[str, jax.Array]
            ) -> Callable[[Variables], tuple[jax.Array, tuple[jax.Array, tuple[Metrics,
                                                                               Variables]]]]:
    """``loss`` as a loss-scaled step differentiates it: the scaled cost, with the cost
    itself beside the auxiliary outputs."""
    def scaled(params: Variables) -> tuple[jax.Array, tuple[jax.Array, tuple[Metrics,
                                                                              Variables]]]:
        cost, aux = loss(params)
        return loss_scale.scale(state, cost), (cost, aux)

    return scaled


def _all_finite(tree: PyTree) -> jax.Array:
    """Whether every element of every leaf of ``tree`` is finite (a bool scalar)."""
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _keep_frozen(step: TrainStep, state: TrainState, params: Variables, new_params: Variables,
                 opt_state: optax.OptState) -> tuple[Variables, optax.OptState]:
    """The parameters the program's managers freeze this step
    (:meth:`graphmod.Manager.frozen_parameters`) and their optimizer state as they were,
    bitwise; every other as the optimizer moved it."""
    program = step.program
    frozen: dict[str, jax.Array] = {}
    for manager in program.managers:
        if manager.has_hook("frozen_parameters"):
            for path, now in manager.frozen_parameters(program.layout, state.variables).items():
                frozen[path] = now if path not in frozen else frozen[path] | now
    if not frozen:
        return new_params, opt_state

    def flag(path: jax.tree_util.KeyPath, _: object) -> jax.Array | bool:
        keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        info = program.layout.by_key.get(keys[1:]) if keys[0] == "model" else None
        return False if info is None else frozen.get(info.path, False)

    mask = jax.tree_util.tree_map_with_path(flag, params)
    states = optax.tree_map_params(step.tx, lambda _, f: f, opt_state, mask,
                                   transform_non_params=lambda v: jax.tree.map(lambda _: False, v))
    keep = lambda f, new, old: jnp.where(f, old, new)
    return (jax.tree.map(keep, mask, new_params, params),
            jax.tree.map(keep, states, opt_state, state.opt_state))


def _copied(tree: _Tree) -> _Tree:
    """``tree`` with every array copied into a buffer of its own."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _extra_args(tx: optax.GradientTransformation, cost: jax.Array, grads: Variables,
                loss: Loss) -> dict[str, object]:
    """What optax's transformations with extra arguments read besides the gradients:
    ``value`` (``optax.contrib.reduce_on_plateau``), and ``grad`` and ``value_fn``, the cost
    at other parameters with the same key and batch (the line searches of
    ``optax.lbfgs``). Transformations without extra arguments get none."""
    if not isinstance(tx, optax.GradientTransformationExtraArgs):
        return {}
    return {"value": cost, "grad": grads, "value_fn": lambda params: loss(params)[0]}


def _norms(grads: Variables) -> dict[str, jax.Array]:
    """``{"grad_norm/<path>": L2 norm}`` of each gradient leaf (``model/linear_layers/0/W``)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    return {"grad_norm/" + _leaf_name(path): jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))
            for path, g in flat}


def _leaf_name(path: jax.tree_util.KeyPath) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _check_differentiable(params: Variables) -> None:
    """Raises if a trained parameter is not floating-point (JAX cannot differentiate it)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    wrong = [f"{_leaf_name(path)} ({jnp.result_type(leaf)})" for path, leaf in flat
             if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    if wrong:
        raise TypeError(
            f"optimize: parameters {', '.join(wrong)} are not floating-point, and gradients "
            "need floating-point parameters: make each a state variable (nnx.Variable "
            "rather than nnx.Param) or a float array, or leave it out of training with "
            "optimize(..., trainable=VariableFilter(...))")


def optimize(program: Program, tx: optax.GradientTransformation | optax.MultiSteps, *,
             skip_nonfinite: bool = False, config: Mapping[str, JSON] | None = None,
             trainable: object = None, grad_norms: bool = False,
             optimizer_rules: Sequence[ShardingRule] = (), loss_scale: LossScale | None = None
             ) -> TrainStep:
    """A jitted, buffer-donating train step for ``program`` with optax optimizer ``tx``.

    Args:
        program: made by :func:`graphmod.compile`; its function returns a scalar cost or
            ``(cost, metrics)``.
        tx: an optax gradient transformation, or an ``optax.MultiSteps`` (gradients
            accumulated over several steps). Transformations taking extra arguments get
            ``value`` (the cost, as ``optax.contrib.reduce_on_plateau`` reads it),
            ``grad`` and ``value_fn`` (the cost at other parameters with the step's key
            and batch, for the line searches of ``optax.lbfgs``).
        skip_nonfinite: leave the state unchanged for a step whose loss or update is not
            finite, and count it in ``train_state.skipped`` (checkpointed with the rest),
            reported as ``metrics["skipped_steps"]``. Without it a state has no count
            (``skipped`` is None): one array less for every call to pass.
        config: the optimizer's name and hyperparameters for the provenance record, e.g.
            ``{"name": "adam", "learning_rate": 1e-3}``, when ``tx`` was not made with
            :func:`graphmod.provenance.optimizer` (which records them itself).
        trainable: what optax trains: a :class:`graphmod.VariableFilter` over the model's
            variables (``bricks``, ``roles``, ``name``, ``name_regex``, ``path``), a Flax
            filter (``nnx.LoRAParam``, ``nnx.PathContains("head")``, a function of
            ``(path, value)``: what Flax's ``wrt=`` takes), a manager (the parameters it
            owns, e.g. LoRA's adapters) or a list of them. The other PARAMETER leaves are
            frozen: no gradient, no update, not in the optimizer state. The training record
            lists the parameters trained.
        grad_norms: also report each parameter's gradient norm in the metrics, as
            ``metrics["grad_norm/model/linear_layers/0/W"]``.
        optimizer_rules: for a program on a mesh, ``(VariableFilter, PartitionSpec)``
            pairs placing the optimizer's copies of the parameters they select (Adam's
            moments) apart from the parameters, e.g. split over the data axis while the
            parameters are replicated (ZeRO's first stage). A Flax variable's own
            ``optimizer_sharding`` metadata is read as a rule for it; the copies of a
            parameter neither selects are placed as the parameter.
        loss_scale: a :class:`graphmod.typing.LossScale` (``managers.DynamicLossScale()``)
            for a step computing in float16: the cost is scaled before differentiation and
            the gradients unscaled; a step whose gradients are not all finite changes no
            variable or optimizer state (and is not counted in ``skipped_steps``); the scale's
            state is ``train_state.loss_scale`` (checkpointed with the rest) and its new
            values are reported as ``metrics["loss_scale/<name>"]``.

    Auxiliary costs (``call.add_auxiliary_variable(value, roles=[COST])``, e.g. from
    ``managers.L2``) are added to the cost that is differentiated: ``metrics["loss"]`` is
    the total, and each owner's sum is reported under its name (``metrics["l2"]``).

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x, y), jax.random.key(0))
        >>> state, metrics = step(state, x, y)
        >>> int(state.step), sorted(metrics)
        (1, ['loss'])
    """
    return TrainStep(program, tx, skip_nonfinite, config, trainable, grad_norms,
                     optimizer_rules, loss_scale)
