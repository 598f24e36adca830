"""What a program refuses, with the named error and the fix: ``compile``'s arguments, its
managers and monitors (checked in this order by ``graphmod.compile``, see
``graphmod._train._program``), a strict manager that matched nothing in a trace, and
variables that do not fit it (checked when a signature is traced, see
``graphmod._core._program._program_core``); and what it warns of: modules read from outside
the model, managers of ``with`` blocks a list leaves out, Flax layers a module flag keeps in
eval mode in training."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence

from flax import nnx

from graphmod._core._managers._manager import Manager
from graphmod._core._managers._order import ManagerOrder, resolve_order
from graphmod._core._model._layout import Layout
from graphmod._core._program._arguments import (
    flat_keys,
    flat_leaves,
    spec,
    spec_differences,
    tree_difference,
)
from graphmod._core._selection._filter import VariableFilter
from graphmod._core._selection._unmatched import unmatched_hints
from graphmod._core._tracing import _context
from graphmod._core._tracing._frame import Frame
from graphmod._core._warn import warn
from graphmod.errors import ManagerConflict, ManagerMatchedNothing, VariablesMismatch
from graphmod.typing import AxisName, ShardingRule

__all__ = ["check_compile_arguments", "check_managers", "check_strict", "check_variables",
           "chosen_managers", "monitors", "warn_held_off", "warn_outside_modules"]


def check_compile_arguments(fn: object, mesh: object, rules: Sequence[ShardingRule],
                            batch_axis: AxisName | None) -> None:
    """Raises unless ``fn`` is callable and a mesh is given where ``rules`` or
    ``batch_axis`` would place arrays on one (``compile``'s first checks).

    Examples:
        >>> check_compile_arguments(lambda m, x: x, None, (), None)
        >>> try:
        ...     check_compile_arguments(lambda m, x: x, None, (), "data")
        ... except ValueError as error:
        ...     print(str(error)[:55])
        compile(rules=..., batch_axis=...) place arrays on a de
    """
    if not callable(fn):
        raise TypeError(f"compile(fn, model): fn must be callable, got {fn!r}")
    if mesh is None and (rules or batch_axis is not None):
        raise ValueError("compile(rules=..., batch_axis=...) place arrays on a device mesh: "
                         "pass mesh= too (e.g. jax.make_mesh((8,), ('data',)))")


def chosen_managers(managers: Iterable[Manager] | None) -> tuple[Manager, ...]:
    """The managers ``compile(managers=...)`` uses: those listed, or (None) those active in
    ``with`` blocks; warns of active ones a list leaves out, refuses a single manager.

    Examples:
        >>> import graphmod as gm
        >>> manager = gm.Manager()
        >>> with manager:
        ...     chosen_managers(None) == (manager,)
        True
    """
    if isinstance(managers, Manager):
        raise TypeError(f"compile(managers=...): expected a list of managers, got one "
                        f"({managers!r}): pass managers=[{type(managers).__name__}(...)]")
    active = _context.active_managers()
    chosen = active if managers is None else tuple(managers)
    if ignored := [m.name for m in active if all(m is not c for c in chosen)]:
        warn(
            f"compile(managers=[...]) uses exactly the managers listed: {ignored}, active in "
            "a with block, are not among them and are ignored. List every manager "
            "(managers=[...]), or enter them all in with blocks")
    return chosen


def check_managers(managers: Sequence[object], layout: Layout) -> ManagerOrder:
    """``managers``, checked (managers with distinct names, bricks of this model), frozen
    and in their listed order with their declared ordering constraints satisfied (see
    ``graphmod._core._managers._order``; each chain sorts it by priority too); raises
    :class:`~graphmod.errors.ManagerConflict` for two with one name or constraints that
    form a cycle."""
    names: dict[str, Manager] = {}
    checked: list[Manager] = []
    for index, manager in enumerate(managers):
        if not isinstance(manager, Manager):
            raise TypeError(f"managers[{index}]: {manager!r} is not a graphmod.Manager")
        checked.append(manager)
        if manager.name in names:
            raise ManagerConflict(
                f"two managers are named {manager.name!r} ({names[manager.name]!r} and "
                f"{manager!r}): pass manager_name=... to one of them"
            )
        names[manager.name] = manager
        layout.resolve(manager.filter.brick_instances(), f"manager {manager.name!r}")
    # As listed, constraints resolved (the chain adds priority); before anything is frozen.
    order = resolve_order(checked, priority=False)
    for manager in checked:
        manager.freeze()
    return order


def monitors(monitor: object, layout: Layout) -> dict[str, VariableFilter]:
    """``compile(monitor=...)`` as a dict of filters by label (``""`` for a single one), the
    bricks each names checked to be ``layout``'s."""
    if monitor is None:
        return {}
    if isinstance(monitor, VariableFilter):
        labelled = {"": monitor}
    elif isinstance(monitor, Mapping):
        labelled: dict[str, VariableFilter] = {}
        for label, f in monitor.items():
            if not isinstance(f, VariableFilter):
                raise TypeError(f"monitor[{label!r}]: expected a VariableFilter, got {f!r}")
            labelled[label] = f
    else:
        raise TypeError(
            f"monitor=: expected a VariableFilter or a dict of them, got {monitor!r}")
    for label, monitor_filter in labelled.items():
        layout.resolve(monitor_filter.brick_instances(), f"monitor[{label!r}]")
    return labelled


def check_strict(frame: Frame) -> None:
    """Raises :class:`~graphmod.errors.ManagerMatchedNothing` for a strict manager the
    trace of ``frame`` never matched."""
    for manager in frame.seen_managers.values():
        if manager.strict and frame.matches[id(manager)] == 0:
            raise ManagerMatchedNothing(
                f"manager {manager.name!r} ({type(manager).__name__}) matched nothing in the "
                f"{frame.mode} trace: its filter {manager.filter!r} selects no variable of "
                f"any application call.{unmatched_hints(manager, frame.layout)} Fix the "
                "filter, or pass strict=False. (A module the function calls but the model "
                "does not hold is no application: attach it to the model.)"
            )


def warn_held_off(frame: Frame) -> None:
    """Warns that Flax layers stayed in eval mode in the training trace of ``frame``
    because of their module flags (``Frame.note_held_off``); once per set of layers, as
    Python's warning registry keeps repeated texts quiet."""
    if not frame.held_off:
        return
    held = [f"{path} ({flag})" for path, flag in frame.held_off.items()]
    shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
    warn(
        f"these Flax layers stay in eval mode in the program's training: {shown}. A flag set "
        "on the module (at construction, or by model.eval()) wins over the program's mode. "
        "If that is not meant, call model.train() before the program traces (a program's "
        "modes take the place of train()/eval()); to keep a layer frozen without this "
        "warning, pass the flag in the call (e.g. self.norm(x, use_running_average=True))")


def warn_outside_modules(fn: Callable[..., object], layout: Layout) -> None:
    """Warns of the modules ``fn`` reads by name from outside the model (its globals and
    closure): a program holds their variables as constants, so they neither train nor
    save, and managers do not see their calls.

    Examples:
        >>> import warnings, graphmod as gm
        >>> from flax import nnx
        >>> head = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = gm.compile(lambda m, x: head(m(x)), nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        >>> "outside the model, 'head' (Linear)" in str(caught[0].message)
        True
    """
    try:
        names = inspect.getclosurevars(fn)
    except (TypeError, ValueError):  # a callable object, a builtin; a closure cell unset
        return
    outside = [f"{name!r} ({type(value).__name__})"
               for name, value in {**names.nonlocals, **names.globals}.items()
               if isinstance(value, nnx.Module) and layout.brick_path(value) is None]
    if outside:
        warn(
            f"compile(fn, model): fn reads modules from outside the model, "
            f"{', '.join(outside)}: a program holds their variables as constants (not "
            "trained, not saved, not seen by managers). Make each part of the model (an "
            "attribute, or compile(fn, nnx.Dict(model=model, head=head)) and read it from "
            "the model argument); one meant to stay as it is (a frozen teacher) needs no "
            "change: ignore this warning")


def check_variables(variables: object, layout: Layout, reference: Mapping | None) -> None:
    """Raises :class:`~graphmod.errors.VariablesMismatch` unless ``variables`` fit: the
    program's two entries, the model's paths, shapes and dtypes as in ``layout``, the
    managers' as in ``reference`` (init's variables; None: unchecked)."""
    if not isinstance(variables, Mapping) or set(variables) != {"model", "managers"}:
        raise VariablesMismatch(
            "variables must be the dict made by program.init: {'model': ..., "
            f"'managers': ...}}; got {_describe_keys(variables)}"
        )
    _check_paths(flat_keys(variables["model"]), layout)
    differences = spec_differences(
        flat_leaves(variables["model"]),
        {key: (info.shape, info.dtype) for key, info in layout.by_key.items()},
        lambda key: layout.by_key[key].path)
    if reference is not None:
        differences += spec_differences(
            flat_leaves(variables["managers"]),
            {key: spec(leaf) for key, leaf in flat_leaves(reference["managers"]).items()},
            lambda key: "managers" + "".join(f"[{part!r}]" for part in key))
    if differences:
        raise VariablesMismatch(
            "variables do not fit this program's layout:\n  " + "\n  ".join(differences)
            + "\nThese variables were made by another program or model: use the variables "
            "this program's init returns (program.init(...)), or the program they were "
            "made for")


def _check_paths(actual: set, layout: Layout) -> None:
    missing, extra = tree_difference(set(layout.by_key), actual)
    if not (missing or extra):
        return
    hint = ""
    if {_int_keys(k) for k in actual} == set(layout.by_key):
        hint = (". The paths differ only in key types ('0' for 0), as orbax returns "
                "them when restoring without a target: restore with one, e.g. the "
                "variables program.init returns")
    raise VariablesMismatch(
        "variables['model'] does not match the model this program was compiled over: "
        + "; ".join(part for part in (
            f"missing {', '.join(missing)}" if missing else "",
            f"unexpected {', '.join(extra)}" if extra else "") if part) + hint
    )


def _describe_keys(value: object) -> str:
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    return type(value).__name__


def _int_keys(key: tuple) -> tuple:
    return tuple(int(k) if isinstance(k, str) and k.isdigit() else k for k in key)
