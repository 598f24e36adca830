"""Import paths of classes and functions: found when recording, checked before rebuilding.

Recording (the core's ``public_path``) finds the shortest *public* path under which an
object is reachable in modules already imported (``jax.nn.relu``, ``graphmod.bricks.MLP``),
never importing anything. An object with no public path (a lambda, a local function,
anything defined in ``__main__`` or only in a private module) is recorded as opaque.

Rebuilding treats every path in a record as hostile. :class:`Rules` checks a path *before
anything is imported*, in this order:

1. **Syntax**: dotted Python identifiers, nothing else.
2. **Public**: no part starts with ``_``: no private module (``jax._src``, ``graphmod._cli``),
   no private or dunder attribute, nothing from ``__main__``.
3. **Allowed distribution**: the top-level package is one of :data:`DEFAULT_ALLOWED`
   (graphmod, managers, jax, flax, optax) or one the caller names with ``allow=``.
4. **No reach into the system**: below the top level, no part names a module of the
   standard library that touches the interpreter, files, processes or the network
   (``os``, ``subprocess``, ``pickle``, ``importlib``, ``runpy``, ... see ``_SYSTEM``), so
   ``flax.nnx.graph.os.system``-style re-exports never resolve.
5. **Nothing that loads or runs**: inside the default packages, no part, split at ``_``,
   contains a word of ``_DENIED_WORDS`` (``load``, ``pickle``, ``exec``, ``eval``, ``run``,
   ``main``, ``system``, ``callback``, ``checkpoint``, ``config``, ...): ``jax.numpy.load``,
   ``jax.debug.callback`` and ``graphmod.rebuild`` itself are refused. A package the
   caller adds with ``allow=`` is trusted for its public names, and this list is applied
   there only to a ``$partial``'s function, which is bound to recorded arguments.
6. **Factories are listed**: a function that rebuild *calls* with recorded arguments (a
   ``$call``, an optimizer's name) must be in :data:`DEFAULT_FACTORIES` (initializer
   factories of ``jax.nn.initializers``/``flax.nnx.initializers``, optax transformations
   and schedules) or in the caller's ``allow_factories=``, exactly. Any other public
   function may only be passed as a *value* (``$callable``: an activation, ``jnp.tanh``);
   rebuild never calls it, the brick it is given to does, with the brick's own arguments.

Only then does :meth:`Rules.resolve` import the longest importable prefix (a public module of
an allowed package) and walk the rest attribute by attribute (``inspect.getattr_static`` below
modules, so no descriptor runs). Every module passed through and the object reached must
belong to an allowed package (a public name may still re-export ``os.system`` or
``numpy.save``), its own ``__name__`` must pass rule 5, and it must be what the record
claims: a class, a plain Python function for a factory, a callable that is neither a class
nor a module for a value. Rebuild adds its own checks on classes (see ``_decoder``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import types
from collections.abc import Iterable
from typing import Any, Literal

from graphmod._records._record import ProvenanceError

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

# Standard-library modules that reach the interpreter, files, processes or the network.
_SYSTEM = frozenset({
    "os", "posix", "nt", "sys", "subprocess", "builtins", "importlib", "runpy", "pickle",
    "pickletools", "copyreg", "marshal", "shelve", "dill", "cloudpickle", "shutil", "socket",
    "ctypes", "code", "codeop", "pty", "multiprocessing", "concurrent", "threading",
    "tempfile", "pathlib", "io", "glob", "webbrowser", "urllib", "http", "inspect", "gc",
    "types", "operator", "functools", "ast", "dis", "compileall", "zipimport", "pkgutil",
    "site", "sysconfig", "tarfile", "zipfile", "asyncio", "selectors", "ssl"})
# Words (parts split at "_") of names in the default packages that load, run or reconfigure.
_DENIED_WORDS = frozenset({
    "load", "loads", "loader", "pickle", "unpickle", "pickler", "unpickler", "marshal",
    "serialize", "deserialize", "serialization", "exec", "execute", "executable", "eval",
    "evaluate", "compile", "run", "runner", "main", "system", "popen", "spawn", "fork", "shell",
    "subprocess", "import", "reload", "open", "save", "savez", "dump", "dumps", "write",
    "remove", "unlink", "rmtree", "rename", "exit", "kill", "breakpoint", "callback", "debug",
    "profiler", "server", "distributed", "config", "flags", "environ", "getenv", "putenv",
    "file", "fromfile", "tofile", "checkpoint", "checkpoints", "restore", "read", "resume",
    "rebuild", "download", "request", "getattr", "setattr", "delattr", "globals", "locals"})
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


def _words(name: str) -> set[str]:
    """The lower-case words of an identifier split at underscores."""
    return {word for word in name.lower().split("_") if word}


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a rebuild may name: allowed top-level packages and callable factories."""

    packages: frozenset[str] = DEFAULT_ALLOWED
    factories: frozenset[str] = DEFAULT_FACTORIES

    @classmethod
    def widened(cls, allow: Iterable[str], allow_factories: Iterable[str]) -> Rules:
        """The default rules plus the caller's packages and factories (each checked)."""
        packages = frozenset(_names("allow", allow))
        for package in packages:
            if not _PATH.match(package) or "." in package or package.startswith("_"):
                raise ValueError(f"rebuild(allow=[{package!r}]): expected top-level package "
                                 "names such as 'mypackage'")
        rules = cls(DEFAULT_ALLOWED | packages, DEFAULT_FACTORIES)
        extra = frozenset(_names("allow_factories", allow_factories))
        for path in extra:
            try:
                rules.check(path, "function", "allow_factories")
            except RebuildError as error:
                raise ValueError(f"rebuild(allow_factories=[{path!r}]): {error}; name public "
                                 "functions of allowed packages, e.g. "
                                 "'mypackage.initializers.scaled'") from None
        return cls(rules.packages, DEFAULT_FACTORIES | extra)

    def check(self, path: Any, kind: Kind, where: str) -> str:
        """Raises :class:`RebuildError` naming ``where`` unless ``path`` may be resolved as a
        ``kind``; imports nothing."""
        if not isinstance(path, str) or not _PATH.match(path):
            raise RebuildError(f"rebuild: {where} names {path!r}, which is not a dotted import "
                               "path; the record is damaged or crafted")
        parts = path.split(".")
        if parts[0] == "__main__":
            raise RebuildError(f"rebuild: {where} names {path!r}, defined in a script "
                               "(__main__), which cannot be imported again; define it in an "
                               "importable module and pass allow=[its package]")
        private = next((part for part in parts if part.startswith("_")), None)
        if private is not None:
            raise RebuildError(f"rebuild: {where} names {path!r}, whose part {private!r} is "
                               "private; rebuild resolves only public names of public modules "
                               "(nothing was imported). Export it from a public module if it "
                               "is yours")
        if parts[0] not in self.packages:
            raise RebuildError(
                f"rebuild: {where} names {path!r}, outside the allowed packages "
                f"({', '.join(sorted(self.packages))}); nothing was imported. If you trust "
                f"this record, pass allow=[{parts[0]!r}]")
        system = next((part for part in parts[1:] if part in _SYSTEM), None)
        if system is not None:
            raise RebuildError(f"rebuild: {where} names {path!r}, which reaches the {system!r} "
                               "module through a re-export; refused (nothing was imported)")
        if path not in self.factories and (parts[0] in DEFAULT_ALLOWED or kind == "partial"):
            self._check_words(parts, path, where)
        if kind == "factory" and path not in self.factories:
            raise RebuildError(
                f"rebuild: {where} calls {path!r}, which is not a factory rebuild may call: "
                "calls are limited to graphmod.provenance.DEFAULT_FACTORIES (initializer "
                "factories, optax transformations and schedules); nothing was imported. If you "
                f"trust it, pass allow_factories=[{path!r}]")
        return path

    def _check_words(self, parts: list[str], path: str, where: str) -> None:
        """Refuses a name whose words say it loads, runs or reconfigures something."""
        for part in parts:
            denied = sorted(_words(part) & _DENIED_WORDS)
            if denied:
                raise RebuildError(
                    f"rebuild: {where} names {path!r}, whose name says it may load, run or "
                    f"reconfigure something ({denied[0]!r}); rebuild never resolves such "
                    "names")

    def resolve(self, path: Any, kind: Kind, where: str) -> Any:
        """The object at ``path`` once :meth:`check` passes; raises :class:`RebuildError` if
        it is missing, lives outside the allowed packages or is not a ``kind``."""
        self.check(path, kind, where)
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
                    raise RebuildError(f"rebuild: {where} names {path!r}, but importing "
                                       f"{module_name} failed: {error}") from error
                index -= 1
            except ImportError as error:
                raise RebuildError(f"rebuild: {where} names {path!r}, but importing "
                                   f"{module_name} failed: {error}") from error
        if obj is None:
            raise RebuildError(f"rebuild: {where} names {path!r}, but no module of it can be "
                               "imported")
        for part in parts[index:]:
            if isinstance(obj, types.ModuleType):
                self._check_owner(obj.__name__, path, where)
            try:
                obj = getattr(obj, part) if isinstance(obj, types.ModuleType) \
                    else inspect.getattr_static(obj, part)
            except AttributeError:
                raise RebuildError(f"rebuild: {where} names {path!r}, which does not exist in "
                                   "this environment (another version?)") from None
        self._check_object(obj, kind, path, where)
        return obj

    def _check_object(self, obj: Any, kind: Kind, path: str, where: str) -> None:
        """Raises unless what ``path`` reached is an allowed package's ``kind``."""
        if isinstance(obj, types.ModuleType):
            raise RebuildError(f"rebuild: {where} names {path!r}, which is a module")
        owner = getattr(obj, "__module__", None)
        if not isinstance(owner, str):
            raise RebuildError(f"rebuild: {where} names {path!r}, which says nowhere which "
                               "module defines it; refused")
        self._check_owner(owner, path, where)
        name = getattr(obj, "__name__", None)
        if path not in self.factories and isinstance(name, str) \
                and (owner.split(".")[0] in DEFAULT_ALLOWED or kind == "partial"):
            self._check_words([name], path, where)
        if kind == "class" and not isinstance(obj, type):
            raise RebuildError(f"rebuild: {where} names {path!r}, which is not a class")
        if kind == "factory" and not inspect.isfunction(obj):
            raise RebuildError(f"rebuild: {where} calls {path!r}, which is not a Python "
                               "function")
        if kind in ("function", "partial") and (isinstance(obj, type) or not callable(obj)):
            raise RebuildError(f"rebuild: {where} names {path!r}, which is not a function")

    def _check_owner(self, module: str, path: str, where: str) -> None:
        """Raises unless ``module`` belongs to an allowed package."""
        if module.split(".")[0] not in self.packages:
            raise RebuildError(f"rebuild: {where} names {path!r}, which is {module}'s, outside "
                               f"the allowed packages ({', '.join(sorted(self.packages))})")


def _names(argument: str, values: Iterable[str]) -> list[str]:
    """``values`` as a list of strings; raises naming ``argument`` otherwise."""
    names = None if isinstance(values, str) else list(values)
    if names is None or not all(isinstance(v, str) for v in names):
        raise TypeError(f"rebuild({argument}=...): expected a list of strings, got {values!r}")
    return names
