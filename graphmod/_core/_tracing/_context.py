"""The one home of graphmod's trace-time context: every ``contextvars`` stack lives here.

Two stacks exist:

* the **manager stack**: managers entered with ``with manager:`` (captured by ``compile``);
* the **frame stack**: the :class:`~graphmod._core._tracing._frame.Frame` of the function
  being traced (one per outer trace of a program), and inside it the application calls in
  progress.

Trace isolation: JAX caches inner traces (an inner ``jax.jit``, a ``lax.scan`` body,
``nnx.remat``) by function and input types, not by ``contextvars``; a cached inner trace is
replayed without running its Python, so one that read the frame (an application call, a
variable, a key) must never be replayed in another program, mode, trace or call. While a
frame is active a JAX config state (part of JAX's trace context, hence of those cache keys)
holds a token:

* **shared** (first): one token for every program trace. An inner trace that reads the frame
  stops the trace at once (:class:`NeedsIsolation`, before JAX caches it), so the cache
  under this token holds only inner traces that never read a frame: JAX's own jitted helpers
  and user functions of arrays, reused across programs like in hand-written JAX (trace time,
  no compile or memory growth per program build). Traces outside programs (token None)
  never share with it.
* **isolated** (from then on, for every program over the layout): a token fresh for every
  outer trace, renewed at every application call inside an inner trace, so no inner trace
  is ever replayed from another program, mode, trace or application call.

This uses ``jax._src.config`` (internal): the JAX minor version is pinned in
``pyproject.toml`` and ``tests/test_isolation.py`` guards it.

Marks: a compiled model carries graphmod's marks only while a program traces it. Plain Flax
modules of the model (no ``@application``) become applications by having their class
swapped to a cached subclass whose intercepted methods run the manager chain (see
``graphmod._core._bricks._intercept``); every module holds a token naming its path and every
variable a tracked class and an identity (``graphmod._core._tracing._variables``), so that the
copies NNX transforms make inside the trace are known too. The marks are the one piece of
process-wide state here: a lock-guarded count per object, so that overlapping traces over
one model (nested, or in other threads) share one set of marks and the last to finish
undoes them, also when the trace raises. Other threads calling the model eagerly meanwhile
see the marked objects, which behave as the originals when no program is tracing in their
context.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
from flax import nnx
from jax._src import config as _jax_config

from graphmod._core._tracing._trace import current_trace
from graphmod.errors import AttributeOutlivesTrace, ManagerReentered

# The stacks hold frames and managers; their modules import this one, not the reverse (no
# import may close a circle, not even under TYPE_CHECKING: tests/test_layers.py).
Frame = Any
Manager = Any

_MANAGERS: contextvars.ContextVar[tuple[Manager, ...]] = contextvars.ContextVar(
    "graphmod_managers", default=()
)
_FRAME: contextvars.ContextVar[Frame | None] = contextvars.ContextVar(
    "graphmod_frame", default=None
)

# The regions managers' wraps have open, innermost last: (manager name, value) pairs (a
# precision policy's calls, which every application called inside them belongs to).
_REGIONS: contextvars.ContextVar[tuple[tuple[str, object], ...]] = contextvars.ContextVar(
    "graphmod_regions", default=()
)

# In a shared-token trace: the outer trace, where the frame may be read (else None).
_SHARED_IN: contextvars.ContextVar[object] = contextvars.ContextVar("graphmod_shared_in",
                                                                    default=None)
_SHARED = "graphmod-shared"  # the token of traces whose inner traces never read a frame

# The trace tokens entered in the current outer trace (see split_trace_caches).
_TOKENS: contextvars.ContextVar[contextlib.ExitStack | None] = contextvars.ContextVar(
    "graphmod_trace_tokens", default=None
)

_TRACED_NOTE = (
    "graphmod: a program traces its arguments and variables as arrays, so Python control "
    "flow (if, bool(), int()) cannot depend on them. Pass Python flags and options in the "
    "function (compile(functools.partial(fn, train=False), model)); a program's modes "
    "(program.train, program.infer) take the place of train/eval flags.")

_SHARDING_NOTE = (
    "graphmod: this model code names shardings (out_sharding=P(...)) for explicit mesh "
    "axes. A program compiled with mesh= runs it on that mesh with axes of type Auto, "
    "where XLA chooses the activations' shardings and refuses such names; compiled "
    "without mesh=, it runs under the mesh jax.set_mesh set, as JAX would. Either compile "
    "without mesh= inside `with jax.set_mesh(mesh):`, or leave out_sharding= out of the "
    "model and place arrays by compile(rules=...) and managers.Sharding "
    "(docs: concepts/multi_device.md).")

_TRACE_TOKEN = _jax_config.string_or_object_state(
    name="graphmod_trace_token",
    default=None,
    help="graphmod internal: a token per kind of trace, splitting JAX's trace caches.",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


# (id(module), name) -> (module, whether sown), for each attribute a model's module gained
# in the trace in progress (see note_new_attribute).
_NEW_ATTRIBUTES: contextvars.ContextVar[dict[tuple[int, str], tuple[nnx.Module, bool]] | None] = (
    contextvars.ContextVar("graphmod_new_attributes", default=None))


@dataclasses.dataclass
class _Marked:
    """An object a trace marked (kept: its id stays its own), the function undoing its
    marks, and how many traces hold them."""

    obj: object
    unmark: Callable[[], None]
    traces: int = 0


_MARKED: dict[int, _Marked] = {}  # by id(object)
_MARK_LOCK = threading.Lock()


def active_managers() -> tuple[Manager, ...]:
    """Managers entered with ``with`` in this context, outermost first."""
    return _MANAGERS.get()


@contextlib.contextmanager
def entered(manager: Manager) -> Iterator[None]:
    """Pushes ``manager`` on the manager stack for the duration of a ``with`` block."""
    stack = _MANAGERS.get()
    if any(m is manager for m in stack):
        raise ManagerReentered(f"manager {manager.name!r} is already active: it was entered "
                               "twice (enter it once, or make another one with name=...)")
    token = _MANAGERS.set((*stack, manager))
    try:
        yield
    finally:
        popped = _MANAGERS.get()
        _MANAGERS.reset(token)
        assert popped[-1] is manager, "manager stack corrupted: exits out of order"


class NeedsIsolation(BaseException):
    """An inner trace read the frame of a shared-token trace: trace it again, isolated.

    A BaseException, so that no ``except Exception`` in JAX or user code swallows it.

    Examples:
        >>> from graphmod._core._tracing._context import NeedsIsolation
        >>> issubclass(NeedsIsolation, Exception)
        False
    """


@contextlib.contextmanager
def region(owner: str, value: object) -> Iterator[None]:
    """Opens manager ``owner``'s region holding ``value`` for what runs inside."""
    token = _REGIONS.set((*_REGIONS.get(), (owner, value)))
    try:
        yield
    finally:
        _REGIONS.reset(token)


