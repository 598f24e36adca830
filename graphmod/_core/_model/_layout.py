"""The layout of a model: every variable's identity, path, role and aliases; module paths.

Computed once at compile (outside the hot path). Paths: the root brick is ``/``, a child
``/layers/0``, a variable ``/layers/0.W`` (root-level: ``/.W``). A variable reachable by two
paths (tied weights) has its first path, in Flax's traversal order, as canonical path and
the others as aliases. Every module has a path (bricks and plain Flax modules alike).

The layout also lists the marks its model carries while a program traces it (``marks``,
applied and undone by ``graphmod._core._tracing._context``): each variable's tracked class and
identity, each module's token and, for plain Flax modules with methods that are
applications, the class they are switched to (see ``graphmod._core._bricks._intercept``). Identities
and tokens are spelled from ``id()``, so every layout over one model agrees on them (the
layout holds the objects, so no other object takes their ids).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib, variablelib
from flax.typing import Key as PathPart
from flax.typing import PathParts

from graphmod import roles as _roles
from graphmod._core._bricks._array_leaves import ArrayLeaf, array_leaves, leaf_role, mark_array_leaf
from graphmod._core._tracing._variables import adopt_node, mark_variable, role_of
from graphmod.errors import ModelChanged
from graphmod.typing import ArrayLike

if TYPE_CHECKING:
    from flax.nnx.pytreelib import PytreeState

Key: TypeAlias = PathParts  # a path of attribute names and indices, as Flax's
# In a trace, a module's token names its path, also in the copies NNX transforms make (they
# copy attributes). Flax hides ``_pytree__`` attributes from displays and its Linen bridge.
_TOKEN = "_pytree__graphmod_token"
_PLAIN = frozenset({bool, int, float, str, type(None)})


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


def _children(node: object) -> Iterator[tuple[PathPart, object]]:
    impl = graphlib.get_node_impl(node) if graphlib.is_node(node) else None
    if impl is None:
        return
    for key, child in impl.node_dict(node).items():
        if not (isinstance(key, str) and key.startswith("_pytree__")):
            yield key, child


def walk_nodes(node: object, key: Key, ancestors: frozenset[int], *, arrays: bool = False
               ) -> Iterator[tuple[Key, object]]:
    """Every (key path, variable or graph node) below ``node``, aliases included, cycles
    cut; with ``arrays``, also every (key path, array) kept as an attribute."""
    for child_key, child in _children(node):
        if type(child) in _PLAIN:  # the common static attributes, without Flax's checks
            continue
        path = (*key, child_key)
        if isinstance(child, nnx.Variable):
            yield path, child
        elif graphlib.is_node(child):
            if id(child) not in ancestors:
                yield path, child
                yield from walk_nodes(child, path, ancestors | {id(child)}, arrays=arrays)
        elif arrays and isinstance(child, jax.Array | np.ndarray):
            yield path, child


def structure(walked: Iterable[tuple[Key, object]]) -> dict[str, object]:
    """Path -> the module or variable there (None for an array attribute: its value is read
    at each use), from ``walk_nodes(..., arrays=True)``: what a program relies on of the
    model's objects (``Layout.check_unchanged``)."""
    out: dict[str, object] = {}
    for key, node in walked:
        if isinstance(node, nnx.Variable):
            out[variable_path_string(key)] = None if isinstance(node, ArrayLeaf) else node
        elif isinstance(node, jax.Array | np.ndarray):
            out[variable_path_string(key)] = None
        else:
            out[brick_path_string(key)] = node
    return out


