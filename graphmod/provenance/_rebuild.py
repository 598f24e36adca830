"""``rebuild``: the bricks, managers and optimizer of a record, constructed again.

Safety: a record is data, and one from elsewhere may be crafted (the threat model is in
``docs/concepts/provenance.md``). One walker, :class:`_Decoder`, reads every tag, in two
passes over everything rebuild will construct (root brick, managers, monitor filters,
optimizer):

1. **Check** (``dry=True``): every import path is checked by
   :meth:`~graphmod.provenance._names.Rules.check` (public, allowed package, no system
   module, no loader or runner, calls only to listed factories; see ``_names``), and every
   entry's shape (a ``$call`` has a function and keyword arguments, a ``$partial`` wraps a
   function, dtypes are numeric, tags are known, nothing is opaque). Nothing is imported,
   constructed or called, so a crafted record is refused, with the field that names the
   culprit, before anything it names is imported.
2. **Construct**: the same walk, each path checked again and resolved by
   :meth:`~graphmod.provenance._names.Rules.resolve`, which verifies what it reached. The root
   and ``$brick`` classes must be graphmod bricks, managers graphmod ``Manager`` subclasses,
   a ``$class`` a brick, manager or Flax module class, an ``$enum`` an ``enum.Enum``. Only
   listed factories are called; functions recorded as values are handed to the bricks that
   take them, never called here. Nothing is unpickled or evaluated.

Any malformed entry raises :class:`RebuildError` naming its field, never a bare
``KeyError`` or ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from graphmod.provenance._names import Kind, RebuildError, Rules
from graphmod.provenance._record import Provenance

_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
# Tags whose values hold no import path: decoded the same way in both passes.
_DATA_TAGS = ("$float", "$dtype", "$array", "$key", "$rngs", "$application")
_FUNCTION_TAGS = ("$callable", "$call", "$partial")
_FILTER_FIELDS = ("roles", "bricks", "applications", "name", "name_regex", "path", "call_id",
                  "each_role")


def _join(where: str, key: Any) -> str:
    return f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"


def _field(inner: Any, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    """``inner[key]``, which must be a ``kind``; raises naming ``where`` otherwise."""
    if not isinstance(inner, Mapping) or not isinstance(inner.get(key), kind):
        raise RebuildError(f"rebuild: {where} lacks a valid {key!r} entry; the record is "
                           "damaged or crafted")
    return inner[key]


def _opaque(inner: Any, where: str) -> RebuildError:
    """The error for a value recorded as opaque."""
    inner = inner if isinstance(inner, Mapping) else {}
    return RebuildError(
        f"rebuild: {where} was recorded as opaque ({inner.get('kind')}: "
        f"{inner.get('repr', inner.get('type'))}), so it cannot be rebuilt. "
        + ("Define it at module level in an importable module (a lambda, a local function or "
           "a function of a script has no import path)."
           if inner.get("kind") == "callable" else
           "Pass values graphmod can record: numbers, strings, lists, roles, bricks, public "
           "functions."))


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
    """Decodes recorded values; with ``dry=True`` only checks them, importing nothing."""

    def __init__(self, rules: Rules, bricks: Mapping[str, Any] | None, *, dry: bool) -> None:
        self.rules = rules
        self.bricks = bricks
        self.dry = dry

    def lookup(self, path: Any, kind: Kind, where: str) -> Any:
        """The object at ``path`` (None when dry, after checking it)."""
        if self.dry:
            self.rules.check(path, kind, where)
            return None
        return self.rules.resolve(path, kind, where)

    def __call__(self, value: Any, where: str) -> Any:
        if isinstance(value, Mapping):
            if len(value) == 1 and str(next(iter(value))).startswith("$"):
                (tag, inner), = value.items()
                try:
                    return self._tagged(tag, inner, where)
                except RebuildError:
                    raise
                except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
                    raise RebuildError(f"rebuild: {where} holds a malformed {tag} entry "
                                       f"({type(error).__name__}: {error}); the record is "
                                       "damaged or crafted") from error
            raise RebuildError(f"rebuild: {where} is a mapping without a tag; the record is "
                               "damaged or crafted")
        if isinstance(value, tuple | list):
            return [self(v, _join(where, i)) for i, v in enumerate(value)]
        return value

    def _tagged(self, tag: str, inner: Any, where: str) -> Any:
        if tag in _DATA_TAGS:
            return _data(tag, inner, where)
        if tag == "$opaque":
            raise _opaque(inner, where)
        if tag == "$tuple":
            return tuple(self(list(inner), where))
        if tag == "$dict":
            items = {k: self(v, _join(where, k)) for k, v in _mapping(inner, where).items()}
            return None if self.dry else items
        if tag == "$items":
            pairs = [(self(k, f"{where}[{i}]"), self(v, f"{where}[{i}]"))
                     for i, (k, v) in enumerate(inner)]
            return None if self.dry else {_hashable(k): v for k, v in pairs}
        if tag == "$role":
            return self._role(inner, where)
        if tag == "$dynamic":
            value = self(inner, where)
            return None if self.dry else _dynamic(value)
        if tag == "$callable":
            return self.lookup(inner, "function", where)
        if tag == "$class":
            return self._class(inner, where)
        if tag == "$call":
            return self._call(inner, where)
        if tag == "$partial":
            return self._partial(inner, where)
        if tag == "$enum":
            cls = self.lookup(_field(inner, "class", where, str), "class", where)
            name = _field(inner, "name", where, str)
            if self.dry:
                return None
            if not (isinstance(cls, type) and issubclass(cls, enum.Enum)) \
                    or name not in cls.__members__:
                raise RebuildError(f"rebuild: {where} names {inner['class']}.{name}, which is "
                                   "not a member of an enum")
            return cls.__members__[name]
        if tag == "$brick":
            return self.construct(inner, where, kind="brick")
        if tag == "$brick_path":
            if not isinstance(inner, str):
                raise RebuildError(f"rebuild: {where} holds a brick path that is not a string")
            if self.dry:
                return None
            if self.bricks is None or inner not in self.bricks:
                raise RebuildError(f"rebuild: {where} names the brick at {inner!r}, which the "
                                   "rebuilt model does not have")
            return self.bricks[inner]
        if tag == "$bound_application":
            brick = self(_field(inner, "brick", where, Mapping), f"{where}.brick")
            name = _field(inner, "name", where, str)
            return None if self.dry else _bound_application(brick, name)
        if tag == "$class_application":
            cls = self(_field(inner, "class", where, Mapping), f"{where}.class")
            name = _field(inner, "name", where, str)
            return None if self.dry else _class_application(cls, name, where)
        if tag == "$filter":
            fields = {k: self(v, _join(where, k)) for k, v in _mapping(inner, where).items()}
            return None if self.dry else _filter(fields, where)
        if tag == "$optimizer":
            return self.optimizer(inner, where)
        raise RebuildError(f"rebuild: {where} holds an unknown tag {tag!r}; the record was "
                           "written by a newer graphmod, or is damaged")

    def _role(self, inner: Any, where: str) -> Any:
        from graphmod import roles

        name = _field(inner, "name", where, str)
        parents = _field(inner, "parents", where, tuple | list)
        if not all(isinstance(p, str) for p in parents):
            raise RebuildError(f"rebuild: {where} holds role parents that are not names")
        if self.dry:
            return None
        parent = None
        for parent_name in reversed(list(parents)):
            parent = roles.add_role(parent_name, parent)
        return roles.add_role(name, parent)

    def _class(self, path: Any, where: str) -> Any:
        """A ``$class``: a graphmod brick or manager class, or a Flax module class."""
        from flax import nnx

        from graphmod._manager import Manager

        cls = self.lookup(path, "class", where)
        if self.dry or getattr(cls, "__graphmod_brick__", False) \
                or issubclass(cls, Manager | nnx.Module):
            return cls
        raise RebuildError(f"rebuild: {where} names {path!r}, which is not a brick, manager or "
                           "Flax module class")

    def _call(self, inner: Any, where: str) -> Any:
        """A ``$call``: a listed factory called with its recorded keyword arguments."""
        path = _field(inner, "function", where, str)
        factory = self.lookup(path, "factory", where)
        kwargs = {k: self(v, f"{where}.kwargs.{k}")
                  for k, v in _field(inner, "kwargs", where, Mapping).items()}
        if self.dry:
            return None
        try:
            return factory(**kwargs)
        except Exception as error:
            raise RebuildError(f"rebuild: {where}: calling {path}(...) failed: "
                               f"{type(error).__name__}: {error}") from error

    def _partial(self, inner: Any, where: str) -> Any:
        """A ``$partial``: ``functools.partial`` of a recorded function and arguments."""
        function = _field(inner, "function", where, Mapping)
        if len(function) != 1 or next(iter(function)) not in _FUNCTION_TAGS:
            raise RebuildError(f"rebuild: {where}.function must be a recorded function "
                               f"({', '.join(_FUNCTION_TAGS)}); the record is damaged or "
                               "crafted")
        (tag, path), = function.items()
        # Bound to recorded arguments, a function value is held to the word list everywhere.
        function = self.lookup(path, "partial", f"{where}.function") if tag == "$callable" \
            else self(function, f"{where}.function")
        args = self(list(_field(inner, "args", where, tuple | list)), f"{where}.args")
        kwargs = {k: self(v, f"{where}.kwargs.{k}")
                  for k, v in _field(inner, "kwargs", where, Mapping).items()}
        return None if self.dry else functools.partial(function, *args, **kwargs)

    def construct(self, config: Any, where: str, *, kind: str) -> Any:
        """A brick or manager from its record (None when dry, after checking it)."""
        config = _mapping(config, where)
        if config.get("recorded") is False or "error" in config or "arguments" not in config:
            reason = config.get("error") or "its construction was not recorded (not a " \
                                            "graphmod Brick or Manager)"
            raise RebuildError(f"rebuild: {where} ({config.get('class')}) cannot be rebuilt: "
                               f"{reason}")
        cls = self.lookup(config.get("class"), "class", f"{where}.class")
        arguments = {k: self(v, f"{where}.arguments.{k}")
                     for k, v in _mapping(config["arguments"], f"{where}.arguments").items()}
        if self.dry:
            return None
        if kind == "brick" and not getattr(cls, "__graphmod_brick__", False):
            raise RebuildError(f"rebuild: {where}.class names {config['class']!r}, which is "
                               "not a graphmod Brick")
        if kind == "manager":
            from graphmod._manager import Manager

            if not issubclass(cls, Manager):
                raise RebuildError(f"rebuild: {where}.class names {config['class']!r}, which "
                                   "is not a graphmod Manager")
        args, kwargs = _call_arguments(cls, arguments, where)
        try:
            return cls(*args, **kwargs)
        except Exception as error:
            raise RebuildError(f"rebuild: constructing {where} ({config['class']}) failed: "
                               f"{type(error).__name__}: {error}") from error

    def optimizer(self, record: Any, where: str) -> Any:
        """The optax transformation or schedule a recorded optimizer names."""
        from graphmod.provenance._optimizer import _factory, optimizer

        name = _field(record, "name", where, str)
        # Checked, not resolved: a listed optax name is made by optimizer() itself.
        self.rules.check(f"optax.{name}", "factory", f"{where}.name")
        arguments = {k: self(v, f"{where}.arguments.{k}")
                     for k, v in _mapping(record.get("arguments", {}),
                                          f"{where}.arguments").items()}
        if self.dry:
            return None
        args, kwargs = _call_arguments(_factory(name), arguments, where)
        try:
            return optimizer(name, *args, **kwargs)
        except Exception as error:
            raise RebuildError(f"rebuild: {where}: optax.{name}(...) failed: "
                               f"{type(error).__name__}: {error}") from error


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    """``value``, which must be a mapping; raises naming ``where`` otherwise."""
    if not isinstance(value, Mapping):
        raise RebuildError(f"rebuild: {where} is {type(value).__name__}, not a mapping; the "
                           "record is damaged or crafted")
    return value


def _data(tag: str, inner: Any, where: str) -> Any:
    """A tagged value holding no import path."""
    if tag == "$float":
        return float(str(inner))
    if tag == "$dtype":
        return _dtype(inner, where)
    if tag == "$array":
        return _array(inner, where)
    if tag == "$key":
        return _key(inner, where)
    if tag == "$rngs":
        return _rngs(inner, where)
    return str(inner)  # $application: the name of an application


def _dynamic(value: Any) -> Any:
    from graphmod._manager import dynamic

    return dynamic(value)


def _class_application(cls: Any, name: str, where: str) -> Any:
    from flax import nnx

    from graphmod._filter import ClassApplication

    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
        raise RebuildError(f"rebuild: {where} names {cls!r}, which is not a flax.nnx.Module "
                           "class")
    return ClassApplication(cls, name)


def _bound_application(brick: Any, name: str) -> Any:
    from graphmod._filter import BoundApplication

    return BoundApplication(brick, name)


def _filter(fields: dict[str, Any], where: str) -> Any:
    from graphmod._filter import VariableFilter

    unknown = sorted(set(fields) - set(_FILTER_FIELDS))
    if unknown:
        raise RebuildError(f"rebuild: {where} holds unknown filter fields {unknown}")
    try:
        return VariableFilter(**fields)
    except (TypeError, ValueError) as error:
        raise RebuildError(f"rebuild: {where}: {error}") from None


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
            if parameter.kind is parameter.VAR_POSITIONAL:
                if not isinstance(value, tuple | list):
                    raise RebuildError(f"rebuild: {where}.arguments.{parameter.name} holds "
                                       f"*{parameter.name}, which must be a list")
                value = tuple(value)
            bound[parameter.name] = value
    call = inspect.BoundArguments(signature.replace(parameters=parameters), bound)
    return call.args, call.kwargs


def _dtype(name: Any, where: str) -> np.dtype:
    """A numeric or boolean dtype by name; objects, strings and raw bytes are refused."""
    dtype = np.dtype(str(name))
    if dtype != np.bool_ and not jax.numpy.issubdtype(dtype, np.number):
        raise RebuildError(f"rebuild: {where} names the dtype {str(name)!r}; only numeric and "
                           "boolean dtypes are recorded")
    return dtype


def _array(inner: Any, where: str) -> Any:
    """A small array recorded by value."""
    dtype = _dtype(_field(inner, "dtype", where, str), where)
    data = [float(v) if isinstance(v, str) else v
            for v in _field(inner, "data", where, tuple | list)]
    if not all(isinstance(v, int | float) for v in data):
        raise RebuildError(f"rebuild: {where} holds array data that are not numbers")
    array = np.asarray(data, dtype).reshape(tuple(_field(inner, "shape", where, tuple | list)))
    if inner.get("kind") == "scalar":
        return dtype.type(array.item())
    if inner.get("kind") == "jax":
        return jax.numpy.asarray(array)
    return array


def _key(inner: Any, where: str) -> Any:
    """A typed PRNG key from its implementation's name and key data."""
    impl = _field(inner, "impl", where, str)
    if impl not in _KEY_IMPLS:
        raise RebuildError(f"rebuild: {where}: unknown PRNG implementation {impl!r}")
    return jax.random.wrap_key_data(np.asarray(inner["data"], np.uint32), impl=impl)


