"""``@application``: tagged brick methods, and the chain of managers around each call.

Each call of an application inside a compiled program

1. creates an :class:`ApplicationCall` (brick, application name, path, ``call_id``,
   ``training``) — passed to the method if it takes an ``application_call`` argument;
2. tags its inputs ``INPUT``, every parameter read inside it with its role, its outputs
   ``OUTPUT``;
3. runs the chain of matching managers around the method (see ``graphmod._manager``);
4. opens ``jax.named_scope`` with the brick's path relative to the calling application, so
   scopes in jaxprs, HLO and profiles read as the brick path.

Outside a compiled program the method runs as written: no tags, no managers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from graphmod import _context
from graphmod import roles as _roles
from graphmod._filter import Tag
from graphmod._frame import current_trace
from graphmod._rewrites import Rewrite, describe

if TYPE_CHECKING:
    from graphmod._frame import Frame
    from graphmod._layout import VariableInfo
    from graphmod._manager import Manager


class OwnedVariable:
    """A manager-owned variable of one application: read and write ``.value``.

    Examples:
        >>> # inside a manager hook: stats = call.variable("mean", jnp.zeros(4))
        >>> # stats.value = 0.9 * stats.value + 0.1 * batch_mean
    """

    __slots__ = ("_frame", "_key")

    def __init__(self, frame: Frame, key: tuple) -> None:
        self._frame = frame
        self._key = key

    @property
    def value(self) -> jax.Array:
        return self._frame.owned[self._key]

    @value.setter
    def value(self, new: Any) -> None:
        if self._frame.training and self._frame.mode != "init":
            self._frame.set_owned(self._key, new)
        # inference and init never update state: the update is dropped on purpose


@dataclasses.dataclass(frozen=True, eq=False)
class ApplicationCall:
    """One call of an application; what managers and the method know about it.

    Attributes:
        brick: the brick whose application runs.
        application: the application's name.
        path: the brick's path in the model (``"/layers/0"``), None outside a program.
        call_id: how many earlier calls of this (path, application) the trace saw.
        training: whether the program runs in training mode.

    Examples:
        >>> import graphmod as gm
        >>> class Scale(gm.Brick):
        ...     @gm.application(inputs=["x"], outputs=["y"])
        ...     def apply(self, x, application_call):
        ...         return x * (2.0 if application_call.training else 1.0)
        >>> Scale().apply(3.0)  # eagerly: not training
        3.0
    """

    brick: Any
    application: str
    path: str | None
    call_id: int
    training: bool
    spec: _Spec | None = dataclasses.field(default=None, repr=False)
    chain: tuple[Manager, ...] = dataclasses.field(default=(), repr=False)
    frame: Frame | None = dataclasses.field(default=None, repr=False)
    manager: Manager | None = None
    role: _roles.Role | None = None
    name: str | None = None

    # -- public API for methods and managers ------------------------------------------
    def rng(self, *, per_step: bool = True) -> jax.Array:
        """A key for this call: the step key folded with CRC32 of (manager, path,
        application, role, variable name) and the call id; inside ``graphmod.scan`` also
        the step index (unless ``per_step=False``: one key for every step); under
        ``compile(axis_name=...)`` also the device index."""
        if self.frame is None or self.path is None:
            raise RuntimeError(
                f"call.rng() in {type(self.brick).__name__}.{self.application} needs a "
                "compiled program: outside graphmod.compile managers do nothing and there "
                "is no step key"
            )
        parts = (
            self.manager.name if self.manager is not None else "",
            self.path,
            self.application,
            self.role.name if self.role is not None else "",
            self.name or "",
        )
        return self.frame.rng(parts, self.call_id, per_step=per_step)

    def variable(
        self, name: str, init: Any, *, role: _roles.Role = _roles.STATE, per_call: bool = False
    ) -> OwnedVariable:
        """A variable owned by the current manager for this (path, application).

        Created at ``init`` (``init`` is an array or a zero-argument callable, computed in
        the abstract trace from the shapes it sees); shared by all call ids unless
        ``per_call=True``.
        """
        if self.frame is None or self.path is None:
            raise RuntimeError(f"call.variable({name!r}) needs a compiled program")
        if self.manager is None:
            raise RuntimeError(f"call.variable({name!r}) is for managers' hooks")
        _roles.as_role(role, argument="call.variable(role=...)")
        key = (self.manager.name, self.path, self.application,
               self.call_id if per_call else None, name)
        self.frame.owned_value(key, init, role)
        return OwnedVariable(self.frame, key)

    def add_auxiliary_variable(
        self, value: Any, *, roles: Sequence[_roles.Role] = (), name: str | None = None
    ) -> Any:
        """Tags ``value`` as an auxiliary variable of this call (monitorable); returns it."""
        role_list = _roles.as_roles(roles, argument="add_auxiliary_variable(roles=...)")
        role = role_list[0] if role_list else _roles.AUXILIARY
        if self.frame is not None and self.path is not None:
            name = name or role.name.lower()
            tag = self.tag(role, name)
            self.frame.record(tag, value, None)
            self.frame.collect(tag, value, self.monitor_key(name))
        return value

    # -- used by the chain --------------------------------------------------------------
    def bound(self, manager: Manager, role: _roles.Role | None = None,
              name: str | None = None) -> ApplicationCall:
        return dataclasses.replace(self, manager=manager, role=role, name=name)

    def tag(self, role: _roles.Role, name: str, path: str | None = None) -> Tag:
        return Tag(role, name, path or f"{self.path}.{self.application}.{name}",
                   self.path or "", self.application, self.call_id, self.brick)

    def monitor_key(self, name: str) -> str:
        call = f"#{self.call_id}" if self.call_id else ""
        return f"{self.path}.{self.application}{call}.{name}"

    def _rewrite(self, manager: Manager, hook: str, tag: Tag, value: Any) -> Any:
        frame = self.frame
        assert frame is not None
        if not manager.selects(tag):
            return value
        frame.matches[id(manager)] += 1
        if manager.exclusive:
            claim = (self.path, self.application, self.call_id, tag.path)
            other = frame.exclusive.setdefault(claim, manager.name)
            if other != manager.name:
                raise ValueError(
                    f"managers {other!r} and {manager.name!r} both make exclusive rewrites of "
                    f"{tag.role} {tag.name!r} in application {self.application!r} of "
                    f"{self.path}: narrow one of their filters"
                )
        new = getattr(manager, hook)(self.bound(manager, tag.role, tag.name), tag.name, value)
        if new is value:  # the manager left it alone (e.g. dropout in inference)
            return value
        frame.rewrites.append(Rewrite(
            manager.name, self.path or "", self.application, self.call_id, tag.role.name,
            tag.name, *describe(value), *describe(new),
        ))
        frame.record(tag, new, manager.name)
        return new

    def rewrite_inputs(self, manager: Manager, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``manager.rewrite_input`` applied to each selected input of this call."""
        if not manager.has_hook("rewrite_input"):
            return args, kwargs
        spec = self.spec
        assert spec is not None
        bound = spec.signature.bind_partial(self.brick, *args, **kwargs)
        for name in spec.inputs:
            if name in bound.arguments:
                tag = self.tag(_roles.INPUT, name)
                bound.arguments[name] = self._rewrite(
                    manager, "rewrite_input", tag, bound.arguments[name])
        return bound.args[1:], bound.kwargs

    def rewrite_outputs(self, manager: Manager, out: Any) -> Any:
        """``manager.rewrite_output`` applied to each selected output of this call."""
        if not manager.has_hook("rewrite_output"):
            return out
        spec = self.spec
        assert spec is not None
        values = spec.split_outputs(out)
        new = [self._rewrite(manager, "rewrite_output", self.tag(_roles.OUTPUT, n), v)
               for n, v in zip(spec.outputs, values, strict=True)]
        return spec.join_outputs(new)

    def read_parameter(self, info: VariableInfo) -> Any:
        """The value of a model variable as this call sees it: rewritten once per call."""
        frame = self.frame
        assert frame is not None
        base = frame.values[info.identity]
        if not info.role.is_a(_roles.PERSISTENT):
            return base
        # One rewrite per (call, variable) and JAX trace: a value rewritten inside an inner
        # trace (a scan body) must not leak out of it. Trace states are not hashable.
        trace = current_trace()
        cached = frame.parameter_cache.setdefault(
            (self.path, self.application, self.call_id, info.identity), [])
        for cached_trace, cached_value in cached:
            if cached_trace == trace:
                return cached_value
        tag = self.tag(info.role, info.name, info.path)
        frame.record(tag, base, None)
        value = base
        for manager in self.chain:
            if manager.has_hook("rewrite_parameter"):
                value = self._rewrite(manager, "rewrite_parameter", tag, value)
        cached.append((trace, value))
        return value


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What an application declares: its input and output names."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    signature: inspect.Signature
    takes_call: bool

    def split_outputs(self, out: Any) -> tuple[Any, ...]:
        if len(self.outputs) == 1:
            return (out,)
        if not isinstance(out, tuple) or len(out) != len(self.outputs):
            raise ValueError(
                f"application {self.name!r} declares outputs {list(self.outputs)} but "
                f"returned {type(out).__name__}"
                + (f" of length {len(out)}" if isinstance(out, tuple) else "")
            )
        return out

    def join_outputs(self, values: list[Any]) -> Any:
        return values[0] if len(self.outputs) == 1 else tuple(values)


