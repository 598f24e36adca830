"""Automatic capture of constructor configuration for bricks and managers.

``Brick.__new__`` and ``Manager.__new__`` call :func:`record_construction`: each
construction records the class's public import path, the arguments as passed (bound to
the parameter names of its ``__init__``) and the defaults of the others, as JSON. The
record is stored on the instance as a plain string attribute — no NNX variable, so
``nnx.state`` is unchanged, and ``nnx.clone``/``copy.deepcopy`` keep it.

Values are encoded as JSON, tagged where JSON has no type of its own: ``{"$tuple": [...]}``,
``{"$role": ...}``, ``{"$dynamic": 0.5}``, ``{"$callable": "jax.nn.relu"}``,
``{"$call": {"function": "jax.nn.initializers.variance_scaling", "kwargs": ...}}`` (an
initializer made by a factory), ``{"$rngs": ...}`` (each stream's key data and count as they
were at construction), ``{"$brick": <config>}`` (a brick argument of a brick),
``{"$brick_instance": i}`` (a brick named by a manager: recorded by path at compile), and
``{"$opaque": ...}`` for what cannot be rebuilt (lambdas, traced values, large arrays).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from graphmod._filter import (
    ClassApplication,
    VariableFilter,
    bound_application,
    class_application,
)
from graphmod._validation import is_key
from graphmod.provenance._names import public_path

CONFIG = "_graphmod_config"
BRICK_REFS = "_graphmod_config_bricks"
MAX_ARRAY = 4096  # larger arrays are recorded by shape, dtype and hash only
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def short_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` without memory addresses, cut to ``limit`` characters."""
    try:
        text = _ADDRESS.sub("", repr(value))
    except Exception:  # a broken __repr__ must not break construction
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def class_path(cls: type) -> str:
    """A class's public import path, or ``module.qualname`` when it has none."""
    return public_path(cls) or f"{cls.__module__}.{cls.__qualname__}"


def class_application_record(application: ClassApplication) -> dict:
    """An unbound Flax method in a filter, by its class (``__call__`` is not a public name)."""
    return {"$class_application": {"class": {"$class": class_path(application.owner)},
                                   "name": application.name}}


def _opaque(kind: str, value: Any, **extra: Any) -> dict:
    return {"$opaque": {"kind": kind, "type": class_path(type(value)),
                        "repr": short_repr(value), **extra}}


