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

Unmodified Flax modules
    Any ``nnx.Module`` of a compiled model that is not a brick is one too: while a program
    traces, every call of its ``__call__`` (read as application ``apply``) and of the methods
    named in ``compile(..., applications={cls: [names]})`` (by default also ``Embed.attend``)
    is an application at the module's path. Its inputs are the arrays among its arguments
    (named as in the method's signature; inside tuples, lists and dicts by their keys,
    ``carry.0``; a ``**kwargs`` entry by its key), its outputs the returned array
    (``output``) or the arrays of a returned tuple (``output_0``, ``output_1``, ...). This
    works by switching the module instances' class, during a trace only, to a cached
    subclass (same name) whose methods run the chain around the original
    (``graphmod._context`` owns the switch and restores it, also after an exception).

Sharp edges
    Inside a trace ``type(module)`` is that subclass (``isinstance`` checks are
    unaffected). A method called on the class (``nnx.Linear.__call__(layer, x)``,
    ``super().__call__(x)``) is not a separate application. Two programs with different
    ``applications=`` tracing one model at the same time share one subclass (the first
    one's). A manager-owned variable of an application whose module a scan slices (``nnx.scan``
    over layers) is one per iteration, stacked with the loops' lengths as leading axes (see
    ``graphmod._loop_keys``); where the loop sees the whole module (``nnx.RNN``'s cell,
    ``nnx.vmap``, ``jax.jit``) it is shared by every iteration and cannot be updated there,
    nor created from a parameter's value (use ``graphmod.scan``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from graphmod import _context
from graphmod import roles as _roles
from graphmod._filter import Tag
from graphmod._frame import current_trace
from graphmod._rewrites import Rewrite, describe
from graphmod._variables import identity_of

