"""Placement rules, ``(VariableFilter, PartitionSpec)`` pairs: checked when they are
given, matched to a model variable (the first whose filter selects it places it), and
fitted to its shape on a mesh. ``compile(rules=...)`` places variables by them,
``optimize(optimizer_rules=...)`` the optimizer's copies of parameters. A rule of the
user's that selects no variable of the model is refused at ``compile``; a preset's
(:class:`PresetRule`) may select none."""

from __future__ import annotations

import glob
import math
from collections.abc import Sequence
from typing import TypeAlias

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from graphmod._core._model._layout import Layout
from graphmod._core._selection._filter import VariableFilter
from graphmod._core._selection._per_layer import PerLayer
from graphmod._core._selection._selection import stored_tag
from graphmod._core._warn import warn
from graphmod.typing import AxisName

__all__ = ["PresetRule", "Rule", "axis_names", "check_rules_select",
           "checked_rules", "first_rule", "fitting", "misfit"]


Rule = tuple[VariableFilter, PartitionSpec | PerLayer]
# A spec, or its entries: per dimension None (whole), a mesh axis or a tuple of them.
SpecLike: TypeAlias = "PartitionSpec | Sequence[AxisName | None]"


class PresetRule(tuple):
    """A ``(VariableFilter, spec)`` rule made by a :mod:`graphmod.sharding` preset. It may
    select no variable of a model, since a preset serves a family of models
    (``tensor_parallel``'s attention rules on a plain MLP); a rule of the user's may not.
    It is a tuple, so it travels in lists of rules as any pair does.

    Examples:
        >>> import graphmod as gm
        >>> from jax.sharding import PartitionSpec as P
        >>> rule = PresetRule((gm.VariableFilter(name="W"), P("data")))
        >>> rule, isinstance(gm.sharding.fsdp()["rules"][0], PresetRule)
        ((VariableFilter(name='W'), P('data',)), True)
    """

    __slots__ = ()


def first_rule(rules: Sequence[Rule], argument: str, layout: Layout, key: tuple,
               shape: tuple[int, ...], mesh: Mesh, what: str) -> PartitionSpec | None:
    """The spec of the first of ``rules`` whose filter selects the model variable at
    ``key`` (None if none does), checked to fit ``shape`` by :func:`fitting`.

    Examples:
        >>> import jax, graphmod as gm
        >>> from flax import nnx
        >>> from jax.sharding import PartitionSpec as P
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 4, rngs=nnx.Rngs(0)))
        >>> rules = [(gm.VariableFilter(name="W"), P(None, "data"))]
        >>> first_rule(rules, "rules", program.layout, ("W",), (2, 4),
        ...            jax.make_mesh((1,), ("data",)), "variable")
        P(None, 'data')
    """
    tag = stored_tag(layout, key)
    for index, (rule_filter, spec) in enumerate(rules):
        if rule_filter.matches(tag, layout.instance_paths):
            placed = (spec.placing(layout.stacked(layout.by_key[key].identity))
                      if isinstance(spec, PerLayer) else spec)
            return fitting(placed, f"{argument}[{index}] ({rule_filter!r}, {spec})", what,
                           tag.path, shape, mesh)
    return None


def fitting(spec: PartitionSpec, source: str, what: str, path: str, shape: tuple[int, ...],
            mesh: Mesh) -> PartitionSpec:
    """``spec``, or a ``ValueError`` naming ``source`` (a rule, a variable's metadata),
    ``what`` it places (a variable, an optimizer's copies), its path and shape, and why
    the spec does not fit it (:func:`misfit`).

    Examples:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> fitting(P("data"), "rules[0]", "variable", "/W", (8, 2),
        ...         jax.make_mesh((1,), ("data",)))
        P('data',)
    """
    why = misfit(spec, shape, mesh)
    if why is not None:
        rule = f"VariableFilter(path={glob.escape(path)!r})"
        later = _later_dimension(spec, shape, mesh)
        raise ValueError(f"{source} does not fit {what} {path} of shape {shape}: {why}; "
                         "narrow the rule's filter (e.g. roles=[WEIGHT]), change the spec "
                         "(None leaves a dimension whole), "
                         + (f"split a later dimension with a rule before it (a weight "
                            f"stacked over scanned layers has the layers first): ({rule}, "
                            f"{later}), " if later is not None else "")
                         + f"or keep this one whole with a rule before it ({rule}, "
                         "PartitionSpec())")
    return spec


def _later_dimension(spec: SpecLike, shape: Sequence[int], mesh: Mesh
                     ) -> PartitionSpec | None:
    """``spec``'s one split moved to the first later dimension it fits, if it has one split
    (fsdp's ``P('data')``) and such a dimension."""
    splits = [dim for dim, entry in enumerate(spec) if entry is not None]
    if len(splits) != 1:
        return None
    entry = spec[splits[0]]
    for dim in range(splits[0] + 1, len(shape)):
        moved = PartitionSpec(*[None] * dim, entry)
        if misfit(moved, shape, mesh) is None:
            return moved
    return None


def misfit(spec: SpecLike, shape: Sequence[int], mesh: Mesh) -> str | None:
    """Why ``spec`` cannot split an array of ``shape`` on ``mesh`` (more dimensions than
    the array, an axis the mesh lacks, a size its axes do not divide), or None if it can.

    Examples:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> misfit(P("data", None), (8, 3), mesh) is None
        True
        >>> misfit(P(None, "model"), (8, 3), mesh)
        "the mesh has no axis 'model' (its axes: ('data',))"
    """
    if len(spec) > len(shape):
        return f"the spec names {len(spec)} dimensions, the array has {len(shape)}"
    for dim, entry in enumerate(spec):
        missing = [axis for axis in axis_names(entry) if axis not in mesh.axis_names]
        if missing:
            return f"the mesh has no axis {missing[0]!r} (its axes: {tuple(mesh.axis_names)})"
        size = math.prod(mesh.shape[axis] for axis in axis_names(entry))
        if shape[dim] % size:
            return (f"dimension {dim} ({shape[dim]}) is not divisible by mesh axes "
                    f"{entry!r} of size {size}")
    return None


