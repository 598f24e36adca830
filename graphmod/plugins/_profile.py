"""``Profile``: a ``jax.profiler`` trace of chosen steps, where TensorBoard's profile plugin
reads it.

The trace starts at an event its template matches (by default the 10th step's) and covers the
``steps`` train steps that follow; it ends at the step event that closes them, once the
device has finished them, so the trace holds their whole device work. Each trace is a
*run* of TensorBoard's profile plugin, ``<directory>/plugins/profile/<timestamp>/`` with
the host's ``*.xplane.pb`` (and a ``*.trace.json.gz`` for Perfetto): ``tensorboard --logdir
<directory>`` (with ``tensorboard-plugin-profile``, or ``xprof --logdir``) shows it in its
Profile tab. The profile's HLO names each operation by the ``jax.named_scope`` of the
application calls around it (``apply/linear_layers/0.apply/dot_general``: the first
layer's matrix product), which XProf shows on GPU and TPU kernels.

The closing step is a schedule of the plugin's template, so a loop fusing steps
(``steps_per_call``) stops a fused call there and the trace covers exactly ``steps`` steps.
"""

from __future__ import annotations

import glob
import os

import jax
import numpy as np

from graphmod._core._number_checks import is_whole_number
from graphmod._train._events import Event, On, Template
from graphmod._train._plugin import Plugin
from graphmod._train._schedule import Schedule, at
from graphmod.plugins._common import directory_argument, template_or
from graphmod.plugins._logger import Logger
from graphmod.typing import LoopLike, PyTree

_HOLDS = "pass a directory to hold the traces (plugins/profile/...)"


class Profile(Plugin):
    """Writes a ``jax.profiler`` trace of ``steps`` train steps at each event ``every``
    matches, for TensorBoard's profile plugin (CLU's ``Profile``, MaxText's profiler).

    A trace begins at the matching event (after the step it names: ``On("step",
    step=at(100))`` traces steps 101 to 100 + ``steps``) and ends once the device finished
    the last of those steps; a match while a trace runs is ignored, and a run that ends (or
    stops) first ends the trace there. Traces go to ``directory``, else to the directory of
    the loop's first :class:`Logger` (beside its log and TensorBoard scalars), as runs of
    ``<directory>/plugins/profile/``; :attr:`traces` lists the run directories written.
    Only one ``jax.profiler`` trace runs in a process at a time.

    Args:
        directory: where traces go (created when missing; default: the Logger's directory).
        every: the events that start a trace (default: the 10th step, after compilation).
        steps: how many steps each trace covers (at least 1).
        name: the plugin's name.

    Examples:
        >>> import glob, jax, numpy as np, optax, tempfile, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.plugins import Profile
        >>> mlp = gm.bricks.MLP([2, 4, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(), mlp)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(np.ones((1, 2), np.float32)), jax.random.key(0))
        >>> profile = Profile(tempfile.mkdtemp(), every=gm.On("step", step=gm.at(1)), steps=2)
        >>> _ = gm.Loop(step, [(np.ones((4, 2), np.float32),)] * 4,
        ...             plugins=[profile]).run(state)
        >>> len(profile.traces), len(glob.glob(profile.traces[0] + "/*.xplane.pb"))
        (1, 1)
    """

    def __init__(self, directory: str | os.PathLike | None = None, *,
                 every: Template | str | None = None, steps: int = 5,
                 name: str = "profile") -> None:
        if not is_whole_number(steps, least=1):
            raise ValueError(f"Profile(steps={steps!r}): must be a positive int, the number "
                             "of steps each trace covers, e.g. steps=5")
        self.start = template_or(every, On("step", step=at(10)), "Profile")
        self._last: int | None = None  # the step that ends the trace in progress
        # Receives the starts, and the step that ends a trace (a schedule: planned ahead).
        super().__init__(name=name, every=self.start | On("step", step=_Ends(self)))
        self.steps = int(steps)
        self.directory = None if directory is None else directory_argument(
            directory, "Profile", "directory", "directory", _HOLDS)
        self.traces: list[str] = []
        self._into: str | None = None  # the directory of this run's traces

    def setup(self, loop: LoopLike) -> None:
        if self.directory is not None:
            self._into = self.directory
            return
        loggers = [p for p in getattr(loop, "plugins", ()) if isinstance(p, Logger)]
        if not loggers:
            raise ValueError(f"Profile {self.name!r}: no directory to write traces to; pass "
                             "Profile(directory=...) or add a Logger to the loop (its "
                             "directory is then used)")
        self._into = directory_argument(os.path.dirname(loggers[0].path), "Profile",
                                        "the Logger's directory", "directory", _HOLDS)

    def __call__(self, event: Event) -> None:
        if self._last is not None and event.type == "step" and event.time.step >= self._last:
            self._stop(event.state)
        if self._last is None and self.start.matches(event):
            self._begin(event)

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        if self._last is not None:  # the run ended (or stopped) inside a trace
            self._stop(loop.state)

    def _begin(self, event: Event) -> None:
        assert self._into is not None
        jax.block_until_ready(event.state)  # earlier steps' device work stays out
        try:
            jax.profiler.start_trace(self._into)
        except RuntimeError as error:
            raise RuntimeError(f"Profile {self.name!r}: could not start a trace at step "
                               f"{event.time.step} ({error}); only one jax.profiler trace "
                               "runs at a time: stop the other one first") from None
        self._last = event.time.step + self.steps

    def _stop(self, state: PyTree) -> None:
        assert self._into is not None
        self._last = None
        try:
            if state is not None:
                jax.block_until_ready(state)  # the traced steps' device work is in
        finally:
            jax.profiler.stop_trace()
        written = _newest_run(self._into)
        if written is not None and written not in self.traces:
            self.traces.append(written)


class _Ends(Schedule):
    """The step that ends the trace in progress of ``profile`` (no point while none runs)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def holds(self, points: np.ndarray) -> np.ndarray:
        last = self.profile._last
        return np.zeros(points.shape, bool) if last is None else points == last

    def holds_at(self, point: int) -> bool:
        return point == self.profile._last

    def __repr__(self) -> str:
        return "end_of_trace"


def _newest_run(directory: str) -> str | None:
    """The profile plugin's run under ``directory`` written last (a trace that began in the
    same second as the one before shares its run: the profiler names runs by the second)."""
    traces = glob.glob(os.path.join(glob.escape(directory), "plugins", "profile", "*",
                                    "*.xplane.pb"))
    return os.path.dirname(max(traces, key=os.path.getmtime)) if traces else None
