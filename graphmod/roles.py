"""Variable roles: singletons with a hierarchy, as in Blocks.

A role says what a tagged variable *is* in a computation: an input or output of an
application, a parameter, running state, an auxiliary value. Filters for a role match its
sub-roles, so a filter for ``PARAMETER`` matches weights and biases::

    PERSISTENT ⊃ PARAMETER ⊃ WEIGHT ⊃ FILTER
                 PARAMETER ⊃ BIAS
    PERSISTENT ⊃ STATE

Users add roles with :func:`add_role`. Roles are hashable, picklable (by name) and
deep-copyable (a role copies to itself).

Examples:
    >>> from graphmod import roles
    >>> roles.WEIGHT.is_a(roles.PARAMETER)
    True
    >>> roles.BIAS.is_a(roles.WEIGHT)
    False
    >>> ATTENTION = roles.add_role("ATTENTION_WEIGHT", roles.WEIGHT)
    >>> ATTENTION.is_a(roles.PARAMETER)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from graphmod._core._naming import did_you_mean

__all__ = [
    "AUXILIARY",
    "BIAS",
    "CARRIED",
    "COST",
    "FILTER",
    "HYPERPARAMETER",
    "INITIAL_STATE",
    "INPUT",
    "OUTPUT",
    "PARAMETER",
    "PERSISTENT",
    "STATE",
    "TARGET",
    "WEIGHT",
    "Role",
    "add_role",
    "as_role",
    "as_roles",
    "get_role",
]


class Role:
    """A variable role. Create roles with :func:`add_role`, never directly.

    Examples:
        >>> from graphmod import roles
        >>> roles.FILTER.is_a(roles.WEIGHT), roles.FILTER.parent
        (True, WEIGHT)
    """

    __slots__ = ("name", "parent")

    name: str
    parent: Role | None

    def __init__(self, name: str, parent: Role | None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "parent", parent)

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError(f"roles are immutable: cannot set {key!r} on {self.name}")

    def is_a(self, other: Role) -> bool:
        """Whether this role is ``other`` or one of its sub-roles."""
        role: Role | None = self
        while role is not None:
            if role is other:
                return True
            role = role.parent
        return False

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple[Callable[[str], Role], tuple[str]]:
        return get_role, (self.name,)

    def __copy__(self) -> Role:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Role:
        return self


# The registry is written once per role name (at import or by ``add_role``) and never
# changed after; roles are singletons, so it is a table of constants, not mutable state.
_REGISTRY: dict[str, Role] = {}


def add_role(name: str, parent: Role | None = None) -> Role:
    """Registers a new role, optionally as a sub-role of ``parent``.

    Adding a role again with the same parent returns the existing singleton.

    Args:
        name: a unique upper-case name, e.g. ``"ATTENTION_WEIGHT"``.
        parent: the role it specialises, or None for a new root.

    Returns:
        The role singleton.

    Examples:
        >>> from graphmod import roles
        >>> GATE = roles.add_role("GATE_BIAS", roles.BIAS)
        >>> GATE.is_a(roles.PARAMETER), roles.add_role("GATE_BIAS", roles.BIAS) is GATE
        (True, True)
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"add_role: name must be a non-empty string, got {name!r}")
    if parent is not None and not isinstance(parent, Role):
        raise TypeError(f"add_role: parent of {name!r} must be a Role, got {parent!r}")
    existing = _REGISTRY.get(name)
    if existing is not None:
        if existing.parent is not parent:
            raise ValueError(
                f"role {name!r} already exists with parent {existing.parent!r}, "
                f"not {parent!r}: choose another name"
            )
        return existing
    role = Role(name, parent)
    _REGISTRY[name] = role
    return role


def get_role(name: str) -> Role:
    """The role registered under ``name``.

    Examples:
        >>> from graphmod import roles
        >>> roles.get_role("WEIGHT") is roles.WEIGHT
        True
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown role {name!r}{did_you_mean(name, _REGISTRY)}; known roles: "
            f"{', '.join(sorted(_REGISTRY))}"
        ) from None


def as_role(value: object, *, argument: str = "roles") -> Role:
    """``value`` as a Role, or a TypeError naming ``argument`` and the bad value.

    Examples:
        >>> from graphmod import roles
        >>> roles.as_role(roles.INPUT)
        INPUT
    """
    if isinstance(value, Role):
        return value
    raise TypeError(
        f"{argument}: {value!r} is not a role; use one of graphmod.roles "
        f"({', '.join(sorted(_REGISTRY))}) or graphmod.roles.add_role(...)"
    )


def as_roles(values: object, *, argument: str = "roles") -> tuple[Role, ...]:
    """A tuple of roles from one role or an iterable of roles, checking each.

    Examples:
        >>> from graphmod import roles
        >>> roles.as_roles(roles.WEIGHT), roles.as_roles([roles.WEIGHT, roles.BIAS])
        ((WEIGHT,), (WEIGHT, BIAS))
    """
    if isinstance(values, Role):
        return (values,)
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise TypeError(f"{argument}: expected a list of roles, got {values!r}")
    return tuple(as_role(v, argument=argument) for v in values)


INPUT = add_role("INPUT")
OUTPUT = add_role("OUTPUT")
COST = add_role("COST")
AUXILIARY = add_role("AUXILIARY")
TARGET = add_role("TARGET")
INITIAL_STATE = add_role("INITIAL_STATE")
PERSISTENT = add_role("PERSISTENT")
PARAMETER = add_role("PARAMETER", PERSISTENT)
WEIGHT = add_role("WEIGHT", PARAMETER)
FILTER = add_role("FILTER", WEIGHT)
BIAS = add_role("BIAS", PARAMETER)
STATE = add_role("STATE", PERSISTENT)
HYPERPARAMETER = add_role("HYPERPARAMETER")
CARRIED = add_role("CARRIED")  # other Flax variables (RngCount, ...): carried, never rewritten
