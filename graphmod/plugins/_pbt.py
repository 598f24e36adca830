"""``PBT``: population-based training (Jaderberg et al., 2017) over a :func:`graphmod.population`
step, and ``PopulationValidation``, the per-member validation it ranks members by.

Exploit and explore
    On each due event (by default each ``validated`` event) the members are ranked by a
    score: a metric of shape ``(N,)`` read from the event's metrics (a
    :class:`PopulationValidation`'s ``"valid/accuracy"``, or a step metric such as
    ``"loss"``) or a function of the train state returning ``N`` scores; ``mode`` says
    whether higher (``"max"``, the default) or lower (``"min"``) is better, and NaN ranks
    last. Each member of the worst ``fraction`` (at least one) *exploits* a member drawn
    from the best ``fraction``: it gets an exact copy of that member's variables and
    optimizer state (one jitted gather on the device; it keeps its own key, so the two
    draw different randomness afterwards), then *explores*: each hyperparameter of the
    copy is multiplied by a factor drawn from ``perturb`` (0.8 or 1.2, as in the paper) and
    clipped to its valid range (a manager's ``hparam_ranges``; a learning rate stays > 0).

Decisions are events and records
    Each decision is fired as an ``exploit`` event (fields ``member``, ``source``,
    ``score``, ``source_score``, ``hparams``) that the plugin handles itself, through a
    handler registered at setup under the name ``<name>.exploit``: that handler applies
    it, so ``loop.trace`` shows a row per decision, and appends it to :attr:`PBT.decisions`
    (``state_dict()["decisions"]``: a JSON list of ``{"step", "member", "source", "score",
    "source_score", "hparams": {name: {"old", "source", "factor", "new"}}}``). Checkpoints
    save that list in their meta record (``graphmod inspect`` shows it under the plugins'
    states) and the run's provenance in ``derived["decisions"][<name>]``
    (:meth:`PBT.provenance_record`); a resumed run restores it. The draws come from
    ``np.random.default_rng([seed, step])``, so a resumed run makes the same decisions as
    the uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TypeAlias

import jax
import numpy as np

from graphmod._core._managers._manager import HParam
from graphmod._core._naming import did_you_mean
from graphmod._core._number_checks import is_real_number
from graphmod._train._engine import Engine, _stacked
from graphmod._train._events import Event, On, Template
from graphmod._train._plugin import Plugin
from graphmod._train._population import Hyperparameter, PopulationStep, label, valid_range
from graphmod._train._train_state import TrainState
from graphmod.plugins._common import event_metrics, is_json_object, registered, template_or
from graphmod.plugins._validation import Validation
from graphmod.typing import JSON, ArrayLike, LoopLike, Metrics, PyTree, Variables

Score: TypeAlias = str | Callable[[TrainState], ArrayLike]
"""A metric name read from the due event's metrics, or ``fn(state) -> (N,) scores``."""