def _scope_name(parent: ApplicationCall | None, path: str, application: str) -> str:
    base = parent.path if parent is not None and parent.path is not None else "/"
    relative = path[len(base):] if path.startswith(base) else path
    relative = relative.strip("/")
    return f"{relative}.{application}" if relative else application


def application(
    method: Callable[..., Any] | None = None,
    *,
    inputs: Sequence[str] = (),
    outputs: Sequence[str] = (),
) -> Any:
    """Decorates a brick method as an application with named inputs and outputs.

    Args:
        inputs: names of the method's arguments tagged ``INPUT``.
        outputs: names of its results tagged ``OUTPUT`` (several: it returns a tuple).

    The decorated method accepts ``use_manager=`` (a manager or a list) to scope managers
    to this call and its children inside a compiled program.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> class Square(gm.Brick):
        ...     @gm.application(inputs=["x"], outputs=["y"])
        ...     def apply(self, x):
        ...         return x * x
        >>> float(Square().apply(jnp.float32(3.0)))
        9.0
    """
    if method is None:
        return functools.partial(application, inputs=inputs, outputs=outputs)
    for label, names in (("inputs", inputs), ("outputs", outputs)):
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"application {method.__name__!r}: {label} must be a list of names")
    signature = inspect.signature(method)
    missing = [n for n in inputs if n not in signature.parameters]
    if missing:
        raise ValueError(
            f"application {method.__qualname__}: inputs {missing} are not arguments of the "
            f"method (it takes {list(signature.parameters)[1:]})"
        )
    spec = _Spec(method.__name__, tuple(inputs), tuple(outputs), signature,
                 "application_call" in signature.parameters)

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, use_manager: Any = None, **kwargs: Any) -> Any:
        frame = _context.current_frame()
        path = None if frame is None else frame.layout.brick_path(self)
        if path is None:
            return _run_plain(spec, method, self, args, kwargs)
        assert frame is not None
        local = () if use_manager is None else tuple(
            use_manager if isinstance(use_manager, list | tuple) else [use_manager])
        with frame.using(local):
            return _run_managed(frame, spec, method, self, path, args, kwargs)

    wrapper.__graphmod_application__ = spec.name  # type: ignore[attr-defined]
    wrapper.__graphmod_spec__ = spec  # type: ignore[attr-defined]
    return wrapper


