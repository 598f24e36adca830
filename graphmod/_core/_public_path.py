"""Public import paths of classes and functions, found without importing anything.

Bricks and managers record the path of each class and function they are given, so that a
record names ``graphmod.bricks.MLP`` or ``jax.nn.relu`` rather than a private module.
"""

from __future__ import annotations

import sys

# Public namespaces tried first, in order, for objects defined in private modules.
_NAMESPACES = ("jax.nn", "jax.nn.initializers", "jax.numpy", "jax.lax", "jax.random",
               "jax.scipy.special", "jax.image", "flax.nnx", "flax.nnx.initializers",
               "optax", "optax.schedules", "graphmod", "graphmod.bricks", "managers")


def is_public(path: str) -> bool:
    """Whether no part of a dotted path starts with an underscore."""
    return not any(part.startswith("_") for part in path.split("."))


def _find_path(obj: object) -> str | None:
    """The shortest public path to ``obj`` among imported modules, or None."""
    name = getattr(obj, "__name__", None)
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", name)
    if not isinstance(name, str) or not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if "<" in qualname:  # a lambda or a function defined inside another
        return None
    if qualname != name:  # a nested class: reachable through its owner's public path
        outer, _, rest = qualname.partition(".")
        found = owner = getattr(sys.modules.get(module), outer, None)
        for part in rest.split("."):
            found = getattr(found, part, None)
        prefix = _find_path(owner) if found is obj and owner is not obj else None
        return f"{prefix}.{rest}" if prefix and is_public(rest) else None
    top = module.split(".")[0]
    parts = module.split(".")
    candidates = [".".join(parts[:i]) for i in range(len(parts), 0, -1)
                  if is_public(".".join(parts[:i]))]
    candidates += [n for n in _NAMESPACES if n.split(".")[0] == top]
    if not is_public(name):
        return None
    for candidate in candidates:
        if getattr(sys.modules.get(candidate), name, None) is obj:
            return f"{candidate}.{name}"
    found = sorted((len(m), m) for m, mod in list(sys.modules.items())
                   if m.split(".")[0] == top and is_public(m)
                   and getattr(mod, name, None) is obj)
    return f"{found[0][1]}.{name}" if found else None


def public_path(obj: object) -> str | None:
    """The shortest public import path reaching ``obj`` (a class or function), or None.

    Examples:
        >>> import jax, graphmod as gm
        >>> from graphmod._core._public_path import public_path
        >>> public_path(jax.nn.relu), public_path(gm.bricks.MLP)
        ('jax.nn.relu', 'graphmod.bricks.MLP')
        >>> public_path(lambda x: x) is None
        True
    """
    try:
        return _find_path(obj)
    except Exception:  # an object whose attributes cannot be read has no path
        return None