class PBT(Plugin):
    """Population-based training: the worst members copy the best and perturb their
    hyperparameters (the loop guide's "Populations" section gives the rules and records).

    Args:
        score: the metric ranking the members, read from the due event's metrics (shape
            ``(N,)``, e.g. ``"valid/accuracy"`` from a :class:`PopulationValidation`), or a
            function of the train state returning ``N`` scores.
        hparams: the hyperparameters to explore: :class:`graphmod.HParam` handles of
            dynamic manager hyperparameters and names of optimizer hyperparameters made
            dynamic by ``optax.inject_hyperparams`` (``"learning_rate"``).
        mode: ``"max"`` (higher scores are better) or ``"min"`` (lower are).
        fraction: the share of members replaced, and of those copied from, in (0, 0.5].
        every: the events on which members are ranked (default: ``On("validated")``).
        seed: seeds the draws, with the step: ``np.random.default_rng([seed, step])``.
        perturb: the factors a copied hyperparameter is multiplied by, one drawn each time.
        ranges: valid ranges of optimizer hyperparameters by name, beside the known ones
            (``learning_rate``: above 0), e.g. ``{"b1": (0.0, 1.0)}``.
        name: the plugin's name (its handler of ``exploit`` events is ``<name>.exploit``).

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import PBT
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(),
        ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> pop = gm.population(gm.optimize(program, tx), members=4)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> state = pop.init(program.init(x[:1], y[:1]), jax.random.split(jax.random.key(0), 4),
        ...                  hparams={"learning_rate": [0.001, 0.01, 0.1, 0.2]})
        >>> pbt = PBT("loss", ["learning_rate"], mode="min", every=gm.On("step", step=gm.at(2)))
        >>> loop = gm.Loop(pop, ArraySource((x, y), batch_size=8), steps=4, plugins=[pbt])
        >>> state = loop.run(state)
        >>> [(d["member"], d["source"]) for d in pbt.decisions]
        [(0, 3)]
        >>> [d.plugin for d in loop.trace if d.event == "exploit"]
        ['pbt.exploit']
    """

    fires = ("exploit",)

    def __init__(self, score: Score, hparams: Iterable[Hyperparameter], *, mode: str = "max",
                 fraction: float = 0.25, every: Template | str | None = None, seed: int = 0,
                 perturb: Iterable[float] = (0.8, 1.2),
                 ranges: Mapping[str, tuple[float, float]] | None = None,
                 name: str = "pbt") -> None:
        if not (isinstance(score, str) and score) and not callable(score):
            raise TypeError(f"PBT(score={score!r}): expected a metric name or a function of "
                            "the train state returning one score per member")
        hparams = [hparams] if isinstance(hparams, HParam | str) else list(hparams)
        for hparam in hparams:
            if not isinstance(hparam, HParam | str):
                raise TypeError(f"PBT(hparams=...): {hparam!r} is neither a graphmod.HParam "
                                "(manager.hparam(name)) nor an optimizer hyperparameter's "
                                "name (e.g. 'learning_rate')")
        if not hparams:
            raise ValueError("PBT(hparams=[]): name at least one hyperparameter to explore")
        if mode not in ("min", "max"):
            raise ValueError(f"PBT(mode={mode!r}): must be 'max' (higher scores are better) "
                             "or 'min'")
        if not is_real_number(fraction) or not 0 < fraction <= 0.5:
            raise ValueError(f"PBT(fraction={fraction!r}): must be in (0, 0.5], the share of "
                             "members replaced (and of those they copy); the paper's is 0.25")
        factors = [float(f) for f in perturb]
        if not factors or not all(f > 0 and math.isfinite(f) for f in factors):
            raise ValueError(f"PBT(perturb={perturb!r}): expected positive factors, e.g. "
                             "(0.8, 1.2)")
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"PBT(seed={seed!r}): must be an int >= 0")
        super().__init__(name=name, every=template_or(every, On("validated"), "PBT"))
        self.score = score
        self.hparams = hparams
        self.mode = mode
        self.fraction = float(fraction)
        self.seed = int(seed)
        self.perturb = tuple(factors)
        self.ranges = {k: (float(lo), float(hi)) for k, (lo, hi) in (ranges or {}).items()}
        self.decisions: list[dict[str, JSON]] = []
        self._exploit = _Exploit(self)
        self._step: PopulationStep | None = None

    # -- plugin protocol ------------------------------------------------------------------------
    def setup(self, loop: LoopLike) -> None:
        step = loop.step
        if not isinstance(step, PopulationStep):
            raise TypeError(f"{self.name}: the loop's step is a {type(step).__name__}; PBT "
                            "trains a population: Loop(graphmod.population(step, members=N),"
                            " ...)")
        if step.members < 2:
            raise ValueError(f"{self.name}: a population of {step.members} member has no one "
                             "to copy; use at least 2 members")
        state = _train_state(loop.state, self.name)
        for hparam in self.hparams:  # each one found in the state, before the first step
            step.get(state, hparam)
        self._step = step
        if not any(plugin is self._exploit for plugin in registered(loop)):
            loop.on(On("exploit", issuer=self), self._exploit)

    def __call__(self, event: Event) -> None:
        """Ranks the members and fires one ``exploit`` event per decision."""
        for decision in self._decide(event):
            event.loop.fire("exploit", **decision)

    def _decide(self, event: Event) -> list[dict[str, JSON]]:
        """The decisions of ``event``'s step (nothing is changed): who copies whom, and the
        new hyperparameters."""
        step = self._population(event.loop)
        scores = self._scores(event, step.members)
        ranked = np.argsort(np.where(np.isnan(scores), np.inf, -scores if self.mode == "max"
                                     else scores), kind="stable")  # best first, NaN last
        count = max(1, int(step.members * self.fraction))
        best, worst = ranked[:count], sorted(ranked[-count:].tolist())
        state = _train_state(event.state, self.name)
        values = {label(h): np.asarray(v, np.float64) for h, v in zip(
            self.hparams, jax.device_get([step.get(state, h) for h in self.hparams]),
            strict=True)}
        draw = np.random.default_rng([self.seed, event.time.step])
        decisions: list[dict[str, JSON]] = []
        for member in worst:
            source = int(draw.choice(best))
            changes: dict[str, JSON] = {}
            for hparam in self.hparams:
                name, factor = label(hparam), float(draw.choice(self.perturb))
                changes[name] = {"old": float(values[name][member]),
                                 "source": float(values[name][source]), "factor": factor,
                                 "new": self._clipped(hparam, values[name][source] * factor)}
            decisions.append({"step": event.time.step, "member": int(member),
                              "source": source, "score": _number(scores[member]),
                              "source_score": _number(scores[source]), "hparams": changes})
        return decisions

    def _apply(self, loop: LoopLike, decision: Mapping[str, JSON]) -> None:
        """Carries ``decision`` out in the loop's state: its member gets an exact copy of its
        source's variables and optimizer state, then its new hyperparameters."""
        step = self._population(loop)
        member, source, hparams = decision["member"], decision["source"], decision["hparams"]
        if not (isinstance(member, int) and isinstance(source, int)
                and isinstance(hparams, dict)):
            raise TypeError(f"{self.name}: an exploit decision holds a member, a source and "
                            f"hparams as PBT makes them, got {dict(decision)}")
        sources = np.arange(step.members)
        sources[member] = source

        def exploit(state: PyTree) -> PyTree:
            state = step.copy(_train_state(state, self.name), sources)
            for hparam in self.hparams:
                values = step.get(state, hparam)
                change = hparams[label(hparam)]
                new = change["new"] if isinstance(change, dict) else None
                if not isinstance(new, int | float):
                    raise TypeError(f"{self.name}: the exploit decision's {label(hparam)} "
                                    f"holds {change!r}, not its new value")
                state = step.set(state, hparam, values.at[member].set(new))
            return state

        loop.update_state(exploit)

    def state_dict(self) -> dict[str, JSON]:
        return {"decisions": [dict(d) for d in self.decisions]}

    def load_state_dict(self, state: dict[str, JSON]) -> None:
        decisions = state.get("decisions", [])
        if not isinstance(decisions, list) or not all(map(is_json_object, decisions)):
            raise ValueError(f"{self.name}: the checkpoint's decisions are not the list of "
                             "records PBT writes")
        self.decisions = [dict(d) for d in decisions if is_json_object(d)]

    def provenance_record(self) -> list[dict[str, JSON]]:
        """Every exploit/explore decision so far (:attr:`decisions`), for the run's record."""
        return self.decisions

    # -- helpers --------------------------------------------------------------------------------
    def _population(self, loop: LoopLike) -> PopulationStep:
        assert self._step is not None and self._step is loop.step, "set up by the loop"
        return self._step

    def _scores(self, event: Event, members: int) -> np.ndarray:
        """The members' scores on the host (float64), checked to be one per member."""
        if callable(self.score):
            value = self.score(_train_state(event.state, self.name))
            what = f"score function {self.score!r}"
        else:
            metrics = event_metrics(event)
            if self.score not in metrics:
                have = sorted(metrics)
                raise ValueError(
                    f"{self.name}: the {event.type!r} event at step {event.time.step} has no "
                    f"metric {self.score!r}{did_you_mean(self.score, have)}; its metrics are "
                    f"{have}. Rank by one of them, or rank on the events that carry it "
                    "(PBT(..., every=On('validated')) after a PopulationValidation)")
            value, what = metrics[self.score], f"metric {self.score!r}"
        scores = np.asarray(jax.device_get(value), np.float64)
        if scores.shape != (members,):
            raise ValueError(f"{self.name}: {what} has shape {scores.shape}; PBT needs one "
                             f"score per member, shape ({members},)")
        return scores

    def _clipped(self, hparam: Hyperparameter, value: float) -> float:
        """``value`` clipped to the hyperparameter's valid range (``ranges=`` first, then the
        manager's or the known one), as the float32 the state stores; a learning rate > 0."""
        chosen = self.ranges.get(hparam) if isinstance(hparam, str) else None
        low, high = chosen or valid_range(hparam) or (-math.inf, math.inf)
        clipped = np.float32(min(max(value, low), high))
        if hparam == "learning_rate" and clipped <= 0:
            clipped = np.finfo(np.float32).tiny
        return float(clipped)