def _is_tracer(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def _key(value: Any) -> dict:
    return {"impl": str(jax.random.key_impl(value)),
            "data": np.asarray(jax.random.key_data(value)).tolist()}


def key_record(value: Any) -> dict | None:
    """``{"impl": ..., "data": [...]}`` of a typed key or raw uint32 key data, or None."""
    if value is None or _is_tracer(value):
        return None
    if is_key(value):
        return _key(value)
    data = np.asarray(value)
    if data.dtype == np.uint32:
        return {"impl": str(jax.random.key_impl(jax.random.wrap_key_data(data))),
                "data": data.tolist()}
    return None


def _array(value: Any) -> dict:
    if _is_tracer(value):
        return _opaque("traced array", value, shape=list(value.shape), dtype=str(value.dtype))
    if is_key(value):
        return {"$key": _key(value)}
    host = np.asarray(value)
    kind = "scalar" if isinstance(value, np.generic) else \
        "numpy" if isinstance(value, np.ndarray) else "jax"
    if host.size > MAX_ARRAY or host.dtype.kind not in "biuf":
        digest = hashlib.sha256(np.ascontiguousarray(host).tobytes()).hexdigest()
        return _opaque("array", value, shape=list(host.shape), dtype=host.dtype.name,
                       sha256=digest)
    data = host.ravel().tolist()
    if host.dtype.kind == "f":  # non-finite values as strings float() reads back
        data = [v if math.isfinite(v) else repr(v) for v in data]
    return {"$array": {"kind": kind, "dtype": host.dtype.name, "shape": list(host.shape),
                       "data": data}}


def _rngs(value: Any) -> dict:
    from flax import nnx

    streams = {}
    for name, stream in vars(value).items():
        if not isinstance(stream, nnx.RngStream):
            continue
        key, count = stream.key[...], stream.count[...]
        if _is_tracer(key) or _is_tracer(count):
            return _opaque("traced rngs", value)
        streams[name] = {"key": _key(key), "count": int(count)}
    return {"$rngs": streams}


def _factory_call(fn: Callable[..., Any]) -> tuple[str, dict[str, Any]] | None:
    """``(factory path, kwargs)`` for a closure made by a public factory function, as
    ``jax.nn.initializers.normal(0.02)`` makes one; None otherwise."""
    qualname = getattr(fn, "__qualname__", "")
    outer, sep, inner = qualname.partition(".<locals>.")
    if not sep or "." in outer or "<" in inner or not inspect.isfunction(fn):
        return None
    import sys

    factory = getattr(sys.modules.get(fn.__module__), outer, None)
    path = public_path(factory) if inspect.isfunction(factory) else None
    if path is None:
        return None
    parameters = inspect.signature(factory).parameters
    kwargs: dict[str, Any] = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        if name not in parameters:
            return None
        try:
            kwargs[name] = cell.cell_contents
        except ValueError:
            return None
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.default is not parameter.empty and name in parameters:
            kwargs.setdefault(name, parameter.default)
    return path, kwargs


def _is_dtype(value: Any) -> bool:
    if isinstance(value, np.dtype):
        return True
    return isinstance(value, type) and (issubclass(value, np.generic)
                                        or type(value).__name__ == "_ScalarMeta")


class Encoder:
    """Encodes constructor arguments as tagged JSON (see the module docstring).

    ``by_path=True`` (managers) records brick instances as ``{"$brick_instance": i}``,
    keeping the instances in :attr:`bricks` to be resolved to paths at compile.
    """

    def __init__(self, *, by_path: bool) -> None:
        self.by_path = by_path
        self.bricks: list[Any] = []

    def __call__(self, value: Any) -> Any:
        from flax import nnx

        from graphmod import roles

        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, enum.Enum):
            path = public_path(type(value))
            return {"$enum": {"class": path, "name": value.name}} if path else \
                _opaque("enum", value)
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, roles.Role):
            chain, role = [], value.parent
            while role is not None:
                chain.append(role.name)
                role = role.parent
            return {"$role": {"name": value.name, "parents": chain}}
        if getattr(value, "__graphmod_dynamic__", False):
            return {"$dynamic": self(value.value)}
        if getattr(value, "__graphmod_brick__", False) and not isinstance(value, type):
            return self._brick(value)
        if isinstance(value, nnx.Rngs):
            return _rngs(value)
        if isinstance(value, VariableFilter):
            return {"$filter": self._filter(value)}
        if isinstance(value, jax.Array | np.ndarray | np.generic):
            return _array(value)
        if _is_dtype(value):
            return {"$dtype": np.dtype(value).name}
        if hasattr(value, "_graphmod_optimizer"):
            return {"$optimizer": json.loads(value._graphmod_optimizer)}
        if isinstance(value, list | nnx.List):
            return [self(v) for v in value]
        if isinstance(value, nnx.Module):
            return _opaque("module", value)
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"$tuple": [self(v) for v in value]}
        if isinstance(value, Mapping) and not isinstance(value, nnx.Module):
            if all(isinstance(k, str) for k in value):
                return {"$dict": {k: self(v) for k, v in value.items()}}
            return {"$items": [[self(k), self(v)] for k, v in value.items()]}
        if isinstance(value, type):
            path = public_path(value)
            return {"$class": path} if path else _opaque("class", value)
        bound = bound_application(value)
        if bound is not None:  # one brick's application: recorded with the brick
            return {"$bound_application": {"brick": self._brick(bound.brick),
                                           "name": bound.name}}
        name = getattr(value, "__graphmod_application__", None)
        if isinstance(name, str):
            return {"$application": name}
        application = class_application(value)
        if application is not None:  # nnx.Linear.__call__: by class
            return class_application_record(application)
        if isinstance(value, functools.partial):
            return {"$partial": {"function": self(value.func),
                                 "args": [self(a) for a in value.args],
                                 "kwargs": {k: self(v) for k, v in value.keywords.items()}}}
        if callable(value):
            path = public_path(value)
            if path is not None:
                return {"$callable": path}
            made = _factory_call(value)
            if made is not None:
                return {"$call": {"function": made[0],
                                  "kwargs": {k: self(v) for k, v in made[1].items()}}}
            return _opaque("callable", value)
        return _opaque("value", value)

    def _brick(self, brick: Any) -> Any:
        if self.by_path:
            for index, seen in enumerate(self.bricks):
                if seen is brick:
                    return {"$brick_instance": index}
            self.bricks.append(brick)
            return {"$brick_instance": len(self.bricks) - 1}
        config = vars(brick).get(CONFIG)
        if config is None:
            return _opaque("brick", brick, reason="its construction was not recorded")
        return {"$brick": json.loads(config)}

    def _filter(self, value: Any) -> dict:
        import dataclasses

        return {f.name: self(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) != f.default}


