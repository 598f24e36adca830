"""Assembling records: a program's, a training run's (step and loop), ``capture``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import numpy as np
from flax import nnx

from graphmod._core._bricks._construction import (
    BRICK_REFS,
    Encoder,
    class_path,
    config_of,
    key_record,
)
from graphmod._core._clock import utc_now
from graphmod._core._codec import filter_fields, plain_filter
from graphmod._core._managers._manager import Manager
from graphmod._core._model._layout import Layout, brick_path_string, walk_nodes
from graphmod._core._selection._per_layer import PerLayer
from graphmod._core._selection._rules import Rule
from graphmod._core._selection._selection import trained_record
from graphmod._records._environment import host, platform_record, versions
from graphmod._records._fingerprint import fingerprint
from graphmod._records._frozen import sha256
from graphmod._records._record import Provenance
from graphmod.typing import JSON, LoopLike

if TYPE_CHECKING:  # the core's classes, named in annotations only
    from jax.sharding import PartitionSpec

    from graphmod._core._program._program_record import ProgramRecord
    from graphmod._core._selection._filter import VariableFilter
    from graphmod._core._selection._selection import Selector
    from graphmod._core._sharding import Placement
    from graphmod._core._tracing._rewrites import Rewrites


# What the records read of the training layer's objects (which this layer cannot import):
# read-only members, so the objects' own attributes satisfy them.
class _Program(Protocol):
    """A compiled program (``graphmod.Program``): its record and rewrite traces."""

    @property
    def record(self) -> ProgramRecord: ...

    @property
    def rewrites(self) -> Rewrites: ...


class _StepProgram(Protocol):
    """A train step's program, as its training record reads it."""

    @property
    def provenance(self) -> Provenance: ...

    @property
    def layout(self) -> Layout: ...


class _OptimizerPlacement(Protocol):
    @property
    def rules(self) -> Sequence[Rule]: ...


class _Step(Protocol):
    """A :func:`graphmod.optimize` step, as a training record reads it."""

    @property
    def program(self) -> _StepProgram: ...

    @property
    def train_seed(self) -> Mapping[str, Any] | None: ...  # a key_record (core: untyped)

    @property
    def optimizer_record(self) -> JSON: ...

    @property
    def skip_nonfinite(self) -> bool: ...

    @property
    def trainable(self) -> tuple[Selector, ...] | None: ...

    @property
    def optimizer_placement(self) -> _OptimizerPlacement: ...


@runtime_checkable
class RunSettings(Protocol):
    """What a run's record reads of a :class:`graphmod.Loop` beyond :class:`LoopLike`: its
    settings and wall-clock times (the loop's own record, ``loop_record``, reads them too)."""

    @property
    def epochs(self) -> int | None: ...

    @property
    def max_steps(self) -> int | None: ...

    @property
    def steps_per_call(self) -> int: ...

    @property
    def plugins(self) -> Sequence[object]: ...  # Plugins and plain callables

    @property
    def started_at(self) -> str | None: ...

    @property
    def ended_at(self) -> str | None: ...


def _run_settings(loop: LoopLike) -> RunSettings:
    """``loop``'s settings and wall-clock times; refuses a loop that is no graphmod.Loop."""
    if not isinstance(loop, RunSettings):
        raise TypeError(f"capture(loop): expected a graphmod.Loop, got {type(loop).__name__} "
                        "(its settings and times are not known)")
    return loop


@runtime_checkable
class Described(Protocol):
    """Data that describe themselves (``ArraySource.describe()``)."""

    def describe(self) -> Mapping[str, object]: ...


@runtime_checkable
class _Deciding(Protocol):
    """A plugin that records what it decided (``Plugin.provenance_record``)."""

    def provenance_record(self) -> Iterable[Mapping[str, object]] | None: ...


