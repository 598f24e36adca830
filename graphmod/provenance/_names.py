"""Import paths of classes and functions: found when recording, checked before rebuilding.

Recording (the core's ``public_path``) finds the shortest *public* path under which an
object is reachable in modules already imported (``jax.nn.relu``, ``graphmod.bricks.MLP``),
never importing anything. An object with no public path (a lambda, a local function,
anything defined in ``__main__`` or only in a private module) is recorded as opaque.

Rebuilding treats every path in a record as hostile and admits a name by **membership in
an allow list**, never by what its words say. :class:`Rules` checks a path *before anything
it names is imported*, in this order:

1. **Syntax**: dotted Python identifiers, nothing else.
2. **Public**: no part starts with ``_``: no private module (``jax._src``, ``graphmod._cli``),
   no private or dunder attribute, nothing from ``__main__``.
3. **Calls are listed**: a function rebuild *calls* with recorded arguments (a ``$call``,
   an optimizer's name) must be in :data:`DEFAULT_FACTORIES` (initializer factories,
   optax transformations and schedules) or the caller's ``allow_factories=``, exactly.
4. **Names are listed**: anything else (a class, a function passed as a value, the function
   of a ``functools.partial``) must be on :func:`default_names` (constructors and pure
   functions: layers, initializers, activations, optax's functions, dtypes, enums; built
   from the rules of :data:`_SOURCES` and the names of :data:`_EXPLICIT`) or be an exact
   name the caller gives with ``allow=``. A top-level package in ``allow=`` admits the
   classes *defined* in that package (the caller's own bricks), nothing else of it.

A listed name resolves to the object the list holds for it, imported when the list was made;
only a class of a package in ``allow=`` is imported on a record's word (its longest importable
prefix, the rest walked attribute by attribute with ``inspect.getattr_static`` below modules,
so no descriptor runs; every module passed through must be the package's, and so must the
module defining the class). What a path reaches must be what the record claims: a class, a
plain Python function for a factory, a callable that is neither a class nor a module for a
value. Rebuild adds its own checks on classes (see ``_decoder``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import jax.numpy as jnp
import numpy as np
from flax import nnx

from graphmod._core._managers._manager import Manager
from graphmod._core._public_path import public_path
from graphmod._records._record import ProvenanceError

# The distributions the default list draws from (and numpy's scalar types).
DEFAULT_ALLOWED = frozenset({"graphmod", "managers", "jax", "flax", "optax"})

_INITIALIZERS = ("constant", "delta_orthogonal", "glorot_normal", "glorot_uniform", "he_normal",
                 "he_uniform", "kaiming_normal", "kaiming_uniform", "lecun_normal",
                 "lecun_uniform", "normal", "orthogonal", "truncated_normal", "uniform",
                 "variance_scaling", "xavier_normal", "xavier_uniform")
_SCHEDULES = ("constant_schedule", "cosine_decay_schedule", "cosine_onecycle_schedule",
              "exponential_decay", "join_schedules", "linear_onecycle_schedule",
              "linear_schedule", "piecewise_constant_schedule", "piecewise_interpolate_schedule",
              "polynomial_schedule", "sgdr_schedule", "warmup_constant_schedule",
              "warmup_cosine_decay_schedule", "warmup_exponential_decay_schedule")
_TRANSFORMATIONS = (
    "adabelief", "adadelta", "adafactor", "adagrad", "adam", "adamax", "adamaxw", "adamw",
    "adan", "adaptive_grad_clip", "add_decayed_weights", "add_noise", "amsgrad", "apply_every",
    "apply_if_finite", "centralize", "chain", "clip", "clip_by_block_rms",
    "clip_by_global_norm", "conditionally_mask", "conditionally_transform", "ema", "flatten",
    "fromage", "identity", "inject_hyperparams", "inject_stateful_hyperparams",
    "keep_params_nonnegative", "lamb", "lars", "lbfgs", "lion", "lookahead", "masked",
    "measure_with_ema", "multi_transform", "nadam", "nadamw", "noisy_sgd", "novograd",
    "partition", "polyak_sgd", "radam", "rmsprop", "rprop", "scale", "scale_by_adadelta",
    "scale_by_adam", "scale_by_adamax", "scale_by_adan", "scale_by_amsgrad",
    "scale_by_backtracking_linesearch", "scale_by_belief", "scale_by_factored_rms",
    "scale_by_lbfgs", "scale_by_lion", "scale_by_novograd", "scale_by_param_block_norm",
    "scale_by_param_block_rms", "scale_by_polyak", "scale_by_radam", "scale_by_rms",
    "scale_by_rprop", "scale_by_rss", "scale_by_schedule", "scale_by_sign", "scale_by_sm3",
    "scale_by_stddev", "scale_by_trust_ratio", "scale_by_yogi", "scale_by_zoom_linesearch",
    "set_to_zero", "sgd", "sign_sgd", "signum", "sm3", "trace", "yogi", "zero_nans")
DEFAULT_FACTORIES = frozenset(
    {f"{space}.{name}" for space in ("jax.nn.initializers", "flax.nnx.initializers")
     for name in _INITIALIZERS}
    | {"flax.nnx.initializers.zeros_init", "flax.nnx.initializers.ones_init"}
    | {f"{space}.{name}" for space in ("optax", "optax.schedules") for name in _SCHEDULES}
    | {f"optax.{name}" for name in _TRANSFORMATIONS})

# Pure functions named one by one where a namespace also holds I/O, configuration or
# callbacks (jax.numpy has load and set_printoptions, flax.nnx has jit and display).
_ELEMENTWISE = ("abs", "cos", "cosh", "exp", "exp2", "expm1", "log", "log1p", "sign", "sin",
                "sinh", "sqrt", "square", "tan", "tanh")
_EXPLICIT: Mapping[str, tuple[str, ...]] = {
    "jax.numpy": (*_ELEMENTWISE, "absolute", "add", "arcsinh", "arctan", "arctanh", "clip",
                  "divide", "expand_dims", "log2", "max", "maximum", "mean", "min", "minimum",
                  "multiply", "negative", "power", "prod", "ravel", "reciprocal", "reshape",
                  "squeeze", "std", "subtract", "sum", "swapaxes", "transpose", "var", "where"),
    "jax.lax": (*_ELEMENTWISE, "add", "div", "erf", "erf_inv", "logistic", "max", "min", "mul",
                "neg", "rsqrt", "sub"),
    "jax.scipy.special": ("erf", "erfc", "expit", "logit", "logsumexp"),
    "flax.nnx": ("avg_pool", "combine_masks", "dot_product_attention", "make_attention_mask",
                 "make_causal_mask", "max_pool", "min_pool", "pool"),
    "graphmod": ("Brick", "Manager"),  # its other names load lazily: never swept
    "graphmod.bricks": ("causal_mask",),
    "optax": _TRANSFORMATIONS + _SCHEDULES,
    "optax.schedules": _SCHEDULES,
}


def _is_function(value: object) -> bool:
    """A callable that is neither a class, a module nor a typing construct."""
    return (callable(value) and not isinstance(value, type | types.ModuleType)
            and type(value).__module__ != "typing")


def _is_layer(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, nnx.Module | Manager)


def _is_enum(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, enum.Enum)


def _is_jax_scalar(value: object) -> bool:
    return isinstance(value, type(jnp.float32))


def _is_numpy_scalar(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, np.number | np.bool_)


# Namespaces whose every public attribute passing a precise rule is on the list.
_SOURCES: tuple[tuple[str, Callable[[object], bool]], ...] = (
    ("flax.nnx", _is_layer),                    # Flax's layers
    ("graphmod.bricks", _is_layer),             # graphmod's bricks
    ("managers", _is_layer),                    # the manager library
    ("jax.nn", _is_function),                   # activations
    ("flax.nnx.nn.activations", _is_function),  # Flax's activations (jax.nn's and tanh)
    ("jax.nn.initializers", _is_function),
    ("flax.nnx.initializers", _is_function),
    ("optax.losses", _is_function),
    ("jax.lax", _is_enum),                      # Precision, DotAlgorithmPreset, ...
    ("jax.numpy", _is_jax_scalar),              # jnp.float32, jnp.bfloat16, ...
    ("numpy", _is_numpy_scalar),                # np.float32, np.int8, np.bool_, ...
)
# Where a listed object may also be named: each public attribute there that *is* one.
_ALIASES = ("jax.nn", "jax.nn.initializers", "jax.numpy", "jax.lax", "jax.scipy.special",
            "flax.nnx", "flax.nnx.initializers", "optax", "optax.schedules", "optax.losses",
            "graphmod", "graphmod.bricks", "managers")
_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
# factory: called by rebuild; function: a value; partial: a value bound to recorded arguments.
Kind = Literal["factory", "function", "partial", "class"]


class RebuildError(ProvenanceError):
    """A provenance record cannot be rebuilt: it names something not allowed, not found,
    or recorded as opaque; or the rebuilt model differs from the recorded one.

    The message names the record's field (``bricks['/'].arguments.kernel_init``) and what
    to do. A refusal for a name not allowed is raised before anything is imported.

    Examples:
        >>> import graphmod as gm
        >>> issubclass(gm.provenance.RebuildError, gm.provenance.ProvenanceError)
        True
    """


def _public(namespace: types.ModuleType) -> dict[str, object]:
    return {name: value for name, value in vars(namespace).items() if not name.startswith("_")}


def _namespace(name: str) -> types.ModuleType:
    """The module at ``name``, an attribute (``flax.nnx.initializers``) or a submodule."""
    parts = name.split(".")
    space = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], 2):
        space = getattr(space, part, None) or importlib.import_module(".".join(parts[:index]))
    return space


@functools.cache
def _default_objects() -> Mapping[str, object]:
    """Every name on the default list with the object it stands for (made once)."""
    spaces = {name: _namespace(name)
              for name in {*(s for s, _ in _SOURCES), *_EXPLICIT, *_ALIASES}}
    names = {f"{space}.{name}": value for space, rule in _SOURCES
             for name, value in _public(spaces[space]).items() if rule(value)}
    names |= {f"{space}.{name}": getattr(spaces[space], name) for space, listed in
              _EXPLICIT.items() for name in listed if hasattr(spaces[space], name)}
    chosen = {id(value): value for value in names.values()}
    names |= {f"{space}.{name}": value for space in _ALIASES
              for name, value in _public(spaces[space]).items() if id(value) in chosen}
    for value in chosen.values():  # where it is defined, and where records find it
        defined = f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', '')}"
        module, _, qualname = defined.rpartition(".")
        if _PATH.match(defined) and _private(defined) is None \
                and getattr(sys.modules.get(module), qualname, None) is value:
            names[defined] = value
        recorded = public_path(value)
        if recorded is not None:
            names[recorded] = value
    return types.MappingProxyType(names)


def default_names() -> frozenset[str]:
    """Every name ``rebuild`` admits by default: constructors and pure functions.

    Layers (every public ``flax.nnx.Module`` subclass of ``flax.nnx``, graphmod's bricks,
    the manager library), initializers (``jax.nn.initializers``, ``flax.nnx.initializers``),
    activations (``jax.nn``, Flax's), optax's transformations, schedules and losses, dtypes
    (``jnp.float32``, ``numpy.int8``, ...), ``jax.lax``'s enums and listed pure functions of
    ``jax.numpy``, ``jax.lax`` and ``flax.nnx``; each under every public name records may
    give it. No registration, configuration, I/O, process, cache or monitoring function is
    on it. ``rebuild(..., allow=[...])`` adds exact names of your own.

    Examples:
        >>> import graphmod as gm
        >>> names = gm.provenance.default_names()
        >>> "jax.nn.relu" in names, "flax.nnx.nn.linear.Linear" in names
        (True, True)
        >>> "jax.monitoring.register_event_listener" in names, "jax.numpy.load" in names
        (False, False)
    """
    return frozenset(_default_objects())


def _private(path: str) -> str | None:
    """The first ``_``-prefixed part of ``path``, if any."""
    return next((part for part in path.split(".") if part.startswith("_")), None)


def _own(path: str) -> str:
    """How a caller admits a name of their own."""
    return f"a class or function of your own is allowed by its exact name: allow=[{path!r}]"


_OWN = _own("mypackage.layers.Scaled")


def _reach(path: str, packages: frozenset[str] | None, fail: Callable[[str], Exception]
           ) -> object:
    """The object at ``path``: its longest importable prefix imported, the rest walked
    (statically below modules). With ``packages``, every module passed through must be
    theirs. Raises ``fail(reason)``."""
    parts = path.split(".")
    obj: object = None
    index = len(parts)
    while index > 0:
        module_name = ".".join(parts[:index])
        try:
            obj = importlib.import_module(module_name)
            break
        except ModuleNotFoundError as error:
            if error.name is None or not module_name.startswith(error.name):
                raise fail(f"importing {module_name} failed: {error}") from error
            index -= 1
        except ImportError as error:
            raise fail(f"importing {module_name} failed: {error}") from error
    if obj is None:
        raise fail("no module of it can be imported")
    for part in parts[index:]:
        if isinstance(obj, types.ModuleType) and packages is not None \
                and obj.__name__.split(".")[0] not in packages:
            raise fail(f"it is reached through {obj.__name__}, outside the packages allowed "
                       f"({', '.join(sorted(packages))})")
        try:
            obj = getattr(obj, part) if isinstance(obj, types.ModuleType) \
                else inspect.getattr_static(obj, part)
        except AttributeError:
            raise fail("it does not exist in this environment (another version?)") from None
    return obj


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a rebuild may name: listed names with their objects, the caller's packages (for
    the classes defined in them), the factories it may call, and what the caller added."""

    names: Mapping[str, object] = dataclasses.field(default_factory=_default_objects)
    packages: frozenset[str] = frozenset()
    factories: frozenset[str] = DEFAULT_FACTORIES
    added: tuple[str, ...] = ()

    @classmethod
    def widened(cls, allow: Iterable[str], allow_factories: Iterable[str]) -> Rules:
        """The default rules plus the caller's names, packages and factories, each checked
        (and each exact name imported: the caller vouches for it) before any record is."""
        allow, allow_factories = _names("allow", allow), _names("allow_factories",
                                                                allow_factories)
        names = dict(_default_objects())
        packages = set()
        for path in allow:
            if "." not in path and _PATH.match(path) and not path.startswith("_"):
                if path in DEFAULT_ALLOWED:
                    raise ValueError(
                        f"rebuild(allow=[{path!r}]): {path} is allowed through graphmod's "
                        "explicit list (graphmod.provenance.default_names()), never as a "
                        "whole package; name what else you need exactly, e.g. "
                        f"allow=['{path}.some_module.SomeClass']")
                packages.add(path)
            else:
                names[path] = _exact("allow", path, lambda v: isinstance(v, type)
                                     or _is_function(v), "a class or a function")
        for path in allow_factories:
            names[path] = _exact("allow_factories", path, inspect.isfunction,
                                 "a Python function")
        return cls(types.MappingProxyType(names), frozenset(packages),
                   DEFAULT_FACTORIES | frozenset(allow_factories),
                   tuple(sorted({*allow, *allow_factories})))

    def check(self, path: object, kind: Kind, where: str) -> str:
        """Raises :class:`RebuildError` naming ``where`` unless ``path`` may be resolved as a
        ``kind``; imports nothing."""
        if not isinstance(path, str) or not _PATH.match(path):
            raise RebuildError(f"rebuild: {where} names {path!r}, which is not a dotted import "
                               "path; the record is damaged or crafted")
        top = path.split(".")[0]
        if top == "__main__":
            raise RebuildError(f"rebuild: {where} names {path!r}, defined in a script "
                               "(__main__), which cannot be imported again; define it in an "
                               f"importable module: then {_OWN}")
        private = _private(path)
        if private is not None:
            raise RebuildError(f"rebuild: {where} names {path!r}, whose part {private!r} is "
                               "private; rebuild resolves only public names of public modules "
                               f"(nothing was imported). If it is yours, export it from a "
                               f"public module: then {_OWN}")
        if kind == "factory":
            if path not in self.factories:
                raise RebuildError(
                    f"rebuild: {where} calls {path!r}, which is not a factory rebuild may "
                    "call: calls are limited to graphmod.provenance.DEFAULT_FACTORIES "
                    "(initializer factories, optax transformations and schedules); nothing "
                    "was imported. A factory of your own is allowed by its exact name: "
                    f"allow_factories=[{path!r}]")
            return path
        if path in self.names or (kind == "class" and top in self.packages):
            return path
        if top in self.packages:
            raise RebuildError(
                f"rebuild: {where} names {path!r}, which is not a class: allow=[{top!r}] "
                f"admits only the classes defined in {top}; nothing was imported. A function "
                f"of your own is allowed by its exact name: allow=[{path!r}]")
        also = f", or every class defined in its package with allow=[{top!r}]" \
            if kind == "class" and top not in DEFAULT_ALLOWED else ""
        raise RebuildError(
            f"rebuild: {where} names {path!r}, which is not on rebuild's allow list "
            "(constructors and pure functions, graphmod.provenance.default_names()); nothing "
            f"was imported. If you trust this record, {_own(path)}{also}")

    def resolve(self, path: object, kind: Kind, where: str) -> Callable[..., object]:
        """The object at ``path`` once :meth:`check` passes; raises :class:`RebuildError` if
        it is missing, lies outside the allowed packages or is not a ``kind``."""
        path = self.check(path, kind, where)
        if path in self.names:
            obj = self.names[path]
        elif kind == "class":  # a class of the caller's package
            obj = _reach(path, self.packages, lambda reason: RebuildError(
                f"rebuild: {where} names {path!r}, but {reason}"))
            owner = getattr(obj, "__module__", None) if isinstance(obj, type) else None
            if not isinstance(owner, str) or owner.split(".")[0] != path.split(".")[0]:
                what = f"{owner}'s" if isinstance(obj, type) else f"a {type(obj).__name__}"
                raise RebuildError(
                    f"rebuild: {where} names {path!r}, which is not a class defined in "
                    f"{path.split('.')[0]} (it is {what}); allow=[package] admits only the "
                    f"package's own classes. If you trust it, {_own(path)}")
        else:  # a listed factory this version lacks
            raise RebuildError(f"rebuild: {where} names {path!r}, which does not exist in "
                               "this environment (another version?)")
        if kind == "class" and not isinstance(obj, type):
            raise RebuildError(f"rebuild: {where} names {path!r}, which is not a class")
        if kind == "factory" and not inspect.isfunction(obj):
            raise RebuildError(f"rebuild: {where} calls {path!r}, which is not a Python "
                               "function")
        if kind in ("function", "partial") and not _is_function(obj):
            raise RebuildError(f"rebuild: {where} names {path!r}, which is not a function")
        if not callable(obj):  # unreached: each kind's check above leaves a class or function
            raise RebuildError(f"rebuild: {where} names {path!r}, which is not callable")
        return obj


def _exact(argument: str, path: str, fits: Callable[[object], bool], what: str) -> object:
    """The object an exact name of the caller's stands for; raises ValueError naming
    ``argument`` unless it is a public dotted name of ``what``."""
    example = "'mypackage.layers.Scaled'" if argument == "allow" else \
        "'mypackage.initializers.scaled'"
    private = _private(path) if _PATH.match(path) else None
    if private is not None:
        raise ValueError(f"rebuild({argument}=[{path!r}]): its part {private!r} is private; "
                         f"name a public class or function, e.g. {example}")
    if not _PATH.match(path) or "." not in path:
        raise ValueError(f"rebuild({argument}=[{path!r}]): expected exact dotted names of "
                         f"your classes or functions, e.g. {example}"
                         + (", or a top-level package name such as 'mypackage' (its classes)"
                            if argument == "allow" else ""))
    obj = _reach(path, None, lambda reason: ValueError(
        f"rebuild({argument}=[{path!r}]): {reason}; name an importable class or function "
        f"exactly, e.g. {example}"))
    if not fits(obj):
        found = "a module" if isinstance(obj, types.ModuleType) else type(obj).__name__
        raise ValueError(f"rebuild({argument}=[{path!r}]): it is {found}, not {what}; name "
                         f"each exactly, e.g. {example}")
    return obj


def _names(argument: str, values: Iterable[str]) -> list[str]:
    """``values`` as a list of strings; raises naming ``argument`` otherwise."""
    try:
        names = None if isinstance(values, str) else list(values)
    except TypeError:
        names = None
    if names is None or not all(isinstance(v, str) for v in names):
        raise TypeError(f"rebuild({argument}=...): expected a list of strings, got {values!r}")
    return names