def axis_names(entry: AxisName | None) -> tuple[str, ...]:
    """The mesh axes a spec entry (None, a name or a tuple of names) splits over."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def checked_rules(mesh: Mesh, rules: object, caller: str = "compile",
                  argument: str = "rules") -> tuple[Rule, ...]:
    """``rules`` (``caller(argument=[...])``) as ``(VariableFilter, PartitionSpec)`` pairs
    whose axes ``mesh`` has; a ``TypeError`` or ``ValueError`` naming the rule otherwise.

    Examples:
        >>> import jax, graphmod as gm
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("data",))
        >>> checked_rules(mesh, [(gm.VariableFilter(name="W"), P("data"))])[0][1]
        P('data',)
    """
    where = f"{caller}({argument}=[(VariableFilter(...), PartitionSpec(...)), ...])"
    if not isinstance(rules, Sequence) or isinstance(rules, str):
        raise TypeError(f"{where}: expected a list of pairs, got {rules!r}; a preset of "
                        "graphmod.sharding is called and spread: compile(..., "
                        "**gm.sharding.fsdp())")
    return tuple(_checked_rule(mesh, where, argument, index, rule)
                 for index, rule in enumerate(rules))


def check_rules_select(rules: Sequence[Rule], layout: Layout) -> None:
    """Refuses a rule of the user's that selects no variable of the model, which would
    place nothing without a word (a path copied from a table, ``model/linear1/kernel``,
    where filters glob ``/linear1.kernel``); a preset's rule may (:class:`PresetRule`), and
    when no rule at all selects a variable, warns that every variable is replicated.

    Examples:
        >>> import jax, graphmod as gm
        >>> from flax import nnx
        >>> from jax.sharding import PartitionSpec as P
        >>> layout = gm.compile(lambda m, x: m(x), nnx.Linear(2, 4, rngs=nnx.Rngs(0))).layout
        >>> check_rules_select([(gm.VariableFilter(path="/kernel"), P("data"))], layout)
        Traceback (most recent call last):
        ...
        ValueError: compile(rules=...): rules[0] (VariableFilter(path='/kernel'), \
P('data',)) selects no variable of the model, so it would place nothing; a rule's path= \
globs the variables' paths, such as /.bias, /.kernel. Fix its filter, or drop the rule
    """
    tags = [stored_tag(layout, info.key) for info in layout.variables]
    examples = ", ".join(info.path for info in layout.variables[:3])
    selecting = [any(f.matches(tag, layout.instance_paths) for tag in tags) for f, _ in rules]
    for index, (rule, selects) in enumerate(zip(rules, selecting, strict=True)):
        if not selects and not isinstance(rule, PresetRule):
            raise ValueError(f"compile(rules=...): rules[{index}] ({rule[0]!r}, {rule[1]}) "
                             "selects no variable of the model, so it would place nothing; a "
                             f"rule's path= globs the variables' paths, such as {examples}. "
                             "Fix its filter, or drop the rule")
    if rules and not any(selecting):
        warn(f"compile(rules=...): no rule of the preset selects a variable of the model, "
             f"so every variable is replicated; the variables' paths are such as {examples}")


def _checked_rule(mesh: Mesh, where: str, argument: str, index: int, rule: object) -> Rule:
    if not (isinstance(rule, tuple | list) and len(rule) == 2
            and isinstance(rule[0], VariableFilter)
            and isinstance(rule[1], PartitionSpec | PerLayer)):
        raise TypeError(f"{where}: {argument}[{index}] must be a (VariableFilter, "
                        f"PartitionSpec) pair, got {rule!r}{_pair_hint(rule, argument)}")
    rule_filter, spec = rule
    if rule_filter.applications is not None or rule_filter.call_id is not None:
        raise TypeError(f"{where}: {argument}[{index}] {rule_filter!r} selects application "
                        "calls; a stored variable belongs to no call: use bricks=, roles=, "
                        "name=, name_regex= or path=")
    entries = spec.spec if isinstance(spec, PerLayer) else spec
    named = [axis for entry in entries for axis in axis_names(entry)]
    for axis in named:
        if axis not in mesh.axis_names:
            raise ValueError(f"{where}: {argument}[{index}] ({rule_filter!r}, {spec}) "
                             f"names mesh axis {axis!r}; the mesh's axes are "
                             f"{tuple(mesh.axis_names)}")
        if named.count(axis) > 1:
            raise ValueError(f"{where}: {argument}[{index}] ({rule_filter!r}, {spec}) "
                             f"names mesh axis {axis!r} twice; an axis splits one dimension "
                             "of a variable")
    return PresetRule(rule) if isinstance(rule, PresetRule) else (rule_filter, spec)


def _pair_hint(rule: object, argument: str) -> str:
    """What a rule that is no (filter, spec) pair was probably meant to be."""
    if isinstance(rule, VariableFilter):
        return f": {argument}= is a list of pairs, {argument}=[(filter, spec)]"
    spec = rule[1] if isinstance(rule, tuple | list) and len(rule) == 2 else None
    if isinstance(spec, NamedSharding):
        return f": give its PartitionSpec, {spec.spec}"
    if isinstance(spec, tuple | list | str):
        entries = tuple(spec) if isinstance(spec, tuple | list) else (spec,)
        return f": write the spec as PartitionSpec{entries!r}".replace(",)", ")")
    return ""
