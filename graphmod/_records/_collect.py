"""Assembling records: a program's, a training run's (step and loop), ``capture``."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

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
from graphmod._core._model._layout import Layout, brick_path_string, walk_nodes
from graphmod._core._selection._rules import PerLayer
from graphmod._core._selection._selection import trained_record
from graphmod._records._environment import host, platform_record, versions
from graphmod._records._fingerprint import fingerprint
from graphmod._records._frozen import sha256
from graphmod._records._record import Provenance


def modules(model: Any) -> dict[str, Any]:
    """Path → module (bricks and other NNX modules, not containers), first path each."""
    found = {"/": model}
    seen = {id(model)}
    for key, node in walk_nodes(model, (), frozenset({id(model)})):
        if isinstance(node, nnx.Module) and not isinstance(node, nnx.List | nnx.Dict) \
                and id(node) not in seen:
            seen.add(id(node))
            found[brick_path_string(key)] = node
    return found


def brick_records(model: Any) -> dict[str, Any]:
    """Per module path: class, and the recorded arguments and defaults of bricks."""
    out: dict[str, Any] = {}
    for path, node in modules(model).items():
        config = config_of(node) if getattr(node, "__graphmod_brick__", False) else None
        if config is None:
            out[path] = {"class": class_path(type(node)), "recorded": False}
        else:
            out[path] = {"class": config["class"], **{k: v for k, v in config.items()
                                                     if k != "class"}}
    return out


def parameter_records(layout: Layout) -> dict[str, Any]:
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

    def __call__(self, value: Any) -> Any:
        if isinstance(value, type):
            return {"$class": class_path(value)}
        if isinstance(value, nnx.Module):
            return self.brick(value)
        return super().__call__(value)

    def brick(self, brick: Any) -> Any:
        return {"$brick_path": self.layout.brick_path(brick) or "?"}


def filter_record(variable_filter: Any, layout: Layout) -> dict[str, Any]:
    """A filter's fields as the codec encodes them (see ``_codec.filter_fields``), in the
    plain form of program records: lists, roles by name, bricks by path."""
    return plain_filter(filter_fields(variable_filter, _InModel(layout)))


def _resolve_bricks(value: Any, refs: tuple[Any, ...], layout: Layout) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$brick_instance"}:
            brick = refs[value["$brick_instance"]]
            path = layout.brick_path(brick)
            if path is None:
                return {"$opaque": {"kind": "brick", "type": class_path(type(brick)),
                                    "repr": "a brick outside the compiled model"}}
            return {"$brick_path": path}
        return {k: _resolve_bricks(v, refs, layout) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_bricks(v, refs, layout) for v in value]
    return value


def manager_records(managers: tuple[Any, ...], layout: Layout) -> dict[str, Any]:
    """Per manager name, in chain order: class, order, priority, configuration, filter."""
    out: dict[str, Any] = {}
    for order, manager in enumerate(managers):
        config = config_of(manager) or {"class": class_path(type(manager)), "recorded": False}
        refs = vars(manager).get(BRICK_REFS, ())
        out[manager.name] = {
            "class": config.pop("class"),
            "order": order,
            "priority": manager.priority,
            "strict": manager.strict,
            **_resolve_bricks(config, refs, layout),
            "filter": filter_record(manager.filter, layout),
        }
    return out


def function_record(fn: Any) -> dict[str, Any]:
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


def _tree(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return [_tree(v) for v in value]
    leaves = jax.tree.leaves(value)
    if len(leaves) == 1 and leaves[0] is value:
        return {"shape": list(np.shape(value)), "dtype": str(value.dtype)}
    return [_tree(leaf) for leaf in leaves]


def examples_record(record: Any) -> dict[str, Any] | None:
    """The shapes and dtypes of ``init``'s example arguments, by argument name."""
    if record.examples is None:
        return None
    return {"positional": record.positional,
            "arguments": {k: _tree(v) for k, v in record.examples.items()}}


