"""The order of a chain of managers: the user's order, with declared constraints resolved.

A manager declares what it must run before or after, by kind or by class, in three
attributes of its class (or of an instance, set in ``__init__``):

* ``kinds``: the kinds it is, strings such as ``"average"``, ``"parameter_rewrite"``,
  ``"batch_selection"``, ``"augmentation"``, ``"cost_on_stored_parameters"``;
* ``runs_before``: kinds or manager classes it must run before: further out in the chain,
  so it sees inputs and parameters first and outputs last (the first listed runs first);
* ``runs_after``: kinds or classes it must run after.

A constraint applies between the declaring manager and every other manager of the list of
that kind (``target in other.kinds``) or class (``isinstance(other, target)``).
:func:`resolve_order` sorts the list to satisfy every constraint that applies: a stable
topological sort. Among the managers free to go next it takes the one of highest
``priority``, then the one listed first, so the user's order (and ``priority``) wins
wherever nothing is declared, a list that satisfies its constraints is left as it is, and
every permutation of a list whose constraints order each pair of managers resolves to one
order. A declared constraint wins over ``priority``. ``compile`` keeps the managers as
listed with the constraints resolved (``program.managers``, what provenance records); each
trace's chain sorts that by priority too. Constraints that form a cycle raise
:class:`~graphmod.errors.ManagerConflict`, naming the managers and the constraints.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from graphmod.errors import ManagerConflict

if TYPE_CHECKING:
    from graphmod._core._managers._manager import Manager

__all__ = ["Constraint", "ManagerOrder", "declared_text", "resolve_order"]

# A constraint's target: a kind, or a manager class.
Target = str | type


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One declared constraint between two managers of a list: ``first`` runs before
    ``then``, because ``declared_by`` declares ``rule``.

    Examples:
        >>> from graphmod._core._managers._order import Constraint
        >>> str(Constraint("ema", "weight_norm", "ema", "EMA.runs_before 'parameter_rewrite'"))
        "ema before weight_norm (EMA.runs_before 'parameter_rewrite')"
    """

    first: str
    then: str
    declared_by: str
    rule: str

    def __str__(self) -> str:
        return f"{self.first} before {self.then} ({self.rule})"


class ManagerOrder(tuple):
    """Managers in their resolved chain order, outermost first (a tuple of them), with how
    they got there: ``listed`` (the names as given), ``constraints`` (every declared
    constraint that applies between two of them) and ``moves`` (those that reversed two
    managers of the list, ordered by priority and listing alone).

    Examples:
        >>> import graphmod as gm
        >>> from graphmod._core._managers._order import resolve_order
        >>> class Inner(gm.Manager):
        ...     kinds = ("inner",)
        >>> class Outer(gm.Manager):
        ...     runs_before = ("inner",)
        >>> order = resolve_order([Inner(), Outer()])
        >>> [m.name for m in order], order.listed
        (['outer', 'inner'], ('inner', 'outer'))
        >>> print(*order.lines(), sep="\\n")
        order: outer, inner (listed: inner, outer)
          moved: outer before inner (Outer.runs_before 'inner')
    """

    listed: tuple[str, ...]
    constraints: tuple[Constraint, ...]
    moves: tuple[Constraint, ...]

    def __new__(cls, managers: Sequence[Manager], listed: Sequence[str] = (),
                constraints: Sequence[Constraint] = (), moves: Sequence[Constraint] = ()
                ) -> ManagerOrder:
        order = super().__new__(cls, managers)
        order.listed = tuple(listed) or tuple(m.name for m in managers)
        order.constraints = tuple(constraints)
        order.moves = tuple(moves)
        return order

    def __reduce__(self) -> tuple[type[ManagerOrder], tuple[tuple[Manager, ...], tuple[str, ...],
                                                            tuple[Constraint, ...],
                                                            tuple[Constraint, ...]]]:
        return (ManagerOrder, (tuple(self), self.listed, self.constraints, self.moves))

    @property
    def names(self) -> tuple[str, ...]:
        """The managers' names in the resolved order."""
        return tuple(m.name for m in self)

    def lines(self) -> list[str]:
        """The resolved order and each constraint that moved a manager, as text lines (none
        when the constraints left the listed order as it was)."""
        if not self.moves:
            return []
        return [f"order: {', '.join(self.names)} (listed: {', '.join(self.listed)})",
                *(f"  moved: {move}" for move in self.moves)]