if TYPE_CHECKING:
    from graphmod._frame import Frame, OwnedKey
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
        return self._frame.read_owned(self._key)

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
        parameter: in a ``rewrite_parameter`` hook, the parameter's path
            (``"/linear1.kernel"``), else None.
        parameter_value: in a ``rewrite_parameter`` hook, the parameter's stored value as
            this call reads it, before any manager's rewrite (a layer's slice inside
            ``nnx.scan``).

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
    parameter: str | None = None
    parameter_value: Any = dataclasses.field(default=None, repr=False)

    # -- public API for methods and managers ------------------------------------------
    def rng(self, *, per_step: bool = True, per_call: bool = False) -> jax.Array:
        """A key for this call: the step key folded with CRC32 of (manager, path,
        application, role, variable name) and the call id; inside ``graphmod.scan`` also
        the step index, inside a loop JAX traces once (``nnx.scan`` over layers,
        ``nnx.fori_loop``) the iteration's position (unless ``per_step=False``: one key for
        every step); under ``compile(axis_name=...)`` also the device index.

        In a ``rewrite_parameter`` hook the key is the parameter's, not the call's: folded
        with (manager, parameter path, role, name) only, so every application call that
        reads the parameter in a step (tied weights: an embedding's ``apply`` and
        ``attend``; a layer called twice) sees one draw, as Blocks' one noisy copy of a
        shared variable per graph. ``per_call=True`` keys it by the call instead.
        """
        if self.frame is None or self.path is None:
            raise RuntimeError(
                f"call.rng() in {type(self.brick).__name__}.{self.application} needs a "
                "compiled program: outside graphmod.compile managers do nothing and there "
                "is no step key"
            )
        by_parameter = self.parameter is not None and not per_call
        parts = (
            self.manager.name if self.manager is not None else "",
            self.parameter if by_parameter else self.path,
            "" if by_parameter else self.application,
            self.role.name if self.role is not None else "",
            self.name or "",
        )
        return self.frame.rng(parts, 0 if by_parameter else self.call_id, per_step=per_step)

    def variable(
        self, name: str, init: Any, *, role: _roles.Role = _roles.STATE, per_call: bool = False,
        per_parameter: bool | None = None,
    ) -> OwnedVariable:
        """A variable owned by the current manager for this (path, application), or in a
        ``rewrite_parameter`` hook for this parameter.

        Created at ``init``. ``init`` is an array, a zero-argument callable computed from
        the shapes it sees, or — in a parameter hook — a callable of one argument, given the
        parameter's initial value (weight norm's ``g = ||W||``). Shared by all call ids
        unless ``per_call=True``. ``per_parameter`` (default: True in parameter hooks) keys
        it by the parameter rather than the application, so two parameters of one
        application get two variables and a tied parameter read by two applications one;
        it lives at ``variables["managers"][manager][owner path][parameter name][name]``.

        Examples:
            >>> import jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> class Norm(gm.Manager):  # weight norm: W * g / ||W||, g starts at ||W||
            ...     def rewrite_parameter(self, call, name, value):
            ...         norm = lambda w: jnp.linalg.norm(w, axis=0)
            ...         g = call.variable("g", norm, role=gm.roles.PARAMETER)
            ...         return value * g.value / norm(value)
            >>> class Two(nnx.Module):
            ...     def __init__(self):
            ...         self.a = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
            ...         self.b = nnx.Linear(3, 1, rngs=nnx.Rngs(1))
            ...     def __call__(self, x):
            ...         return self.b(self.a(x))
            >>> model = Two()
            >>> with Norm(roles=[gm.roles.WEIGHT]):
            ...     program = gm.compile(lambda m, x: m(x), model)
            >>> owned = program.init(jnp.ones((1, 2)))["managers"]["norm"]
            >>> sorted(owned), owned["/a"]["kernel"]["g"].shape
            (['/a', '/b', 'hparams'], (3,))
        """
        if self.frame is None or self.path is None:
            raise RuntimeError(f"call.variable({name!r}) needs a compiled program")
        if self.manager is None:
            raise RuntimeError(f"call.variable({name!r}) is for managers' hooks")
        _roles.as_role(role, argument="call.variable(role=...)")
        if per_parameter is None:
            per_parameter = self.parameter is not None
        if per_parameter and (self.parameter is None or per_call):
            raise ValueError(
                f"manager {self.manager.name!r}: call.variable({name!r}, per_parameter=True) "
                + ("is for rewrite_parameter hooks; this call rewrites an input or output"
                   if self.parameter is None else
                   "cannot also be per_call: a parameter's variable is shared by its calls")
            )
        if per_parameter:
            owner, _, parameter = self.parameter.rpartition(".")
            key: OwnedKey = (self.manager.name, owner, parameter, None, name)
        else:
            key = (self.manager.name, self.path, self.application,
                   self.call_id if per_call else None, name)
        given = self.parameter_value if per_parameter and _takes_one_argument(init) else None
        self.frame.owned_value(key, init, role, given, _iterates_over(self.brick, self.frame))
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
              name: str | None = None, parameter: tuple[str, Any] | None = None
              ) -> ApplicationCall:
        path, value = parameter or (None, None)
        return dataclasses.replace(self, manager=manager, role=role, name=name,
                                   parameter=path, parameter_value=value)

    def tag(self, role: _roles.Role, name: str, path: str | None = None) -> Tag:
        return Tag(role, name, path or f"{self.path}.{self.application}.{name}",
                   self.path or "", self.application, self.call_id, self.brick)

    def monitor_key(self, name: str) -> str:
        call = f"#{self.call_id}" if self.call_id else ""
        return f"{self.path}.{self.application}{call}.{name}"

    def _rewrite(self, manager: Manager, hook: str, tag: Tag, value: Any,
                 parameter: tuple[str, Any] | None = None) -> Any:
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
        bound = self.bound(manager, tag.role, tag.name, parameter)
        new = getattr(manager, hook)(bound, tag.name, value)
        if new is value:  # the manager left it alone (e.g. dropout in inference)
            return value
        self.note_rewrite(manager.name, tag, value, new)
        return new

    def note_rewrite(self, by: str, tag: Tag, before: Any, after: Any) -> None:
        """Notes a rewrite of ``tag`` by ``by`` (a manager, or ``nnx.Dropout`` following the
        program) in the rewrite trace and, marked with it, in the computation graph."""
        assert self.frame is not None
        self.frame.rewrites.append(Rewrite(
            by, self.path or "", self.application, self.call_id, tag.role.name, tag.name,
            *describe(before), *describe(after),
        ))
        self.frame.record(tag, after, by)

    def rewrite_inputs(self, manager: Manager, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``manager.rewrite_input`` applied to each selected input of this call."""
        if not manager.has_hook("rewrite_input"):
            return args, kwargs
        spec = self.spec
        assert spec is not None
        bound = spec.signature.bind_partial(self.brick, *args, **kwargs)
        for name, argument, keys in spec.input_slots(bound.arguments):
            value = _nested(bound.arguments[argument], keys)
            new = self._rewrite(manager, "rewrite_input", self.tag(_roles.INPUT, name), value)
            if new is not value:
                bound.arguments[argument] = _replaced(bound.arguments[argument], keys, new)
        return bound.args[1:], bound.kwargs

    def rewrite_outputs(self, manager: Manager, out: Any) -> Any:
        """``manager.rewrite_output`` applied to each selected output of this call."""
        if not manager.has_hook("rewrite_output"):
            return out
        spec = self.spec
        assert spec is not None
        new = [self._rewrite(manager, "rewrite_output", self.tag(_roles.OUTPUT, n), v)
               for n, v in spec.output_items(out)]
        return spec.with_outputs(out, new)

    def read_parameter(self, info: VariableInfo, base: Any) -> Any:
        """The value ``base`` of a model variable as this call sees it: rewritten once per
        call (and JAX trace)."""
        frame = self.frame
        assert frame is not None
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
                value = self._rewrite(manager, "rewrite_parameter", tag, value,
                                      (info.path, base))
        cached.append((trace, value))
        return value


def _iterates_over(brick: Any, frame: Frame) -> bool:
    """Whether the trace in progress sees a slice of ``brick``'s own variables (a loop over
    layers stacked on a leading axis), rather than the whole (a cell broadcast over steps,
    or no loop at all)."""
    if current_trace() == frame.base_trace:
        return False
    for value in vars(brick).values():
        info = frame.layout.by_identity.get(identity_of(value)) if isinstance(
            value, nnx.Variable) else None
        if info is not None and jnp.ndim(value.get_raw_value()) < len(info.shape):
            return True
    return False


def _takes_one_argument(init: Any) -> bool:
    """Whether an owned variable's ``init`` is a callable of exactly one required argument
    (given the parameter's value), not of none (computed from shapes) or an array."""
    if not callable(init) or hasattr(init, "shape"):
        return False
    try:
        parameters = inspect.signature(init).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called with nothing
        return False
    required = [p for p in parameters if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


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

    def input_slots(self, arguments: dict[str, Any]) -> list[tuple[str, str, tuple]]:
        """``(tag name, argument, keys into it)`` of each tagged input of a call's bound
        arguments."""
        return [(name, name, ()) for name in self.inputs if name in arguments]

    def output_items(self, out: Any) -> list[tuple[str, Any]]:
        """``(name, value)`` of each tagged output of a call's result."""
        return list(zip(self.outputs, self.split_outputs(out), strict=True))

    def with_outputs(self, out: Any, values: list[Any]) -> Any:
        """``out`` with its tagged outputs replaced by ``values``."""
        return self.join_outputs(values)


def _array_keys(value: Any, keys: tuple = ()) -> list[tuple]:
    """The keys of the arrays in ``value``, looking into tuples, lists and dicts."""
    if _is_array(value):
        return [keys]
    if isinstance(value, tuple | list):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()  # type: ignore[assignment]
    else:
        return []
    return [found for key, item in items for found in _array_keys(item, (*keys, key))]


def _nested(value: Any, keys: tuple) -> Any:
    for key in keys:
        value = value[key]
    return value


def _replaced(value: Any, keys: tuple, new: Any) -> Any:
    """``value`` with the item at ``keys`` replaced (containers copied, types kept)."""
    if not keys:
        return new
    head, *rest = keys
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], tuple(rest), new)}
    items = list(value)
    items[head] = _replaced(items[head], tuple(rest), new)
    return type(value)._make(items) if hasattr(value, "_make") else type(value)(items)