def regions() -> tuple[tuple[str, object], ...]:
    """The open regions, ``(manager name, value)``, innermost last."""
    return _REGIONS.get()


def current_frame() -> Frame | None:
    """The frame of the trace in progress, or None outside a compiled program.

    Raises :class:`NeedsIsolation` when asked from an inner trace of a shared-token trace.
    """
    frame = _FRAME.get()
    outer = _SHARED_IN.get()
    if outer is not None and current_trace() != outer:
        raise NeedsIsolation
    return frame


def note_new_attribute(module: nnx.Module, name: str) -> None:
    """Notes that ``module`` of the model gained attribute ``name`` in the trace in progress
    (``graphmod._core._bricks._intercept.assign_in_program``): it must be gone when it ends."""
    added = _NEW_ATTRIBUTES.get()
    assert added is not None, "a new attribute noted outside a program's trace"
    added[id(module), name] = (module, False)


def note_sown(module: nnx.Module, name: str) -> None:
    """Notes that ``Module.sow`` stored ``name`` on ``module``, as Flax does, for the
    function to pop: if the trace gave the module that attribute, one the function leaves
    is dropped when the trace ends, not refused (a monitorable auxiliary variable all the
    same)."""
    added = _NEW_ATTRIBUTES.get()
    if added is not None and (id(module), name) in added:
        added[id(module), name] = (module, True)


