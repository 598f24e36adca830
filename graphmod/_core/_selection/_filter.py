"""``VariableFilter``: one filter language for graphs, managers and monitoring.

A filter selects *tagged variables*: inputs, outputs, parameters and auxiliary values of
application calls. Its fields follow Blocks' ``VariableFilter``; every given field must
match (fields left as None match anything).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import re
import sys
from collections.abc import Callable, Iterable
from typing import TypeAlias

from flax import nnx

from graphmod import roles as _roles
from graphmod._core._number_checks import is_whole_number

_EXAMPLES = {"name": "W", "name_regex": "W|b", "path": "/layers/*"}


@dataclasses.dataclass(frozen=True)
class Tag:
    """A tagged variable of one application call, as filters see it."""

    role: _roles.Role
    name: str
    path: str  # the variable's path: "/layers/0.W", "/layers/0.apply.input_"
    brick_path: str
    application: str
    call_id: int
    brick: object = dataclasses.field(default=None, repr=False, compare=False)  # its module
    aliases: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def label(self) -> str:
        """The variable as tables show it: its name, or for a model variable the call reads
        from below its module (a Linen module's ``Dense_0.kernel`` under Flax's ``ToNNX``,
        a child's weight) its path from there, or from elsewhere its whole path."""
        paths = (self.path, *self.aliases)  # a tied weight is also the module's own
        if {f"{self.brick_path}.{self.name}",
                f"{self.brick_path}.{self.application}.{self.name}"} & set(paths):
            return self.name
        below = self.brick_path.rstrip("/") + "/"
        return next((p[len(below):] for p in paths if p.startswith(below)), self.path)


def _as_tuple(value: object) -> tuple[object, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        return (value,)
    return tuple(value)


def _members(bricks: Iterable[object]) -> tuple[object, ...]:
    """``bricks`` with each ``nnx.List`` or ``nnx.Dict`` among them replaced by its modules
    (``bricks=[model.layers, model.head]``): a container has no application of its own."""
    out: list[object] = []
    for brick in bricks:
        if isinstance(brick, nnx.List | nnx.Dict):
            out += _members(tuple(brick.values() if isinstance(brick, nnx.Dict) else brick))
        else:
            out.append(brick)
    return tuple(out)


def application_name(value: object) -> str:
    """The name of an application given by name or as the decorated method."""
    if isinstance(value, str):
        return value
    name = getattr(value, "__graphmod_application__", None)
    if name is None:
        raise TypeError(
            f"applications: {value!r} is neither a name nor a @graphmod.application method"
        )
    return name


def _flax_method(value: object) -> tuple[nnx.Module | type[nnx.Module], str] | None:
    """``(self or class, application name)`` for a method of a plain Flax module, bound
    (``model.linear.__call__``) or unbound (``nnx.Linear.__call__``), else None."""
    function = getattr(value, "__func__", value)
    if not inspect.isfunction(function) or hasattr(function, "__graphmod_application__"):
        return None
    name = "apply" if function.__name__ == "__call__" else function.__name__
    if inspect.ismethod(value):
        owner = value.__self__
        return (owner, name) if isinstance(owner, nnx.Module) else None
    # An unbound method: its class, found by its qualified name in its module.
    owner = sys.modules.get(function.__module__)
    *classes, method = function.__qualname__.split(".")
    for part in classes:
        owner = getattr(owner, part, None)
    if not (isinstance(owner, type) and issubclass(owner, nnx.Module)
            and vars(owner).get(method) is function):
        return None
    return owner, name


@dataclasses.dataclass(frozen=True)
class ClassApplication:
    """The application of every instance of one Flax module class, from an unbound method
    (``nnx.Linear.__call__``, read as ``apply``; ``nnx.Embed.attend``).

    Examples:
        >>> import graphmod as gm
        >>> from flax import nnx
        >>> gm.VariableFilter(applications=[nnx.Embed.attend]).applications
        (ClassApplication(owner=<class 'flax.nnx.nn.linear.Embed'>, name='attend'),)
    """

    owner: type
    name: str


@dataclasses.dataclass(frozen=True, eq=False)
class BoundApplication:
    """One brick instance's application, from a bound method (``model.layer.apply``).

    Examples:
        >>> import graphmod as gm
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))
        >>> gm.VariableFilter(applications=[lin.apply]).applications[0].name
        'apply'
    """

    brick: object  # the module (a brick or a plain Flax module)
    name: str

    def __repr__(self) -> str:
        return f"<{self.name} of {type(self.brick).__name__} at 0x{id(self.brick):x}>"


def bound_application(value: object) -> BoundApplication | None:
    """The instance's application a bound application method names, else None."""
    if isinstance(value, BoundApplication):
        return value
    name = getattr(value, "__graphmod_application__", None)
    if name is not None and inspect.ismethod(value) and not isinstance(value.__self__, type):
        return BoundApplication(value.__self__, name)
    flax_method = _flax_method(value)
    if flax_method is not None and isinstance(flax_method[0], nnx.Module):
        return BoundApplication(*flax_method)
    return None


def class_application(value: object) -> ClassApplication | None:
    """Every instance's application an unbound Flax method names, else None."""
    if isinstance(value, ClassApplication):
        return value
    flax_method = _flax_method(value)
    if flax_method is None or not isinstance(flax_method[0], type):
        return None
    return ClassApplication(flax_method[0], flax_method[1])


Application: TypeAlias = "str | BoundApplication | ClassApplication"  # as a filter holds it
# What bricks= and applications= take: a brick (a module) or a class of them; an application
# by name, as a method, or as a filter holds it.
BrickSelector: TypeAlias = "nnx.Module | type"
ApplicationSelector: TypeAlias = "str | Callable[..., object] | BoundApplication | ClassApplication"


def _application(value: object) -> Application:
    """A name (every instance's application), one instance's (a bound method) or every
    instance's of one Flax class (an unbound Flax method)."""
    bound = bound_application(value)
    if bound is not None:
        return bound
    by_class = class_application(value)
    if by_class is not None:
        return by_class
    if inspect.isfunction(value) and not hasattr(value, "__graphmod_application__"):
        raise TypeError(
            f"applications: {value.__qualname__} is not a method of a flax.nnx.Module class "
            "reachable by its name (a class defined inside a function is not); select it "
            f"with bricks=[TheClass], applications=[{value.__name__!r}] instead"
        )
    return application_name(value)


def _check_brick(brick: object) -> None:
    """Refuses what ``bricks=`` cannot take, naming what was probably meant."""
    if isinstance(brick, type) and issubclass(brick, nnx.Variable):
        raise TypeError(
            f"VariableFilter(bricks=...): {brick.__name__} is a Variable type, not a brick "
            "class: select its variables by role (roles=[...]: a class attribute role= of "
            "the type gives its own) or by name (name=...)")
    if isinstance(brick, nnx.Variable):  # its repr would print the whole array
        raise TypeError(
            f"VariableFilter(bricks=...): got a {type(brick).__name__} variable, not a brick: "
            "select variables by name (name='kernel') or path (path='/layers/linear.kernel'), "
            "their module by bricks=[the module]")
    if not isinstance(brick, type | nnx.Module):
        fix = _path_fix(brick) if isinstance(brick, str) else ""
        raise TypeError(
            f"VariableFilter(bricks=...): {brick!r} is neither a Brick instance nor a brick "
            f"class (any flax.nnx.Module instance or class){fix}")


def _path_fix(text: str) -> str:
    """The ``path=`` meant by a string given as a brick: a glob as it is, else the
    brick's variables or its whole subtree."""
    if any(c in text for c in "*?["):
        return f"; to select by path, give path={rooted(text)!r}"
    return f"; to select by path, give {brick_globs(rooted(text).rstrip('/') or '/')}"


def rooted(glob: str) -> str:
    """``glob`` as a path: starting with '/' (or a wildcard, which may match it)."""
    return glob if glob.startswith(("/", "*")) else "/" + glob


def brick_globs(path: str) -> str:
    """The two ``path=`` globs that select by a brick's ``path``: its own variables (or
    calls), and with its children's."""
    return f"path='{path}.*' (its own) or path='{path}*' (with its children's)"


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class VariableFilter:
    """Selects tagged variables by role, brick, application, name, path and call id.

    Args:
        roles: roles to match; a variable matches if its role is one of them or a sub-role
            (with ``each_role=True`` it must be a sub-role of every one).
        bricks: brick instances (matched by their path in the model: a parent matches its
            own applications, not its children's; an ``nnx.List`` or ``nnx.Dict`` of them
            stands for its members) or brick classes (``isinstance``).
        applications: application names or the methods: an unbound brick application
            (``Linear.apply``) matches that application of every instance by name, an
            unbound Flax method (``nnx.Linear.__call__``) every instance of that class, a
            bound one (``model.layers[0].apply``, ``model.linear1.__call__``) only that
            instance's (by its path in the model).
        name: the variable's exact name (``"W"``, ``"input_"``).
        name_regex: a regular expression matched at the start of the name.
        path: a glob over the variable's path, e.g. ``"/layers/*"`` or ``"*.W"``.
        call_id: one call id or several.
        each_role: require every listed role rather than any.

    Examples:
        >>> import graphmod as gm
        >>> from graphmod import roles
        >>> f = gm.VariableFilter(roles=[roles.PARAMETER], name_regex="W")
        >>> f
        VariableFilter(roles=(PARAMETER,), name_regex='W')
    """

    # As the filter holds them once __post_init__ has checked and normalized what __init__
    # (or a dataclass subclass's) took.
    roles: tuple[_roles.Role, ...] | None = None
    bricks: tuple[BrickSelector, ...] | None = None
    applications: tuple[Application, ...] | None = None
    name: str | None = None
    name_regex: str | None = None
    path: str | None = None
    call_id: tuple[int, ...] | None = None
    each_role: bool = False

    def __init__(self, roles: _roles.Role | Iterable[_roles.Role] | None = None,
                 bricks: BrickSelector | Iterable[BrickSelector] | None = None,
                 applications: ApplicationSelector | Iterable[ApplicationSelector] | None = None,
                 name: str | None = None, name_regex: str | None = None,
                 path: str | None = None, call_id: int | Iterable[int] | None = None,
                 each_role: bool = False) -> None:
        # As a dataclass's own __init__ (a subclass's runs __post_init__ the same way), with
        # the types of what each field takes.
        given = (roles, bricks, applications, name, name_regex, path, call_id, each_role)
        for field, value in zip(dataclasses.fields(VariableFilter), given, strict=True):
            object.__setattr__(self, field.name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if self.roles is not None:
            set_("roles", _roles.as_roles(self.roles, argument="VariableFilter(roles=...)"))
        bricks = _as_tuple(self.bricks)
        if bricks is not None:
            bricks = _members((self.bricks,) if isinstance(self.bricks, nnx.Dict) else bricks)
            for brick in bricks:
                _check_brick(brick)
        set_("bricks", bricks)
        apps = _as_tuple(self.applications)
        set_("applications", None if apps is None else tuple(map(_application, apps)))
        if self.name_regex is not None:
            try:
                re.compile(self.name_regex)
            except re.error as error:
                raise ValueError(
                    f"VariableFilter(name_regex={self.name_regex!r}) is not a valid regular "
                    f"expression: {error}"
                ) from None
        for field in ("name", "name_regex", "path"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"VariableFilter({field}={value!r}): must be a string "
                                f"(e.g. {field}={_EXAMPLES[field]!r})")
        call_ids = _as_tuple(self.call_id)
        for call_id in call_ids or ():
            if not is_whole_number(call_id, least=0):
                raise TypeError(f"VariableFilter(call_id={self.call_id!r}): call ids are "
                                "ints >= 0 (one, or several in a list)")
        set_("call_id", call_ids)

    def __repr__(self) -> str:
        return self.as_text()

    def as_text(self, brick_path: Callable[[object], str | None] = lambda brick: None) -> str:
        """This filter as text; brick instances as ``brick_path(brick)`` (their path in a
        model) where it knows them, else as ``<Class at 0x…>``, never their own long repr.

        Examples:
            >>> import graphmod as gm
            >>> from flax import nnx
            >>> lin = gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0))
            >>> gm.VariableFilter(bricks=[lin, gm.bricks.Linear]).as_text(lambda b: "/lin")
            'VariableFilter(bricks=(/lin, Linear))'
        """
        def brick(b: object) -> str:
            if isinstance(b, type):
                return b.__name__
            return brick_path(b) or f"<{type(b).__name__} at 0x{id(b):x}>"

        fields = [
            f"{f.name}=({', '.join(map(brick, self.bricks))}{',' * (len(self.bricks) == 1)})"
            if f.name == "bricks" and self.bricks is not None
            else f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) not in (None, False)
        ]
        return f"VariableFilter({', '.join(fields)})"

    @property
    def selects_variables(self) -> bool:
        """Whether any field narrows the variables of a matched application."""
        return any(x is not None for x in (self.roles, self.name, self.name_regex, self.path))

    def names_role(self, role: _roles.Role) -> bool:
        """Whether ``roles=`` names ``role``, a role under it or one above it: a choice of
        its variables made on purpose, not by a wider field (``path=``, no ``roles=``).

        Examples:
            >>> from graphmod import roles
            >>> VariableFilter(roles=[roles.PERSISTENT]).names_role(roles.STATE)
            True
            >>> VariableFilter(path="/norm*").names_role(roles.STATE)
            False
        """
        return any(r.is_a(role) or role.is_a(r) for r in self.roles or ())

    def brick_instances(self) -> tuple[object, ...]:
        """The brick instances this filter names, in ``bricks`` or as bound applications
        (to be resolved to paths at compile)."""
        return tuple(b for b in self.bricks or () if not isinstance(b, type)) + tuple(
            a.brick for a in self.applications or () if isinstance(a, BoundApplication))

    def matches_application(
        self, brick: object, brick_path: str, application: str, call_id: int,
        instance_paths: dict[int, str],
    ) -> bool:
        """Whether an application call is selected (bricks, applications, call_id).

        ``instance_paths`` maps ``id(brick instance)`` named by this filter to its path.
        """
        if self.applications is not None and not any(
            a == application if isinstance(a, str)
            else a.name == application and isinstance(brick, a.owner)
            if isinstance(a, ClassApplication)
            else a.name == application and instance_paths[id(a.brick)] == brick_path
            for a in self.applications
        ):
            return False
        if self.call_id is not None and call_id not in self.call_id:
            return False
        if self.bricks is not None:
            return any(
                isinstance(brick, b) if isinstance(b, type) else instance_paths[id(b)] == brick_path
                for b in self.bricks
            )
        return True

    def matches_call(self, brick: object, brick_path: str, application: str, call_id: int,
                     instance_paths: dict[int, str]) -> bool:
        """Whether an application call is selected as a whole, for a manager that only
        wraps calls: its application matches, ``path`` (if any) globs the call's path
        (``/layers/0.apply``), and no field selects variables (roles, names)."""
        return self.matches_application(brick, brick_path, application, call_id,
                                        instance_paths) and (
            self.roles is None and self.name is None and self.name_regex is None) and (
            self.path is None or fnmatch.fnmatchcase(f"{brick_path}.{application}", self.path))

    def matches_variable(self, tag: Tag) -> bool:
        """Whether a tagged variable of an already selected application is selected."""
        if self.roles is not None:
            hits = (tag.role.is_a(r) for r in self.roles)
            if not (all(hits) if self.each_role else any(hits)):
                return False
        if self.name is not None and tag.name != self.name:
            return False
        if self.name_regex is not None and not re.match(self.name_regex, tag.name):
            return False
        return self.path is None or fnmatch.fnmatchcase(tag.path, self.path)

    def matches(self, tag: Tag, instance_paths: dict[int, str]) -> bool:
        """Whether ``tag`` is selected by every field of this filter."""
        return self.matches_application(
            tag.brick, tag.brick_path, tag.application, tag.call_id, instance_paths
        ) and self.matches_variable(tag)