def _flat_variables(model: nnx.Pytree) -> list[tuple[Key, object]]:
    """The model's variables by key path. Raises naming the first hijax or ref variable
    (made under ``nnx.var_defaults(hijax=True)`` or ``(ref=True)``): a program reads and
    rewrites variables of NNX's default kind, which hold arrays."""
    flat: list[tuple[Key, object]] = list(nnx.to_flat_state(nnx.state(model)))
    for key, value in flat:
        raw = value.get_raw_value() if isinstance(value, nnx.Variable) else value
        if isinstance(raw, jax.ShapeDtypeStruct):
            raise TypeError(
                f"compile(fn, model): the model's variable {variable_path_string(key)} is "
                f"abstract ({raw.dtype}{list(raw.shape)}, as nnx.eval_shape makes them), not "
                "an array: give it values first, e.g. nnx.update(model, state) with loaded "
                "weights, or build the model with real rngs")
        if isinstance(value, variablelib.HijaxVariable):
            kind = "hijax"
        elif isinstance(value, nnx.Variable) and variablelib.is_array_ref(value.get_raw_value()):
            kind = "ref"
        else:
            continue
        raise TypeError(
            f"compile(fn, model): the model's variable {variable_path_string(key)} is a {kind} "
            f"variable (made under nnx.var_defaults({kind}=True)); graphmod reads and rewrites "
            "NNX's default variables. Compile a copy with regular ones instead, model = "
            f"nnx.with_vars(model, {kind}=False), and name that copy's modules in managers' "
            "filters.")
    return flat


def brick_token(brick: object) -> str | None:
    return vars(brick).get(_TOKEN)


