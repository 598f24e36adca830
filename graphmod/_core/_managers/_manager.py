"""Managers: context managers that rewrite applications while a function is traced.

When rewriting happens
    Only while ``graphmod.compile``'s program traces the model function. Eagerly, a brick
    runs its plain code and managers do nothing.

How chains are ordered
    Around each application call the matching managers form a chain, the first entered (or
    listed) outermost; ``priority`` (higher = further out) reorders it stably, and the
    ordering constraints managers declare (``kinds``, ``runs_before``, ``runs_after``:
    EMA runs before every ``"parameter_rewrite"``) are resolved at compile by a stable
    topological sort (``graphmod._core._managers._order``), shown in ``program.rewrites`` and the
    program's display. Inputs and parameters pass outermost→innermost, outputs return
    innermost→outermost, like nested ``with`` blocks. Each manager's :meth:`Manager.wrap`
    is one layer of that chain: the default layer rewrites inputs, calls the next layer and
    rewrites outputs, so a subclass can override the three hooks, or ``wrap`` itself
    (remat, precision, sharding). :meth:`Manager.wrap_program` layers wrap the program's
    whole function instead (Selective Backprop), outside every application's chain.

What is undefined
    A hook that returns a value of another shape than the original changes the program;
    graphmod records it but does not forbid it. Hooks must be pure functions of their
    arguments, ``call.rng()`` and the manager's hyperparameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import Any, ClassVar, NoReturn, Self, TypeVar

import jax
import jax.numpy as jnp

from graphmod._core._bricks._construction import record_construction
from graphmod._core._naming import snake_case
from graphmod._core._selection._filter import (
    ApplicationSelector,
    BrickSelector,
    Tag,
    VariableFilter,
)
from graphmod._core._tracing import _context
from graphmod._core._warn import warn
from graphmod.roles import Role
from graphmod.typing import (
    ArrayLike,
    HookContext,
    ModelLayout,
    ProgramContext,
    PyTree,
    Variables,
    WrapContext,
)

V = TypeVar("V")  # a value a hook is given, rewritten into one of its kind
R = TypeVar("R")  # what the rest of a chain returns, returned by a layer around it


@dataclasses.dataclass(frozen=True)
class Dynamic:
    """A hyperparameter stored in the variables, changeable between steps without retrace.

    Examples:
        >>> import graphmod as gm
        >>> gm.dynamic(0.5)
        Dynamic(value=0.5)
    """

    value: float

    __graphmod_dynamic__ = True

    def _not_a_number(self, *_: object) -> NoReturn:
        raise TypeError(
            f"{self!r} declares a dynamic hyperparameter; it is not a number. Inside a "
            "manager's hook read its current value with self.hp(\"<name>\") (a float32 "
            "scalar from the variables), e.g. self.hp(\"rate\")")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _not_a_number
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __neg__ = __jax_array__ = _not_a_number
    __lt__ = __le__ = __gt__ = __ge__ = _not_a_number


def dynamic(value: float) -> Dynamic:
    """Marks a manager hyperparameter as dynamic: a float32 scalar in the variables.

    A plain float is a compile-time constant; ``dynamic(x)`` stores x at
    ``variables["managers"][name]["hparams"][hparam]``, where a plugin can change it
    (see :meth:`Manager.hparam`) without recompiling.

    Examples:
        >>> import graphmod as gm
        >>> gm.dynamic(0.1).value
        0.1
    """
    if isinstance(value, Dynamic):
        return value
    try:
        return Dynamic(float(value))
    except (TypeError, ValueError):
        raise TypeError(f"dynamic(value): expected a float, got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class HParam:
    """A handle on one dynamic hyperparameter in a program's variables, and its valid range.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> h = gm.HParam("dropout", "rate")
        >>> v = {"managers": {"dropout": {"hparams": {"rate": jnp.float32(0.5)}}}}
        >>> float(h.get(h.set(v, 0.25)))
        0.25
    """

    manager: str
    name: str
    valid: tuple[float, float] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def keys(self) -> tuple[str, ...]:
        return ("managers", self.manager, "hparams", self.name)

    def get(self, variables: Variables) -> jax.Array:
        """The current value in ``variables``."""
        node: object = variables
        for key in self.keys:
            if not isinstance(node, dict) or key not in node:
                raise KeyError(
                    f"hyperparameter {self.manager}.{self.name}: no "
                    f"variables[{']['.join(map(repr, self.keys))}]; was the manager "
                    "compiled into the program that made these variables?")
            node = node[key]
        return jnp.asarray(node)  # the stored scalar itself (an array already)

    def set(self, variables: Variables, value: ArrayLike) -> Variables:
        """A copy of ``variables`` (dicts along the path copied) with the new value.

        The value is cast to the stored dtype, so the compiled step does not retrace.
        """
        old = self.get(variables)
        new = jnp.asarray(value, dtype=old.dtype)
        if new.shape != old.shape:
            raise ValueError(
                f"hyperparameter {self.manager}.{self.name}: value of shape {new.shape} "
                f"does not fit the stored shape {old.shape}")

        def replace(node: dict, keys: tuple[str, ...]) -> dict:
            head, *rest = keys
            return {**node, head: replace(node[head], tuple(rest)) if rest else new}

        return replace(variables, self.keys)


def _deprecated_name(manager: Manager, name: str, manager_name: str | None) -> str:
    """The manager's name from the deprecated ``name=``, with a warning naming both intents."""
    cls = type(manager).__name__
    if manager_name is not None:
        raise TypeError(f"{cls}(name={name!r}, manager_name={manager_name!r}): name= is the "
                        "deprecated spelling of manager_name=; pass manager_name= only")
    warn(  # at the user's line, past a user's subclass's super().__init__ calls too
        f"{cls}(name={name!r}): name= is deprecated because it reads like a variable filter. "
        f"It names the manager {name!r} (as before) and does not narrow what it rewrites. "
        f"Write {cls}(manager_name={name!r}) to name the manager, or "
        f"{cls}(variable_name={name!r}) to rewrite only the variables named {name!r}.",
        DeprecationWarning, past=_manager_init,
    )
    return name