def modules(model: nnx.Pytree) -> dict[str, nnx.Pytree]:
    """Path → module (bricks and other NNX modules, not containers), first path each."""
    found = {"/": model}
    seen = {id(model)}
    for key, node in walk_nodes(model, (), frozenset({id(model)})):
        if isinstance(node, nnx.Module) and not isinstance(node, nnx.List | nnx.Dict) \
                and id(node) not in seen:
            seen.add(id(node))
            found[brick_path_string(key)] = node
    return found


def brick_records(model: nnx.Pytree) -> dict[str, dict[str, JSON]]:
    """Per module path: class, and the recorded arguments and defaults of bricks."""
    out: dict[str, dict[str, JSON]] = {}
    for path, node in modules(model).items():
        config = config_of(node) if getattr(node, "__graphmod_brick__", False) else None
        if config is None:
            out[path] = {"class": class_path(type(node)), "recorded": False}
        else:
            out[path] = {"class": config["class"], **{k: v for k, v in config.items()
                                                     if k != "class"}}
    return out


def parameter_records(layout: Layout) -> dict[str, dict[str, JSON]]:
    """Per variable path: shape, dtype, role, variable type and aliases."""
    return {
        info.path: {"shape": list(info.shape), "dtype": info.dtype, "role": info.role.name,
                    "type": type(layout.objects[info.identity]).__name__,
                    "aliases": list(info.aliases)}
        for info in layout.variables
    }


class _InModel(Encoder):
    """Encodes a compiled program's filter: brick instances (any Flax module) by their path
    in the model, classes by :func:`class_path` (a path even without a public one)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(by_path=True)
        self.layout = layout

    def __call__(self, value: object) -> JSON:
        if isinstance(value, type):
            return {"$class": class_path(value)}
        if isinstance(value, nnx.Module):
            return self.brick(value)
        return super().__call__(value)

    def brick(self, brick: object) -> JSON:
        return {"$brick_path": self.layout.brick_path(brick) or "?"}


def filter_record(variable_filter: VariableFilter, layout: Layout) -> dict[str, JSON]:
    """A filter's fields as the codec encodes them (see ``_codec.filter_fields``), in the
    plain form of program records: lists, roles by name, bricks by path."""
    return plain_filter(filter_fields(variable_filter, _InModel(layout)))


def _resolve_bricks(value: JSON, refs: Sequence[object], layout: Layout) -> JSON:
    if isinstance(value, dict):
        index = value.get("$brick_instance")
        if set(value) == {"$brick_instance"} and isinstance(index, int):  # as Encoder writes
            brick = refs[index]
            path = layout.brick_path(brick)
            if path is None:
                return {"$opaque": {"kind": "brick", "type": class_path(type(brick)),
                                    "repr": "a brick outside the compiled model"}}
            return {"$brick_path": path}
        return {k: _resolve_bricks(v, refs, layout) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_bricks(v, refs, layout) for v in value]
    return value


def manager_records(managers: Sequence[Manager], layout: Layout) -> dict[str, JSON]:
    """Per manager name, in chain order: class, order, priority, configuration, filter."""
    out: dict[str, JSON] = {}
    for order, manager in enumerate(managers):
        config = config_of(manager) or {"class": class_path(type(manager)), "recorded": False}
        refs = vars(manager).get(BRICK_REFS, ())
        out[manager.name] = {
            "class": config.pop("class"),
            "order": order,
            "priority": manager.priority,
            "strict": manager.strict,
            **{k: _resolve_bricks(v, refs, layout) for k, v in config.items()},
            "filter": filter_record(manager.filter, layout),
        }
    return out


def function_record(fn: Callable[..., object]) -> dict[str, JSON]:
    """The compiled function's module, name and a hash of its source (None if unknown)."""
    target = getattr(fn, "func", fn)  # functools.partial
    try:
        source = inspect.getsource(target)
        digest = sha256(source)
    except (OSError, TypeError):
        digest = None
    return {"module": getattr(target, "__module__", None),
            "name": getattr(target, "__qualname__", type(target).__qualname__),
            "source_sha256": digest}


