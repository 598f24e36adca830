"""The layout of a model: every variable's identity, path, role and aliases; module paths.

Computed once at compile (outside the hot path). Paths: the root brick is ``/``, a child
``/layers/0``, a variable ``/layers/0.W`` (root-level: ``/.W``). A variable reachable by two
paths (tied weights) has its first path, in Flax's traversal order, as canonical path and
the others as aliases. Every module has a path (bricks and plain Flax modules alike); the
plain Flax modules with methods that are applications are listed with the class they are
switched to while a program traces (``swaps``, see ``graphmod._core._application``).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flax import nnx
from flax.nnx import graphlib

from graphmod import roles as _roles
from graphmod._core._variables import adopt, adopt_node, assign_identity, identity_of, role_of

Key = tuple[Any, ...]
_TOKEN = "_graphmod_token"


def brick_path_string(key: Key) -> str:
    return "/" + "/".join(map(str, key))


def variable_path_string(key: Key) -> str:
    return f"{brick_path_string(key[:-1])}.{key[-1]}"


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """One model variable: identity, key in the pure dict, canonical path, role."""

    identity: str
    key: Key
    path: str
    name: str
    role: _roles.Role
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str


def _children(node: Any) -> Iterator[tuple[Any, Any]]:
    if not graphlib.is_node(node):
        return
    for key, child in graphlib.get_node_impl(node).node_dict(node).items():
        if not (isinstance(key, str) and key.startswith("_pytree__")):
            yield key, child


def walk_nodes(node: Any, key: Key, ancestors: frozenset[int]) -> Iterator[tuple[Key, Any]]:
    """Every (key path, node) below ``node``, aliases included, cycles cut."""
    for child_key, child in _children(node):
        path = (*key, child_key)
        if isinstance(child, nnx.Variable):
            yield path, child
        elif graphlib.is_node(child) and id(child) not in ancestors:
            yield path, child
            yield from walk_nodes(child, path, ancestors | {id(child)})


def brick_token(brick: Any) -> str | None:
    return vars(brick).get(_TOKEN)


class Layout:
    """Variables and bricks of one model, shared by every program compiled over it.

    Compiling adopts the model's plain Flax variables (see ``graphmod._core._variables``) and
    stores identities in variables and tokens in modules; no array is touched.
    ``intercept`` gives the class a plain Flax module is switched to while a program traces,
    or None for no applications (``graphmod._core._intercept.interceptor``).
    """

    def __init__(self, model: nnx.Module,
                 intercept: Callable[[type], type | None] | None = None) -> None:
        if not isinstance(model, nnx.Module):
            raise TypeError(f"compile(fn, model): model must be a flax.nnx.Module (a brick), "
                            f"got {type(model).__name__}")
        self.model = model
        _, state = nnx.split(model)
        canonical = {id(v): k for k, v in nnx.to_flat_state(state)}
        paths: dict[int, list[Key]] = {}
        objects: dict[int, Any] = {}
        bricks: dict[int, list[Key]] = {}
        brick_objects: dict[int, Any] = {id(model): model}
        bricks[id(model)] = [()]
        node_states = {id(model): (model, adopt_node(model))}
        for key, node in walk_nodes(model, (), frozenset({id(model)})):
            node_states.setdefault(id(node), (node, adopt_node(node)))
            if isinstance(node, nnx.Variable):
                paths.setdefault(id(node), []).append(key)
                objects[id(node)] = node
            elif isinstance(node, nnx.Module) and not isinstance(node, nnx.List | nnx.Dict):
                bricks.setdefault(id(node), []).append(key)
                brick_objects[id(node)] = node
        self.node_states = tuple(item for item in node_states.values() if item[1] is not None)
        self.variables = self._identify(canonical, paths, objects)
        self.by_identity = {info.identity: info for info in self.variables}
        self.objects = {identity_of(objects[i]): objects[i] for i in canonical}
        self.by_key = {info.key: info for info in self.variables}
        self.brick_paths = self._tokenize(bricks, brick_objects)
        self.bricks_at = {brick_path_string(keys[0]): brick_objects[i]
                          for i, keys in bricks.items()}  # path -> brick, for filters
        self.instance_paths: dict[int, str] = {}
        self.swaps = () if intercept is None else _swaps(brick_objects.values(), intercept)

    def _identify(self, canonical: dict[int, Key], paths: dict[int, list[Key]],
                  objects: dict[int, Any]) -> tuple[VariableInfo, ...]:
        seen: set[str] = set()
        infos = []
        for object_id, key in canonical.items():
            variable = objects[object_id]
            adopt(variable)
            identity = identity_of(variable)
            if identity is None or identity in seen:  # new, or a copy of another variable
                identity = assign_identity(variable)
            seen.add(identity)
            value = variable.get_raw_value()
            aliases = tuple(variable_path_string(k) for k in paths.get(object_id, [key])
                            if k != key)
            infos.append(VariableInfo(
                identity, key, variable_path_string(key), str(key[-1]),
                role_of(variable, str(key[-1])), aliases,
                tuple(getattr(value, "shape", ())), str(getattr(value, "dtype", "")),
            ))
        return tuple(infos)

    def _tokenize(self, bricks: dict[int, list[Key]], objects: dict[int, Any]
                  ) -> dict[str, str]:
        by_token: dict[str, str] = {}
        for object_id, keys in bricks.items():
            brick = objects[object_id]
            token = brick_token(brick)
            if token is None or token in by_token:
                token = uuid.uuid4().hex
                object.__setattr__(brick, _TOKEN, token)
            by_token[token] = brick_path_string(keys[0])
        return by_token

    def reset_node_states(self) -> None:
        """Puts back each NNX node's adopted ``PytreeState`` (see ``adopt_node``)."""
        for node, state in self.node_states:
            if vars(node).get("_pytree__state") is not state:
                object.__setattr__(node, "_pytree__state", state)

    def brick_path(self, brick: Any) -> str | None:
        """The path of ``brick`` in the model (also for copies made by nnx transforms)."""
        token = brick_token(brick)
        return None if token is None else self.brick_paths.get(token)

    def resolve(self, instances: tuple[Any, ...], owner: str) -> None:
        """Records the paths of brick instances named by a filter; raises for strangers."""
        for brick in instances:
            path = self.brick_path(brick)
            if path is None:
                raise ValueError(
                    f"{owner}: brick {type(brick).__name__} at 0x{id(brick):x} named in "
                    "bricks= or applications= is not part of the compiled model; name bricks "
                    "of the model (e.g. model.layers[0]) or a brick class"
                )
            self.instance_paths[id(brick)] = path

    def model_values(self, pure: dict) -> dict[str, Any]:
        """identity → value, from a pure dict of the model's state."""
        return {info.identity: _get(pure, info.key) for info in self.variables}

    def pure(self, values: dict[str, Any]) -> dict:
        """A pure nested dict (like ``nnx.to_pure_dict``) from identity → value."""
        out: dict = {}
        for info in self.variables:
            node = out
            for part in info.key[:-1]:
                node = node.setdefault(part, {})
            node[info.key[-1]] = values[info.identity]
        return out


def _swaps(modules: Iterable[Any], intercept: Callable[[type], type | None]
           ) -> tuple[tuple[Any, type, type], ...]:
    """``(module, class, intercepting class)`` for each plain Flax module with applications."""
    out = []
    for module in modules:
        cls = getattr(type(module), "__graphmod_original__", type(module))  # compiled in a trace
        intercepting = intercept(cls)
        if intercepting is not None:
            out.append((module, cls, intercepting))
    return tuple(out)


def _get(tree: dict, key: Key) -> Any:
    node = tree
    for part in key:
        node = node[part]
    return node