def _rngs(inner: Any, where: str) -> Any:
    """``nnx.Rngs`` with each stream's recorded key and count."""
    from flax import nnx

    streams = _mapping(inner, where)
    rngs = nnx.Rngs(**{name: _key(_field(s, "key", f"{where}.{name}", Mapping),
                                  f"{where}.{name}.key") for name, s in streams.items()})
    for name, stream in streams.items():
        count = getattr(rngs, name).count
        count[...] = jax.numpy.asarray(_field(stream, "count", f"{where}.{name}", int),
                                       count[...].dtype)
    return rngs


def _walk_bricks(model: Any) -> dict[str, Any]:
    from graphmod.provenance._collect import modules

    return modules(model)


def _verify(record: Provenance, model: Any) -> None:
    """Raises if the rebuilt model's modules or parameters differ from the record's."""
    from graphmod._layout import Layout
    from graphmod.provenance._collect import brick_records, parameter_records

    recorded_bricks = _mapping(record.inputs.get("bricks") or {}, "bricks")
    recorded_params = _mapping(record.inputs.get("parameters") or {}, "parameters")
    bricks = brick_records(model)
    params = parameter_records(Layout(model))
    problems = []
    for path in sorted(set(recorded_bricks) | set(bricks)):
        a, b = recorded_bricks.get(path), bricks.get(path)
        if a is None or b is None:
            problems.append(f"module {path}: {'only rebuilt' if a is None else 'missing'}")
        elif _mapping(a, f"bricks[{path!r}]").get("class") != b["class"]:
            problems.append(f"module {path}: recorded {a.get('class')}, rebuilt {b['class']}")
    for path in sorted(set(recorded_params) | set(params)):
        a, b = recorded_params.get(path), params.get(path)
        if a is None or b is None:
            problems.append(f"variable {path}: {'only rebuilt' if a is None else 'missing'}")
            continue
        for field in ("shape", "dtype", "role", "aliases"):
            recorded = _thaw(_mapping(a, f"parameters[{path!r}]").get(field))
            if recorded != b[field]:
                problems.append(f"variable {path}: {field} recorded {recorded}, "
                                f"rebuilt {b[field]}")
    if problems:
        raise RebuildError(
            "rebuild: the rebuilt model differs from the recorded one (was the model changed "
            "after construction, or did a library change?):\n  " + "\n  ".join(problems[:20]))


