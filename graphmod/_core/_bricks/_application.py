"""``@application``: tagged brick methods, run inside the chain of managers in a program.

Each call of an application inside a compiled program

1. creates an :class:`ApplicationCall` (brick, application name, path, ``call_id``,
   ``training``) — passed to the method if it takes an ``application_call`` argument;
2. tags its inputs ``INPUT``, every parameter read inside it with its role, its outputs
   ``OUTPUT``;
3. runs the chain of matching managers around the method (see ``graphmod._core._tracing._chain``
   and ``graphmod._core._managers._manager``);
4. opens ``jax.named_scope`` with the brick's path relative to the calling application, so
   scopes in jaxprs, HLO and profiles read as the brick path.

Outside a compiled program the method runs as written: no tags, no managers. Methods of
unmodified Flax modules are applications too (see ``graphmod._core._bricks._intercept``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar, overload

from flax import nnx

from graphmod._core._bricks._spec import Spec
from graphmod._core._tracing import _context
from graphmod._core._tracing._call import ApplicationCall
from graphmod._core._tracing._chain import Chain

if TYPE_CHECKING:
    from graphmod._core._managers._manager import Manager

R = TypeVar("R")  # what the method returns: a program's managers rewrite it as such


@overload
def application(method: Callable[..., R], *, inputs: Sequence[str] = (),
                outputs: Sequence[str] = (), targets: Sequence[str] = (),
                costs: Sequence[str] = ()) -> Callable[..., R]: ...


@overload
def application(method: None = None, *, inputs: Sequence[str] = (),
                outputs: Sequence[str] = (), targets: Sequence[str] = (),
                costs: Sequence[str] = ()) -> Callable[[Callable[..., R]], Callable[..., R]]: ...


def application(
    method: Callable[..., R] | None = None,
    *,
    inputs: Sequence[str] = (),
    outputs: Sequence[str] = (),
    targets: Sequence[str] = (),
    costs: Sequence[str] = (),
) -> Callable[..., R] | Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorates a brick method as an application with named inputs and outputs.

    Args:
        inputs: names of the method's arguments tagged ``INPUT``.
        outputs: names of its results tagged ``OUTPUT`` (several: it returns a tuple).
        targets: names of arguments tagged ``TARGET`` instead (a cost's labels: what
            ``managers.LabelSmoothing`` rewrites; ``roles=[INPUT]`` leaves them alone).
        costs: names among ``outputs`` tagged ``COST`` instead.

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
        return functools.partial(application, inputs=inputs, outputs=outputs,
                                 targets=targets, costs=costs)
    return _wrapped(method, _spec(method, inputs, outputs, targets, costs))


def _wrapped(method: Callable[..., R], spec: Spec) -> Callable[..., R]:
    """``method`` running as application ``spec`` (see the module docstring)."""

    @functools.wraps(method)
    def wrapper(self: nnx.Module, *args: object,
                use_manager: Manager | list[Manager] | tuple[Manager, ...] | None = None,
                **kwargs: object) -> R:
        frame = _context.current_frame()
        path = None if frame is None else frame.layout.brick_path(self)
        if frame is None or path is None:
            return _run_plain(spec, method, self, args, kwargs)
        local = () if use_manager is None else tuple(
            use_manager if isinstance(use_manager, list | tuple) else [use_manager])
        with frame.using(local):
            return Chain(frame, spec, self, path).run(method, args, kwargs)

    wrapper.__graphmod_application__ = spec.name  # type: ignore[attr-defined]
    wrapper.__graphmod_spec__ = spec  # type: ignore[attr-defined]
    return wrapper


def _spec(method: Callable[..., object], inputs: Sequence[str], outputs: Sequence[str],
          targets: Sequence[str] = (), costs: Sequence[str] = ()) -> Spec:
    """The checked declaration of application ``method``."""
    named = (("inputs", inputs), ("outputs", outputs), ("targets", targets), ("costs", costs))
    for label, names in named:
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"application {method.__name__!r}: {label} must be a list of names")
    signature = inspect.signature(method)
    missing = [n for n in (*inputs, *targets) if n not in signature.parameters]
    if missing:
        raise ValueError(
            f"application {method.__qualname__}: inputs and targets {missing} are not "
            f"arguments of the method (it takes {list(signature.parameters)[1:]})"
        )
    if not set(costs) <= set(outputs):
        raise ValueError(f"application {method.__qualname__}: costs {list(costs)} must be "
                         f"among its outputs {list(outputs)}")
    return Spec(method.__name__, tuple(inputs), tuple(outputs), signature,
                "application_call" in signature.parameters, tuple(targets), tuple(costs))


def _run_plain(spec: Spec, method: Callable[..., R], brick: nnx.Module,
               args: tuple[object, ...], kwargs: dict[str, object]) -> R:
    if spec.takes_call:
        call = ApplicationCall(brick, spec.name, None, 0, False)
        kwargs = {**kwargs, "application_call": call}
    return method(brick, *args, **kwargs)
