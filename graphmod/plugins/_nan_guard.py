"""``NaNGuard``: stops a run whose steps went non-finite, keeping the last good state."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from graphmod._core._number_checks import is_whole_number
from graphmod._core._warn import warn
from graphmod._train._events import Event, On, Template
from graphmod._train._loop._models import Models
from graphmod._train._plugin import Plugin
from graphmod._train._schedule import each
from graphmod.plugins._common import saved_field, template_or
from graphmod.typing import JSON, ArrayLike, LoopLike

SKIPPED = "skipped_steps"


class NaNGuard(Plugin):
    """Stops the run when steps are skipped for a non-finite loss or update.

    It works with ``graphmod.optimize(program, tx, skip_nonfinite=True)``: such a step
    leaves the train state unchanged when its loss or update is not finite and counts it
    in ``metrics["skipped_steps"]``, so the state always stays finite. On each due event
    NaNGuard reads that count (one device sync); when more than ``max_skipped`` steps were
    skipped since the run began it warns and calls ``loop.terminate()``, and the loop
    returns the last good state. It also checks once when the run ends (and warns).

    Trade-off: the default, every 100 steps, costs one sync per 100 steps but may run up
    to 99 more (skipped, so harmless) steps before it stops; ``every=On("step")`` stops at
    the first bad step and waits on the device at every step.

    Args:
        max_skipped: how many skipped steps to tolerate before stopping.
        every: the events on which the count is read (default: every 100 steps).
        name: the plugin's name.

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import NaNGuard
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> y[20:] = np.nan  # the third batch on is broken
        >>> step = gm.optimize(program, optax.sgd(0.1), skip_nonfinite=True)
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> guard = NaNGuard(every=gm.On("step", step=gm.each(2)))
        >>> loop = gm.Loop(step, ArraySource((x, y), batch_size=4), epochs=1, plugins=[guard])
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     state = loop.run(state)
        >>> print(caught[0].message)  # doctest: +ELLIPSIS
        nan_guard: 1 step(s) had a non-finite loss or update by step 6 ...
        >>> finite = all(np.isfinite(v).all() for v in jax.tree.leaves(state.variables))
        >>> guard.stopped_step, int(state.step), int(state.skipped), finite
        (6, 6, 1, True)
    """

    def __init__(self, *, max_skipped: int = 0, every: Template | str | None = None,
                 name: str = "nan_guard") -> None:
        if not is_whole_number(max_skipped, least=0):
            raise ValueError(f"NaNGuard(max_skipped={max_skipped!r}): must be an int >= 0")
        super().__init__(name=name,
                         every=template_or(every, On("step", step=each(100)), "NaNGuard"))
        self.max_skipped = max_skipped
        self.baseline: int | None = None  # skipped steps when the run began
        self.skipped = 0  # skipped steps this run, at the latest check
        self.stopped_step: int | None = None
        self._checked_step: int | None = None

    def setup(self, loop: LoopLike) -> None:
        if isinstance(loop.step, Models):
            names = ", ".join(loop.step.names)
            raise ValueError(f"NaNGuard: the loop runs several models ({names}) and NaNGuard "
                             "watches one step's count for now; leave it out (each model's "
                             "'<model>/skipped_steps' metric counts its skipped steps)")
        if getattr(loop.step, "skip_nonfinite", True) is False:
            raise ValueError("NaNGuard: the loop's step does not skip non-finite steps; make "
                             "it with graphmod.optimize(program, tx, skip_nonfinite=True)")
        skipped = getattr(loop.state, "skipped", None)
        self.baseline = int(np.asarray(skipped)) if skipped is not None else 0
        self.skipped = 0
        self.stopped_step = None
        self._checked_step = None

    def __call__(self, event: Event) -> None:
        if self._check(event.loop, event.metrics, event.time.step):
            self.stopped_step = event.time.step
            event.loop.terminate(f"{self.skipped} step(s) with a non-finite loss or update")

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        if error is None and self.stopped_step is None and loop.metrics \
                and self._checked_step != loop.time.step:
            self._check(loop, loop.metrics, loop.time.step)

    def _check(self, loop: LoopLike, metrics: Mapping[str, ArrayLike], step: int) -> bool:
        """Reads the count; warns and returns True when too many steps were skipped."""
        if SKIPPED not in metrics:
            raise ValueError(f"{self.name}: the step's metrics have no {SKIPPED!r}; make the "
                             "step with graphmod.optimize(program, tx, skip_nonfinite=True)")
        total = int(np.asarray(metrics[SKIPPED]))  # the one sync
        self._checked_step = step
        skipped = total - (self.baseline or 0)
        grew = skipped > self.skipped
        self.skipped = skipped
        if grew and skipped > self.max_skipped:
            warn(f"{self.name}: {skipped} step(s) had a non-finite loss or update by "
                 f"step {step} (skipped: the state is unchanged by them); stopping "
                 "the run", RuntimeWarning)
            return True
        return False

    def state_dict(self) -> dict[str, JSON]:
        return {"baseline": self.baseline, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, JSON]) -> None:
        self.baseline = saved_field(state, "baseline", int, self.name)
        self.skipped = saved_field(state, "skipped", int, self.name) or 0