def _is_array(value: Any) -> bool:
    """Whether a Flax method's argument or result is a tagged variable (keys are not)."""
    return isinstance(value, jax.Array | np.ndarray) and not jax.dtypes.issubdtype(
        value.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class _MethodSpec(_Spec):
    """An unmodified Flax method: its array arguments are inputs, array results outputs."""

    def input_slots(self, arguments: dict[str, Any]) -> list[tuple[str, str, tuple]]:
        # Arrays nested in tuples, lists and dicts (an RNN cell's carry, *args, **kwargs)
        # are inputs too: "carry.0", "args.1"; a **kwargs entry by its key.
        slots = []
        for argument, value in list(arguments.items())[1:]:
            kind = self.signature.parameters[argument].kind
            for keys in _array_keys(value):
                if kind is inspect.Parameter.VAR_KEYWORD:
                    name = ".".join(map(str, keys))
                else:
                    name = ".".join(map(str, (argument, *keys)))
                slots.append((name, argument, keys))
        return slots

    def output_items(self, out: Any) -> list[tuple[str, Any]]:
        if _is_array(out):
            return [("output", out)]
        if isinstance(out, tuple):
            return [(f"output_{i}", v) for i, v in enumerate(out) if _is_array(v)]
        return []

    def with_outputs(self, out: Any, values: list[Any]) -> Any:
        if _is_array(out):
            return values[0]
        new = iter(values)
        items = [next(new) if _is_array(v) else v for v in out]
        return type(out)._make(items) if hasattr(out, "_make") else tuple(items)


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
    if current_trace() != frame.base_trace:
        # A call inside an inner trace (a jax.jit, nnx.remat, scan body): no later inner
        # trace may replay it. Calls at the outer level run their Python anyway, so JAX's
        # own jitted helpers (random bits, ...) stay cached across them.
        _context.split_trace_caches()
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
        for name, argument, keys in spec.input_slots(bound.arguments):
            see(call.tag(_roles.INPUT, name), _nested(bound.arguments[argument], keys), name)

    def outputs(out: Any, see: Callable[[Tag, Any, str], None]) -> None:
        for name, value in spec.output_items(out):
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


# Methods besides ``__call__`` that are applications of every program's Flax modules.
_DEFAULT_APPLICATIONS: dict[type, tuple[str, ...]] = {nnx.Embed: ("attend",)}


def method_applications(applications: Any) -> dict[type, tuple[str, ...]]:
    """Checks ``compile(..., applications=...)`` and adds the defaults (``Embed.attend``).

    Examples:
        >>> from flax import nnx
        >>> from graphmod._application import method_applications
        >>> class Net(nnx.Module):
        ...     def encode(self, x):
        ...         return x
        >>> method_applications({Net: ["encode"]})[Net]
        ('encode',)
    """
    out = dict(_DEFAULT_APPLICATIONS)
    if applications is None:
        return out
    if not isinstance(applications, Mapping):
        raise TypeError(f"compile(applications={applications!r}): expected a dict of module "
                        "classes to method names, e.g. applications={MyModule: ['encode']}")
    for cls, names in applications.items():
        if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
            raise TypeError(f"compile(applications=...): key {cls!r} is not a flax.nnx.Module "
                            "class; write applications={MyModule: ['encode']}")
        if getattr(cls, "__graphmod_brick__", False):
            raise TypeError(f"compile(applications=...): {cls.__name__} is a brick; mark its "
                            "methods with @graphmod.application instead")
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"compile(applications=...): the methods of {cls.__name__} must "
                            f"be a list of names, e.g. ['encode']; got {names!r}")
        for name in names:
            if not inspect.isfunction(inspect.getattr_static(cls, name, None)):
                raise ValueError(f"compile(applications=...): {cls.__name__} has no method "
                                 f"{name!r} (a plain function defined in the class)")
        out[cls] = (*out.get(cls, ()), *names)
    return out


