"""``Plugin``: the base of loop plugins (Pylearn's DispatchPlugin, Composer's callbacks)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeAlias

from graphmod._core._naming import snake_case
from graphmod._train._events import Event, Template
from graphmod.typing import JSON, ArrayLike, LoopLike, PyTree

StepFunction: TypeAlias = Callable[..., tuple[PyTree, Mapping[str, ArrayLike]]]
"""A train step, ``step(state, *batch) -> (state, metrics)``."""


class Plugin:
    """A loop plugin: receives each event at its ``on_<type>`` method when it defines one.

    Beyond a plain callable, a plugin has a stable ``name`` (keys its state in checkpoints),
    a ``priority``, an optional template ``every`` choosing the events it receives (None:
    all of them), set-up and tear-down around the run (``setup``/``teardown``, the latter
    also on error and KeyboardInterrupt; both receive the loop, typed by what a plugin may
    use of it: :class:`graphmod.typing.LoopLike`), step middleware (``wrap_step``) and
    ``state_dict()``/``load_state_dict()`` for exact resume. It changes the train state only
    through ``event.loop.update_state(fn)``. A plugin that fires event types of its own
    declares them in ``fires``: ``Loop.run`` refuses a template for a type nothing fires.

    Examples:
        >>> import graphmod as gm
        >>> class CountSteps(gm.Plugin):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.count = 0
        ...     def on_step(self, event):
        ...         self.count += 1
        ...     def state_dict(self):
        ...         return {"count": self.count}
        >>> CountSteps().name
        'count_steps'
    """

    name: str
    priority: int = 0
    every: Template | None = None
    fires: tuple[str, ...] = ()

    def __init__(self, *, name: str | None = None, priority: int = 0,
                 every: Template | None = None) -> None:
        if every is not None and not isinstance(every, Template):
            raise TypeError(f"{type(self).__name__}(every=...): expected On(...), got {every!r}")
        self.name = name or snake_case(type(self).__name__)
        self.priority = priority
        self.every = every

    def __call__(self, event: Event) -> None:
        handler = getattr(self, f"on_{event.type}", None)
        if handler is not None:
            handler(event)

    def handles(self, event_type: str) -> bool:
        """Whether this plugin reacts to events of ``event_type`` when ``every`` is None:
        it defines ``on_<type>``, or overrides ``__call__`` to see every event."""
        return type(self).__call__ is not Plugin.__call__ or hasattr(self, f"on_{event_type}")

    def setup(self, loop: LoopLike) -> None:
        """Called once before the run's first event."""

    def teardown(self, loop: LoopLike, error: BaseException | None) -> None:
        """Called once after the run, also when it stops on an error or an interrupt."""

    due: Event | None = None
    """An event whose work this plugin put off (set by its handler, e.g. a Checkpoint's
    save): once that event and every event it set off were delivered, the loop calls
    :meth:`settle` with it. None: nothing put off."""

    def settle(self, event: Event) -> None:
        """Does the work put off at :attr:`due` (the loop calls it once ``event`` and every
        event it set off were delivered: a Checkpoint saves then, after a Validation and an
        EarlyStopping recorded that event's results), and clears :attr:`due`. Only plugins
        that override it are asked (default: nothing is ever put off).

        Examples:
            >>> import numpy as np, graphmod as gm
            >>> class Later(gm.Plugin):
            ...     done = []
            ...     def on_step(self, event):
            ...         self.due = event  # put off until what it sets off is delivered
            ...     def settle(self, event):
            ...         self.due = None
            ...         self.done.append(event.time.step)
            >>> _ = gm.Loop(lambda s, x: (s, {}), [np.ones(1)] * 2, plugins=[Later()]).run(0)
            >>> Later.done
            [1, 2]
        """

    def wrap_step(self, step: StepFunction) -> StepFunction:
        """Step middleware: return a function with ``step``'s signature (default: ``step``)."""
        return step

    def state_dict(self) -> dict[str, JSON]:
        """JSON-serialisable state saved in checkpoints (default: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, JSON]) -> None:
        """Restores what :meth:`state_dict` returned."""

    def provenance_record(self) -> list[dict[str, JSON]] | None:
        """What this plugin decided that changed the run, as JSON records (population-based
        training's exploits, a layer freezing's steps, a control's commands), which the
        run's provenance lists under ``derived["decisions"][name]``; default None: it
        decides nothing (a plugin that only observes, or one whose effect its settings
        already say).

        Examples:
            >>> import jax, jax.numpy as jnp, optax, graphmod as gm
            >>> from flax import nnx
            >>> class Halver(gm.Plugin):
            ...     def __init__(self):
            ...         super().__init__(name="halver")
            ...         self.done = []
            ...     def on_step(self, event):
            ...         self.done.append({"step": event.time.step})
            ...     def provenance_record(self):
            ...         return self.done
            >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(),
            ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
            >>> step = gm.optimize(program, optax.sgd(0.1))
            >>> loop = gm.Loop(step, [(jnp.ones((4, 2)),)] * 2, plugins=[Halver()])
            >>> _ = loop.run(step.init(program.init(jnp.ones((4, 2))), jax.random.key(0)))
            >>> [dict(d) for d in loop.provenance.derived["decisions"]["halver"]]
            [{'step': 1}, {'step': 2}]
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