def _rewrites(program: Any) -> list[dict[str, Any]]:
    return [{"manager": r.manager, "path": r.path, "application": r.application,
             "call_id": r.call_id, "role": r.role, "variable": r.name,
             "shape_in": list(r.shape_in), "dtype_in": r.dtype_in,
             "shape_out": list(r.shape_out), "dtype_out": r.dtype_out}
            for r in program.rewrites.train]


def program_provenance(program: Any) -> Provenance:
    """The record of a program: bricks, parameters, managers, function, examples, seeds,
    environment; fingerprint and rewrite trace (computed from ``init``'s examples)."""
    record = program.record
    layout = record.layout
    derived: dict[str, Any] = {"fingerprint": None}
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
    inputs = {
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


def placement_record(placement: Any, layout: Layout) -> dict[str, Any]:
    """A mesh placement as plain data: the mesh's axes and sizes, the rules (filters as
    program records write them, specs as lists) and the batch axis."""
    return {"mesh": {str(axis): int(size) for axis, size in placement.mesh.shape.items()},
            "rules": rules_record(placement.rules, layout),
            "batch_axis": _spec([placement.batch_axis])[0]}


def rules_record(rules: Any, layout: Layout) -> list[list[Any]]:
    """Placement rules as plain data: each filter as program records write it, each spec
    as a list (a tuple of axes as a list; one layer's, ``per_layer``, as
    ``{"per_layer": [...]}``)."""
    return [[filter_record(f, layout), _spec(s)] for f, s in rules]


def _spec(spec: Any) -> list[Any] | dict[str, list[Any]]:
    if isinstance(spec, PerLayer):  # one layer's spec (graphmod.sharding.per_layer)
        return {"per_layer": _spec(spec.spec)}
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def data_record(data: Any, *, metadata: bool = False) -> dict[str, Any]:
    """A data source's own description (name, size, shapes, dtypes, content hash), or its
    type when it cannot describe itself; with ``metadata`` (a run's training data) also
    the JSON of its metadata when it has one (``ArraySource.metadata``)."""
    describe = getattr(data, "describe", None)
    if not callable(describe):
        return {"name": class_path(type(data)), "described": False}
    described = dict(describe())
    if metadata and "metadata" not in described:
        try:
            found = getattr(data, "metadata", None)
        except (TypeError, ValueError):  # fields metadata cannot hold (nested dicts): none
            found = None
        if found is not None:
            described["metadata"] = found.to_dict()
    return described


_NO_STATE = object()


def training_inputs(step: Any, loop: Any = None, *, state: Any = _NO_STATE) -> dict[str, Any]:
    """The inputs of a training run: the program's, optimizer, data, loop settings, seeds
    (the train seed read from ``state``, by default the loop's state)."""
    base = step.program.provenance.inputs
    seeds = dict(base["seeds"])
    if state is _NO_STATE:
        state = getattr(loop, "state", None)
    # The train state keeps the base key's data for the whole run (resumed runs too); the
    # step knows its implementation when it made the first state in this process.
    from_state = key_record(getattr(state, "rng", None))
    known = step.train_seed
    seeds["train"] = known if from_state is None or (
        known is not None and list(known["data"]) == list(from_state["data"])) else from_state
    inputs = {k: v for k, v in base.items() if k not in ("seeds", "versions", "platform")}
    inputs["optimizer"] = step.optimizer_record
    inputs["skip_nonfinite"] = step.skip_nonfinite
    inputs["trainable"] = trained_record(step.program.layout, step.trainable)
    if step.optimizer_placement.rules:  # where the optimizer's moments were, not what
        inputs["placement"] = {**inputs["placement"], "optimizer_rules": rules_record(
            step.optimizer_placement.rules, step.program.layout)}
    if loop is not None:
        inputs.update(_loop_inputs(loop))
    inputs["seeds"] = seeds
    inputs["versions"] = base["versions"]
    inputs["platform"] = base["platform"]
    return inputs


def _loop_inputs(loop: Any) -> dict[str, Any]:
    """A run's data and loop settings, and the changes its resumes made."""
    inputs = {"data": data_record(loop.data, metadata=True),
              "loop": {"epochs": loop.epochs, "steps": loop.max_steps,
                       "steps_per_call": loop.steps_per_call,
                       "plugins": [{"name": getattr(p, "name", None),
                                    "class": class_path(type(p))} for p in loop.plugins]}}
    if getattr(loop, "data_changes", None):  # resumed on other data, as its caller allowed
        inputs["data_changes"] = list(loop.data_changes)
    if getattr(loop, "setting_changes", None):  # resumed with other settings
        inputs["setting_changes"] = list(loop.setting_changes)
    return inputs


def _loop_derived(loop: Any) -> dict[str, Any]:
    """What a run did so far: counts and times, and what its plugins decided."""
    time = loop.time
    derived = {"steps": time.step, "examples": time.examples, "epochs": time.epoch,
               "seconds": round(time.seconds, 6), "train_seconds": round(time.train_seconds, 6),
               # Wall-clock times the loop noted as they happened.
               "started": loop.started_at or utc_now(), "ended": loop.ended_at or utc_now()}
    if decided := run_decisions(loop):
        derived["decisions"] = decided
    return derived


def run_decisions(loop: Any) -> dict[str, list[dict[str, Any]]]:
    """Each plugin's :meth:`graphmod.Plugin.provenance_record` that is not None, by plugin
    name (a plain callable plugin records nothing)."""
    found = {}
    for plugin in loop.plugins:
        decide = getattr(plugin, "provenance_record", None)
        records = decide() if callable(decide) else None
        if records is not None:
            found[getattr(plugin, "name", type(plugin).__name__)] = [dict(r) for r in records]
    return found


def training_derived(step: Any, loop: Any = None) -> dict[str, Any]:
    """The derived fields of a training run: the program's, counts and times."""
    derived = dict(step.program.provenance.derived)
    if loop is not None:
        derived.update(_loop_derived(loop))
    return derived


def training_provenance(step: Any, loop: Any = None,
                        inputs: Mapping[str, Any] | None = None) -> Provenance:
    """The record of a training run (``inputs`` may be a cached :func:`training_inputs`)."""
    return Provenance("training", inputs if inputs is not None else training_inputs(step, loop),
                      training_derived(step, loop))


def models_inputs(models: Sequence[Mapping[str, Any]], steps: Mapping[str, Any],
                  loop: Any) -> dict[str, Any]:
    """The inputs of a run of several models: each stepping model's own training record
    (program, managers, optimizer, train seed from its state) under its name, None for a
    frozen one; the models' ``order``, ``schedules`` (descriptions, None: every
    iteration), ``reads`` and ``frozen`` names; the data and loop settings; versions.

    ``models`` is what a checkpoint records of them (``Models.record()``), ``steps`` their
    ``graphmod.optimize`` steps by name (None: frozen)."""
    states = loop.state if isinstance(loop.state, Mapping) else {}
    stepping = [model for model in models if model["steps"]]

    def record(name: str) -> dict[str, Any]:  # the model's own, its seed from its state
        step = steps[name]
        return training_provenance(step, inputs=training_inputs(step, state=states.get(name))
                                   ).to_dict()

    return {
        "models": {model["name"]: record(model["name"]) if model["steps"] else None
                   for model in models},
        "order": [model["name"] for model in models],
        "schedules": {model["name"]: model["schedule"] for model in stepping},
        "reads": {model["name"]: list(model["reads"]) for model in stepping if model["reads"]},
        "frozen": [model["name"] for model in models if not model["steps"]],
        **_loop_inputs(loop),
        "versions": versions(),
        "platform": platform_record(),
    }


def models_provenance(inputs: Mapping[str, Any], loop: Any) -> Provenance:
    """The record of a run of several models from its :func:`models_inputs`: what the loop
    did so far among the derived fields (each model's fingerprint is in its own record)."""
    return Provenance("training", inputs, _loop_derived(loop))


def capture(obj: Any) -> Provenance:
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