@contextlib.contextmanager
def tracing(frame: Frame, *, isolated: bool) -> Iterator[Frame]:
    """Makes ``frame`` current, under the shared token or, ``isolated``, a fresh one; leaves
    the model's modules without the attributes they gained meanwhile, and raises
    :class:`~graphmod.errors.AttributeOutlivesTrace` if the traced function left any."""
    token = _FRAME.set(frame)
    added: dict[tuple[int, str], tuple[nnx.Module, bool]] = {}
    added_token = _NEW_ATTRIBUTES.set(added)
    frame.layout.reset_node_states()  # NNX lifted transforms rebuild them (_variables)
    try:
        check = functools.partial(frame.layout.check_unchanged, f"program.{frame.mode}")
        with _marked(frame.layout.marks, frame.layout.model, check), \
                contextlib.ExitStack() as tokens:
            tokens_token = _TOKENS.set(tokens if isolated else None)
            shared_token = _SHARED_IN.set(None if isolated else current_trace())
            try:
                tokens.enter_context(_TRACE_TOKEN(uuid.uuid4().hex if isolated else _SHARED))
                yield frame
            finally:
                _SHARED_IN.reset(shared_token)
                _TOKENS.reset(tokens_token)
    finally:
        left = [(module, name, sown) for (_, name), (module, sown) in added.items()
                if name in vars(module)]
        for module, name, _ in left:
            delattr(module, name)  # Flax's own delete: its record of the attribute goes too
        _NEW_ATTRIBUTES.reset(added_token)
        frame.layout.reset_node_states()
        popped = _FRAME.get()
        _FRAME.reset(token)
        assert popped is frame, "frame stack corrupted: traces exited out of order"
    assigned = [(module, name) for module, name, sown in left if not sown]
    if assigned:
        raise AttributeOutlivesTrace("\n".join(
            f"{type(module).__name__}.{name} (the module at "
            f"{frame.layout.brick_path(module)!r}) was assigned while the program traced and "
            "was still there when the function returned" for module, name in assigned)
            + ". A program's variables are fixed when it is compiled, so the model is left "
            "as it was: take the value off again in the function (nnx.pop(model, ...), as "
            "Flax's examples do), or return it with self.sow(...) to monitor it")


class Isolation(Protocol):
    """Whether the programs over one layout trace isolated (see :func:`traced`)."""

    isolated: bool


def traced(shared: Isolation, make_frame: Callable[[], Frame], fn: Callable[..., object], /,
           *args: object, **kwargs: object) -> Frame:
    """Runs ``fn(*args, **kwargs)`` in a fresh frame under the shared token, keeping what it
    returns (``frame.out``); again, isolated, if an inner trace read the frame, and isolated
    from then on (``shared.isolated``: one flag for the programs over one layout)."""
    while True:
        frame = make_frame()
        try:
            with tracing(frame, isolated=shared.isolated):
                # fn called here, not in a closure: JAX keeps the whole Python stack of
                # every equation it records, at a cost per frame.
                frame.returned(fn(*args, **kwargs))
            return frame
        except NeedsIsolation:  # what the stopped try traced is dead code
            shared.isolated = True
        except (ValueError, TypeError) as error:  # JAX's, that a note explains
            note = _note_for(error)
            if note and note not in getattr(error, "__notes__", ()):  # once, also when nested
                error.add_note(note)
            raise


def _note_for(error: Exception) -> str | None:
    """What graphmod adds to JAX's error: Python control flow on a traced value (`if
    train:`), or model code naming shardings for explicit mesh axes."""
    if isinstance(error, jax.errors.ConcretizationTypeError):
        return _TRACED_NOTE
    text = str(error)
    if "PartitionSpec" in text and ("mesh" in text or "Auto" in text):
        return _SHARDING_NOTE
    return None


@contextlib.contextmanager
def _marked(marks: Sequence[tuple[object, Callable[[], Callable[[], None]]]], model: object,
            check: Callable[[], None]) -> Iterator[None]:
    """Applies each ``(object, mark)`` (``mark()`` marks it and returns the function that
    undoes it) while any trace holds the object; undoes it when the last one ends. Runs
    ``check`` first if no trace holds ``model`` (under the lock: no trace changes it)."""
    held: list[object] = []
    try:
        with _MARK_LOCK:
            if id(model) not in _MARKED:
                check()
            for obj, mark in marks:
                entry = _MARKED.get(id(obj))
                if entry is None:  # else a trace in progress keeps the marks it applied
                    entry = _MARKED[id(obj)] = _Marked(obj, mark())
                entry.traces += 1
                held.append(obj)
        yield
    finally:
        with _MARK_LOCK:
            for obj in held:
                entry = _MARKED[id(obj)]
                entry.traces -= 1
                if entry.traces == 0:
                    entry.unmark()
                    del _MARKED[id(obj)]


def split_trace_caches() -> None:
    """Gives the rest of the current trace a fresh token (no-op outside an isolated trace).

    Called at every application call, so an inner trace started after it is never
    replayed from one started before: two calls of a brick through one jitted or
    ``nnx.remat`` function each run their Python, with their own call ids and masks. The
    tokens are restored when the outer trace ends.
    """
    tokens = _TOKENS.get()
    if tokens is not None:
        tokens.enter_context(_TRACE_TOKEN(uuid.uuid4().hex))


def trace_token_shared() -> str:
    """The token of shared traces; exposed for the isolation test."""
    return _SHARED


def trace_token() -> str | None:
    """The current trace token (None outside a trace); exposed for the isolation test."""
    return _TRACE_TOKEN.value
