"""``graphmod.compile`` as the core does it: the layout of the model, the managers and
monitors checked, and a program of the type the caller asks for."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from graphmod._core import _context
from graphmod._core._filter import VariableFilter
from graphmod._core._intercept import interceptor
from graphmod._core._layout import Layout
from graphmod._core._manager import Manager
from graphmod._core._program_checks import check_managers, monitors
from graphmod._core._program_record import Shared

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
) -> Any:
    """``graphmod.compile`` as the core does it, making a ``program_type``."""
    if not callable(fn):
        raise TypeError(f"compile(fn, model): fn must be callable, got {fn!r}")
    layout = Layout(model, interceptor(applications))
    chosen = _context.active_managers() if managers is None else tuple(managers)
    labelled = monitors(monitor)
    for label, monitor_filter in labelled.items():
        layout.resolve(monitor_filter.brick_instances(), f"monitor[{label!r}]")
    return program_type(fn, Shared(layout), check_managers(chosen, layout), labelled,
                        axis_name, strict=True)