def capture(cls: type, init: Callable[..., Any], instance: Any, args: tuple, kwargs: dict,
            *, by_path: bool) -> tuple[str, tuple[Any, ...]]:
    """``(config JSON, brick instances)`` of the call ``cls(*args, **kwargs)`` whose
    ``__init__`` is ``init``."""
    encode = Encoder(by_path=by_path)
    record: dict[str, Any] = {"class": class_path(cls)}
    try:
        signature = inspect.signature(init)
        bound = signature.bind(instance, *args, **kwargs)
    except (TypeError, ValueError) as error:  # the call itself will raise
        record["error"] = f"{type(error).__name__}: {error}"
        return json.dumps(record), ()
    record["arguments"], record["defaults"] = encode_arguments(
        list(signature.parameters.values())[1:], bound, encode, Encoder(by_path=by_path))
    return json.dumps(record), tuple(encode.bricks)


def encode_arguments(parameters: list[inspect.Parameter], bound: inspect.BoundArguments,
                     encode: Callable[[Any], Any], encode_default: Callable[[Any], Any]
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(arguments, defaults)``: the call's arguments (``*args`` as a list, ``**kwargs``
    spread) and the defaults it left, each encoded for a record."""
    arguments: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    for parameter in parameters:
        if parameter.name in bound.arguments:
            value = bound.arguments[parameter.name]
            if parameter.kind is parameter.VAR_KEYWORD:
                arguments.update({k: encode(v) for k, v in value.items()})
            elif parameter.kind is parameter.VAR_POSITIONAL:
                arguments[parameter.name] = [encode(v) for v in value]
            else:
                arguments[parameter.name] = encode(value)
        elif parameter.default is not parameter.empty:
            defaults[parameter.name] = encode_default(parameter.default)
    return arguments, defaults


def record_construction(instance: Any, args: tuple, kwargs: dict, *, by_path: bool) -> None:
    """Notes on ``instance`` the configuration of ``type(instance)(*args, **kwargs)``.

    Called from ``__new__``, which sees every construction's arguments once, whatever
    defines ``__init__`` (a dataclass-generated one included) and before ``__init__``
    consumes any of them (an ``nnx.Rngs`` is recorded with its counts as passed).
    """
    cls = type(instance)
    try:
        config, bricks = capture(cls, cls.__init__, instance, args, kwargs, by_path=by_path)
    except Exception as error:  # recording must never break construction
        config = json.dumps({"class": class_path(cls),
                             "error": f"{type(error).__name__}: {error}"})
        bricks = ()
    object.__setattr__(instance, CONFIG, config)
    if by_path:
        object.__setattr__(instance, BRICK_REFS, bricks)


def config_of(obj: Any) -> dict[str, Any] | None:
    """The configuration recorded when ``obj`` (a brick or manager) was constructed.

    Examples:
        >>> import graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.provenance._capture import config_of
        >>> config = config_of(gm.bricks.Linear(2, 3, use_bias=False, rngs=nnx.Rngs(0)))
        >>> config["class"], config["arguments"]["use_bias"]
        ('graphmod.bricks.Linear', False)
    """
    text = vars(obj).get(CONFIG) if hasattr(obj, "__dict__") else None
    return None if text is None else json.loads(text)
