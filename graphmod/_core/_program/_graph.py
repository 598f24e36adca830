"""``ComputationGraph``: the tagged variables and the jaxpr of one traced function."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from jax.extend.core import ClosedJaxpr

from graphmod import roles as _roles
from graphmod._core._display._table import html_table, text_table
from graphmod._core._model._layout import Layout
from graphmod._core._selection._filter import VariableFilter
from graphmod._core._tracing._side_outputs import Recorded

_HEADERS = ("role", "path", "application", "call", "variable", "shape", "dtype", "rewritten by")


class ComputationGraph:
    """What one trace of a program saw: every tagged variable, before and after each
    rewrite, and the jaxpr. Made by ``program.graph(*args, mode=...)``.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([3, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> cg = gm.compile(lambda m, x: m(x), mlp).graph(jnp.ones((1, 3)))
        >>> [v.tag.path for v in cg.filter(gm.VariableFilter(roles=[gm.roles.WEIGHT]))]
        ['/linear_layers/0.W', '/linear_layers/1.W']
    """

    def __init__(self, records: tuple[Recorded, ...], jaxpr: ClosedJaxpr, mode: str,
                 layout: Layout) -> None:
        self.variables = records
        self.jaxpr = jaxpr
        self.mode = mode
        self._layout = layout

    def __iter__(self) -> Iterator[Recorded]:
        return iter(self.variables)

    def __len__(self) -> int:
        return len(self.variables)

    def _by_role(self, role: _roles.Role) -> Records:
        return Records(r for r in self.variables if r.tag.role.is_a(role))

    @property
    def inputs(self) -> Records:
        return self._by_role(_roles.INPUT)

    @property
    def outputs(self) -> Records:
        return self._by_role(_roles.OUTPUT)

    @property
    def targets(self) -> Records:
        """The arguments applications declare as ``targets`` (a cost's labels)."""
        return self._by_role(_roles.TARGET)

    @property
    def parameters(self) -> Records:
        return self._by_role(_roles.PARAMETER)

    @property
    def auxiliary_variables(self) -> Records:
        return Records(r for r in self.variables if not any(
            r.tag.role.is_a(role) for role in (_roles.INPUT, _roles.OUTPUT, _roles.TARGET,
                                               _roles.PERSISTENT)))

    @property
    def rewritten(self) -> Records:
        """The variables after a rewrite, each marked with its manager."""
        return Records(r for r in self.variables if r.manager is not None)

    def filter(self, variable_filter: VariableFilter) -> Records:
        """The recorded variables ``variable_filter`` selects (a list that prints as a
        table)."""
        if not isinstance(variable_filter, VariableFilter):
            raise TypeError(f"filter: expected a VariableFilter, got {variable_filter!r}")
        self._layout.resolve(variable_filter.brick_instances(), "ComputationGraph.filter")
        return Records(r for r in self.variables
                       if variable_filter.matches(r.tag, self._layout.instance_paths))

    def _caption(self) -> str:
        eqns = len(self.jaxpr.jaxpr.eqns)
        return f"{self.mode} graph: {len(self.variables)} tagged variables, {eqns} equations"

    def __str__(self) -> str:
        return self._caption() + "\n" + str(Records(self.variables))

    __repr__ = __str__  # the table at a prompt too, as a graph's Records show

    def _repr_html_(self) -> str:
        return html_table(_HEADERS, _rows(self.variables), self._caption())


def _rows(records: Iterable[Recorded]) -> list[tuple[object, ...]]:
    return [(r.tag.role, r.tag.brick_path, r.tag.application, r.tag.call_id, r.tag.label,
             r.shape, r.dtype, r.manager or "") for r in records]


class Records(list):
    """A list of recorded variables that prints as a table (text and HTML)."""

    def __str__(self) -> str:
        return text_table(_HEADERS, _rows(self))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return html_table(_HEADERS, _rows(self), f"{len(self)} variables")
