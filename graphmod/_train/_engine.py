"""The evaluation engine of :func:`graphmod.evaluate` and the ``Validation`` plugin.

One jitted function runs the program in inference mode on a batch and returns each
metric's sums (``Metric.statistics``, the one metric protocol), and the predictions when
they are kept. Nothing waits on the device per batch: the host fetches every batch's sums
once, at the end, adds them in float64 and calls ``Metric.result``. Engines are reused per
program, binding, targets and metrics (:func:`engine_for`), so evaluating again does not
retrace. Before the first batch runs, :func:`prepare` binds the batch's fields to the
program's arguments (``graphmod._train._batch``), finds the targets, and checks the
shapes of predictions and targets against the metrics, naming the culprit.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from graphmod._core._program._program_core import ProgramCore
from graphmod._core._sharding import mesh_context, on_mesh
from graphmod._train._batch import (
    Binding,
    Field,
    bind,
    bind_fields,
    fields_of,
    pick,
    target_field,
)
from graphmod.metrics import Metric, get
from graphmod.typing import Metrics, PyTree, Variables

Mask: TypeAlias = np.ndarray | jax.Array
"""Which rows of a padded batch are real examples (bool, one per row)."""

Sums: TypeAlias = dict[str, dict[str, jax.Array]]
"""One batch's sums of each metric, by metric name (``Metric.statistics``)."""


@runtime_checkable
class PaddedSource(Protocol):
    """Evaluation data whose short final batch is padded and masked, so that every example
    counts once: a :class:`graphmod.data.ArraySource`, a Grain pipeline's source.

    Examples:
        >>> import numpy as np
        >>> from graphmod.data import ArraySource
        >>> from graphmod._train._engine import PaddedSource
        >>> isinstance(ArraySource((np.ones((3, 2)),), 2), PaddedSource)
        True
    """

    def iter_padded(self) -> Iterable[tuple[object, Mask]]:
        """Every ``(batch, mask)`` of one pass, the final batch padded to full size."""
        ...

_KEPT = 8  # engines kept per program: metrics of fresh unhashable settings never match


@dataclasses.dataclass(frozen=True)
class Totals:
    """What an engine's run found: metric results, kept predictions, counts."""

    values: Metrics
    predictions: np.ndarray | None
    examples: int
    batches: int


class Engine:
    """Per-batch metric sums of ``program`` on the device, reduced on the host at the end.

    Holds its program weakly, so the cache of engines (:func:`engine_for`) keeps no
    program alive.

    Examples:
        >>> import numpy as np, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod._train._batch import Binding
        >>> from graphmod._train._engine import Engine
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0)))
        >>> variables = program.init(np.ones((1, 2), np.float32))
        >>> x, y = np.eye(2, dtype=np.float32), np.array([0, 1])
        >>> engine = Engine(program, Binding((0,)), 1, [gm.metrics.Accuracy()])
        >>> engine.run(variables, [((x, y), np.array([True, True]))]).examples
        2
    """

    def __init__(self, program: ProgramCore, binding: Binding, target: Field,
                 metrics: Sequence[Metric], keep: bool = False) -> None:
        self._program = weakref.ref(program)
        self.binding, self.target, self.keep = binding, target, keep
        self.metrics = tuple(metrics)
        self._sums = jax.jit(on_mesh(self._batch_sums, program.placement))

    def _live(self) -> ProgramCore:
        """The program, which the engine holds weakly (its caller holds it)."""
        program = self._program()
        if program is None:
            raise ReferenceError("this evaluation engine's program no longer exists; make "
                                 "the engine again with engine_for(program, ...)")
        return program

    def outputs(self, variables: Variables, batch: object) -> Any:
        """The program's predictions for ``batch`` (monitored values left out): what the
        user's function returns."""
        program = self._live()
        args, kwargs = self.binding.arguments(batch)
        out = program.infer(variables, *args, **kwargs)
        return out[0] if program.record.monitor else out  # traced once per engine

    def _batch_sums(self, variables: Variables, batch: object, mask: jax.Array
                    ) -> tuple[Sums, PyTree]:
        outputs = self.outputs(variables, batch)
        weights = mask.astype(jnp.float32)
        targets = None if self.target is None else pick(batch, self.target)
        sums = {m.name: m.statistics(outputs, batch if m.takes_batch else targets, weights)
                for m in self.metrics}
        return sums, outputs if self.keep else None

    def run(self, variables: Variables, batches: Iterable[tuple[object, Mask]]) -> Totals:
        """Every ``(batch, mask)`` once; one wait on the device, at the end."""
        with mesh_context(self._live().placement):
            return self._run(variables, batches)

    def _run(self, variables: Variables, batches: Iterable[tuple[object, Mask]]) -> Totals:
        sums: list[Sums] = []
        kept: list[tuple[PyTree, Mask]] = []
        examples = 0
        for batch, mask in batches:
            batch_sums, outputs = self._sums(variables, batch, mask)
            sums.append(batch_sums)
            if self.keep:
                kept.append((outputs, mask))
            examples += int(np.sum(mask))
        host_sums, host_kept = jax.device_get((_stacked(sums), [o for o, _ in kept]))
        totals = {} if not sums else jax.tree.map(
            lambda x: np.sum(np.asarray(x, np.float64), axis=0), host_sums)
        values = {m.name: m.result(totals[m.name]) for m in self.metrics}
        predictions = np.concatenate([out[np.asarray(mask, bool)] for out, (_, mask)
                                      in zip(host_kept, kept, strict=True)]) if kept else None
        return Totals(values, predictions, examples, len(sums))


