"""``rebuild``: the bricks, managers and optimizer of a record, constructed again.

Safety: a record is data. ``rebuild`` first walks everything it will construct and checks
every import path in it — syntax, no dunder attributes, top-level package in the
allow-list (graphmod, managers, jax, flax, optax, and what the caller adds) — and that
nothing it needs was recorded as opaque, all before importing anything. Only then does it
import, and each object reached must belong to an allowed package. Classes must be
graphmod bricks or managers; factories (``$call``) must be functions. Nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from graphmod.provenance._names import DEFAULT_ALLOWED, RebuildError, check_path, resolve
from graphmod.provenance._record import Provenance

_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def _join(where: str, key: Any) -> str:
    return f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"


def _paths(value: Any, where: str) -> Iterator[tuple[str, str]]:
    """Every import path a recorded value names, as ``(path, where)``; raises for opaque
    values, which cannot be rebuilt."""
    if isinstance(value, Mapping):
        if len(value) == 1:
            (tag, inner), = value.items()
            if tag == "$opaque":
                raise RebuildError(
                    f"rebuild: {where} was recorded as opaque ({inner.get('kind')}: "
                    f"{inner.get('repr', inner.get('type'))}), so it cannot be rebuilt. "
                    + ("Define it at module level in an importable module (a lambda or a "
                       "local function has no import path)."
                       if inner.get("kind") == "callable" else
                       "Pass values graphmod can record: numbers, strings, lists, roles, "
                       "bricks, public functions."))
            if tag in ("$callable", "$class"):
                yield inner, where
                return
            if tag == "$call":
                yield inner["function"], where
                yield from _paths(inner["kwargs"], f"{where}.kwargs")
                return
            if tag == "$enum":
                yield inner["class"], where
                return
            if tag == "$brick":
                yield from config_paths(inner, where)
                return
            if tag == "$optimizer":
                yield from optimizer_paths(inner, where)
                return
        for key, item in value.items():
            yield from _paths(item, _join(where, key))
    elif isinstance(value, tuple | list):
        for index, item in enumerate(value):
            yield from _paths(item, _join(where, index))


def config_paths(config: Mapping[str, Any], where: str) -> Iterator[tuple[str, str]]:
    """The import paths a constructor record needs (its class and arguments)."""
    if config.get("recorded") is False or "error" in config or "arguments" not in config:
        reason = config.get("error") or "its construction was not recorded (not a graphmod " \
                                        "Brick or Manager)"
        raise RebuildError(f"rebuild: {where} ({config.get('class')}) cannot be rebuilt: "
                           f"{reason}")
    yield config["class"], f"{where}.class"
    yield from _paths(config["arguments"], f"{where}.arguments")


def optimizer_paths(record: Mapping[str, Any], where: str) -> Iterator[tuple[str, str]]:
    """The import paths a recorded optimizer needs (``optax.<name>`` and its arguments)."""
    yield f"optax.{record['name']}", f"{where}.name"
    yield from _paths(record.get("arguments", {}), f"{where}.arguments")


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """What :func:`rebuild` constructed from a record.

    Attributes:
        model: the root brick, built with the recorded arguments and RNG key data.
        managers: the managers, in the recorded chain order, their bricks resolved by path.
        optimizer: the optax transformation, or None when the record does not say how to
            make it (see ``provenance.optimizer``).
        monitor: the program's monitor filters (a dict; empty if none).
        seeds: name → typed PRNG key (``"init"``: ``program.init``'s, ``"train"``: the one
            given to ``step.init``).
        provenance: the record rebuilt from.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x).sum(),
        ...                      gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> _ = program.init(jnp.ones((4, 2)))
        >>> again = gm.rebuild(program.provenance)
        >>> args, kwargs = again.example_arguments()
        >>> args[0].shape, again.managers, again.optimizer
        ((4, 2), (), None)
    """

    model: Any
    managers: tuple[Any, ...]
    optimizer: Any
    monitor: Mapping[str, Any]
    seeds: Mapping[str, Any]
    provenance: Provenance

    def compile(self, fn: Any, **kwargs: Any) -> Any:
        """``graphmod.compile(fn, model, managers=managers, monitor=...)``."""
        from graphmod._program import compile

        kwargs.setdefault("managers", self.managers)
        if self.monitor:
            kwargs.setdefault("monitor", self.monitor.get("", self.monitor)
                              if set(self.monitor) == {""} else dict(self.monitor))
        axis = self.provenance.inputs.get("axis_name")
        if axis is not None:
            kwargs.setdefault("axis_name", axis)
        return compile(fn, self.model, **kwargs)

    def example_arguments(self) -> tuple[tuple, dict]:
        """Zeros of the recorded example shapes: ``(args, kwargs)`` for ``program.init``."""
        examples = self.provenance.inputs.get("example_shapes")
        if examples is None:
            raise RebuildError("rebuild: the record holds no example shapes (its program's "
                               "init had not run)")

        def make(node: Any) -> Any:
            if isinstance(node, Mapping) and set(node) == {"shape", "dtype"}:
                return np.zeros(node["shape"], np.dtype(node["dtype"]))
            if isinstance(node, Mapping):
                return {k: make(v) for k, v in node.items()}
            return [make(v) for v in node]

        arguments = examples["arguments"]
        positional = list(examples["positional"])
        args = tuple(make(arguments[name]) for name in positional)
        kwargs = {k: make(v) for k, v in arguments.items() if k not in positional}
        return args, kwargs

    def check_data(self, source: Any, *, name: str = "data") -> None:
        """Raises unless ``source`` describes itself as the recorded data (same content
        hash, size and shapes)."""
        recorded = self.provenance.inputs.get(name)
        describe = getattr(source, "describe", None)
        if recorded is None or not callable(describe):
            raise RebuildError(f"check_data: the record has no {name!r} description, or the "
                               "source cannot describe itself")
        actual = describe()
        differing = [k for k in ("sha256", "size", "shapes", "dtypes")
                     if k in recorded and _thaw(recorded[k]) != actual.get(k)]
        if differing:
            raise RebuildError(f"check_data: the source differs from the recorded data in "
                               f"{', '.join(differing)}")


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


class _Decoder:
    def __init__(self, allowed: frozenset[str], bricks: Mapping[str, Any] | None) -> None:
        self.allowed = allowed
        self.bricks = bricks

    def __call__(self, value: Any, where: str) -> Any:
        if isinstance(value, Mapping):
            if len(value) == 1 and next(iter(value)).startswith("$"):
                (tag, inner), = value.items()
                return self._tagged(tag, inner, where)
            raise RebuildError(f"rebuild: {where} is a mapping without a tag; the record is "
                               "damaged or crafted")
        if isinstance(value, tuple | list):
            return [self(v, _join(where, i)) for i, v in enumerate(value)]
        return value

    def _tagged(self, tag: str, inner: Any, where: str) -> Any:
        from graphmod import roles
        from graphmod._filter import VariableFilter
        from graphmod._manager import dynamic

        if tag == "$tuple":
            return tuple(self(v, _join(where, i)) for i, v in enumerate(inner))
        if tag == "$dict":
            return {k: self(v, _join(where, k)) for k, v in inner.items()}
        if tag == "$items":
            return {_hashable(self(k, where)): self(v, where) for k, v in inner}
        if tag == "$float":
            return float(inner)
        if tag == "$role":
            parent = None
            for name in reversed(list(inner["parents"])):
                parent = roles.add_role(name, parent)
            return roles.add_role(inner["name"], parent)
        if tag == "$dynamic":
            return dynamic(self(inner, where))
        if tag in ("$callable", "$class"):
            obj = resolve(inner, self.allowed, where)
            if tag == "$class" and not isinstance(obj, type):
                raise RebuildError(f"rebuild: {where} names {inner!r}, which is not a class")
            if tag == "$callable" and not callable(obj):
                raise RebuildError(f"rebuild: {where} names {inner!r}, which is not callable")
            return obj
        if tag == "$call":
            factory = resolve(inner["function"], self.allowed, where)
            if not inspect.isfunction(factory):
                raise RebuildError(f"rebuild: {where} names {inner['function']!r}, which is "
                                   "not a function")
            kwargs = {k: self(v, f"{where}.kwargs.{k}") for k, v in inner["kwargs"].items()}
            return factory(**kwargs)
        if tag == "$partial":
            return functools.partial(self(inner["function"], where),
                                     *self(inner["args"], where),
                                     **{k: self(v, where) for k, v in inner["kwargs"].items()})
        if tag == "$enum":
            return resolve(inner["class"], self.allowed, where)[inner["name"]]
        if tag == "$dtype":
            return np.dtype(str(inner))
        if tag == "$array":
            return _array(inner)
        if tag == "$key":
            return _key(inner, where)
        if tag == "$rngs":
            return _rngs(inner, where)
        if tag == "$brick":
            return self.construct(inner, where, kind="brick")
        if tag == "$brick_path":
            if self.bricks is None or inner not in self.bricks:
                raise RebuildError(f"rebuild: {where} names the brick at {inner!r}, which the "
                                   "rebuilt model does not have")
            return self.bricks[inner]
        if tag == "$filter":
            return VariableFilter(**{k: self(v, _join(where, k)) for k, v in inner.items()})
        if tag == "$application":
            return str(inner)
        if tag == "$optimizer":
            return self.optimizer(inner, where)
        raise RebuildError(f"rebuild: {where} holds an unknown tag {tag!r}; the record was "
                           "written by a newer graphmod, or is damaged")

    def construct(self, config: Mapping[str, Any], where: str, *, kind: str) -> Any:
        cls = resolve(config["class"], self.allowed, f"{where}.class")
        marker = "__graphmod_brick__" if kind == "brick" else None
        if kind == "brick" and not (isinstance(cls, type) and getattr(cls, marker, False)):
            raise RebuildError(f"rebuild: {where}.class names {config['class']!r}, which is "
                               "not a graphmod Brick")
        if kind == "manager":
            from graphmod._manager import Manager

            if not (isinstance(cls, type) and issubclass(cls, Manager)):
                raise RebuildError(f"rebuild: {where}.class names {config['class']!r}, which "
                                   "is not a graphmod Manager")
        arguments = {k: self(v, f"{where}.arguments.{k}")
                     for k, v in config["arguments"].items()}
        args, kwargs = _call_arguments(cls, arguments, where)
        try:
            return cls(*args, **kwargs)
        except Exception as error:
            raise RebuildError(f"rebuild: constructing {where} ({config['class']}) failed: "
                               f"{type(error).__name__}: {error}") from error

    def optimizer(self, record: Mapping[str, Any], where: str) -> Any:
        from graphmod.provenance._optimizer import _factory, optimizer

        _factory(record["name"])
        arguments = {k: self(v, f"{where}.arguments.{k}")
                     for k, v in record.get("arguments", {}).items()}
        factory = _factory(record["name"])
        args, kwargs = _call_arguments(factory, arguments, where)
        return optimizer(record["name"], *args, **kwargs)


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _call_arguments(target: Any, arguments: dict[str, Any], where: str
                    ) -> tuple[tuple, dict]:
    """Positional and keyword arguments for ``target`` from recorded named arguments."""
    init = target.__init__ if isinstance(target, type) else target
    signature = inspect.signature(init)
    parameters = [p for p in signature.parameters.values()][1 if isinstance(target, type)
                                                               else 0:]
    names = {p.name for p in parameters}
    var_keyword = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
    bound: dict[str, Any] = {}
    extra = {k: v for k, v in arguments.items() if k not in names}
    if extra and var_keyword is None:
        raise RebuildError(f"rebuild: {where}: {getattr(target, '__qualname__', target)} no "
                           f"longer takes {', '.join(extra)} (another version?)")
    for parameter in parameters:
        if parameter.kind is parameter.VAR_KEYWORD:
            if extra:
                bound[parameter.name] = extra
        elif parameter.name in arguments:
            value = arguments[parameter.name]
            bound[parameter.name] = tuple(value) if parameter.kind is parameter.VAR_POSITIONAL \
                else value
    call = inspect.BoundArguments(signature.replace(parameters=parameters), bound)
    return call.args, call.kwargs


def _array(inner: Mapping[str, Any]) -> Any:
    dtype = np.dtype(str(inner["dtype"]))
    data = [float(v) if isinstance(v, str) else v for v in inner["data"]]
    array = np.asarray(data, dtype).reshape(tuple(inner["shape"]))
    if inner.get("kind") == "scalar":
        return dtype.type(array.item())
    if inner.get("kind") == "jax":
        return jax.numpy.asarray(array)
    return array


def _key(inner: Mapping[str, Any], where: str) -> Any:
    impl = inner.get("impl")
    if impl not in _KEY_IMPLS:
        raise RebuildError(f"rebuild: {where}: unknown PRNG implementation {impl!r}")
    return jax.random.wrap_key_data(np.asarray(inner["data"], np.uint32), impl=impl)


def _rngs(inner: Mapping[str, Any], where: str) -> Any:
    from flax import nnx

    rngs = nnx.Rngs(**{name: _key(s["key"], f"{where}.{name}") for name, s in inner.items()})
    for name, stream in inner.items():
        count = getattr(rngs, name).count
        count[...] = jax.numpy.asarray(stream["count"], count[...].dtype)
    return rngs


def _walk_bricks(model: Any) -> dict[str, Any]:
    from graphmod.provenance._collect import modules

    return modules(model)


def _verify(record: Provenance, model: Any) -> None:
    """Raises if the rebuilt model's modules or parameters differ from the record's."""
    from graphmod._layout import Layout
    from graphmod.provenance._collect import brick_records, parameter_records

    recorded_bricks = record.inputs.get("bricks") or {}
    recorded_params = record.inputs.get("parameters") or {}
    bricks = brick_records(model)
    params = parameter_records(Layout(model))
    problems = []
    for path in sorted(set(recorded_bricks) | set(bricks)):
        a, b = recorded_bricks.get(path), bricks.get(path)
        if a is None or b is None:
            problems.append(f"module {path}: {'only rebuilt' if a is None else 'missing'}")
        elif a["class"] != b["class"]:
            problems.append(f"module {path}: recorded {a['class']}, rebuilt {b['class']}")
    for path in sorted(set(recorded_params) | set(params)):
        a, b = recorded_params.get(path), params.get(path)
        if a is None or b is None:
            problems.append(f"variable {path}: {'only rebuilt' if a is None else 'missing'}")
            continue
        for field in ("shape", "dtype", "role", "aliases"):
            if _thaw(a[field]) != b[field]:
                problems.append(f"variable {path}: {field} recorded {_thaw(a[field])}, "
                                f"rebuilt {b[field]}")
    if problems:
        raise RebuildError(
            "rebuild: the rebuilt model differs from the recorded one (was the model changed "
            "after construction, or did a library change?):\n  " + "\n  ".join(problems[:20]))


def rebuild(provenance: Provenance | str, *, allow: Iterable[str] = (),
            verify: bool = True) -> Rebuilt:
    """Constructs the model, managers and optimizer a provenance record describes.

    The root brick is constructed with its recorded arguments (RNG streams restored with
    their recorded key data and counts, so its parameters come out the same), then each
    manager (bricks it names resolved by path in the new model), then the optimizer if it
    was recorded. Compiling the same function over them gives the same graph fingerprint.

    Args:
        provenance: a program, training or evaluation record (for an evaluation, its
            model's), or its JSON text.
        allow: top-level packages to allow besides graphmod, managers, jax, flax and optax
            (e.g. the package defining your bricks). Every import path in the record is
            checked against this list before anything is imported.
        verify: check that the rebuilt model's modules, classes and parameter shapes,
            dtypes, roles and aliases are the recorded ones.

    Returns:
        :class:`Rebuilt` with ``model``, ``managers``, ``optimizer``, ``monitor``,
        ``seeds`` and ``compile(fn)``.

    Raises:
        RebuildError: the record names something outside the allowed packages (nothing is
            imported then), something missing, or a value recorded as opaque; or the
            rebuilt model differs from the record.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([3, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> drop = managers.Dropout(0.5, bricks=mlp.linear_layers, roles=[gm.roles.INPUT])
        >>> cost = lambda m, x: (m(x) ** 2).mean()
        >>> program = gm.compile(cost, mlp, managers=[drop])
        >>> _ = program.init(jnp.ones((2, 3)))
        >>> again = gm.rebuild(gm.Provenance.from_json(program.provenance.to_json()))
        >>> twin = again.compile(cost)
        >>> _ = twin.init(jnp.ones((2, 3)))
        >>> twin.provenance.fingerprint == program.provenance.fingerprint
        True
        >>> bool((again.model.linear_layers[0].W[...] == mlp.linear_layers[0].W[...]).all())
        True
    """
    if isinstance(provenance, str | bytes):
        provenance = Provenance.from_json(provenance)
    if not isinstance(provenance, Provenance):
        raise TypeError(f"rebuild: expected a Provenance, got {type(provenance).__name__}")
    if provenance.kind == "evaluation":
        nested = provenance.model
        if nested is None:
            raise RebuildError("rebuild: this evaluation record holds no model record")
        provenance = nested
    allowed = DEFAULT_ALLOWED | frozenset(allow)
    inputs = provenance.inputs
    root = (inputs.get("bricks") or {}).get("/")
    if root is None:
        raise RebuildError("rebuild: the record holds no root brick (bricks['/'])")
    managers = inputs.get("managers") or {}
    optimizer = inputs.get("optimizer")
    rebuild_optimizer = optimizer is not None and optimizer.get("name") is not None \
        and optimizer.get("source") != "explicit"
    # 1. Check every path, and that nothing needed is opaque, before importing anything.
    needed = list(config_paths(root, "bricks['/']"))
    for name, record in managers.items():
        needed += config_paths(record, f"managers.{name}")
    for label, record in (inputs.get("monitor") or {}).items():
        needed += _paths(record, f"monitor[{label!r}]")
    if rebuild_optimizer:
        needed += optimizer_paths(optimizer, "optimizer")
    for path, where in needed:
        check_path(path, allowed, where)
    # 2. Construct.
    model = _Decoder(allowed, None).construct(root, "bricks['/']", kind="brick")
    if verify:
        _verify(provenance, model)
    decoder = _Decoder(allowed, _walk_bricks(model))
    ordered = sorted(managers.items(), key=lambda item: item[1].get("order", 0))
    built = tuple(decoder.construct(record, f"managers.{name}", kind="manager")
                  for name, record in ordered)
    for (name, _), manager in zip(ordered, built, strict=True):
        if manager.name != name:
            raise RebuildError(f"rebuild: managers.{name} was rebuilt named {manager.name!r}")
    monitor = {label: _monitor_filter(record, decoder, label)
               for label, record in (inputs.get("monitor") or {}).items()}
    tx = decoder.optimizer(optimizer, "optimizer") if rebuild_optimizer else None
    seeds = {name: _key(record, f"seeds.{name}")
             for name, record in (inputs.get("seeds") or {}).items() if record is not None}
    return Rebuilt(model, built, tx, monitor, seeds, provenance)


def _monitor_filter(record: Mapping[str, Any], decoder: _Decoder, label: str) -> Any:
    from graphmod import roles
    from graphmod._filter import VariableFilter

    fields = {}
    for key, value in record.items():
        where = f"monitor[{label!r}].{key}"
        if key == "roles":
            fields[key] = [roles.get_role(r) for r in value]
        elif key == "bricks":
            fields[key] = [decoder(v, where) for v in value]
        elif isinstance(value, tuple):
            fields[key] = list(value)
        else:
            fields[key] = value
    return VariableFilter(**fields)
