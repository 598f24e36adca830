"""``TrainState``: what a train step carries from one call to the next, as a pytree whose
leaves XLA takes in the order that runs fastest."""

from __future__ import annotations

import html
import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
import optax
from jax.core import Tracer

from graphmod._core._display._show import VariablesTable, known_roles, size_text, treescope_tree
from graphmod.typing import Variables

if TYPE_CHECKING:  # Flax's display, imported where it renders
    from treescope.renderers import TreescopeSubtreeRenderer
    from treescope.rendering_parts import RenderableAndLineAnnotations

__all__ = ["TrainState"]


class TrainState(NamedTuple):
    """What a train step carries: variables, optimizer state, step count, the base key's
    data (``jax.random.key_data``: raw uint32 words dispatch faster than a typed key), the
    number of steps skipped for a non-finite loss or update (``optimize(...,
    skip_nonfinite=True)``; None without: every leaf costs each call of the step its
    dispatch, about 2 µs on a CPU), and the loss scale's state (``optimize(...,
    loss_scale=)``; None without). As a pytree (what ``jax.jit`` and ``jax.tree.leaves``
    see) it lists the optimizer state before the variables.

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

    variables: Variables
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array
    skipped: jax.Array | None = None
    loss_scale: dict[str, jax.Array] | None = None

    @property
    def evaluation_variables(self) -> Variables:
        """The variables to evaluate and export: ``variables``, except under a schedule-free
        optimizer (``optax.contrib.schedule_free_adamw``, ...), which trains at one point
        and is evaluated at another: there its parameters are replaced by
        ``optax.contrib.schedule_free_eval_params``'s (``Validation`` reads these).

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> step = gm.optimize(program, optax.contrib.schedule_free_sgd(0.1))
            >>> state = step.init(program.init(jnp.ones((1, 2))), jax.random.key(0))
            >>> for _ in range(3):
            ...     state, _ = step(state, jnp.ones((4, 2)))
            >>> bool((state.evaluation_variables["model"]["W"] != state.variables["model"]["W"]
            ...       ).all())
            True
        """
        variables = self.variables
        for free in jax.tree.leaves(self.opt_state, is_leaf=_is_schedule_free):
            if _is_schedule_free(free) and isinstance(free.z, Mapping):  # the parameters'
                variables = _evaluation_point(variables, free.z, free.b1)
        return variables

    def __repr__(self) -> str:  # sizes, never the arrays' values (a 100-column line)
        variables, opt = self._tables()
        skipped = "" if self.skipped is None else f"skipped={_count(self.skipped)}, "
        return (f"TrainState(step={_count(self.step)}, {skipped}"
                f"variables: {variables.arrays} arrays, {size_text(variables.nbytes, 'B')}"
                f"; opt_state: {opt.arrays} arrays, {size_text(opt.nbytes, 'B')})")

    def _tables(self) -> tuple[VariablesTable, VariablesTable]:
        """The variables, with the roles a program gave a tree like them, and the optimizer
        state with its copies of the variables (Adam's ``mu``, ``nu``) folded."""
        head = f"TrainState: step {_count(self.step)}" + (
            "" if self.skipped is None else f", skipped {_count(self.skipped)}")
        return (VariablesTable(self.variables, known_roles(self.variables), title=head),
                VariablesTable(self.opt_state, title="opt_state", like=self.variables))

    def _repr_html_(self) -> str:  # the optimizer state folded away, one click to open
        variables, opt = self._tables()
        return (variables._repr_html_() + f"<details><summary>opt_state: "
                f"{html.escape(opt.totals)}</summary>{opt._repr_html_()}</details>")

    def __treescope_repr__(self, path: str | None,
                           subtree_renderer: TreescopeSubtreeRenderer
                           ) -> RenderableAndLineAnnotations:
        """Treescope's rendering (Flax's display): the counters, the variables folded by
        module with their roles, the optimizer state folded."""
        from treescope import rendering_parts as parts  # Flax's display: where it renders

        variables, opt = self._tables()
        at = lambda name: None if path is None else f"{path}.{name}"
        fields = {"step": subtree_renderer(self.step, path=at("step"))}
        if self.skipped is not None:
            fields["skipped"] = subtree_renderer(self.skipped, path=at("skipped"))
        fields |= {
            "variables": treescope_tree(self.variables, variables.roles, at("variables"),
                                        subtree_renderer, variables.totals),
            "opt_state": treescope_tree(self.opt_state, None, at("opt_state"),
                                        subtree_renderer, opt.totals, like=self.variables),
            "rng": subtree_renderer(self.rng, path=at("rng")),
        }
        if self.loss_scale is not None:
            fields["loss_scale"] = subtree_renderer(self.loss_scale, path=at("loss_scale"))
        return parts.build_foldable_tree_node_from_children(
            prefix="TrainState(", suffix=")", path=path,
            children=[parts.build_full_line_with_annotations(
                parts.siblings_with_annotations(f"{name}=", shown), ",")
                for name, shown in fields.items()],
            expand_state=parts.ExpandState.EXPANDED)


# The step's XLA parameters in this order: XLA:CPU schedules a small step by its parameters'
# order, and the optimizer state first (as a hand-written dict state sorts it) ran the
# StopGradient and WeightStandardization steps 4-11% faster (benchmarks/manager_costs.py).
# The fields keep their order and names (``state.variables``, ``state[0]``, keyword
# construction); checkpoints find each stored leaf by its path, so either order restores.
# Flattened by C functions (itemgetter, tuple.__new__) behind two small lambdas: 0.14 µs a
# call more than a plain NamedTuple, against 0.33 µs for register_dataclass's keywords.
_FLAT_FIELDS = ("opt_state", "variables", "step", "rng", "skipped", "loss_scale")
_FLAT = operator.itemgetter(*map(TrainState._fields.index, _FLAT_FIELDS))
_UNFLAT = operator.itemgetter(*map(_FLAT_FIELDS.index, TrainState._fields))
_KEYS = tuple(map(jax.tree_util.GetAttrKey, _FLAT_FIELDS))
jax.tree_util.register_pytree_with_keys(
    TrainState,
    lambda state: (tuple(zip(_KEYS, _FLAT(state), strict=True)), None),
    # JAX hands the children over as a tuple (its stub says Iterable): indexed as they are.
    lambda _, children: tuple.__new__(TrainState, _UNFLAT(children)),  # pyright: ignore[reportArgumentType]
    lambda state: (_FLAT(state), None))


def _is_schedule_free(node: object) -> bool:
    return isinstance(node, optax.contrib.ScheduleFreeState)


# Nested dicts of arrays, read by key and written back as dicts.
def _evaluation_point(variables: dict[str, Any], z: Mapping[str, object], b1: jax.Array
                      ) -> dict[str, Any]:
    """``variables`` with each parameter ``y`` that ``z`` holds (in the trained
    parameters' nesting) replaced by ``(y - (1 - b1) z) / b1``, as
    ``schedule_free_eval_params`` computes it, in the parameter's dtype."""
    point = dict(variables)
    for key, value in z.items():
        if isinstance(value, Mapping):
            point[key] = _evaluation_point(variables[key], value, b1)
        elif isinstance(value, jax.Array):  # else masked out: another transformation trains it
            y = variables[key]
            point[key] = ((y - (1.0 - b1) * value) / b1).astype(y.dtype)
    return point


def _count(value: jax.Array) -> str:
    """A step counter as text (a population's: one value per member unless all agree),
    without a device read inside a trace."""
    if isinstance(value, Tracer):
        return "traced"
    counts = np.asarray(value)
    return str(int(counts.flat[0])) if (counts == counts.flat[0]).all() else str(counts.tolist())
