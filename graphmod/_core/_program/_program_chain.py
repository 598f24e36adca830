"""Managers around the whole function a program traces: :meth:`Manager.wrap_program`.

A manager overriding ``wrap_program(call, next, args, kwargs)`` is a layer around the
program's function ``fn(model, *args, **kwargs)`` in every trace (``init``, ``train``,
``infer``, ``graph``): ``next(*args, **kwargs)`` runs the inner layers, then ``fn``. The
layers nest in the chain's resolved order (the first outermost), all of them outside every
application's chain, so what a layer changes of the batch (Selective Backprop keeps the
examples of highest loss) is what every application sees. ``call`` is a read-only
:class:`ProgramCall`: the mode, and verbs to draw a key, own a variable, report a metric,
note a rewrite of the program's inputs, run a function as inference sees it inside a
training trace (:meth:`ProgramCall.infer`) and choose between two ways of running the rest
on a traced flag without retracing (:meth:`ProgramCall.switch`).

Sharp edges
    :meth:`ProgramCall.switch` is a ``lax.cond`` whose branches are traced as the frame's
    base, like a ``graphmod.remat`` region: both must return the same structure, shapes and
    dtypes (monitored values included) and write the same variables; at ``init`` the second
    way alone runs. Writes to the copies an NNX lifted transform makes (``nnx.scan`` over
    layers writing its state) cannot cross it: a static choice (a Python bool) can.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from graphmod import roles as _roles
from graphmod._core._loops._scan import _by_identity, _region
from graphmod._core._managers._order import resolve_order
from graphmod._core._selection._filter import Tag
from graphmod._core._tracing import _context
from graphmod._core._tracing._call import OwnedVariable
from graphmod.typing import ArrayLike, PyTree

if TYPE_CHECKING:
    from graphmod._core._managers._manager import Manager
    from graphmod._core._tracing._frame import Frame

__all__ = ["ProgramCall", "program_function"]

APPLICATION = "program"  # the application name of a program layer's own variables
_SAVED = "graphmod_switch_saved"  # what a switch's backward pass reads instead of recomputing
_SAVED_ONLY = jax.checkpoint_policies.save_only_these_names(_SAVED)
T = TypeVar("T")  # a value handed back as it came, or the result of a function given
A = TypeVar("A", bound=ArrayLike)  # a metric reported, handed back


@dataclasses.dataclass(frozen=True, eq=False)
class ProgramCall:
    """One trace of the program's function, as a :meth:`Manager.wrap_program` layer sees it.

    Attributes:
        manager: the manager whose layer this is.
        model: the program's root brick (the function's first argument).
        function: the program's function ``fn(model, *args, **kwargs)``.
        mode: ``"init"`` (the abstract trace that makes the variables), ``"train"`` or
            ``"infer"``.
        training: whether the program runs in training mode (``init`` too).

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> class Modes(gm.Manager):
        ...     seen = []
        ...     def wrap_program(self, call, next, args, kwargs):
        ...         self.seen.append(call.mode)
        ...         return next(*args, **kwargs)
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(1, 1, rngs=nnx.Rngs(0)),
        ...                      managers=[Modes()])
        >>> _ = program.infer(program.init(jnp.ones((1, 1))), jnp.ones((1, 1)))
        >>> Modes.seen
        ['init', 'infer']
    """

    manager: Manager
    model: nnx.Module
    function: Callable[..., object]
    _frame: Frame = dataclasses.field(repr=False)

    @property
    def mode(self) -> str:
        return self._frame.mode

    @property
    def training(self) -> bool:
        return self._frame.training

    @property
    def name(self) -> str:
        """The function's name, as the rewrite trace shows it (its application column)."""
        return getattr(self.function, "__name__", type(self.function).__name__)

    def rng(self, name: str = "") -> jax.Array:
        """The step key folded with CRC32 of (manager, ``name``): the same draw in a
        resumed run, whatever else the program holds; training only."""
        return self._frame.rng((self.manager.name, "/", APPLICATION, "", name), 0)

    def variable(self, name: str, init: ArrayLike | Callable[[], jax.Array], *,
                 role: _roles.Role = _roles.STATE
                 ) -> OwnedVariable:
        """A variable the manager owns for the program (a step counter), created at
        ``init`` from ``init`` (an array, or a callable of nothing), at
        ``variables["managers"][manager]["/"]["program"][name]``; written in training only.
        """
        _roles.as_role(role, argument="call.variable(role=...)")
        key = (self.manager.name, "/", APPLICATION, None, name)
        self._frame.owned_value(key, init, role)
        return OwnedVariable(self._frame, key)

    def report(self, name: str, value: A) -> A:
        """Has :func:`graphmod.optimize` report ``value`` (a scalar) in the step's metrics
        as ``"<manager>.<name>"``, fused into the step; returns it."""
        self._frame.add_measurement(f"{self.manager.name}.{name}", value)
        return value

    def note_input(self, name: str, before: PyTree, after: PyTree) -> None:
        """Notes in the rewrite trace that the layer made the function's argument ``name``
        ``after`` from ``before`` (role ``INPUT``, path ``/``, application: the function)."""
        tag = Tag(_roles.INPUT, name, f"/.{self.name}.{name}", "/", self.name, 0, self.model)
        self._frame.note_rewrite(self.manager.name, tag, before, after)

    def infer(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """``fn(*args, **kwargs)`` as inference sees the program, inside this trace: its
        application calls in inference mode, what it rewrites, writes, monitors or costs
        dropped (see ``Frame.inference_pass``), its result without gradient."""
        with self._frame.inference_pass():
            out = fn(*args, **kwargs)
        return jax.tree.map(jax.lax.stop_gradient, out)

    def saved(self, value: T) -> T:
        """``value``, kept for the backward pass of a :meth:`switch` instead of recomputed
        (each way of a switch is rematerialized: what made a saved value, Selective
        Backprop's ranking pass, is not run again)."""
        return jax.tree.map(lambda leaf: checkpoint_name(leaf, _SAVED), value)

    def switch(self, on: jax.Array | bool, when_on: Callable[[], T], when_off: Callable[[], T]
               ) -> T:
        """``when_on()`` where ``on`` holds, else ``when_off()``: a Python bool chooses as
        it traces; a traced one in a ``lax.cond`` that carries the program's state, costs
        and measurements through both (see the module's sharp edges), each way
        rematerialized in the backward pass but for the values it marks :meth:`saved`. At
        ``init``, ``when_off()``."""
        if isinstance(on, bool) or self._frame.mode == "init":
            return when_on() if on is True else when_off()
        frame = self._frame
        snapshot, state = frame.snapshot(), frame.carry()
        copies: tuple[list, list] = ([], [])
        # Each way rematerialized but for what it marks saved (ProgramCall.saved): a cond's
        # residuals, zeros for the way not taken, cost the char LM's step 1.25-1.5x on CPU.
        branches = [jax.checkpoint(functools.partial(_region, frame, snapshot, state,
                                                     copies[i], f), policy=_SAVED_ONLY)
                    for i, f in enumerate((when_off, when_on))]
        try:  # traced in this order: the rewrite trace keeps the second's (when_on's)
            out, written, monitored, costs, measured, _ = jax.lax.switch(
                jax.numpy.asarray(on, jax.numpy.int32), branches)
        except TypeError as error:
            error.add_note(f"graphmod: manager {self.manager.name!r} runs the program's "
                           "function two ways on a traced flag (a lax.cond): both must return "
                           "the same structure, shapes and dtypes, monitored values included "
                           "(monitor parameters, or values reduced over the batch)")
            raise
        if copies[0] or copies[1]:
            raise NotImplementedError(
                f"manager {self.manager.name!r} switches between two ways of running the "
                "program's function on a traced flag, and the function writes state through "
                "an NNX lifted transform (nnx.scan, nnx.vmap, ...), whose writes cannot cross "
                "the switch: give the manager a static choice (its schedule always on)")
        frame.after_loop((_by_identity(frame, written[0]), written[1]), monitored,
                         owned_written=True)
        for (owner, key), cost in costs.items():
            frame.add_cost(owner, key, cost)
        for key, value in measured.items():
            frame.add_measurement(key, value)
        return out


def program_function(fn: Callable[..., object], managers: Sequence[Manager]
                     ) -> Callable[..., object]:
    """``fn`` itself with no manager overriding ``wrap_program``, else ``fn`` inside the
    layers of those that do (in chain order, the first outermost: ``managers`` with their
    constraints resolved, then by priority).

    Examples:
        >>> import graphmod as gm
        >>> from graphmod._core._program._program_chain import program_function
        >>> fn = lambda model, x: x
        >>> program_function(fn, [gm.Manager()]) is fn
        True
    """
    layered = tuple(m for m in resolve_order(managers) if m.has_hook("wrap_program"))
    if not layered:
        return fn
    return functools.partial(_run, fn, layered)


def _run(fn: Callable[..., object], layered: tuple[Manager, ...], model: nnx.Module,
         *args: PyTree, **kwargs: PyTree) -> object:
    frame = _context.current_frame()
    if frame is None:  # outside a program's trace (never: programs call it inside one)
        return fn(model, *args, **kwargs)
    layer: Callable[..., object] = functools.partial(fn, model)
    for manager in reversed(layered):
        frame.note_match(manager)  # a program layer matches the program
        call = ProgramCall(manager, model, fn, frame)
        layer = functools.partial(manager.wrap_program, call, layer)
        layer = functools.partial(_spread, layer)
    return layer(*args, **kwargs)


def _spread(wrap: Callable[[tuple[PyTree, ...], dict[str, PyTree]], object], *args: PyTree,
            **kwargs: PyTree) -> object:
    """``wrap(args, kwargs)``: a layer called as the function is, with spread arguments."""
    return wrap(args, kwargs)