def interceptor(applications: Any) -> Callable[[type], type | None]:
    """For ``compile(..., applications=...)`` (checked here, before anything changes): the
    class a plain Flax module class is switched to while a program traces, None for bricks
    and modules without applications."""
    checked = method_applications(applications)

    def intercept(cls: type) -> type | None:
        if getattr(cls, "__graphmod_brick__", False):
            return None  # bricks declare theirs with @application
        names = ["__call__"] if any("__call__" in vars(c) for c in cls.__mro__[:-1]) else []
        for base, extra in checked.items():
            if issubclass(cls, base):
                names += [name for name in extra if name not in names]
        return intercepting_class(cls, tuple(names)) if names else None

    return intercept


@functools.cache
def intercepting_class(cls: type, methods: tuple[str, ...]) -> type:
    """A subclass of Flax module class ``cls`` (same name) whose ``methods`` are
    applications; a module's class is switched to it only while a program traces."""
    namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                 "__graphmod_original__": cls, "__slots__": ()}
    for name in methods:
        namespace[name] = _intercepted(getattr(cls, name), name)
    if cls.sow is nnx.Module.sow:
        namespace["sow"] = sow_in_program
    return type(cls.__name__, (cls,), namespace)


def _intercepted(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    spec = _MethodSpec("apply" if name == "__call__" else name, (), (),
                       inspect.signature(method), False)
    in_program = _PROGRAM_CODE.get(method, method)

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        frame = _context.current_frame()
        path = None if frame is None else frame.layout.brick_path(self)
        if path is None:  # another thread calling the model eagerly, or a stranger module
            return method(self, *args, **kwargs)
        return _run_managed(frame, spec, in_program, self, path, args, kwargs)

    return wrapper


def sow_in_program(self: nnx.Module, variable_type: Any, name: str, value: Any, *args: Any,
         **kwargs: Any) -> bool:
    """``Module.sow`` in a program: each array of ``value`` is an auxiliary variable
    ``name`` (``name_0``, ``name_1``, ... for several) of the innermost application call,
    monitorable; nothing is stored on the module (``init_fn``/``reduce_fn`` are unused)."""
    frame = _context.current_frame()
    if frame is None or frame.layout.brick_path(self) is None:
        return nnx.Module.sow(self, variable_type, name, value, *args, **kwargs)
    if not frame.calls:
        raise RuntimeError(f"{type(self).__name__}.sow({name!r}) outside any application "
                           "call: sow inside a module method, or return the value from fn")
    leaves = [leaf for leaf in jax.tree.leaves(value) if _is_array(leaf)]
    for index, leaf in enumerate(leaves):
        frame.calls[-1].add_auxiliary_variable(
            leaf, name=name if len(leaves) == 1 else f"{name}_{index}")
    return True


def _innermost_call() -> ApplicationCall:
    frame = _context.current_frame()
    assert frame is not None and frame.calls
    return frame.calls[-1]


def _dropout(self: nnx.Dropout, inputs: Any, *, deterministic: bool | None = None,
             rngs: Any = None) -> Any:
    """``nnx.Dropout.__call__`` in a program: the program's mode and its step key folded
    with the module's path (stored or passed ``rngs`` are not used); identity in inference
    or where the user set ``deterministic=True`` (at construction or in the call)."""
    call = _innermost_call()
    explicit = self.deterministic if deterministic is None else deterministic
    if explicit or not call.training or self.rate == 0.0:
        return inputs
    keep = 1.0 - self.rate
    if keep == 0.0:  # zeros with zero (finite) gradients, as Flax does
        out = jnp.zeros_like(inputs)
    else:
        shape = list(jnp.shape(inputs))
        for axis in self.broadcast_dims:
            shape[axis] = 1
        mask = jnp.broadcast_to(jax.random.bernoulli(call.rng(), keep, shape),
                                jnp.shape(inputs))
        out = jax.lax.select(mask, inputs / keep, jnp.zeros_like(inputs))
    call.note_rewrite("nnx.Dropout", call.tag(_roles.OUTPUT, "output"), inputs, out)
    return out


def _batch_norm(self: nnx.BatchNorm, x: Any, use_running_average: bool | None = None, *,
                mask: Any = None) -> Any:
    """``nnx.BatchNorm.__call__`` in a program: batch statistics (running averages updated)
    in training, running averages in inference or where the user set
    ``use_running_average=True`` (at construction or in the call)."""
    explicit = self.use_running_average if use_running_average is None else use_running_average
    frozen = bool(explicit) or not _innermost_call().training
    return _FLAX_BATCH_NORM(self, x, use_running_average=frozen, mask=mask)


def _attention(self: nnx.MultiHeadAttention, inputs_q: Any, inputs_k: Any = None,
               inputs_v: Any = None, *, deterministic: bool | None = None, rngs: Any = None,
               **kwargs: Any) -> Any:
    """``nnx.MultiHeadAttention.__call__`` in a program: its attention-weight dropout
    follows the program's mode and draws from its step key folded with the module's path
    (stored or passed ``rngs`` are not used), unless the user set ``deterministic=True``."""
    call = _innermost_call()
    explicit = self.deterministic if deterministic is None else deterministic
    frozen = bool(explicit) or not call.training or self.dropout_rate == 0.0
    key = None if frozen else call.rng()
    if key is not None:
        keys = inputs_q if inputs_k is None else inputs_k
        weights = jax.ShapeDtypeStruct(
            (*jnp.shape(inputs_q)[:-2], self.num_heads, jnp.shape(inputs_q)[-2],
             jnp.shape(keys)[-2]), jnp.result_type(inputs_q))
        call.note_rewrite("nnx.Dropout", call.tag(_roles.AUXILIARY, "attention_weights"),
                          weights, weights)
    return _FLAX_ATTENTION(self, inputs_q, inputs_k, inputs_v, deterministic=frozen,
                           rngs=None if key is None else (lambda: key), **kwargs)


_FLAX_BATCH_NORM = nnx.BatchNorm.__call__
_FLAX_ATTENTION = nnx.MultiHeadAttention.__call__
# Flax's own methods whose behaviour follows the program (mode, key) inside one.
_PROGRAM_CODE: dict[Callable[..., Any], Callable[..., Any]] = {
    nnx.Dropout.__call__: _dropout,
    nnx.BatchNorm.__call__: _batch_norm,
    nnx.MultiHeadAttention.__call__: _attention,
}
