"""``FreezeLayers``: freezes more layers of a ``managers.LayerFreezing`` on a schedule."""

from __future__ import annotations

import functools

import jax
import numpy as np

from graphmod._core._managers._manager import HParam, Manager
from graphmod._train._events import Event, On, Template
from graphmod._train._loop._models import model_state, with_model_state
from graphmod._train._plugin import Plugin
from graphmod.plugins._anneal import _variables, _with_variables
from graphmod.plugins._common import registered, template_or
from graphmod.typing import JSON, LoopLike, PyTree


class FreezeLayers(Plugin):
    """On each due event, freezes ``layers`` more layers of a layer-freezing manager (from
    the input side), up to all of them, without recompiling the step.

    A due event fires a ``layers_frozen`` event (data: ``frozen``, the number of layers now
    frozen, and ``of``, how many there are), which the plugin's own handler
    (``<name>.freeze``, registered at setup: a plugin never receives what it fires) carries
    out: it writes the manager's dynamic ``frozen`` hyperparameter into the train state
    through ``loop.update_state`` (cast to its float32: no retrace), so ``loop.trace`` has
    a row for each freeze and the steps after it train the layers left. What was frozen when is
    in :attr:`history` and the checkpoints (``state_dict``); a resumed run reads the number
    frozen from its restored state and freezes at the same steps as the uninterrupted one
    (the events are the loop's time's).

    Args:
        freezing: a ``managers.LayerFreezing`` (or its ``hparam("frozen")``).
        every: the events on which to freeze more (default: each ``epoch_end``), e.g.
            ``On("step", step=graphmod.each(100, start=500))``.
        layers: how many more layers each due event freezes.
        name: the plugin's name (keys its state in checkpoints).
        model: in a loop over several models, the one whose program holds the manager.

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm, managers
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import FreezeLayers
        >>> mlp = gm.bricks.MLP([2, 8, 8, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> freezing = managers.LayerFreezing(mlp.linear_layers)
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), mlp,
        ...                      managers=[freezing])
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.adam(0.01))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> freeze = FreezeLayers(freezing, every=gm.On("step", step=gm.each(2)))
        >>> loop = gm.Loop(step, ArraySource((x, y), batch_size=8), steps=5, plugins=[freeze])
        >>> state = loop.run(state)
        >>> freeze.history
        [{'step': 2, 'frozen': 1}, {'step': 4, 'frozen': 2}]
        >>> [(d.step, d.plugin) for d in loop.trace if d.event == "layers_frozen"]
        [(2, 'freeze_layers.freeze'), (4, 'freeze_layers.freeze')]
    """

    fires = ("layers_frozen",)

    def __init__(self, freezing: Manager | HParam, *, every: Template | str | None = None,
                 layers: int = 1, name: str = "freeze_layers", model: str | None = None
                 ) -> None:
        hparam = freezing.hparam("frozen") if isinstance(freezing, Manager) and \
            "frozen" in freezing.hparams else freezing
        if not isinstance(hparam, HParam) or hparam.valid is None:
            raise TypeError(f"FreezeLayers(freezing): expected a managers.LayerFreezing (or "
                            f"its hparam('frozen')), got {freezing!r}")
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"FreezeLayers(layers={layers!r}): must be an int >= 1, the "
                             "layers each due event freezes")
        super().__init__(name=name, every=template_or(every, On("epoch_end"), "FreezeLayers"))
        self.hparam = hparam
        self.layers = layers
        self.limit = int(hparam.valid[1])
        self.model = model
        self.frozen: int | None = None  # read from the state at setup
        self.history: list[dict[str, int]] = []
        self._handler = _Freeze(self)

    def setup(self, loop: LoopLike) -> None:
        own = model_state(loop, loop.state, self.model, "FreezeLayers")
        self.frozen = int(np.asarray(jax.device_get(self.hparam.get(_variables(own,
                                                                               self.name)))))
        if not any(plugin is self._handler for plugin in registered(loop)):
            loop.on(On("layers_frozen", issuer=self), self._handler)  # a plugin never gets
            # the events it fires: its handler does, with a row of its own in loop.trace

    def __call__(self, event: Event) -> None:
        """Fires ``layers_frozen`` with the number of layers to freeze now, unless every
        layer is frozen."""
        if self.frozen is None:
            self.setup(event.loop)  # registered with loop.on(template, plugin)
        assert self.frozen is not None
        if self.frozen < self.limit:
            event.loop.fire("layers_frozen", frozen=min(self.frozen + self.layers, self.limit),
                            of=self.limit)

    def freeze(self, loop: LoopLike, frozen: int, step: int) -> None:
        """Writes ``frozen`` (layers from the input side) into the loop's train state and
        records it (``history``): what the handler of ``layers_frozen`` events does."""
        loop.update_state(functools.partial(self._written, loop, frozen))
        self.frozen = frozen
        self.history.append({"step": step, "frozen": frozen})

    def _written(self, loop: LoopLike, frozen: int, state: PyTree) -> PyTree:
        """The loop's ``state`` with the manager's ``frozen`` hyperparameter set."""
        own = model_state(loop, state, self.model, "FreezeLayers")
        own = _with_variables(own, self.hparam.set(_variables(own, self.name), frozen))
        return with_model_state(loop, state, self.model, own)

    def state_dict(self) -> dict[str, JSON]:
        return {"history": [{**entry} for entry in self.history]}

    def load_state_dict(self, state: dict[str, JSON]) -> None:
        history = state.get("history", [])
        self.history = []
        for entry in history if isinstance(history, list) else [history]:
            step, frozen = (entry.get("step"), entry.get("frozen")) if isinstance(entry, dict) \
                else (None, None)
            if not isinstance(step, int) or not isinstance(frozen, int):
                raise ValueError(f"{self.name}: the checkpoint's history holds {entry!r}, not "
                                 "a {'step': ..., 'frozen': ...} record")
            self.history.append({"step": step, "frozen": frozen})

    def provenance_record(self) -> list[dict[str, int]]:
        """When how many layers froze (:attr:`history`), for the run's record."""
        return self.history


class _Freeze:
    """The handler of a :class:`FreezeLayers`' own ``layers_frozen`` events."""

    def __init__(self, plugin: FreezeLayers) -> None:
        self.plugin = plugin
        self.name = f"{plugin.name}.freeze"

    def __call__(self, event: Event) -> None:
        frozen = event.data["frozen"]
        if not isinstance(frozen, int):  # as FreezeLayers fires it
            raise TypeError(f"{self.name}: a layers_frozen event's frozen is {frozen!r}, not "
                            "a number of layers")
        self.plugin.freeze(event.loop, frozen, event.time.step)