def metric_list(metrics: object, who: str) -> list[Metric]:
    """Metric names or :class:`~graphmod.metrics.Metric` objects as metrics, names distinct.

    Examples:
        >>> from graphmod._train._engine import metric_list
        >>> metric_list(["accuracy", "macro_f1"], "demo")
        [Accuracy(name='accuracy'), F1(name='macro_f1')]
    """
    if isinstance(metrics, str) or not isinstance(metrics, Sequence):
        raise TypeError(f"{who}(metrics=...): expected a list of metrics, got {metrics!r}")
    chosen = [get(m) for m in metrics]
    names = [m.name for m in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"{who}(metrics=...): metric names repeat: {names}")
    return chosen


@jax.jit
def _stacked(sums: list[Sums]) -> Sums:
    """Every batch's sums stacked on a first axis: fetched from the device in one transfer
    per metric sum, not one per batch (compiled once per number of batches)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *sums) if sums else {}


_ENGINES: weakref.WeakKeyDictionary[ProgramCore, dict[Hashable, Engine]] = \
    weakref.WeakKeyDictionary()


def _identity(metric: Metric) -> Hashable:
    """Equal for metrics of one class and equal settings; the metric itself otherwise."""
    key = (type(metric), tuple(sorted(vars(metric).items())))
    try:
        hash(key)
    except TypeError:  # settings such as arrays: reused only as this very object
        return metric
    return key


def engine_for(program: ProgramCore, binding: Binding, target: Field, metrics: Sequence[Metric],
               keep: bool = False) -> Engine:
    """The engine of these, made once per program and reused (no retrace on a second
    evaluation with equal metrics).

    Examples:
        >>> import numpy as np, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod._train._batch import Binding
        >>> from graphmod._train._engine import engine_for
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0)))
        >>> first = engine_for(program, Binding((0,)), 1, [gm.metrics.get("accuracy")])
        >>> first is engine_for(program, Binding((0,)), 1, [gm.metrics.get("accuracy")])
        True
    """
    key = (binding, target, tuple(_identity(m) for m in metrics), keep)
    engines = _ENGINES.setdefault(program, {})
    if key not in engines:
        if len(engines) >= _KEPT:
            engines.pop(next(iter(engines)))
        engines[key] = Engine(program, binding, target, metrics, keep)
    return engines[key]


def prepare(program: ProgramCore, variables: Variables, first: object,
            metrics: Sequence[Metric], *, who: str, source: str,
            inputs: Sequence[Field] | None = None, targets: Field = None,
            keep: bool = False, spare: int = 0, hint: str = "") -> Engine:
    """The engine for ``program`` on batches like ``first``, checked before any batch runs:
    the fields bound to the arguments (``inputs=`` or by the function's signature), the
    targets (``targets=`` or the field left over), the predictions' and targets' shapes.

    Examples:
        >>> import numpy as np, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod._train._engine import prepare
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0)))
        >>> variables = program.init(np.ones((1, 2), np.float32))
        >>> batch = {"x": np.eye(2, dtype=np.float32), "y": np.array([0, 1])}
        >>> engine = prepare(program, variables, batch, [gm.metrics.Accuracy()], who="demo",
        ...                  source="toy")
        >>> engine.binding.fields, engine.target
        (('x',), 'y')
    """
    binding = bind(program.fn, first, who=who, source=source, spare=spare, hint=hint) \
        if inputs is None else bind_fields(first, inputs, who=who, source=source)
    target = target_field(first, binding, targets, who=who, source=source)
    needing = [m.name for m in metrics if m.needs_targets]
    if needing and target is None:
        fields = fields_of(first)
        left = [f for f in fields if f not in binding.fields]
        if len(left) > 1:
            raise ValueError(
                f"{who}: the metrics {', '.join(needing)} need targets, and several fields "
                f"of the source {source!r} could be them ({', '.join(map(repr, left))}): "
                "name one with targets=...; a metric that reads the whole batch itself "
                "(takes_batch) can say needs_targets = False")
        # Every field an input, more than one: most likely a cost fn(model, x, y).
        cost = len(binding.fields) > 1 and len(binding.fields) == len(fields)
        raise ValueError(
            f"{who}: the metrics {', '.join(needing)} need targets, but the source "
            f"{source!r} has no field for them besides the program's inputs (fields: "
            f"{', '.join(map(repr, fields))}; inputs: "
            f"{', '.join(map(repr, binding.fields))}). Add the targets to the source, or name "
            "their field with targets=..." + (
                "; where the program's function takes the targets itself (a cost), "
                "evaluate one returning predictions: evaluate(..., predict=lambda model, x: "
                "model(x)), Validation(program.derive(lambda model, x: model(x)), ...)"
                if cost else ""))
    engine = engine_for(program, binding, target, metrics, keep)
    shapes = output_shapes(engine, variables, first, who=who, source=source)
    if keep or any(not m.takes_batch for m in metrics):
        _check_predictions(engine, shapes, first, who=who, source=source)
    return engine


def output_shapes(engine: Engine, variables: Variables, batch: object, *, who: str,
                  source: str) -> PyTree:
    """The shapes of the engine's outputs on ``batch``; raises when the fields do not fit
    the program's arguments.

    Examples:
        >>> import numpy as np, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod._train._batch import Binding
        >>> from graphmod._train._engine import Engine, output_shapes
        >>> program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> variables = program.init(np.ones((1, 2), np.float32))
        >>> output_shapes(Engine(program, Binding((None,)), None, []), variables,
        ...               np.ones((4, 2), np.float32), who="demo", source="toy").shape
        (4, 3)
    """
    try:
        return jax.eval_shape(engine.outputs, variables, batch)
    except (ValueError, TypeError) as error:
        fields = ", ".join(map(repr, engine.binding.fields))
        raise ValueError(f"{who}: the data of source {source!r} do not fit the program's "
                         f"inputs (fields {fields} → the program's arguments): "
                         f"{error}") from error


def _check_predictions(engine: Engine, shapes: PyTree, first: object, *, who: str,
                       source: str) -> None:
    if not isinstance(shapes, jax.ShapeDtypeStruct):
        raise ValueError(
            f"{who}: the program returns {jax.tree.structure(shapes)}, not an array of "
            "predictions; pass predict=lambda model, x: model(x) (a function returning "
            "predictions)")
    sizes = {int(np.shape(leaf)[0]) for leaf in jax.tree.leaves(first) if np.ndim(leaf) > 0}
    rows = sizes.pop() if len(sizes) == 1 else -1
    if not shapes.shape or shapes.shape[0] != rows:
        raise ValueError(
            f"{who}: the predictions have shape {shapes.shape}, but a batch of source "
            f"{source!r} has {rows} examples: the program must return one prediction per "
            "example (batch first); pass predict= a function returning predictions")
    target = engine.target
    target_shape = None if target is None else jax.eval_shape(lambda b: pick(b, target), first)
    for metric in engine.metrics:
        if not metric.takes_batch:
            metric.check(shapes, target_shape, str(target))
