"""Which JAX trace is in progress, and the one a frame's side outputs leave from.

A frame collects values beside the traced function's result (updated variables, monitored
values, new manager variables): they can leave only from the frame's base trace (the outer
trace of the program, or the body of a ``graphmod.scan``, which carries them), never from an
inner trace (``jax.jit``, ``lax.scan``, ``nnx.vmap``, ...), whose tracers would leak.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import jax.extend

from graphmod.errors import StateEscapesTransform


def current_trace() -> object:
    """An opaque token of the JAX trace in progress (equal tokens: same trace; JAX's
    ``OpaqueTraceState``, not public)."""
    return jax.extend.core.get_opaque_trace_state(convention="nnx")


class TraceScope:
    """The base trace of a frame: where its side outputs may be made.

    Examples:
        >>> from graphmod._core._tracing._trace import TraceScope
        >>> TraceScope().inner()  # created and asked in the same (eager) trace
        False
    """

    def __init__(self) -> None:
        self._base = current_trace()

    @property
    def base(self) -> object:
        return self._base

    def inner(self) -> bool:
        """Whether the trace in progress is an inner one (its values cannot leave it)."""
        return current_trace() != self._base

    def check(self, what: str, where: str) -> None:
        """Raises :class:`~graphmod.errors.StateEscapesTransform` in an inner trace."""
        if self.inner():
            raise StateEscapesTransform(
                f"{what}{where} happens inside a raw JAX transform or an NNX lifted transform "
                "(jax.jit, lax.scan, lax.cond, jax.checkpoint, nnx.scan, nnx.cond, nnx.vmap, "
                "nnx.remat, nnx.RNN...): the value could not leave it. Use graphmod.scan for "
                "recurrences and loops over layers, narrow the manager's filter to layers "
                "called outside the transform, or return the value through the transform."
            )

    @contextmanager
    def moved_here(self) -> Iterator[None]:
        """The trace in progress is the base while the block runs (a ``graphmod.scan``
        body, whose carry takes the side outputs out)."""
        saved, self._base = self._base, current_trace()
        try:
            yield
        finally:
            self._base = saved
