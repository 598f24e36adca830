"""Public import paths of classes and functions, and their safe resolution for ``rebuild``.

Recording finds the shortest public path under which an object is reachable in modules
already imported (``jax.nn.relu``, ``graphmod.bricks.MLP``), never importing anything.
Resolving checks the path's syntax and top-level package against an allow-list *before*
importing, and checks again that what it reached belongs to an allowed package (a module
may re-export ``os.system``).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import types
from collections.abc import Iterable
from typing import Any

DEFAULT_ALLOWED = frozenset({"graphmod", "managers", "jax", "flax", "optax"})
_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
# Public namespaces tried first, in order, for objects defined in private modules.
_NAMESPACES = ("jax.nn", "jax.nn.initializers", "jax.numpy", "jax.lax", "jax.random",
               "jax.scipy.special", "jax.image", "flax.nnx", "flax.nnx.initializers",
               "optax", "optax.schedules", "graphmod", "graphmod.bricks", "managers")


class RebuildError(ValueError):
    """A provenance record cannot be rebuilt: it names something not allowed, not found,
    or recorded as opaque; or the rebuilt model differs from the recorded one.

    Examples:
        >>> import graphmod as gm
        >>> issubclass(gm.provenance.RebuildError, ValueError)
        True
    """


def _is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split("."))


def _find_path(obj: Any) -> str | None:
    name = getattr(obj, "__name__", None)
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", name)
    if not isinstance(name, str) or not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if "<" in qualname:  # a lambda or a function defined inside another
        return None
    if qualname != name:  # a nested class: only reachable through its owner
        owner = sys.modules.get(module)
        found = owner
        for part in qualname.split("."):
            found = getattr(found, part, None)
        return f"{module}.{qualname}" if found is obj else None
    top = module.split(".")[0]
    parts = module.split(".")
    candidates = [".".join(parts[:i]) for i in range(len(parts), 0, -1)
                  if _is_public(".".join(parts[:i]))]
    candidates += [n for n in _NAMESPACES if n.split(".")[0] == top]
    for candidate in candidates:
        if getattr(sys.modules.get(candidate), name, None) is obj:
            return f"{candidate}.{name}"
    found = sorted((len(m), m) for m, mod in list(sys.modules.items())
                   if m.split(".")[0] == top and _is_public(m)
                   and getattr(mod, name, None) is obj)
    if found:
        return f"{found[0][1]}.{name}"
    if getattr(sys.modules.get(module), name, None) is obj:
        return f"{module}.{name}"  # importable, though from a private module
    return None


def public_path(obj: Any) -> str | None:
    """The shortest import path reaching ``obj`` (a class or function), or None.

    Examples:
        >>> import jax, graphmod as gm
        >>> from graphmod.provenance._names import public_path
        >>> public_path(jax.nn.relu), public_path(gm.bricks.MLP)
        ('jax.nn.relu', 'graphmod.bricks.MLP')
        >>> public_path(lambda x: x) is None
        True
    """
    try:
        return _find_path(obj)
    except Exception:  # an object whose attributes cannot be read has no path
        return None


def check_path(path: Any, allowed: Iterable[str], where: str) -> str:
    """Raises :class:`RebuildError` unless ``path`` is a dotted name in an allowed package.

    Nothing is imported.
    """
    allowed = frozenset(allowed)
    if not isinstance(path, str) or not _PATH.match(path):
        raise RebuildError(f"rebuild: {where} names {path!r}, which is not a dotted import "
                           "path; the record is damaged or crafted")
    parts = path.split(".")
    if any(part.startswith("__") for part in parts):
        raise RebuildError(f"rebuild: {where} names {path!r}: dunder attributes are never "
                           "resolved; the record is damaged or crafted")
    if parts[0] not in allowed:
        raise RebuildError(
            f"rebuild: {where} names {path!r}, outside the allowed packages "
            f"({', '.join(sorted(allowed))}); nothing was imported. If you trust this "
            f"record, pass allow=[{parts[0]!r}]"
        )
    return path


def resolve(path: str, allowed: Iterable[str], where: str) -> Any:
    """The object at ``path`` after :func:`check_path`; raises :class:`RebuildError` if it
    is missing or lives outside the allowed packages."""
    allowed = frozenset(allowed)
    check_path(path, allowed, where)
    parts = path.split(".")
    obj: Any = None
    index = len(parts)
    while index > 0:
        module_name = ".".join(parts[:index])
        try:
            obj = importlib.import_module(module_name)
            break
        except ModuleNotFoundError as error:
            if error.name is None or not module_name.startswith(error.name):
                raise
            index -= 1
    if obj is None:
        raise RebuildError(f"rebuild: {where} names {path!r}, but no module of it can be "
                           "imported")
    for part in parts[index:]:
        if isinstance(obj, types.ModuleType):
            _check_owner(obj.__name__, path, allowed, where)
        try:
            obj = inspect.getattr_static(obj, part) if not isinstance(obj, types.ModuleType) \
                else getattr(obj, part)
        except AttributeError:
            raise RebuildError(f"rebuild: {where} names {path!r}, which does not exist in "
                               "this environment (another version?)") from None
    owner = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    if isinstance(owner, str):
        _check_owner(owner, path, allowed, where)
    return obj


def _check_owner(module: str, path: str, allowed: frozenset[str], where: str) -> None:
    if module.split(".")[0] not in allowed:
        raise RebuildError(f"rebuild: {where} names {path!r}, which is {module}'s, outside "
                           f"the allowed packages ({', '.join(sorted(allowed))})")