def _run_plain(spec: _Spec, method: Callable, brick: Any, args: tuple, kwargs: dict) -> Any:
    if spec.takes_call:
        call = ApplicationCall(brick, spec.name, None, 0, False, spec)
        kwargs = {**kwargs, "application_call": call}
    return method(brick, *args, **kwargs)


def _run_managed(frame: Frame, spec: _Spec, method: Callable, brick: Any, path: str,
                 args: tuple, kwargs: dict) -> Any:
    _context.split_trace_caches()  # no later inner trace may replay this call's
    call_id = frame.next_call_id(path, spec.name)
    chain = tuple(
        m for m in frame.chain()
        if m.filter.matches_application(brick, path, spec.name, call_id,
                                        frame.layout.instance_paths)
    )
    parent = frame.calls[-1] if frame.calls else None
    call = ApplicationCall(brick, spec.name, path, call_id, frame.training, spec, chain, frame)
    for manager in chain:
        if not manager.filter.selects_variables and manager.has_hook("wrap"):
            frame.matches[id(manager)] += 1  # a pure middleware matches the application

    def inputs(args: tuple, kwargs: dict, see: Callable[[Tag, Any, str], None]) -> None:
        bound = spec.signature.bind_partial(brick, *args, **kwargs)
        for name in spec.inputs:
            if name in bound.arguments:
                see(call.tag(_roles.INPUT, name), bound.arguments[name], name)

    def outputs(out: Any, see: Callable[[Tag, Any, str], None]) -> None:
        for name, value in zip(spec.outputs, spec.split_outputs(out), strict=True):
            see(call.tag(_roles.OUTPUT, name), value, name)

    record = lambda tag, value, name: frame.record(tag, value, None)
    collect = lambda tag, value, name: frame.collect(tag, value, call.monitor_key(name))

    def innermost(*args: Any, **kwargs: Any) -> Any:
        inputs(args, kwargs, collect)  # monitored: the inputs as the method sees them
        if spec.takes_call:
            kwargs = {**kwargs, "application_call": call}
        with frame.calling(call):
            out = method(brick, *args, **kwargs)
        outputs(out, record)  # recorded: the outputs before any rewrite
        return out

    layer: Callable[..., Any] = innermost
    for manager in reversed(chain):
        layer = functools.partial(_layer, manager, call, layer)
    with jax.named_scope(_scope_name(parent, path, spec.name)):
        inputs(args, kwargs, record)
        out = layer(*args, **kwargs)
    outputs(out, collect)  # monitored: the outputs as the caller sees them
    return out


def _layer(manager: Manager, call: ApplicationCall, next: Callable[..., Any],
           *args: Any, **kwargs: Any) -> Any:
    return manager.wrap(call.bound(manager), next, args, kwargs)
