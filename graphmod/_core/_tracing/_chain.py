"""The chain runner: runs the matching managers around one application call.

For each call of an application inside a compiled program, the application's wrapper
makes a :class:`Chain` and calls :meth:`Chain.run` (nothing between them: JAX keeps the
Python stack of every equation it records, at a cost per frame), which

1. gives the call its id and the read-only :class:`~graphmod._core._tracing._call.ApplicationCall`
   that hooks and the method see (one per manager and variable, :meth:`Chain.bound`);
2. tags its inputs ``INPUT``, every parameter read inside it with its role, its outputs
   ``OUTPUT``, recording them for the computation graph and collecting monitored ones;
3. runs each manager's ``wrap`` around the method, outermost first; the default ``wrap``
   rewrites the selected inputs and outputs (:meth:`Chain.rewrite_inputs`,
   :meth:`Chain.rewrite_outputs`); a parameter read in the call is rewritten by every
   ``rewrite_parameter`` hook once per JAX trace
   (``graphmod._core._tracing._parameter_read``, through :meth:`Chain.rewrite`);
4. opens ``jax.named_scope`` with the brick's path relative to the calling application.

What the trace collects (matches, exclusive claims, rewrites, records, monitored values)
goes to the frame through its verbs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
from flax import nnx

from graphmod import roles as _roles
from graphmod._core._bricks._spec import Spec, nested, replaced
from graphmod._core._program._arguments import has_shape
from graphmod._core._selection._filter import Tag
from graphmod._core._tracing import _context
from graphmod._core._tracing._call import ApplicationCall, stacked_slices
from graphmod.errors import GraphmodError

if TYPE_CHECKING:
    from graphmod._core._managers._manager import Manager
    from graphmod._core._tracing._frame import CallInProgress, Frame

# What a chain does with a tagged value it sees: (tag, value, tag name).
See = Callable[[Tag, object, str], None]
# A value a hook rewrites: a hook gives back one of the same kind (an array for an array).
V = TypeVar("V")


class Chain:
    """The managers matching one application call, and the call's plumbing."""

    def __init__(self, frame: Frame, spec: Spec, brick: nnx.Module, path: str) -> None:
        if frame.inner():
            # A call inside an inner trace (a jax.jit, nnx.remat, scan body): no later inner
            # trace may replay it. Calls at the outer level run their Python anyway, so JAX's
            # own jitted helpers (random bits, ...) stay cached across them.
            _context.split_trace_caches()
            for info, axes in stacked_slices(brick, frame):  # placed by rules per layer
                frame.layout.note_stacked(info.identity, axes)
        self.frame = frame
        self.spec = spec
        self.brick = brick
        self.path = path
        self.application = spec.name
        self.call_id = frame.next_call_id(path, spec.name)
        self.managers = tuple(
            m for m in frame.chain()
            if (m.filter.matches_call if m.wraps_only else m.filter.matches_application)(
                brick, path, spec.name, self.call_id, frame.layout.instance_paths)
        )
        self.call = ApplicationCall(brick, spec.name, path, self.call_id, frame.training,
                                    _runner=self)
        self.auxiliary_names: dict[str, int] = {}  # name -> times this call tagged it
        # the method's arguments, once it runs
        self.inputs: tuple[tuple[object, ...], dict[str, object]] = ((), {})

    def bound(self, manager: Manager, role: _roles.Role | None = None,
              name: str | None = None, parameter: tuple[str, jax.Array] | None = None
              ) -> ApplicationCall:
        """The call as ``manager``'s hook sees it (rewriting variable ``name``)."""
        path, value = parameter or (None, None)
        return dataclasses.replace(self.call, manager=manager, role=role, name=name,
                                   parameter=path, parameter_value=value)

    def tag(self, role: _roles.Role, name: str, path: str | None = None,
            aliases: tuple[str, ...] = ()) -> Tag:
        return Tag(role, name, path or f"{self.path}.{self.application}.{name}",
                   self.path, self.application, self.call_id, self.brick, aliases)

    def monitor_key(self, name: str) -> str:
        call = f"#{self.call_id}" if self.call_id else ""
        return f"{self.path}.{self.application}{call}.{name}"

    def layer_arrays(self) -> list[jax.Array]:
        """The values of the layer's own variables (an ensemble's vmap maps them)."""
        values = (v.get_raw_value() for v in vars(self.brick).values()
                  if isinstance(v, nnx.Variable))
        return [value for value in values if isinstance(value, jax.Array)]

    def arrays(self) -> list[jax.Array]:
        """The arrays of the call: its inputs and its layer's own variables' values."""
        inputs = [leaf for leaf in jax.tree.leaves(self.inputs) if isinstance(leaf, jax.Array)]
        return [*inputs, *self.layer_arrays()]

    def auxiliary(self, value: object, role: _roles.Role, name: str) -> None:
        """Tags ``value`` as auxiliary variable ``name``: recorded and monitorable. A name
        the call tags again (a ``sow`` in a loop) is monitored as ``name#1``, ``name#2``..."""
        tag = self.tag(role, name)
        self.frame.record(tag, value, None)
        again = self.auxiliary_names.get(name, 0)
        self.auxiliary_names[name] = again + 1
        self.frame.collect(tag, value, self.monitor_key(f"{name}#{again}" if again else name))

    def note_rewrite(self, by: str, tag: Tag, before: object, after: object) -> None:
        self.frame.note_rewrite(by, tag, before, after)

    # -- rewrites -------------------------------------------------------------------------
    def rewrite(self, manager: Manager, hook: str, tag: Tag, value: V,
                parameter: tuple[str, jax.Array] | None = None) -> V:
        """``value`` through ``manager``'s ``hook`` if the manager selects ``tag``."""
        if not manager.selects(tag):
            return value
        if manager.exclusive:
            self.frame.claim_exclusive(tag, manager)
        if manager.once and self.frame.rewrote_around(manager.name):
            self.frame.note_match(manager)
            return value  # it rewrote the enclosing call's values: these come from them
        bound = self.bound(manager, tag.role, tag.name, parameter)
        new = getattr(manager, hook)(bound, tag.name, value)
        # Left alone: dropout in inference, or only read (L2's cost, EMA's average).
        self.frame.note_match(manager, left=tag if new is value else None)
        if new is value:
            return value
        self.frame.note_rewrite(manager.name, tag, value, new)
        return new

    def rewrite_inputs(self, manager: Manager, args: tuple[object, ...],
                       kwargs: dict[str, object]
                       ) -> tuple[tuple[object, ...], dict[str, object]]:
        """``manager.rewrite_input`` applied to each selected input of this call."""
        if not manager.has_hook("rewrite_input"):
            return args, kwargs
        bound = self.spec.signature.bind_partial(self.brick, *args, **kwargs)
        for name, argument, keys in self.spec.input_slots(bound.arguments):
            value = nested(bound.arguments[argument], keys)
            new = self.rewrite(manager, "rewrite_input",
                               self.tag(self.spec.input_role(name), name), value)
            if new is not value:
                bound.arguments[argument] = replaced(bound.arguments[argument], keys, new)
        return bound.args[1:], bound.kwargs

    def rewrite_outputs(self, manager: Manager, out: object) -> object:
        """``manager.rewrite_output`` applied to each selected output of this call."""
        if not manager.has_hook("rewrite_output"):
            return out
        new = []
        for name, value in self.spec.output_items(out):  # a loop: no comprehension's frame
            tag = self.tag(self.spec.output_role(name), name)
            new.append(self.rewrite(manager, "rewrite_output", tag, value))
        return self.spec.with_outputs(out, new)

    # -- running the call -----------------------------------------------------------------
    def see_inputs(self, args: tuple[object, ...], kwargs: dict[str, object], see: See
                   ) -> None:
        bound = self.spec.signature.bind_partial(self.brick, *args, **kwargs)
        for name, argument, keys in self.spec.input_slots(bound.arguments):
            see(self.tag(self.spec.input_role(name), name),
                nested(bound.arguments[argument], keys), name)

    def see_outputs(self, out: object, see: See) -> None:
        for name, value in self.spec.output_items(out):
            see(self.tag(self.spec.output_role(name), name), value, name)

    def _record(self, tag: Tag, value: object, name: str) -> None:
        self.frame.record(tag, value, None)

    def _collect(self, tag: Tag, value: object, name: str) -> None:
        self.frame.collect(tag, value, self.monitor_key(name))

    def run(self, method: Callable[..., object], args: tuple[object, ...],
            kwargs: dict[str, object]) -> Any:
        """Runs ``method`` inside the chain of managers (see the module docstring)."""
        for manager in self.managers:
            if manager.wraps_only or (
                    not manager.filter.selects_variables and manager.has_hook("wrap")):
                self.frame.note_match(manager)  # a middleware matches the application
        parent = self.frame.calls[-1] if self.frame.calls else None
        self.inputs = (args, kwargs)

        def innermost(*args: object, **kwargs: object) -> object:
            self.see_inputs(args, kwargs, self._collect)  # monitored: as the method sees them
            if self.spec.takes_call:
                kwargs = {**kwargs, "application_call": self.call}
            with self.frame.calling(self):
                out = method(self.brick, *args, **kwargs)
            self.see_outputs(out, self._record)  # recorded: the outputs before any rewrite
            return out

        # As few frames between the method and its caller as can be (JAX keeps the whole
        # Python stack of every equation it records): one per manager with a wrap, one for
        # each run of managers without.
        layer: Callable[..., object] = innermost
        runs = itertools.groupby(reversed(self.managers), key=lambda m: m.has_hook("wrap"))
        for wraps, run in runs:
            inner_first = tuple(run)
            if not wraps:
                layer = functools.partial(_rewriting, inner_first[::-1], self, layer)
                continue
            for manager in inner_first:
                layer = functools.partial(_wrapping, manager, self, layer)
        with jax.named_scope(_scope_name(parent, self.path, self.application)):
            self.see_inputs(args, kwargs, self._record)
            try:
                out = layer(*args, **kwargs)
            except Exception as error:
                _note_where(error, self, args, kwargs)
                raise
        self.see_outputs(out, self._collect)  # monitored: the outputs as the caller sees them
        return out


