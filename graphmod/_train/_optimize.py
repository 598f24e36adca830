"""``optimize``: a jitted, buffer-donating train step from a program and an optax optimizer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from graphmod import roles as _roles
from graphmod._core._arguments import as_key
from graphmod._core._construction import key_record
from graphmod._records._collect import training_provenance
from graphmod._records._optimizer import optimizer_record
from graphmod._train._batch import step_arguments
from graphmod._train._program import Program


class TrainState(NamedTuple):
    """What a train step carries: variables, optimizer state, step count, the base key's
    data (``jax.random.key_data``: raw uint32 words dispatch faster than a typed key), and
    the number of steps skipped for a non-finite loss or update.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
        ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
        >>> state = gm.optimize(program, optax.sgd(0.1)).init(
        ...     program.init(jnp.ones((1, 2))), jax.random.key(0))
        >>> int(state.step), state.rng.dtype
        (0, dtype('uint32'))
    """

    variables: dict
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    skipped: jax.Array


def _split_output(out: Any) -> tuple[jax.Array, dict]:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return out[0], dict(out[1])
    return out, {}


class TrainStep:
    """``step(state, *batch) -> (state, metrics)``, jitted, donating ``state``.

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

    def __init__(self, program: Program, tx: optax.GradientTransformation,
                 skip_nonfinite: bool, config: Mapping[str, Any] | None = None) -> None:
        if not isinstance(program, Program):
            raise TypeError(f"optimize(program, tx): expected a graphmod Program, got "
                            f"{type(program).__name__}")
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"optimize(program, tx): tx must be an optax "
                            f"GradientTransformation, got {type(tx).__name__}")
        self.program = program
        self.tx = tx
        self.skip_nonfinite = skip_nonfinite
        self.optimizer_record = optimizer_record(tx, config)
        self.train_seed: dict | None = None
        self._step = jax.jit(self._traced, donate_argnums=0)
        self._steps = jax.jit(self._scanned, donate_argnums=0)

    @property
    def provenance(self) -> Any:
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

    def init(self, variables: dict, rng: Any) -> TrainState:
        """The first train state (copies ``variables``, so donation never frees yours).

        ``variables`` are checked against the program's layout and ``rng`` must be a key
        (e.g. ``jax.random.key(0)``), before anything is copied."""
        key = as_key(rng, "step.init(variables, rng)")
        self.program._unpack(variables)
        variables = jax.tree.map(lambda x: jnp.array(x, copy=True), variables)
        params, _ = self.program.split(variables, _roles.PARAMETER)
        data = jax.random.key_data(key)
        seed = key_record(key)
        if seed is not None:  # not under a trace (abstract_state)
            self.train_seed = seed
        return TrainState(variables, self.tx.init(params), jnp.int32(0), data, jnp.int32(0))

    def abstract_state(self, *example_args: Any, **example_kwargs: Any) -> TrainState:
        """The shapes and dtypes of this step's train state (no array is computed)."""
        return jax.eval_shape(lambda: self.init(
            self.program.init(*example_args, **example_kwargs), jax.random.key(0)))

    def __call__(self, state: TrainState, *batch: Any, **kwargs: Any) -> tuple[TrainState, dict]:
        return self._step(state, batch, kwargs)

    def steps(self, state: TrainState, batches: Any) -> tuple[TrainState, dict]:
        """Several steps in one ``lax.scan`` dispatch over ``batches`` stacked on a leading
        axis (a tuple is passed positionally, a dict by name); metrics stacked per step.
        One jitted function per train step, so the loop's fused runs compile once per
        number of steps."""
        return self._steps(state, batches)

    def _scanned(self, state: TrainState, batches: Any) -> tuple[TrainState, dict]:
        def one(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
            return self._traced(state, *step_arguments(batch))

        return jax.lax.scan(one, state, batches)

    def _traced(self, state: TrainState, batch: tuple, kwargs: dict) -> tuple[TrainState, dict]:
        program = self.program
        program._unpack(state.variables)  # named errors before split meets a stranger
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        params, rest = program.split(state.variables, _roles.PARAMETER)

        def loss(params: dict) -> tuple[jax.Array, tuple[dict, dict]]:
            result = program._train_traced(program.merge(params, rest), key, batch, kwargs)
            out, new_variables = result[0], result[1]
            monitored = result[2] if len(result) == 3 else {}
            cost, metrics = _split_output(out)
            if jnp.ndim(cost) != 0 or not jnp.issubdtype(jnp.result_type(cost), jnp.floating):
                raise ValueError(
                    f"optimize: the cost returned by {getattr(program.fn, '__name__', 'fn')} "
                    f"must be a float scalar to differentiate; got shape {jnp.shape(cost)} "
                    f"and dtype {jnp.result_type(cost)} (reduce it, e.g. with .mean())"
                )
            return cost, ({**metrics, **monitored}, new_variables)

        (cost, (metrics, new_variables)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = self.tx.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        _, new_rest = program.split(new_variables, _roles.PARAMETER)
        variables = program.merge(new_params, new_rest)
        skipped = state.skipped
        if self.skip_nonfinite:
            finite = jnp.isfinite(cost) & jnp.all(jnp.asarray(
                [jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)]))
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            variables = keep(variables, state.variables)
            opt_state = keep(opt_state, state.opt_state)
            skipped = skipped + jnp.where(finite, 0, 1).astype(skipped.dtype)
            metrics = {**metrics, "skipped_steps": skipped}
        new_state = TrainState(variables, opt_state, state.step + 1, state.rng, skipped)
        return new_state, {"loss": cost, **metrics}


def optimize(program: Program, tx: optax.GradientTransformation, *,
             skip_nonfinite: bool = False, config: Mapping[str, Any] | None = None
             ) -> TrainStep:
    """A jitted, buffer-donating train step for ``program`` with optax optimizer ``tx``.

    Args:
        program: made by :func:`graphmod.compile`; its function returns a scalar cost or
            ``(cost, metrics)``.
        tx: an optax gradient transformation.
        skip_nonfinite: leave the state unchanged for a step whose loss or update is not
            finite, and count it in ``metrics["skipped_steps"]``.
        config: the optimizer's name and hyperparameters for the provenance record, e.g.
            ``{"name": "adam", "learning_rate": 1e-3}``, when ``tx`` was not made with
            :func:`graphmod.provenance.optimizer` (which records them itself).

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
    return TrainStep(program, tx, skip_nonfinite, config)