def resolve_order(managers: Sequence[Manager], *, priority: bool = True) -> ManagerOrder:
    """``managers`` sorted to satisfy their declared ordering constraints (see the module
    docstring); raises :class:`~graphmod.errors.ManagerConflict` for a cycle. Without
    ``priority`` the listed order alone breaks ties: the order ``program.managers`` keeps
    (as listed, constraints resolved), which the chain then sorts by priority as well.

    Examples:
        >>> import graphmod as gm
        >>> from graphmod._core._managers._order import resolve_order
        >>> a, b = gm.Manager(manager_name="a"), gm.Manager(manager_name="b", priority=1)
        >>> resolve_order([a, b]).names  # nothing declared: priority, then the listing
        ('b', 'a')
        >>> resolve_order([a, b], priority=False).names
        ('a', 'b')
    """
    listed = tuple(managers)
    constraints = _constraints(listed)
    after: dict[int, list[int]] = {i: [] for i in range(len(listed))}
    waiting = [0] * len(listed)
    for first, then, _ in constraints:
        after[first].append(then)
        waiting[then] += 1
    key = [(-manager.priority if priority else 0, index)
           for index, manager in enumerate(listed)]
    ready = [key[i] for i in range(len(listed)) if waiting[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, index = heapq.heappop(ready)
        order.append(index)
        for then in after[index]:
            waiting[then] -= 1
            if waiting[then] == 0:
                heapq.heappush(ready, key[then])
    if len(order) < len(listed):
        raise _cycle(listed, constraints, {i for i in range(len(listed)) if waiting[i]})
    plain = {index: position for position, index in enumerate(sorted(range(len(listed)),
                                                                      key=key.__getitem__))}
    found = [constraint for _, _, constraint in constraints]
    moves = [c for (first, then, c) in constraints if plain[first] > plain[then]]
    return ManagerOrder([listed[i] for i in order], [m.name for m in listed], found, moves)


def declared_text(manager: Manager) -> str:
    """What ``manager`` declares of the order, in a few words ("" if nothing).

    Examples:
        >>> import graphmod as gm
        >>> from graphmod._core._managers._order import declared_text
        >>> class EMA(gm.Manager):
        ...     kinds, runs_before = ("average",), ("parameter_rewrite",)
        >>> declared_text(EMA())
        "average, runs before 'parameter_rewrite'"
    """
    kinds, before, after = _declared(manager)
    parts = [", ".join(kinds)] if kinds else []
    for word, targets in (("before", before), ("after", after)):
        if targets:
            parts.append(f"runs {word} {', '.join(map(_target_text, targets))}")
    return ", ".join(parts)


def _constraints(managers: tuple[Manager, ...]) -> list[tuple[int, int, Constraint]]:
    """Every declared constraint between two of ``managers``: (first, then, constraint),
    ``first`` and ``then`` their positions; one per pair and direction."""
    found: dict[tuple[int, int], Constraint] = {}
    for index, manager in enumerate(managers):
        _, before, after = _declared(manager)
        for attribute, targets in (("runs_before", before), ("runs_after", after)):
            for target in targets:
                rule = f"{type(manager).__name__}.{attribute} {_target_text(target)}"
                for other_index, other in enumerate(managers):
                    if other_index == index or not _is(other, target):
                        continue
                    pair = (index, other_index) if attribute == "runs_before" else (
                        other_index, index)
                    found.setdefault(pair, Constraint(managers[pair[0]].name,
                                                      managers[pair[1]].name, manager.name, rule))
    return [(first, then, constraint) for (first, then), constraint in found.items()]


def _declared(manager: Manager) -> tuple[tuple[str, ...], tuple[Target, ...], tuple[Target, ...]]:
    """A manager's ``kinds``, ``runs_before`` and ``runs_after``, checked."""
    owner = type(manager).__name__
    kinds: list[str] = []
    for kind in _tuple(getattr(manager, "kinds", ()), f"{owner}.kinds"):
        if not isinstance(kind, str) or not kind:
            raise TypeError(f"{owner}.kinds: {kind!r} is not a kind; kinds are non-empty "
                            "strings, e.g. kinds = ('augmentation',)")
        kinds.append(kind)
    targets: list[tuple[Target, ...]] = []
    for attribute in ("runs_before", "runs_after"):
        chosen: list[Target] = []
        for target in _tuple(getattr(manager, attribute, ()), f"{owner}.{attribute}"):
            if not (isinstance(target, str) and target) and not isinstance(target, type):
                raise TypeError(
                    f"{owner}.{attribute}: {target!r} is neither a kind (a string, e.g. "
                    "'augmentation') nor a manager class (e.g. managers.EMA)")
            chosen.append(target)
        targets.append(tuple(chosen))
    return tuple(kinds), targets[0], targets[1]


def _tuple(value: object, what: str) -> tuple[object, ...]:
    if isinstance(value, str | type):  # kinds = "average": one kind, not five letters
        return (value,)
    try:
        if isinstance(value, Iterable):
            return tuple(value)
    except TypeError:
        pass
    raise TypeError(f"{what}: expected a tuple of kinds or classes, got {value!r}") from None


def _is(manager: Manager, target: Target) -> bool:
    if isinstance(target, str):
        return target in _tuple(getattr(manager, "kinds", ()), type(manager).__name__)
    return isinstance(manager, target)


def _target_text(target: Target) -> str:
    return repr(target) if isinstance(target, str) else target.__name__


def _cycle(managers: tuple[Manager, ...], constraints: list[tuple[int, int, Constraint]],
           stuck: set[int]) -> ManagerConflict:
    """The error naming one cycle among the managers ``stuck`` in the sort (each waits for
    another of them)."""
    before = {then: (first, c) for first, then, c in constraints
              if first in stuck and then in stuck}  # each stuck manager waits for one
    path: list[int] = [min(stuck)]
    while path[-1] not in path[:-1]:
        path.append(before[path[-1]][0])
    loop = path[path.index(path[-1]):]  # walked backwards, closing where it began
    steps = [before[loop[k]][1] for k in reversed(range(len(loop) - 1))]
    names = ", ".join(dict.fromkeys(managers[i].name for i in loop))
    return ManagerConflict(
        f"the ordering constraints of managers {names} form a cycle: "
        + "; ".join(map(str, steps)) + ". No order runs each of them before the next: "
        "leave one of these managers out, or change its declared runs_before/runs_after "
        "(an instance's own attribute wins over its class's)")
