"""The decoding ``rebuild`` runs: the codec's tags, with import paths under :class:`Rules`.

Each tag decodes itself (``graphmod._core._codec``); what the core must not decide comes
from here: an import path is checked by :meth:`Rules.check` in the check pass (nothing
imported) and resolved by :meth:`Rules.resolve` in the construct pass; bricks and managers
are constructed, and optimizers made, with their recorded arguments bound to the current
signatures; a ``$class`` must be a brick, manager or Flax module class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Literal

from flax import nnx

from graphmod._core._codec import Decoding, Kind
from graphmod._core._managers._manager import Manager, dynamic
from graphmod._records._optimizer import optax_factory, optimizer
from graphmod.provenance._names import RebuildError, Rules


class RecordDecoder(Decoding):
    """Decodes a record's values under ``rules``; with ``dry=True`` only checks them,
    importing nothing. ``bricks`` maps paths of the rebuilt model to its bricks (for
    ``$brick_path``; None before the model exists).

    Examples:
        >>> from graphmod.provenance._decoder import RecordDecoder
        >>> from graphmod.provenance._names import Rules
        >>> RecordDecoder(Rules(), None, dry=False)({"$callable": "jax.nn.relu"}, "x").__name__
        'relu'
    """

    error = RebuildError
    classes = (Manager, nnx.Module)

    def __init__(self, rules: Rules, bricks: Mapping[str, nnx.Pytree] | None, *,
                 dry: bool) -> None:
        super().__init__(dry=dry)
        self.rules = rules
        self.bricks = bricks

    def check(self, path: object, kind: Kind, where: str) -> None:
        self.rules.check(path, kind, where)

    def lookup(self, path: object, kind: Kind, where: str
               ) -> type | Callable[..., object] | None:  # typed by Decoding's overloads
        if self.dry:
            self.rules.check(path, kind, where)
            return None
        found = self.rules.resolve(path, kind, where)
        if kind == "class" and not isinstance(found, type):  # resolve refuses it: unreached
            raise RebuildError(f"rebuild: {where} names {path!r}, which is not a class")
        return found

    def build(self, cls: type, path: str, arguments: dict[str, object], where: str,
              kind: Literal["brick", "manager"]) -> object:
        if kind == "brick" and not getattr(cls, "__graphmod_brick__", False):
            raise RebuildError(f"rebuild: {where}.class names {path!r}, which is not a "
                               "graphmod Brick")
        if kind == "manager" and not issubclass(cls, Manager):
            raise RebuildError(f"rebuild: {where}.class names {path!r}, which is not a "
                               "graphmod Manager")
        args, kwargs = call_arguments(cls, arguments, where)
        try:
            return cls(*args, **kwargs)
        except Exception as error:
            raise RebuildError(f"rebuild: constructing {where} ({path}) failed: "
                               f"{type(error).__name__}: {error}") from error

    def optimizer(self, name: str, arguments: dict[str, object], where: str) -> object:
        args, kwargs = call_arguments(optax_factory(name), arguments, where)
        try:
            return optimizer(name, *args, **kwargs)
        except Exception as error:
            raise RebuildError(f"rebuild: {where}: optax.{name}(...) failed: "
                               f"{type(error).__name__}: {error}") from error

    def dynamic(self, value: object) -> object:
        if not isinstance(value, int | float):  # graphmod records its float (tagged() names
            raise TypeError(f"dynamic(value): expected a float, got {value!r}")  # the entry)
        return dynamic(value)

    def brick_at(self, path: str, where: str) -> nnx.Pytree:
        if self.bricks is None or path not in self.bricks:
            raise RebuildError(f"rebuild: {where} names the brick at {path!r}, which the "
                               "rebuilt model does not have")
        return self.bricks[path]


def call_arguments(target: Callable[..., object], arguments: Mapping[str, object], where: str
                   ) -> tuple[tuple[object, ...], dict[str, object]]:
    """Positional and keyword arguments for ``target`` from recorded named arguments."""
    init = target.__init__ if isinstance(target, type) else target
    signature = inspect.signature(init)
    parameters = [p for p in signature.parameters.values()][1 if isinstance(target, type)
                                                               else 0:]
    names = {p.name for p in parameters}
    var_keyword = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
    bound: dict[str, object] = {}
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