def _rewriting(managers: tuple[Manager, ...], chain: Chain, next: Callable[..., object],
               *args: object, **kwargs: object) -> object:
    """The layers of ``managers`` (outermost first) in one: their input rewrites, outermost
    first, ``next``, and their output rewrites, innermost first."""
    for manager in managers:
        args, kwargs = chain.rewrite_inputs(manager, args, kwargs)
    out = next(*args, **kwargs)
    for manager in reversed(managers):
        out = chain.rewrite_outputs(manager, out)
    return out


def _wrapping(manager: Manager, chain: Chain, next: Callable[..., object],
              *args: object, **kwargs: object) -> object:
    """The layer of a manager with a ``wrap``: the wrap around its rewrites and ``next``
    (so a wrap sees the call's arguments as they came)."""
    rewritten = functools.partial(_rewriting, (manager,), chain, next)
    if manager.wraps_only:  # the others' rewrites are in the trace
        chain.frame.note_wrap(manager.name, chain.path, chain.application, chain.call_id)
    return manager.wrap(chain.bound(manager), rewritten, args, kwargs)


def _scope_name(parent: CallInProgress | None, path: str, application: str) -> str:
    base = parent.path if parent is not None and parent.path is not None else "/"
    relative = path[len(base):] if path.startswith(base) else path
    relative = relative.strip("/")
    return f"{relative}.{application}" if relative else application