def _tree(value: object) -> JSON:
    if isinstance(value, Mapping):
        return {str(k): _tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return [_tree(v) for v in value]
    leaves = jax.tree.leaves(value)
    if len(leaves) == 1 and leaves[0] is value:
        typed = value if isinstance(value, jax.ShapeDtypeStruct | jax.Array | np.ndarray
                                    | np.generic) else np.asarray(value)  # a Python number
        return {"shape": list(typed.shape), "dtype": str(typed.dtype)}
    return [_tree(leaf) for leaf in leaves]


def examples_record(record: ProgramRecord) -> dict[str, object] | None:
    """The shapes and dtypes of ``init``'s example arguments, by argument name."""
    if record.examples is None:
        return None
    return {"positional": record.positional,
            "arguments": {k: _tree(v) for k, v in record.examples.items()}}


def _rewrites(program: _Program) -> list[JSON]:
    return [{"manager": r.manager, "path": r.path, "application": r.application,
             "call_id": r.call_id, "role": r.role, "variable": r.name,
             "shape_in": list(r.shape_in), "dtype_in": r.dtype_in,
             "shape_out": list(r.shape_out), "dtype_out": r.dtype_out}
            for r in program.rewrites.train]


def program_provenance(program: _Program) -> Provenance:
    """The record of a program: bricks, parameters, managers, function, examples, seeds,
    environment; fingerprint and rewrite trace (computed from ``init``'s examples)."""
    record = program.record
    layout = record.layout
    derived: dict[str, JSON] = {"fingerprint": None}
    jaxpr = None
    try:
        jaxpr = record.training_jaxpr()
    except Exception as error:  # a record must not fail because one derived field did
        derived["fingerprint_error"] = f"{type(error).__name__}: {error}"
    if jaxpr is not None:
        derived["fingerprint"] = fingerprint(jaxpr)
    derived["rewrites"] = _rewrites(program) if jaxpr is not None else []
    derived["created"] = record.created
    derived["host"] = host()
    inputs: dict[str, object] = {
        "bricks": brick_records(layout.model),
        "parameters": parameter_records(layout),
        "managers": manager_records(record.managers, layout),
        "function": function_record(record.fn),
        "monitor": {label: filter_record(f, layout) for label, f in record.monitor.items()},
        "axis_name": None if record.axis_name is None else str(record.axis_name),
        "example_shapes": examples_record(record),
        "seeds": {"init": record.init_key},
        # Fitted on the training data: kinds, numbers, metadata, the source's description.
        "transforms": None if record.transforms is None else record.transforms.record(),
        "versions": versions(),
        "platform": platform_record(),
    }
    if record.placement is not None:  # where it ran; the results are one device's
        inputs["placement"] = placement_record(record.placement, layout)
    return Provenance("program", inputs, derived)


def placement_record(placement: Placement, layout: Layout) -> dict[str, object]:
    """A mesh placement as plain data: the mesh's axes and sizes, the rules (filters as
    program records write them, specs as lists) and the batch axis."""
    return {"mesh": {str(axis): int(size) for axis, size in placement.mesh.shape.items()},
            "rules": rules_record(placement.rules, layout),
            "batch_axis": _axes([placement.batch_axis])[0]}


def rules_record(rules: Iterable[Rule], layout: Layout) -> list[object]:
    """Placement rules as plain data: each filter as program records write it, each spec
    as a list (a tuple of axes as a list; one layer's, ``per_layer``, as
    ``{"per_layer": [...]}``)."""
    return [[filter_record(f, layout), _spec(s)] for f, s in rules]


def _spec(spec: PartitionSpec | PerLayer) -> object:
    if isinstance(spec, PerLayer):  # one layer's spec (graphmod.sharding.per_layer)
        return {"per_layer": _spec(spec.spec)}
    return _axes(spec)


def _axes(entries: Iterable[object]) -> list[object]:
    """A spec's entries: a tuple of axes as a list."""
    return [list(e) if isinstance(e, tuple) else e for e in entries]


def data_record(data: object, *, metadata: bool = False) -> dict[str, object]:
    """A data source's own description (name, size, shapes, dtypes, content hash), or its
    type when it cannot describe itself; with ``metadata`` (a run's training data) also
    the JSON of its metadata when it has one (``ArraySource.metadata``)."""
    if not (isinstance(data, Described) and callable(data.describe)):
        return {"name": class_path(type(data)), "described": False}
    described = dict(data.describe())
    if metadata and "metadata" not in described:
        try:
            found = getattr(data, "metadata", None)
        except (TypeError, ValueError):  # fields metadata cannot hold (nested dicts): none
            found = None
        if found is not None:
            described["metadata"] = found.to_dict()
    return described


_NO_STATE = object()


def training_inputs(step: _Step, loop: LoopLike | None = None, *, state: object = _NO_STATE
                    ) -> dict[str, object]:
    """The inputs of a training run: the program's, optimizer, data, loop settings, seeds
    (the train seed read from ``state``, by default the loop's state)."""
    base = step.program.provenance.inputs
    seeds = dict(base["seeds"])
    if state is _NO_STATE:
        state = None if loop is None else loop.state
    # The train state keeps the base key's data for the whole run (resumed runs too); the
    # step knows its implementation when it made the first state in this process.
    from_state = key_record(getattr(state, "rng", None))
    known = step.train_seed
    seeds["train"] = known if from_state is None or (
        known is not None and known["data"] == from_state["data"]) else from_state  # lists
    inputs = {k: v for k, v in base.items() if k not in ("seeds", "versions", "platform")}
    inputs["optimizer"] = step.optimizer_record
    inputs["skip_nonfinite"] = step.skip_nonfinite
    inputs["trainable"] = trained_record(step.program.layout, step.trainable)
    if step.optimizer_placement.rules:  # where the optimizer's moments were, not what
        inputs["placement"] = {**base["placement"], "optimizer_rules": rules_record(
            step.optimizer_placement.rules, step.program.layout)}
    if loop is not None:
        inputs.update(_loop_inputs(loop))
    inputs["seeds"] = seeds
    inputs["versions"] = base["versions"]
    inputs["platform"] = base["platform"]
    return inputs


def _loop_inputs(loop: LoopLike) -> dict[str, object]:
    """A run's data and loop settings, and the changes its resumes made."""
    settings = _run_settings(loop)
    inputs: dict[str, object] = {"data": data_record(loop.data, metadata=True),
              "loop": {"epochs": settings.epochs, "steps": settings.max_steps,
                       "steps_per_call": settings.steps_per_call,
                       "plugins": [{"name": getattr(p, "name", None),
                                    "class": class_path(type(p))} for p in settings.plugins]}}
    if changes := getattr(loop, "data_changes", None):  # resumed on other data, as allowed
        inputs["data_changes"] = list(changes)
    if changes := getattr(loop, "setting_changes", None):  # resumed with other settings
        inputs["setting_changes"] = list(changes)
    return inputs


def _loop_derived(loop: LoopLike) -> dict[str, object]:
    """What a run did so far: counts and times, and what its plugins decided."""
    time, settings = loop.time, _run_settings(loop)
    derived: dict[str, object] = {
               "steps": time.step, "examples": time.examples, "epochs": time.epoch,
               "seconds": round(time.seconds, 6), "train_seconds": round(time.train_seconds, 6),
               # Wall-clock times the loop noted as they happened.
               "started": settings.started_at or utc_now(),
               "ended": settings.ended_at or utc_now()}
    if decided := run_decisions(loop):
        derived["decisions"] = decided
    return derived


def run_decisions(loop: LoopLike) -> dict[str, list[dict[str, object]]]:
    """Each plugin's :meth:`graphmod.Plugin.provenance_record` that is not None, by plugin
    name (a plain callable plugin records nothing)."""
    found: dict[str, list[dict[str, object]]] = {}
    for plugin in _run_settings(loop).plugins:
        records = plugin.provenance_record() if isinstance(plugin, _Deciding) \
            and callable(plugin.provenance_record) else None
        if records is not None:
            found[getattr(plugin, "name", type(plugin).__name__)] = [dict(r) for r in records]
    return found


def training_derived(step: _Step, loop: LoopLike | None = None) -> dict[str, object]:
    """The derived fields of a training run: the program's, counts and times."""
    derived = dict(step.program.provenance.derived)
    if loop is not None:
        derived.update(_loop_derived(loop))
    return derived


def training_provenance(step: _Step, loop: LoopLike | None = None,
                        inputs: Mapping[str, object] | None = None) -> Provenance:
    """The record of a training run (``inputs`` may be a cached :func:`training_inputs`)."""
    return Provenance("training", inputs if inputs is not None else training_inputs(step, loop),
                      training_derived(step, loop))


def models_inputs(models: Sequence[Mapping[str, JSON]], steps: Mapping[str, _Step | None],
                  loop: LoopLike) -> dict[str, object]:
    """The inputs of a run of several models: each stepping model's own training record
    (program, managers, optimizer, train seed from its state) under its name, None for a
    frozen one; the models' ``order``, ``schedules`` (descriptions, None: every
    iteration), ``reads`` and ``frozen`` names; the data and loop settings; versions.

    ``models`` is what a checkpoint records of them (``Models.record()``), ``steps`` their
    ``graphmod.optimize`` steps by name (None: frozen)."""
    states = loop.state if isinstance(loop.state, Mapping) else {}
    named = [(str(model["name"]), model) for model in models]
    stepping = [(name, model) for name, model in named if model["steps"]]

    def record(name: str) -> dict[str, JSON]:  # the model's own, its seed from its state
        step = steps[name]
        assert step is not None  # a model that steps has its step
        return training_provenance(step, inputs=training_inputs(step, state=states.get(name))
                                   ).to_dict()

    return {
        "models": {name: record(name) if model["steps"] else None for name, model in named},
        "order": [name for name, _ in named],
        "schedules": {name: model["schedule"] for name, model in stepping},
        "reads": {name: list(reads) for name, model in stepping
                  if (reads := model["reads"]) and isinstance(reads, list | tuple)},
        "frozen": [name for name, model in named if not model["steps"]],
        **_loop_inputs(loop),
        "versions": versions(),
        "platform": platform_record(),
    }


def models_provenance(inputs: Mapping[str, object], loop: LoopLike) -> Provenance:
    """The record of a run of several models from its :func:`models_inputs`: what the loop
    did so far among the derived fields (each model's fingerprint is in its own record)."""
    return Provenance("training", inputs, _loop_derived(loop))


def capture(obj: object) -> Provenance:
    """The provenance of a program, a train step, a loop or an evaluation.

    A program's record holds its bricks, parameters, managers, function, example shapes,
    seeds and environment, with the graph fingerprint and rewrite trace; a train step's
    adds the optimizer and the train seed; a loop's (whose step is a
    :func:`graphmod.optimize` step) adds the data, the loop's settings and what happened:
    steps, examples, epochs, times. A loop of several models records each model's own
    training record under its name (``record.models``), with their order, schedules, reads
    and frozen models, the data and the loop's settings.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: (m(x) ** 2).mean(), lin)
        >>> _ = program.init(jnp.ones((4, 2)))
        >>> prov = gm.provenance.capture(program)
        >>> prov.kind, prov["bricks"]["/"]["class"], prov.fingerprint[:7]
        ('program', 'graphmod.bricks.Linear', 'sha256:')
    """
    provenance = obj if isinstance(obj, Provenance) else getattr(obj, "provenance", None)
    if isinstance(provenance, Provenance):
        return provenance
    raise TypeError(f"capture: expected a Program, a train step, a Loop or an Evaluation, got "
                    f"{type(obj).__name__}")