def _manager_init(frame: FrameType) -> bool:
    """Whether ``frame`` runs a manager's ``__init__`` (a subclass's, calling its base's)."""
    return frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), Manager)


def _chosen_filter(manager: Manager, filter: object, given: dict[str, object]
                   ) -> VariableFilter | None:
    """The filter a manager was given, ``filter=`` (None: the filter fields ``given``, the
    ``variable_name`` argument as ``name``), checked: never both."""
    owner = type(manager).__name__
    if filter is not None and given:
        fields = ", ".join("variable_name" if k == "name" else k for k in given)
        raise TypeError(f"{owner}: pass either filter= or the filter fields ({fields}), "
                        "not both")
    if filter is not None and not isinstance(filter, VariableFilter):
        raise TypeError(f"{owner}(filter=...): expected a VariableFilter, got {filter!r}")
    name = given.get("name")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{owner}(variable_name={name!r}): must be a string, the exact name "
                        "of the variables to rewrite (e.g. 'W')")
    return filter


def _unknown_arguments(manager: Manager, unknown: dict[str, object]) -> str:
    """What a manager says of keyword arguments it does not take: the likely spelling."""
    known = [name for cls in type(manager).__mro__ if "__init__" in vars(cls)
             for name, parameter in inspect.signature(vars(cls)["__init__"]).parameters.items()
             if name not in ("self", "name") and parameter.kind in (
                 parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
    close = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
    text = [f"{name}=" + (f" (did you mean {c[0]}=?)" if c else "") for name, c in close.items()]
    return (f"{type(manager).__name__}: no argument {', '.join(text)}; it takes "
            f"{', '.join(dict.fromkeys(known))}")


def _check_naming(manager: Manager, priority: object, manager_name: object) -> None:
    owner = type(manager).__name__
    if not isinstance(priority, int):
        raise TypeError(f"{owner}(priority=...): expected an int, got {priority!r}")
    if manager_name is not None and (not isinstance(manager_name, str)
                                     or not manager_name.isidentifier()):
        raise ValueError(f"{owner}(manager_name=...): {manager_name!r} must be an identifier")


_BASE_FIELDS = frozenset({"filter", "priority", "name", "strict", "_entered"})


def _overrides(manager: Manager, hook: str) -> bool:
    return getattr(type(manager), hook) is not getattr(Manager, hook)


class Manager:
    """Base class of managers: rewrites of inputs, outputs and parameters of applications.

    Args:
        bricks, roles, applications, path, name_regex, call_id: the fields of a
            :class:`VariableFilter` selecting what this manager rewrites.
        variable_name: the exact name of the variables to rewrite (``"W"``, ``"kernel"``);
            the filter's ``name`` field.
        filter: a ready :class:`VariableFilter` instead of the fields.
        priority: higher runs further out in the chain (default 0).
        manager_name: the manager's own name, unique in a chain (default: class name in
            snake case). It keys ``variables["managers"]``, the randomness and the rewrite
            trace, and is the attribute ``manager.name``.
        strict: raise if the filter matches nothing in a trace.
        name: deprecated spelling of ``manager_name`` (it read like a variable filter);
            still names the manager, with a ``DeprecationWarning``.

    Subclasses override ``rewrite_input``/``rewrite_output``/``rewrite_parameter`` (each
    returns the new value) or ``wrap``. Hyperparameters that may be :func:`dynamic` are
    listed in ``hparams`` and read with ``self.hp(name)`` inside hooks; their valid closed
    ranges in ``hparam_ranges`` (``plugins.Anneal`` refuses a value outside). Constructing a
    manager records its configuration for provenance (bricks it names are recorded by path
    at compile). A class with ``once = True`` leaves alone what it selects inside an
    application call whose own values it rewrote: values passed on from them (a
    classifier's labels into its cost brick) are rewritten once.

    Ordering constraints (class attributes; an instance may set its own in ``__init__``):
    ``kinds`` names what the manager is (``"average"``, ``"parameter_rewrite"``,
    ``"batch_selection"``, ``"augmentation"``, ``"cost_on_stored_parameters"``, or a kind
    of your own); ``runs_before`` and ``runs_after`` hold kinds or manager classes it must
    run before (further out: it sees inputs and parameters first) or after. ``compile``
    sorts the managers to satisfy them, the listed order and ``priority`` winning where
    nothing is declared, and refuses a cycle (:class:`~graphmod.errors.ManagerConflict`).
    A built-in manager that rewrites the parameters it reads is a ``"parameter_rewrite"``:
    declare it on yours, so that ``EMA`` goes before it. Two hooks beyond an application's:
    :meth:`wrap_program` (around the program's whole function) and
    :meth:`frozen_parameters` (parameters :func:`graphmod.optimize` leaves as they are).

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> class Double(gm.Manager):
        ...     def rewrite_output(self, call, name, value):
        ...         return 2 * value
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> with Double(roles=[gm.roles.OUTPUT]):
        ...     program = gm.compile(lambda m, x: m(x), lin)
        >>> x = jnp.ones((1, 2))
        >>> variables = program.init(x)
        >>> bool(jnp.allclose(program.infer(variables, x), 2 * lin(x)))
        True
        >>> double_w = Double(roles=[gm.roles.WEIGHT], variable_name="W", manager_name="w2")
        >>> double_w.name, double_w.filter
        ('w2', VariableFilter(roles=(WEIGHT,), name='W'))
        >>> class Outermost(gm.Manager):  # before every parameter rewrite, wherever listed
        ...     runs_before = ("parameter_rewrite",)
        >>> class Rewrite(gm.Manager):
        ...     kinds = ("parameter_rewrite",)
        >>> program = gm.compile(lambda m, x: m(x), lin, managers=[Rewrite(), Outermost()])
        >>> [m.name for m in program.managers]
        ['outermost', 'rewrite']
    """

    exclusive: ClassVar[bool] = False
    once: ClassVar[bool] = False
    hparams: ClassVar[tuple[str, ...]] = ()
    # These four a class sets, or an instance in its __init__ (LayerFreezing's ranges, an
    # L2's kinds): no ClassVar. Ordering constraints, resolved at compile (see
    # graphmod._core._managers._order): what this manager is, and the kinds (strings) or
    # manager classes it runs before or after.
    hparam_ranges: dict[str, tuple[float, float]] = {}
    kinds: tuple[str, ...] = ()
    runs_before: tuple[str | type, ...] = ()
    runs_after: tuple[str | type, ...] = ()

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        manager = super().__new__(cls)
        record_construction(manager, args, kwargs, by_path=True)  # for provenance
        return manager

    def __init__(
        self,
        *,
        bricks: BrickSelector | Iterable[BrickSelector] | None = None,
        roles: Role | Iterable[Role] | None = None,
        applications: ApplicationSelector | Iterable[ApplicationSelector] | None = None,
        path: str | None = None,
        variable_name: str | None = None,
        name_regex: str | None = None,
        call_id: int | Iterable[int] | None = None,
        filter: VariableFilter | None = None,
        priority: int = 0,
        manager_name: str | None = None,
        strict: bool = True,
        name: str | None = None,
        **unknown: object,
    ) -> None:
        if unknown:
            raise TypeError(_unknown_arguments(self, unknown))
        if name is not None:
            manager_name = _deprecated_name(self, name, manager_name)
        fields = dict(bricks=bricks, roles=roles, applications=applications, path=path,
                      name=variable_name, name_regex=name_regex, call_id=call_id)
        chosen = _chosen_filter(self, filter, {k: v for k, v in fields.items()
                                               if v is not None})
        self.filter = chosen if chosen is not None else VariableFilter(
            bricks=bricks, roles=roles, applications=applications, path=path,
            name=variable_name, name_regex=name_regex, call_id=call_id)
        _check_naming(self, priority, manager_name)
        self.priority = priority
        self.name = manager_name or snake_case(type(self).__name__)
        self.strict = strict
        self._entered: list[contextlib.AbstractContextManager[None]] = []

    # -- configuration ----------------------------------------------------------------
    def __getattr__(self, key: str) -> NoReturn:
        # Reached only when an attribute is missing: a base field missing means a subclass
        # whose __init__ did not run Manager.__init__.
        if key in _BASE_FIELDS:
            raise AttributeError(
                f"{type(self).__name__} has no {key!r}: its __init__ did not call "
                "super().__init__(**kwargs). Call it first in __init__, passing the filter "
                "fields (roles=, bricks=, ...) on")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    def __setattr__(self, key: str, value: object) -> None:
        if not key.startswith("_") and self.__dict__.get("_frozen", False):
            raise AttributeError(
                f"manager {self.name!r} is frozen: it was compiled into a program; "
                f"create a new manager instead of setting {key!r}"
            )
        object.__setattr__(self, key, value)

    def __getstate__(self) -> dict[str, object]:
        # The `with` blocks a manager is in belong to this context, not to its copies.
        return {k: v for k, v in self.__dict__.items() if k != "_entered"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__dict__["_entered"] = []

    def freeze(self) -> None:
        """Forbids changes from now on (called by ``compile``)."""
        self._frozen = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(manager_name={self.name!r}, filter={self.filter!r})"

    def __enter__(self) -> Manager:
        context = _context.entered(self)
        context.__enter__()
        self._entered.append(context)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._entered.pop().__exit__(kind, error, traceback)

    # -- hyperparameters --------------------------------------------------------------
    def dynamic_hparams(self) -> dict[str, float]:
        """The initial values of this manager's dynamic hyperparameters."""
        return {
            h: getattr(self, h).value for h in self.hparams if isinstance(getattr(self, h), Dynamic)
        }

    def hp(self, name: str) -> Any:
        """The value of hyperparameter ``name`` in the trace: a constant or a scalar tracer."""
        value = getattr(self, name)
        if not isinstance(value, Dynamic):
            return value
        frame = _context.current_frame()
        if frame is None:
            return value.value
        return frame.hparam(self, name)

    def hparam(self, name: str) -> HParam:
        """A handle on dynamic hyperparameter ``name``, for plugins that anneal it.

        Examples:
            >>> import graphmod as gm, managers
            >>> managers.Dropout(gm.dynamic(0.5), roles=[gm.roles.INPUT]).hparam("rate")
            HParam(manager='dropout', name='rate')
        """
        if name not in self.hparams:
            raise KeyError(f"{type(self).__name__} has no hyperparameter {name!r}; "
                           f"it has {list(self.hparams)}")
        if not isinstance(getattr(self, name), Dynamic):
            raise ValueError(
                f"hyperparameter {self.name}.{name} is a compile-time constant; construct "
                f"the manager with graphmod.dynamic({getattr(self, name)!r}) to change it")
        return HParam(self.name, name, self.hparam_ranges.get(name))

    # -- hooks --------------------------------------------------------------------------
    def rewrite_input(self, call: HookContext, name: str, value: V) -> V:
        """Returns the rewritten input ``name`` of ``call`` (default: unchanged)."""
        return value

    def rewrite_output(self, call: HookContext, name: str, value: V) -> V:
        """Returns the rewritten output ``name`` of ``call`` (default: unchanged)."""
        return value

    def rewrite_parameter(self, call: HookContext, name: str, value: V) -> V:
        """Returns the rewritten parameter ``name`` as ``call`` reads it (default: unchanged);
        the model's ``STATE`` variables come here only if this manager's ``roles=`` names
        ``STATE`` (or ``PERSISTENT``)."""
        return value

    def wrap(self, call: WrapContext, next: Callable[..., R], args: tuple[PyTree, ...],
             kwargs: dict[str, PyTree]) -> R:
        """Middleware around the call (default: ``next(*args, **kwargs)``): remat, casts,
        sharding constraints. ``args`` are the call's as they came; ``next`` applies this
        manager's ``rewrite_input`` and ``rewrite_output`` around the rest of the chain."""
        return next(*args, **kwargs)

    def wrap_program(self, call: ProgramContext, next: Callable[..., R],
                     args: tuple[PyTree, ...], kwargs: dict[str, PyTree]) -> R:
        """Middleware around the program's whole function ``fn(model, *args, **kwargs)``
        in every trace (``init``, ``train``, ``infer``, ``graph``); default:
        ``next(*args, **kwargs)``, the inner layers and then ``fn``. ``args`` and
        ``kwargs`` are the program's arguments after the model (the batch); ``call`` (a
        :class:`graphmod.typing.ProgramContext`: ``mode``, ``training``, ``model``,
        ``function``) can draw a key (``call.rng(name)``), own a variable
        (``call.variable(name, init)``), report a metric (``call.report(name, value)``),
        note a rewrite of an argument (``call.note_input``), run a function as inference
        sees it (``call.infer``) and switch between two ways of running on a traced flag
        (``call.switch``). Layers
        nest in chain order, all outside every application's chain; a manager with this
        hook only is in no application's chain.

        Examples:
            >>> import jax, jax.numpy as jnp, graphmod as gm
            >>> from flax import nnx
            >>> class Halve(gm.Manager):  # the program's inputs, halved in training
            ...     def wrap_program(self, call, next, args, kwargs):
            ...         return next(*(a / 2 for a in args)) if call.training else next(*args)
            >>> lin = gm.bricks.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
            >>> program = gm.compile(lambda m, x: m(x).sum(), lin, managers=[Halve()])
            >>> v = program.init(jnp.ones((1, 1)))
            >>> out, _ = program.train(v, jnp.ones((1, 1)), rng=jax.random.key(0))
            >>> bool(jnp.isclose(out, program.infer(v, jnp.ones((1, 1))) / 2))
            True
        """
        return next(*args, **kwargs)

    def frozen_parameters(self, layout: ModelLayout, variables: Variables
                          ) -> dict[str, jax.Array]:
        """The parameters :func:`graphmod.optimize`'s step leaves as they are this step,
        by path (``"/linear_layers/0.W"``), each with a (traced) bool: where it holds, the
        parameter and its optimizer state (Adam's moments) keep their values bitwise, however
        the optimizer would move them (momentum keeps moving a parameter whose gradient is
        zero). Read from ``variables`` (a dynamic hyperparameter: no retrace when it
        changes). Default: none (``managers.LayerFreezing`` freezes layers).

        Examples:
            >>> import graphmod as gm
            >>> gm.Manager().frozen_parameters(None, {})
            {}
        """
        return {}

    def region(self, value: object) -> contextlib.AbstractContextManager[None]:
        """A ``with`` block, entered in :meth:`wrap` around ``next``, inside which every
        application called belongs to this manager's *region* holding ``value`` (what a
        precision policy casts to): :meth:`regions` lists the open ones. The stack lives
        with graphmod's other trace-time stacks, so a manager keeps no state of its own.

        Examples:
            >>> import graphmod as gm
            >>> manager = gm.Manager()
            >>> with manager.region("bfloat16"):
            ...     gm.Manager.regions()
            (('manager', 'bfloat16'),)
            >>> gm.Manager.regions()
            ()
        """
        return _context.region(self.name, value)

    @staticmethod
    def regions() -> tuple[tuple[str, object], ...]:
        """The regions open where this is called, ``(manager name, value)``, innermost
        last: see :meth:`region`.

        Examples:
            >>> import graphmod as gm
            >>> gm.Manager.regions()
            ()
        """
        return _context.regions()

    # -- matching (used by the chain) -----------------------------------------------------
    def has_hook(self, hook: str) -> bool:
        return _overrides(self, hook)

    @property
    def applies_to_calls(self) -> bool:
        """Whether the manager has a hook of application calls (a ``rewrite_*`` or
        ``wrap``): one with none (``wrap_program`` only) is in no application's chain."""
        return any(self.has_hook(h) for h in (
            "rewrite_input", "rewrite_output", "rewrite_parameter", "wrap"))

    @property
    def wraps_only(self) -> bool:
        """Whether ``wrap`` is the manager's only hook (``Remat``): it selects calls, not
        variables (see :meth:`VariableFilter.matches_call`)."""
        return self.has_hook("wrap") and not any(self.has_hook(h) for h in (
            "rewrite_input", "rewrite_output", "rewrite_parameter"))

    def selects(self, tag: Tag) -> bool:
        return self.filter.matches_variable(tag)