class _Exploit:
    """The handler of a :class:`PBT`'s own ``exploit`` events: applies and records each."""

    def __init__(self, pbt: PBT) -> None:
        self.pbt = pbt
        self.name = f"{pbt.name}.exploit"

    def __call__(self, event: Event) -> None:
        decision = {key: event.data[key] for key in
                    ("step", "member", "source", "score", "source_score", "hparams")}
        if not is_json_object(decision):  # as PBT fired it: numbers, names, None
            raise TypeError(f"{self.name}: the exploit event's data are no JSON record: "
                            f"{decision}")
        self.pbt._apply(event.loop, decision)
        self.pbt.decisions.append(decision)


class PopulationValidation(Validation):
    """:class:`Validation` of every member of a population: one vmapped inference pass per
    batch, metrics of shape ``(N,)`` (``valid/accuracy[i]`` is member ``i``'s).

    It takes :class:`Validation`'s arguments; the program is one member's (e.g.
    ``program.derive(lambda m, x: m(x))``), and the loop's state a population's stacked
    train state (``graphmod.population``). Its ``validated`` events carry the per-member
    metrics that :class:`PBT` ranks by, a ``Logger`` writes as ``name[i]`` columns and a
    ``LivePlot`` draws one line each.

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import PopulationValidation
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(),
        ...                      gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
        >>> pop = gm.population(gm.optimize(program, optax.sgd(0.1)), members=3)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> state = pop.init(program.init(x[:1], y[:1]), jax.random.split(jax.random.key(0), 3))
        >>> mse = lambda out, batch: ((out - batch[1]) ** 2).mean(-1)
        >>> valid = PopulationValidation(program.derive(lambda m, x: m(x)),
        ...                              ArraySource((x[:10], y[:10]), 4), metrics={"mse": mse})
        >>> state = gm.Loop(pop, ArraySource((x, y), batch_size=8), epochs=1,
        ...                 plugins=[valid]).run(state)
        >>> valid.history[-1][1]["valid/mse"].shape
        (3,)
    """

    def setup(self, loop: LoopLike) -> None:
        if self._engine is None:
            self._engine = self._prepare(_first(self._variables(loop, loop.state)))

    def evaluate(self, variables: Variables) -> Metrics:
        """``{prefix + name: (N,) values}`` over every row of the source, for a population's
        stacked ``variables`` (``state.variables``).

        Examples:
            >>> import jax, numpy as np, optax, graphmod as gm
            >>> from flax import nnx
            >>> from graphmod.data import ArraySource
            >>> from graphmod.plugins import PopulationValidation
            >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
            >>> pop = gm.population(gm.optimize(program.derive(lambda m, x: m(x).mean()),
            ...                                 optax.sgd(0.1)), members=2)
            >>> x, y = np.eye(2, dtype=np.float32), np.array([0, 1])
            >>> state = pop.init(program.init(x), jax.random.split(jax.random.key(0), 2))
            >>> valid = PopulationValidation(program, ArraySource((x, y), 2),
            ...                              metrics=["accuracy"])
            >>> valid.evaluate(state.variables)["valid/accuracy"].shape
            (2,)
        """
        if self._engine is None:
            self._engine = self._prepare(_first(dict(variables)))
        engine = self._engine
        if getattr(self, "_members_engine", None) is not engine:  # one vmapped jit per engine
            self._members_engine = engine
            self._member_sums = jax.jit(jax.vmap(engine._batch_sums, in_axes=(0, None, None)))
        sums = [self._member_sums(variables, batch, mask)[0]
                for batch, mask in self.source.iter_padded()]
        totals = jax.tree.map(lambda x: np.sum(np.asarray(x, np.float64), axis=0),
                              jax.device_get(_stacked(sums)))
        return {self.prefix + m.name: _per_member(engine, m.name, totals) for m in engine.metrics}


def _per_member(engine: Engine, name: str, totals: Mapping[str, PyTree]) -> np.ndarray:
    """Metric ``name``'s result for each member, from sums stacked over the members."""
    metric = next(m for m in engine.metrics if m.name == name)
    members = jax.tree.leaves(totals[name])[0].shape[0]
    return np.asarray([metric.result(jax.tree.map(lambda x, i=i: x[i], totals[name]))
                       for i in range(members)])


def _first(variables: Variables) -> Variables:
    """Member 0's variables (the shapes one member's program is checked with)."""
    return jax.tree.map(lambda leaf: leaf[0], variables)


def _number(value: float | np.ndarray) -> float | None:
    """A score as JSON holds it (NaN as None)."""
    number = float(value)
    return None if math.isnan(number) else number


def _train_state(state: PyTree, who: str) -> TrainState:
    """The loop's state, checked to be a population's train state."""
    if not isinstance(state, TrainState):
        raise TypeError(f"{who}: the loop's state is a {type(state).__name__}, not the "
                        "graphmod.TrainState of a population")
    return state
