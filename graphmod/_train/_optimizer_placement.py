"""Where the optimizer's copies of the parameters (Adam's moments) live on a mesh.

Each copy is placed as its parameter unless one of these places it (the first that does):

1. ``optimize(program, tx, optimizer_rules=[(VariableFilter, PartitionSpec), ...])``: the
   first rule whose filter selects a model parameter places that parameter's copies.
2. The parameter's Flax variable metadata ``optimizer_sharding`` (a ``PartitionSpec`` of
   mesh axes), as Flax's optimization cookbook writes it,
   ``nnx.with_metadata(init, optimizer_sharding=P("data"))``, and ``nnx.Optimizer`` reads
   it: an unmodified Flax model brings its own placement.

Replicated parameters with split copies are ZeRO's first stage: the optimizer's memory is
divided over the devices, and XLA gathers each update where it is applied.

Sharp edges
    The rules select model parameters; a manager's parameter (LoRA's ``a`` and ``b``) keeps
    its copies placed as itself. A program without a mesh places nothing: the metadata is
    then not read, and ``optimizer_rules`` is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from graphmod._core._model._layout import Layout
from graphmod._core._selection._rules import Rule, checked_rules, first_rule, fitting
from graphmod._core._sharding import Placement
from graphmod.typing import ShardingRule

__all__ = ["OptimizerPlacement"]

_METADATA = "optimizer_sharding"


class OptimizerPlacement:
    """The placement of the optimizer's copies of each model parameter, by rules and by the
    Flax variables' ``optimizer_sharding`` metadata.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 4, rngs=nnx.Rngs(0)),
        ...                      mesh=mesh)
        >>> variables = program.init(jnp.ones((1, 2)))
        >>> rules = [(gm.VariableFilter(roles=[gm.roles.WEIGHT]), P("data"))]
        >>> placed = OptimizerPlacement(program.placement, program.layout, rules)
        >>> placed.copies(variables, program.placement.variables(variables, program.layout),
        ...               program.layout)["model"]["W"].spec
        P('data',)
    """

    def __init__(self, placement: Placement | None, layout: Layout,
                 rules: Sequence[ShardingRule] = ()) -> None:
        if placement is None:
            if rules:
                raise ValueError("optimize(optimizer_rules=...): the program runs on one "
                                 "device; compile it with mesh=... to place arrays by rules")
            self.rules: tuple[Rule, ...] = ()
            self.annotated: dict[tuple, PartitionSpec] = {}
            return
        self.mesh = placement.mesh
        self.rules = checked_rules(self.mesh, rules, "optimize", "optimizer_rules")
        for index, (rule_filter, _) in enumerate(self.rules):
            layout.resolve(rule_filter.brick_instances(), f"optimize(optimizer_rules[{index}])")
        self.annotated = {info.key: _annotated_spec(info.path, annotation)
                          for info, annotation in layout.metadata(_METADATA)}

    def lines(self) -> list[str]:
        """What places the optimizer's copies apart from their parameters, for a step's
        repr (nothing when nothing does)."""
        rules = [f"optimizer_rules[{index}]: ({rule_filter!r}, {spec})"
                 for index, (rule_filter, spec) in enumerate(self.rules)]
        if self.annotated:
            rules.append(f"{_METADATA} metadata of {len(self.annotated)} variables")
        return [f"optimizer state placed by {line}" for line in rules]

    def copies(self, variables: Mapping[str, object], shardings: Mapping[str, object],
               layout: Layout) -> Mapping[str, object]:
        """``shardings`` (the variables' own) with each model parameter's replaced by the
        placement of its optimizer copies. Raises ``ValueError`` naming the parameter, its
        shape and the rule or metadata when the spec does not fit it."""
        if not self.rules and not self.annotated:
            return shardings

        def model(node: object, placed: object, key: tuple) -> object:
            if isinstance(node, Mapping) and isinstance(placed, Mapping):  # the same nesting
                return {k: model(v, placed[k], (*key, k)) for k, v in node.items()}
            spec = self._spec(layout, key, tuple(jax.typeof(node).shape))
            return placed if spec is None else NamedSharding(self.mesh, spec)

        return {**shardings, "model": model(variables["model"], shardings["model"], ())}

    def _spec(self, layout: Layout, key: tuple, shape: tuple[int, ...]) -> PartitionSpec | None:
        what = "the optimizer's copies of parameter"
        spec = first_rule(self.rules, "optimize: optimizer_rules", layout, key, shape,
                          self.mesh, what)
        if spec is None and key in self.annotated:
            spec = fitting(self.annotated[key], f"optimize: its {_METADATA} metadata "
                           f"{self.annotated[key]}", what, layout.by_key[key].path, shape,
                           self.mesh)
        return spec


def _annotated_spec(path: str, annotation: object) -> PartitionSpec:
    """The ``PartitionSpec`` of a variable's ``optimizer_sharding`` metadata (mesh axes)."""
    if not isinstance(annotation, Iterable):
        raise TypeError(f"optimize: the {_METADATA} metadata of parameter {path} is "
                        f"{annotation!r}, not mesh axes: write it as a PartitionSpec, e.g. "
                        "nnx.with_metadata(init, optimizer_sharding=P('data'))")
    return PartitionSpec(*annotation)