class Layout:
    """Variables and bricks of one model, shared by every program compiled over it.

    Building one touches nothing of the model but the NNX nodes' trace state (see
    ``graphmod._core._tracing._variables.adopt_node``); its ``marks`` are applied while a program
    traces.
    ``intercept`` gives the class a plain Flax module (containers too) is switched to while
    a program traces, or None for bricks (``graphmod._core._bricks._intercept.interceptor``).
    """

    def __init__(self, model: nnx.Pytree,
                 intercept: Callable[[type], type | None] | None = None) -> None:
        if not isinstance(model, nnx.Pytree):
            raise TypeError(f"compile(fn, model): model must be a flax.nnx.Module (a brick) "
                            f"or nnx.Pytree, got {type(model).__name__}")
        self.model = model
        flat = _flat_variables(model)
        leaves = array_leaves(model, flat)  # arrays kept as module attributes
        canonical = {id(leaves[k][2] if k in leaves else v): k for k, v in flat}
        paths: dict[int, list[Key]] = {}
        objects: dict[int, nnx.Variable] = {id(leaf): leaf for _, _, leaf in leaves.values()}
        bricks: dict[int, list[Key]] = {id(model): [()]}
        brick_objects: dict[int, nnx.Pytree] = {id(model): model}
        node_states: dict[int, tuple[object, PytreeState | None]] = {
            id(model): (model, adopt_node(model))}
        walked = list(walk_nodes(model, (), frozenset({id(model)}), arrays=True))
        for key, node in walked:
            if isinstance(node, jax.Array | np.ndarray):  # array leaves: found above
                continue
            node_states.setdefault(id(node), (node, adopt_node(node)))
            if isinstance(node, nnx.Variable):
                paths.setdefault(id(node), []).append(key)
                objects[id(node)] = node
            elif isinstance(node, nnx.Module):  # containers too: nnx.capture writes them
                bricks.setdefault(id(node), []).append(key)
                brick_objects[id(node)] = node
        self.node_states = tuple(item for item in node_states.values() if item[1] is not None)
        self.variables = self._identify(canonical, paths, objects)
        self.by_identity = {info.identity: info for info in self.variables}
        self.objects = {info.identity: objects[i] for info, i in zip(self.variables, canonical,
                                                                         strict=True)}
        self.by_key = {info.key: info for info in self.variables}
        self.brick_paths = {_spelled(brick_objects[i]): brick_path_string(keys[0])
                            for i, keys in bricks.items()}  # token -> path
        self.bricks_at = {brick_path_string(keys[0]): brick_objects[i] for i, keys in bricks.items()
                          if not isinstance(brick_objects[i], nnx.List | nnx.Dict)}  # filters
        self.instance_paths: dict[int, str] = {}
        self._bricks = brick_objects
        self._owners = {_spelled(leaf): (module, name) for module, name, leaf in leaves.values()}
        self.marks = self._marks(intercept)
        self._structure = structure(walked)

    @functools.cached_property
    def _stacked(self) -> dict[str, int]:
        """Variable identity -> the leading axes it stacks over loops or an ensemble's
        members, as a trace saw a slice of it; filled as programs trace."""
        return {}

    def note_stacked(self, identity: str, axes: int) -> None:
        """Notes that a trace saw variable ``identity`` without its ``axes`` leading axes (a
        layer of a scan over layers, an ensemble's member)."""
        self._stacked[identity] = axes

    def stacked(self, identity: str) -> int:
        """How many leading axes of variable ``identity`` stack layers or members (0 until
        a trace saw a slice of it: ``init`` traces the program)."""
        return self._stacked.get(identity, 0)

    @functools.cached_property
    def identity_at(self) -> dict[str, str]:
        """Variable identities by variable path."""
        return {info.path: info.identity for info in self.variables}

    def check_unchanged(self, caller: str) -> None:
        """Raises :class:`~graphmod.errors.ModelChanged` if a module or variable of the model
        was replaced, added or removed since compile (a walk of the model: per trace, not
        per call)."""
        now = structure(walk_nodes(self.model, (), frozenset({id(self.model)}), arrays=True))
        if len(now) == len(self._structure) and all(
                self._structure.get(path, ...) is obj for path, obj in now.items()):
            return
        changed: list[str] = []  # one line for a module and what is in it
        for path in {**self._structure, **now}:
            if self._structure.get(path, ...) is not now.get(path, ...) and not any(
                    path.startswith(f"{shown}{sep}") for shown in changed for sep in "./"):
                changed.append(path)
        changes = [f"{path} is new" if path not in self._structure else
                   f"{path} is gone" if path not in now else
                   f"{path} is another {_kind(now[path])}" for path in changed]
        sown = [path for path, obj in now.items()
                if path not in self._structure and isinstance(obj, nnx.Intermediate)]
        raise ModelChanged(
            f"{caller}: the model changed since it was compiled: {', '.join(changes[:5])}"
            f"{f' (and {len(changes) - 5} more)' if len(changes) > 5 else ''}. "
            + (f"{', '.join(sown)}: values a call of the model sowed outside the program; "
               "take them off with nnx.pop(model, nnx.Intermediate), as Flax's examples "
               "do. " if sown else "")
            + "A program holds the modules and variables it was compiled over: compile again after "
            "changing them (graphmod.compile(fn, model)), or change values in place "
            "(nnx.update(model, state), variable[...] = ..., "
            "program.update_model(variables))")

    def _marks(self, intercept: Callable[[type], type | None] | None
               ) -> tuple[tuple[object, Callable[[], Callable[[], None]]], ...]:
        """``(object, mark)`` for every variable and module (see ``_context._marked``)."""
        return (
            *((v, functools.partial(mark_array_leaf, *self._owners[identity], v, identity)
               if identity in self._owners else functools.partial(mark_variable, v, identity))
              for identity, v in self.objects.items()),
            *((b, functools.partial(_mark_module, b, _spelled(b),
                                    None if intercept is None else intercept(_original(b))))
              for b in self._bricks.values()))

    def _identify(self, canonical: dict[int, Key], paths: dict[int, list[Key]],
                  objects: dict[int, nnx.Variable]) -> tuple[VariableInfo, ...]:
        infos = []
        for object_id, key in canonical.items():
            variable = objects[object_id]
            value = variable.get_raw_value()
            if not ((hasattr(value, "shape") and hasattr(value, "dtype"))
                    or isinstance(value, bool | int | float | complex)):
                fix = ("a function is code, not data: mark it static, module.attribute = "
                       "nnx.static(fn)" if callable(value) else
                       f"keep one {type(variable).__name__} per array in the module (e.g. "
                       "one attribute for each entry of a dict)")
                raise TypeError(
                    f"compile(fn, model): variable {variable_path_string(key)} holds a "
                    f"{type(value).__name__}, not an array: a program's variables are one "
                    f"array each; {fix}")
            aliases = tuple(variable_path_string(k) for k in paths.get(object_id, [key])
                            if k != key)
            name = str(key[-1])
            role = (leaf_role(variable.get_raw_value(), name) if isinstance(variable, ArrayLeaf)
                    else role_of(variable, name))
            infos.append(VariableInfo(
                _spelled(variable), key, variable_path_string(key), name, role, aliases,
                tuple(getattr(value, "shape", ())), str(getattr(value, "dtype", "")),
            ))
        return tuple(infos)

    def metadata(self, name: str) -> list[tuple[VariableInfo, Any]]:
        """``(info, value)`` of each variable whose Flax metadata holds ``name`` (e.g.
        ``out_sharding``), in the layout's order (typed as Flax types metadata)."""
        found = ((info, self.objects[info.identity].get_metadata().get(name))
                 for info in self.variables)
        return [(info, value) for info, value in found if value is not None]

    def value(self, identity: str) -> ArrayLike:
        """The model's array of variable ``identity`` (outside the traces of programs)."""
        if identity not in self._owners:
            return self.objects[identity].get_raw_value()
        module, name = self._owners[identity]
        value = vars(module)[name]  # a stand-in while another thread's trace holds it
        return value.get_raw_value() if isinstance(value, ArrayLeaf) else value

    def store(self, identity: str, value: ArrayLike) -> None:
        """Makes ``value`` the model's array of variable ``identity`` (outside traces)."""
        if identity in self._owners:
            setattr(*self._owners[identity], value)
        else:
            self.objects[identity].set_raw_value(value)

    def reset_node_states(self) -> None:
        """Puts back each NNX node's adopted ``PytreeState`` (see ``adopt_node``)."""
        for node, state in self.node_states:
            if vars(node).get("_pytree__state") is not state:
                object.__setattr__(node, "_pytree__state", state)

    def brick_path(self, brick: object) -> str | None:
        """The path of ``brick`` in the model (in a trace, also of the copies NNX transforms
        make of it, which keep its token)."""
        token = brick_token(brick)
        if token is None and self._bricks.get(id(brick)) is brick:
            token = _spelled(brick)
        return None if token is None else self.brick_paths.get(token)

    def resolve(self, instances: Iterable[object], owner: str) -> None:
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

    # A pure dict of the model's state is typed as Flax types nnx.to_pure_dict's (its
    # values), nested by the parts of key paths (names, list indices: any hashable key).
    def model_values(self, pure: Mapping[str, object]) -> dict[str, Any]:
        """identity → value, from a pure dict of the model's state."""
        return {info.identity: _get(pure, info.key) for info in self.variables}

    def pure(self, values: Mapping[str, object]) -> dict[str, Any]:
        """A pure nested dict (like ``nnx.to_pure_dict``) from identity → value."""
        out: dict[Any, Any] = {}
        for info in self.variables:
            node = out
            for part in info.key[:-1]:
                node = node.setdefault(part, {})
            node[info.key[-1]] = values[info.identity]
        return out


def _kind(obj: object) -> str:
    return "array" if obj is None else type(obj).__name__


def _spelled(obj: object) -> str:
    """The identity or token of an object of the model: unique while the layout holds it."""
    return f"{id(obj):x}"


def _original(module: object) -> type:
    """The module's own class, also when a trace in progress has switched it."""
    return getattr(type(module), "__graphmod_original__", type(module))


def _mark_module(module: object, token: str, intercepting: type | None) -> Callable[[], None]:
    """Stores ``token`` in ``module`` and switches it to ``intercepting`` (if not None), for
    one trace; returns the function that puts back what was there."""
    original, previous = type(module), vars(module).get(_TOKEN)
    object.__setattr__(module, _TOKEN, token)
    if intercepting is not None:
        object.__setattr__(module, "__class__", intercepting)

    def unmark() -> None:
        object.__setattr__(module, "__class__", original)
        if previous is None:
            object.__delattr__(module, _TOKEN)
        else:
            object.__setattr__(module, _TOKEN, previous)

    return unmark


def _get(tree: Mapping[str, object], key: Key) -> Any:
    node: Any = tree
    for part in key:
        node = node[part]
    return node