_WHERE = "graphmod: raised in the application "


def _note_where(error: Exception, chain: Chain, args: tuple[object, ...],
                kwargs: dict[str, object]) -> None:
    """Names the innermost application an error came from and what it was given: the
    traceback shows the code, not which layer of a deep model failed or on what (a module
    passed where an array belongs, float token ids). graphmod's own errors name theirs."""
    if isinstance(error, GraphmodError) or any(
            note.startswith(_WHERE) for note in getattr(error, "__notes__", ())):
        return
    try:
        bound = chain.spec.signature.bind_partial(chain.brick, *args, **kwargs).arguments
        given = [f"{name}={_short(value)}" for name, value in list(bound.items())[1:]]
    except TypeError:  # the call's own arguments do not fit: the error says so
        given = [_short(value) for value in args]
        given += [f"{name}={_short(value)}" for name, value in kwargs.items()]
    error.add_note(f"{_WHERE}{chain.application!r} of {chain.path or '/'} "
                   f"({type(chain.brick).__name__}), called with {', '.join(given) or 'nothing'}")


def _short(value: object) -> str:
    """``float32[3, 5]`` for an array, ``<Type>`` for anything but a container or a plain
    constant."""
    if has_shape(value):  # a tuple shape and a dtype
        return f"{getattr(value, 'dtype', '')}{list(getattr(value, 'shape', ()))}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_short(item) for item in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {_short(item)}" for key, item in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:37]}..."
    return f"<{type(value).__name__}>"
