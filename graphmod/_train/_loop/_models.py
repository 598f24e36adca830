"""Several models in one loop: named train steps on schedules, in a declared order, a step
reading other models' current variables.

``Loop({"disc": d_step, "gen": g_step}, data, schedules={"gen": each(5)},
reads={"gen": ["disc"]})`` runs, at each iteration ``t`` of the loop's step timeline
(counted from 1, as ``step`` events are), the step of every model whose schedule holds at
``t`` (default: every iteration), in the dict's order, each on the same batch. The loop's
state is a dict of states by model name; one model is the plain ``Loop(step, ...)``.

Reads
    ``reads={"gen": ["disc"]}`` passes ``disc``'s current variables (a plain dict, on the
    device: a TrainState's ``variables``) to ``gen``'s step as the keyword ``disc``, after
    the batch: ``g_step(g_state, *batch, disc=d_variables)``. The cost function takes the
    argument (``def cost(model, z, disc)``, ``program.init(z, disc=d_variables)``) and may
    run another program on it (``d_predict.infer(disc, x)``). It is an input of the step,
    never differentiated nor updated there, and new values of the same shapes never
    retrace. The order decides what a reader sees: a model declared before it and due
    at ``t`` has already stepped at ``t``; one declared after it has not.

Frozen models
    A model whose step is None (a teacher that only infers) never steps: its state (its
    variables, or a TrainState) is carried, read by other steps and checkpointed with the
    rest.

Trace
    Each model's step is a row of the loop's dispatch trace (``loop.trace``: event
    ``"train"``, the iteration, the model's name, its position in the declared order, the
    host seconds of the call; ``kind="model"``): which model stepped when, among the plugin
    calls. A loop of one step records none.

Provenance
    ``capture(loop)`` (and each checkpoint) holds every stepping model's own training
    record under its name (``record.models``), with their order, schedules, reads and
    frozen models; ``graphmod.provenance.rebuild_models`` rebuilds them all.

Metrics
    Each model's metrics are named ``model/metric`` (``gen/loss``); ``loop.metrics`` holds
    every model's latest (a model's stay as its last step left them on the iterations it
    does not step).

Sharp edges
    ``steps_per_call`` must stay 1, and programs compiled on a mesh are refused: both are
    for one model for now.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from time import perf_counter
from typing import TypeAlias

import jax

from graphmod import roles as _roles
from graphmod._core._model._layout import Layout
from graphmod._records._collect import (
    models_inputs,
    models_provenance,
    training_inputs,
    training_provenance,
)
from graphmod._records._record import Provenance
from graphmod._train._batch import step_arguments
from graphmod._train._loop._dispatch import Dispatch
from graphmod._train._loop._steps import (
    EpochSource,
    Step,
    StepMetrics,
    check_batch,
    check_start_state,
)
from graphmod._train._optimize import TrainStep
from graphmod._train._schedule import Schedule
from graphmod.typing import JSON, ArrayLike, Batch, LoopLike, PyTree

LoopStep: TypeAlias = Step | Mapping[str, Step | None]
"""What ``Loop(step, ...)`` takes: a train step, or a dict of them by model name (a step
None: a frozen model)."""


class Models:
    """The named steps of a loop over several models (the loop makes it from a dict).

    Calling it runs one iteration: ``models(t, states, batch, metrics, record)`` returns
    the states after the steps due at ``t`` and ``metrics`` updated with theirs; ``record``
    (the loop's ``trace.append``) gets a :class:`Dispatch` row of each step taken.

    Examples:
        >>> import graphmod as gm
        >>> from graphmod._train._loop._models import Models
        >>> count = lambda state, x: (state + 1, {"count": state + 1})
        >>> models = Models({"a": count, "b": count}, schedules={"b": gm.each(2)})
        >>> states, metrics = models(2, {"a": 0, "b": 0}, (1,), {})
        >>> states, sorted(metrics)
        ({'a': 1, 'b': 1}, ['a/count', 'b/count'])
        >>> rows = []
        >>> models(1, states, (1,), {}, rows.append)[0]
        {'a': 2, 'b': 1}
        >>> [(row.event, row.step, row.plugin, row.order) for row in rows]
        [('train', 1, 'a', 0)]
    """

    def __init__(self, steps: Mapping[str, Step | None], *,
                 schedules: Mapping[str, Schedule] | None = None,
                 reads: Mapping[str, Sequence[str] | str] | None = None) -> None:
        if not isinstance(steps, Mapping) or not steps:
            raise ValueError(f"Loop(steps): a loop over several models takes a non-empty "
                             f"dict of steps by model name, got {steps!r}")
        for name, step in steps.items():
            _check_model(name, step)
        names = tuple(steps)
        if all(step is None for step in steps.values()):
            raise ValueError(f"Loop(steps): every model of {list(names)} is frozen (step "
                             "None); give at least one a train step")
        self.steps = dict(steps)
        self.schedules = _schedules(schedules or {}, self.steps)
        self.reads = _reads(reads or {}, self.steps)
        for reader, read in self.reads.items():
            _check_trained_once(reader, read, self.steps)
        # The hot path's plan: (name, step, its schedule's test or None for always, names
        # read, the model's position in the declared order).
        self._plan = tuple((name, step, _holds(self.schedules.get(name)),
                            self.reads.get(name, ()), order)
                           for order, (name, step) in enumerate(self.steps.items())
                           if step is not None)

    @property
    def names(self) -> tuple[str, ...]:
        """The models' names, in their order within an iteration."""
        return tuple(self.steps)

    def __repr__(self) -> str:
        def line(name: str) -> str:
            step = self.steps[name]
            if step is None:
                return f"{name}: frozen"
            when = f" at {self.schedules[name]!r}" if name in self.schedules else ""
            read = f", reads {', '.join(self.reads[name])}" if name in self.reads else ""
            return f"{name}{when}{read}: " + repr(step).replace("\n", "\n    ")
        return "Models:\n  " + "\n  ".join(map(line, self.steps))

    def record(self) -> list[dict[str, JSON]]:
        """What a checkpoint records of these models, in their order (data, never code):
        each one's ``name``, whether it ``steps`` (False: frozen), its ``schedule`` as the
        schedule's description (None: every iteration) and the models it ``reads``.

        Examples:
            >>> import graphmod as gm
            >>> from graphmod._train._loop._models import Models
            >>> count = lambda state, x, a: (state + 1, {})
            >>> models = Models({"a": None, "b": count}, schedules={"b": gm.each(2)},
            ...                 reads={"b": "a"})
            >>> for model in models.record():
            ...     print(model)
            {'name': 'a', 'steps': False, 'schedule': None, 'reads': []}
            {'name': 'b', 'steps': True, 'schedule': 'each(2)', 'reads': ['a']}
        """
        return [{"name": name, "steps": step is not None,
                 "schedule": repr(self.schedules[name]) if name in self.schedules else None,
                 "reads": list(self.reads.get(name, ()))}
                for name, step in self.steps.items()]

    def __call__(self, iteration: int, states: PyTree, batch: Batch,
                 metrics: StepMetrics, record: Callable[[Dispatch], None] | None = None
                 ) -> tuple[dict[str, PyTree], dict[str, ArrayLike]]:
        # The loop's hot path: per model step a few dict operations and, with ``record``,
        # one trace row made without a Python frame (about 1 µs a model step, no sync).
        if type(states) is not dict and not isinstance(states, Mapping):
            raise TypeError(f"Loop: the state of a loop over models is a dict of their states "
                            f"by name, got {type(states).__name__} (from update_state?)")
        args, kwargs = step_arguments(batch)
        states, metrics = dict(states), dict(metrics)
        for name, step, holds, reads, order in self._plan:
            if holds is not None and not holds(iteration):
                continue
            if reads:
                kwargs_in = {**kwargs, **{other: variables_of(states[other]) for other in reads}}
            else:
                kwargs_in = kwargs
            begin = perf_counter()
            states[name], out = step(states[name], *args, **kwargs_in)
            if record is not None:  # the host time of the call (its dispatch): no sync
                record(_row(Dispatch, ("train", iteration, name, order, perf_counter() - begin,
                                       "model")))
            if type(out) is not dict and not isinstance(out, Mapping):
                raise TypeError(f"Loop: model {name!r}'s step returned metrics of type "
                                f"{type(out).__name__}; a step returns (state, metrics) "
                                "with metrics a dict of arrays")
            for key, value in out.items():
                metrics[f"{name}/{key}"] = value
        return states, metrics

    def wrapped(self, wrap: Callable[[Step], Step]) -> Models:
        """These models with each step wrapped by ``wrap`` (plugins' ``wrap_step``)."""
        steps = {name: None if step is None else wrap(step) for name, step in self.steps.items()}
        return Models(steps, schedules=self.schedules, reads=self.reads)

    def check(self, states: PyTree, data: Iterable[Batch], epoch: int, position: int
              ) -> None:
        """Refuses, before anything runs, ``states`` that are no dict of these models' states
        and a first batch (of a resumable source) a model's step cannot take with what it
        reads, naming the model."""
        if not isinstance(states, dict) or set(states) != set(self.steps):
            given = sorted(states) if isinstance(states, dict) else type(states).__name__
            raise ValueError(
                f"Loop.run(state): a loop over the models {list(self.steps)} takes a dict of "
                f"their states by name, got {given}; pass "
                + "{" + ", ".join(f"{name!r}: ..." for name in self.steps) + "}")
        for name, step in self.steps.items():
            check_start_state(step, states[name], f"Loop.run(state[{name!r}])")
        _check_own_buffers(states, self.steps)
        if not isinstance(data, EpochSource):
            return  # a plain iterable is not read ahead (the step's own trace says)
        first = next(iter(data.iter_epoch(epoch, start=position)), None)
        if first is None:
            return
        _, fields = step_arguments(first)
        for name, step, _, reads, _ in self._plan:
            if clash := sorted(set(reads) & set(fields)):
                raise ValueError(f"Loop: model {name!r} reads {clash[0]!r}, which is also a "
                                 "field of the data's dict batches: rename the model or the "
                                 "field (the model's variables are passed by its name)")
            if isinstance(step, TrainStep):
                _check_unread(name, step, reads, self.steps)
                check_batch(step, first, {other: variables_of(states[other]) for other in reads},
                            f"Loop.run: model {name!r}")


_row = tuple.__new__  # a Dispatch made from a tuple in C (its own __new__ is Python)


def _holds(schedule: Schedule | None) -> Callable[[int], bool] | None:
    """The test of a model's schedule, bound once; None: every iteration."""
    return None if schedule is None else schedule.holds_at


def variables_of(state: PyTree) -> PyTree:
    """A model's variables as a read passes them: a TrainState's ``variables``, else the
    state itself (a frozen model's variables)."""
    return getattr(state, "variables", state)


def loop_step(step: LoopStep, schedules: Mapping[str, Schedule] | None,
              reads: Mapping[str, Sequence[str] | str] | None, steps_per_call: int
              ) -> Step | Models:
    """The step a ``Loop`` runs: ``step`` itself, or :class:`Models` for a dict of them."""
    if not isinstance(step, Mapping):
        if schedules or reads:
            raise ValueError("Loop(schedules=..., reads=...): these name models of a loop over "
                             "several steps; pass the steps as a dict by model name, e.g. "
                             "Loop({'disc': d_step, 'gen': g_step}, data, ...)")
        return step
    if steps_per_call != 1:
        raise ValueError(f"Loop(steps_per_call={steps_per_call!r}): a loop over several models "
                         "runs one iteration per dispatch for now; leave steps_per_call=1")
    return Models(step, schedules=schedules, reads=reads)


def run_inputs(loop: LoopLike) -> dict[str, object]:
    """The inputs of a loop's run record: its :func:`graphmod.optimize` step's, or for
    several models each one's (see ``models_inputs``); refuses, naming the model, a step
    that is no ``graphmod.optimize`` step (its model is unknown)."""
    step = loop.step
    if isinstance(step, Models):
        trained: dict[str, TrainStep | None] = {}
        for name, one in step.steps.items():
            if one is not None and not isinstance(one, TrainStep):
                raise TypeError(f"capture(loop): model {name!r}'s step is not a "
                                "graphmod.optimize step, so its model is unknown; capture "
                                "its program instead")
            trained[name] = one
        return models_inputs(step.record(), trained, loop)
    return training_inputs(_train_step(step), loop)


def _train_step(step: object) -> TrainStep:
    """A loop's one step, refused unless a :func:`graphmod.optimize` step's."""
    if not isinstance(step, TrainStep):
        raise TypeError("capture(loop): the loop's step is not a graphmod.optimize step, "
                        "so its model is unknown; capture the program instead")
    return step


def run_provenance(loop: LoopLike, inputs: Mapping[str, object] | None = None) -> Provenance:
    """A loop's run record (``inputs``: a cached :func:`run_inputs`; the derived fields,
    what the run did so far, are made now)."""
    if inputs is None:
        inputs = run_inputs(loop)
    if isinstance(loop.step, Models):
        return models_provenance(inputs, loop)
    return training_provenance(_train_step(loop.step), loop, inputs)


def model_state(loop: LoopLike, state: PyTree, model: str | None, who: str) -> PyTree:
    """The state of ``model`` in a loop's ``state`` (the whole state for a loop of one
    step, where ``model`` is None), refusing a missing or wrong name with the fix."""
    steps = loop.step
    if not isinstance(steps, Models):
        if model is not None:
            raise ValueError(f"{who}(model={model!r}): the loop runs one step, not named "
                             "models; leave model out")
        return state
    if model is None:
        raise ValueError(f"{who}: the loop runs several models ({', '.join(steps.names)}); "
                         f"say which one with {who}(..., model={steps.names[-1]!r})")
    if model not in steps.steps:
        raise ValueError(f"{who}(model={model!r}): the loop has no such model; it has "
                         f"{list(steps.names)}")
    return _by_model(state, who)[model]


def with_model_state(loop: LoopLike, state: PyTree, model: str | None, new: PyTree) -> PyTree:
    """``state`` (a loop's) with ``model``'s state replaced by ``new``."""
    if not isinstance(loop.step, Models):
        return new
    return {**_by_model(state, "update_state"), model: new}


def _by_model(state: PyTree, who: str) -> Mapping[str, PyTree]:
    """The state of a loop over several models: a dict of their states by name."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{who}: the state of a loop over several models is a dict of their "
                        f"states by name, got {type(state).__name__}")
    return state


def _check_model(name: object, step: object) -> None:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"Loop(steps): model name {name!r} must be a non-empty string "
                         "without '/' (metrics are named model/metric)")
    if step is not None and not callable(step):
        raise TypeError(f"Loop(steps): model {name!r}'s step must be callable as "
                        f"step(state, *batch) (or None for a frozen model), got {step!r}")
    if isinstance(step, TrainStep) and step.program.placement is not None:
        raise ValueError(f"Loop(steps): model {name!r}'s program is compiled on a mesh; a "
                         "loop over several models runs on one device for now (compile it "
                         "without mesh=)")


def _check_unread(name: str, step: TrainStep, reads: Sequence[str],
                  steps: Mapping[str, Step | None]) -> None:
    """Refuses a step whose function needs an argument named after a model it does not
    read (the likely slip: a missing ``reads`` entry)."""
    fn = step.program.fn
    try:
        taken = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return
    for other in steps:
        if other != name and other not in reads and other in taken \
                and taken[other].default is inspect.Parameter.empty:
            raise TypeError(
                f"Loop: model {name!r}'s function {getattr(fn, '__name__', 'fn')} takes "
                f"{other!r}, a model of this loop: declare reads={{{name!r}: [{other!r}]}} "
                "to pass it that model's variables")


def _check_trained_once(reader: str, read: Sequence[str], steps: Mapping[str, Step | None]) -> None:
    """Refuses a reader whose own program holds the parameters of a model it reads (the
    slip of compiling the generator's cost over ``nnx.Dict(gen=gen, disc=disc)``): its
    optimizer would train them too, as its cost differentiates them, besides their own
    model's step. Two models of one program (two copies trained apart) hold their own
    values and are not concerned."""
    step = steps[reader]
    if not isinstance(step, TrainStep) or step.trainable is not None:
        return  # trainable= chooses what the reader trains
    layout = step.program.layout
    for other in read:
        theirs = steps[other]
        if not isinstance(theirs, TrainStep) or theirs.program.layout is layout:
            continue
        mine = {id(variable): path for path, variable in _parameters(layout)}
        for path, variable in _parameters(theirs.program.layout):
            if id(variable) in mine:
                raise ValueError(
                    f"Loop(reads={{{reader!r}: [{other!r}]}}): model {reader!r}'s program "
                    f"holds {other!r}'s parameter {path} (as {mine[id(variable)]}), so "
                    f"{reader!r}'s step would train it too; compile {reader!r}'s cost over "
                    f"its own model alone and use {other!r} through the variables it reads "
                    f"(or choose what it trains with optimize(..., trainable=...))")


def _parameters(layout: Layout) -> list[tuple[str, object]]:
    """``(path, nnx.Variable)`` of each PARAMETER of a program's model."""
    return [(info.path, layout.objects[info.identity]) for info in layout.variables
            if info.role.is_a(_roles.PARAMETER)]


def _check_own_buffers(states: Mapping[str, PyTree], steps: Mapping[str, Step | None]) -> None:
    """Refuses two models given one array (``{"a": state, "b": state}``) where one of them
    is a :func:`graphmod.optimize` step's: it donates its state's buffers, which the other
    model's state would then miss (a step of your own that donates nothing may share)."""
    owners: dict[int, str] = {}
    donates = {name: isinstance(step, TrainStep) for name, step in steps.items()}
    for name, state in states.items():
        for leaf in jax.tree.leaves(state):
            if not isinstance(leaf, jax.Array):
                continue
            other = owners.setdefault(id(leaf), name)
            if other != name and (donates[name] or donates[other]):
                raise ValueError(
                    f"Loop.run(state): the states of models {other!r} and {name!r} share "
                    "arrays, and a train step donates its state's buffers (the other "
                    f"model's would be freed under it); give {name!r} a copy: "
                    f"jax.tree.map(jnp.copy, state)")


def _known(name: str, steps: Mapping[str, Step | None], argument: str) -> str:
    if name not in steps:
        raise ValueError(f"Loop({argument}): {name!r} is not a model of this loop; its models "
                         f"are {list(steps)}")
    if steps[name] is None:
        raise ValueError(f"Loop({argument}): model {name!r} is frozen (its step is None): it "
                         "never steps; give it a step, or leave it out of here")
    return name


def _schedules(schedules: Mapping[str, Schedule], steps: Mapping[str, Step | None]
               ) -> dict[str, Schedule]:
    if not isinstance(schedules, Mapping):
        raise TypeError(f"Loop(schedules=...): expected a dict of schedules by model name, "
                        f"e.g. {{'gen': graphmod.each(5)}}, got {schedules!r}")
    for name, schedule in schedules.items():
        _known(name, steps, f"schedules={{{name!r}: ...}}")
        if not isinstance(schedule, Schedule):
            raise TypeError(f"Loop(schedules={{{name!r}: {schedule!r}}}): expected a "
                            "graphmod.Schedule, e.g. graphmod.each(5)")
        if (off := schedule.fractional()) is not None:
            raise ValueError(f"Loop(schedules={{{name!r}: {schedule!r}}}): {off!r} places "
                             "points between the iterations (integers); use integers")
    return dict(schedules)


def _reads(reads: Mapping[str, Sequence[str] | str], steps: Mapping[str, Step | None]
           ) -> dict[str, tuple[str, ...]]:
    if not isinstance(reads, Mapping):
        raise TypeError(f"Loop(reads=...): expected a dict of the models each step reads, "
                        f"e.g. {{'gen': ['disc']}}, got {reads!r}")
    checked = {}
    for reader, read in reads.items():
        argument = f"reads={{{reader!r}: {read!r}}}"
        _known(reader, steps, argument)
        names = (read,) if isinstance(read, str) else tuple(read)
        for name in names:
            if name not in steps:
                raise ValueError(f"Loop({argument}): {name!r} is not a model of this loop; "
                                 f"its models are {list(steps)}")
            if name == reader:
                raise ValueError(f"Loop({argument}): model {reader!r} reads itself; its step "
                                 "has its own variables in its state already")
            if not name.isidentifier():
                raise ValueError(f"Loop({argument}): {name!r} is passed as a keyword "
                                 "argument and must be a Python identifier; rename the model")
        if len(set(names)) != len(names):
            raise ValueError(f"Loop({argument}): a model is named twice")
        if names:
            checked[reader] = names
    return checked
