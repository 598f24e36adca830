"""``graphmod.compile`` as the core does it: the layout of the model, the managers and
monitors checked, and a program of the type the caller asks for."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from graphmod._core._bricks._intercept import interceptor
from graphmod._core._managers._manager import Manager
from graphmod._core._model._layout import Layout
from graphmod._core._program._input_transforms import check_transform_fields
from graphmod._core._program._program_checks import check_managers, monitors, warn_outside_modules
from graphmod._core._program._program_record import Shared
from graphmod._core._selection._filter import VariableFilter
from graphmod._core._sharding import Placement
from graphmod._core._tracing import _context
from graphmod._core._warn import warn
from graphmod.typing import InputTransforms

__all__ = ["compile_program"]


def compile_program(
    program_type: type[Any],
    fn: Callable[..., Any],
    model: Any,
    *,
    managers: Iterable[Manager] | None = None,
    monitor: VariableFilter | Mapping[str, VariableFilter] | None = None,
    axis_name: Any = None,
    applications: Mapping[type, Sequence[str]] | None = None,
    mesh: Any = None,
    rules: Sequence[Any] = (),
    batch_axis: Any = None,
    transforms: InputTransforms | None = None,
) -> Any:
    """``graphmod.compile`` as the core does it, making a ``program_type``."""
    if not callable(fn):
        raise TypeError(f"compile(fn, model): fn must be callable, got {fn!r}")
    if mesh is None and (rules or batch_axis is not None):
        raise ValueError("compile(rules=..., batch_axis=...) place arrays on a device mesh: "
                         "pass mesh= too (e.g. jax.make_mesh((8,), ('data',)))")
    if transforms is not None:  # before anything else is built: names the field
        check_transform_fields(transforms, fn)
    layout = Layout(model, interceptor(applications))
    warn_outside_modules(fn, layout)
    placement = None if mesh is None else Placement(mesh, rules, batch_axis, layout=layout)
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
    labelled = monitors(monitor)
    for label, monitor_filter in labelled.items():
        layout.resolve(monitor_filter.brick_instances(), f"monitor[{label!r}]")
    return program_type(fn, Shared(layout, placement, transforms),
                        check_managers(chosen, layout), labelled, axis_name, strict=True)