def rebuild(provenance: Provenance | str, *, allow: Iterable[str] = (),
            allow_factories: Iterable[str] = (), verify: bool = True) -> Rebuilt:
    """Constructs the model, managers and optimizer a provenance record describes.

    The root brick is constructed with its recorded arguments (RNG streams restored with
    their recorded key data and counts, so its parameters come out the same), then each
    manager (bricks it names resolved by path in the new model), then the optimizer if it
    was recorded. Compiling the same function over them gives the same graph fingerprint.

    A record is data and may be crafted: rebuild constructs only public graphmod bricks and
    managers, and calls only the factories of ``graphmod.provenance.DEFAULT_FACTORIES``
    (initializers, optax transformations and schedules), reached through public modules of
    the allowed packages; functions recorded as values (``jax.nn.relu``) must be public and
    are never called by rebuild itself. Every import path in the record is checked *before
    anything is imported*; a refusal names the record's field. See "Threat model" in the
    provenance docs.

    Args:
        provenance: a program, training or evaluation record (for an evaluation, its
            model's), or its JSON text.
        allow: top-level packages to trust besides graphmod, managers, jax, flax and optax
            (e.g. the package defining your bricks): their public classes and functions may
            be named.
        allow_factories: public functions rebuild may also call with recorded arguments
            (exact paths, e.g. ``["mypackage.initializers.scaled"]``; its package must be
            allowed), for initializers made by your own factories.
        verify: check that the rebuilt model's modules, classes and parameter shapes,
            dtypes, roles and aliases are the recorded ones.

    Returns:
        :class:`Rebuilt` with ``model``, ``managers``, ``optimizer``, ``monitor``,
        ``seeds`` and ``compile(fn)``.

    Raises:
        RebuildError: the record names something not allowed (nothing is imported then),
            something missing, a malformed entry or a value recorded as opaque; or the
            rebuilt model differs from the record.
        ProvenanceError: ``provenance`` is text that is not a provenance record.

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
    rules = Rules.widened(allow, allow_factories)
    inputs = provenance.inputs
    root = _mapping(inputs.get("bricks") or {}, "bricks").get("/")
    if root is None:
        raise RebuildError("rebuild: the record holds no root brick (bricks['/'])")
    # 1. Check everything to be constructed, importing nothing.
    _Decoder(rules, None, dry=True).construct(root, "bricks['/']", kind="brick")
    _the_rest(inputs, _Decoder(rules, None, dry=True))
    # 2. Construct.
    model = _Decoder(rules, None, dry=False).construct(root, "bricks['/']", kind="brick")
    if verify:
        _verify(provenance, model)
    built, monitor, tx, seeds = _the_rest(inputs, _Decoder(rules, _walk_bricks(model),
                                                           dry=False))
    return Rebuilt(model, built, tx, monitor, seeds, provenance)


def _the_rest(inputs: Mapping[str, Any], decoder: _Decoder
              ) -> tuple[tuple[Any, ...], dict[str, Any], Any, dict[str, Any]]:
    """The managers, monitor filters, optimizer and seeds of a record (Nones when dry)."""
    managers = _mapping(inputs.get("managers") or {}, "managers")
    for name, record in managers.items():
        if not isinstance(_mapping(record, f"managers.{name}").get("order", 0), int):
            raise RebuildError(f"rebuild: managers.{name}.order is not an integer")
    ordered = sorted(managers.items(), key=lambda item: item[1].get("order", 0))
    built = tuple(decoder.construct(record, f"managers.{name}", kind="manager")
                  for name, record in ordered)
    for (name, _), manager in zip(ordered, built, strict=True):
        if manager is not None and manager.name != name:
            raise RebuildError(f"rebuild: managers.{name} was rebuilt named {manager.name!r}")
    monitor = {label: _monitor_filter(record, decoder, label) for label, record
               in _mapping(inputs.get("monitor") or {}, "monitor").items()}
    optimizer = inputs.get("optimizer")
    tx = decoder.optimizer(optimizer, "optimizer") \
        if isinstance(optimizer, Mapping) and optimizer.get("name") is not None \
        and optimizer.get("source") != "explicit" else None
    seeds = {name: decoder({"$key": record}, f"seeds.{name}") for name, record
             in _mapping(inputs.get("seeds") or {}, "seeds").items() if record is not None}
    return built, monitor, tx, seeds


def _monitor_filter(record: Any, decoder: _Decoder, label: str) -> Any:
    """A monitor filter from its record (None when the decoder is dry)."""
    fields: dict[str, Any] = {}
    for key, value in _mapping(record, f"monitor[{label!r}]").items():
        where = f"monitor[{label!r}].{key}"
        if key in ("roles", "bricks") and not isinstance(value, tuple | list):
            raise RebuildError(f"rebuild: {where} is not a list")
        if key == "roles":
            if not all(isinstance(r, str) for r in value):
                raise RebuildError(f"rebuild: {where} holds role names that are not strings")
            fields[key] = None if decoder.dry else [_role(r, where) for r in value]
        elif key == "bricks":
            fields[key] = [decoder(v, _join(where, i)) for i, v in enumerate(value)]
        else:
            fields[key] = list(value) if isinstance(value, tuple) else value
    return None if decoder.dry else _filter(fields, f"monitor[{label!r}]")


def _role(name: str, where: str) -> Any:
    """The registered role ``name``."""
    from graphmod import roles

    try:
        return roles.get_role(name)
    except (KeyError, ValueError) as error:
        raise RebuildError(f"rebuild: {where}: {error}") from None
