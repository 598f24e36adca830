"""``Validation``: a nested inference pass over a held-out source, fired as ``validated``.

What is averaged
    Validation runs on :func:`graphmod.evaluate`'s engine (``graphmod._train._engine``:
    per-batch sums on the device, one wait and a float64 reduction on the host) with its
    metric protocol (:class:`graphmod.metrics.Metric`). ``metrics={"accuracy": fn}`` means
    :class:`graphmod.metrics.Mean`: each ``fn(outputs, batch)`` returns a per-example array
    (first axis the batch; any further axes are averaged per example; a scalar is refused,
    naming the metric), averaged over the real rows. ``metrics=["accuracy", ...]`` takes
    evaluate's metrics (names or instances), with the targets in the field the program's
    arguments leave over. Without ``metrics``, the program's own output is taken apart
    (:class:`graphmod.metrics._per_example.Output`): a dict of values, ``(cost, dict)`` as a
    training function returns (the cost as ``"loss"``), or a lone scalar (``"loss"``);
    per-example values are averaged over the real rows, scalar values are averaged over
    batches weighted by their real rows.

Padding
    :meth:`ArraySource.iter_padded` pads the short final batch by repeating its last row,
    so every batch has one shape and the program compiles once; the mask drops the padding
    from per-example means exactly. A scalar a program computes over a whole padded batch
    cannot be unpadded (the repeated row weighs in): return per-example values where
    exactness matters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np

from graphmod import metrics as _metrics
from graphmod._train._data_checks import check_evaluation_data, transformed_targets
from graphmod._train._engine import Engine, PaddedSource, metric_list, output_shapes, prepare
from graphmod._train._events import Event, On, Template
from graphmod._train._loop._models import model_state
from graphmod._train._plugin import Plugin
from graphmod._train._program import Program
from graphmod.data._grain import as_source
from graphmod.metrics._per_example import Output, named_outputs
from graphmod.plugins._common import template_or
from graphmod.typing import JSON, ArrayLike, Batch, LoopLike, Metrics, PyTree, Variables

MetricFn: TypeAlias = Callable[[Any, Batch], ArrayLike]  # outputs: what the program returns
"""``fn(outputs, batch) -> per-example array``, traced with ``jax.jit`` (use ``jnp``)."""

_HINT = " (or validate a program derived over a function of these fields)"


class Validation(Plugin):
    """Evaluates the current variables on ``source`` and fires a ``validated`` event.

    On each due event it runs ``program.infer`` (in inference mode: no dropout, running
    batch-norm statistics) with ``event.state.evaluation_variables`` (the variables, or a
    schedule-free optimizer's evaluation point) over every row of ``source``
    once, in padded batches, and fires ``validated`` with
    ``metrics={prefix + name: value}`` (plugins such as ``EarlyStopping`` and ``Print``
    read them there). The inference call gets the entries of each batch its function
    takes: a dict batch by argument name, a tuple batch by position (so
    ``program.derive(lambda m, x: m(x))`` over ``(x, y)`` batches gets ``x``); metric
    functions get the whole batch. It runs on :func:`graphmod.evaluate`'s engine: one
    jitted function computes each batch's masked sums, and the loop waits on the device
    once per evaluation. In a loop, its first batch is checked against the program when
    the loop sets up (fields bound to the arguments, shapes, metrics), so data that do not
    fit stop the run before its first step. See the module docstring for what is averaged.

    Args:
        program: an inference program over the trained model, e.g.
            ``program.derive(lambda m, x: m(x))``, or the training program itself.
        source: an :class:`graphmod.data.ArraySource` of held-out data.
        metrics: ``{name: fn(outputs, batch) -> per-example array}``, or a list of
            :func:`graphmod.evaluate`'s metrics (names or :class:`graphmod.metrics.Metric`
            objects; the targets are the field the program's arguments leave over);
            default: the program's own outputs.
        every: the events to validate on (default: ``On("epoch_end")``).
        prefix: put before every metric name (default ``"valid/"``, and
            ``"<model>/valid/"`` with ``model``).
        name: the plugin's name (and the ``issuer`` of its events).
        model: in a loop over several models, the one whose variables are evaluated.

    Examples:
        >>> import jax, numpy as np, optax, graphmod as gm
        >>> from flax import nnx
        >>> from graphmod.data import ArraySource
        >>> from graphmod.plugins import Validation
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(), lin)
        >>> x, y = np.ones((32, 2), np.float32), np.zeros((32, 1), np.float32)
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state = step.init(program.init(x[:1], y[:1]), jax.random.key(0))
        >>> predict = program.derive(lambda m, x: m(x))
        >>> mse = lambda out, batch: ((out - batch[1]) ** 2).mean(-1)
        >>> valid = Validation(predict, ArraySource((x[:10], y[:10]), 4), metrics={"mse": mse})
        >>> state = gm.Loop(step, ArraySource((x, y), batch_size=8), epochs=2,
        ...                 plugins=[valid]).run(state)
        >>> [(step, sorted(metrics)) for step, metrics in valid.history]
        [(4, ['valid/mse']), (8, ['valid/mse'])]
        >>> sorted(Validation(predict, ArraySource((x, y), 8), metrics=["mse"]).evaluate(
        ...     state.variables))
        ['valid/mse']
    """

    def __init__(self, program: Program, source: object, *,
                 metrics: Mapping[str, MetricFn] | Sequence[str | _metrics.Metric] | None = None,
                 every: Template | str | None = None, prefix: str | None = None,
                 name: str = "validation", model: str | None = None) -> None:
        if not isinstance(program, Program):
            raise TypeError(f"Validation(program): expected a graphmod Program (e.g. "
                            f"program.derive(lambda m, x: m(x))), got {type(program).__name__}")
        source = as_source(source)  # a Grain pipeline of batches: a GrainSource
        if not isinstance(source, PaddedSource):
            raise TypeError(f"Validation(source): expected a graphmod.data.ArraySource (it "
                            f"pads and masks the final batch), got {type(source).__name__}")
        chosen = None if metrics is None else _protocol(metrics)
        if prefix is None:
            prefix = "valid/" if model is None else f"{model}/valid/"
        if not isinstance(prefix, str):
            raise TypeError(f"Validation(prefix={prefix!r}): expected a string")
        super().__init__(name=name,
                         every=template_or(every, On("epoch_end"), "Validation"))
        self.program = program
        self.source = source
        self.metrics = chosen
        self.prefix = prefix
        self.model = model
        self.history: list[tuple[int, Metrics]] = []
        self._engine: Engine | None = None

    def setup(self, loop: LoopLike) -> None:
        # Checked on the first batch now, not at the first validation an epoch later: data
        # that do not fit the program stop the run before it trains (an abstract trace).
        if self._engine is None:
            self._engine = self._prepare(self._variables(loop, loop.state))

    def __call__(self, event: Event) -> None:
        results = self.evaluate(self._variables(event.loop, event.state))
        self.history.append((event.time.step, results))
        event.loop.fire("validated", metrics=results)

    def state_dict(self) -> dict[str, JSON]:
        """The history, as JSON (arrays as lists): a resumed run's holds every validation."""
        return {"history": [[step, {name: np.asarray(value).tolist()
                                    for name, value in results.items()}]
                            for step, results in self.history]}

    def load_state_dict(self, state: dict[str, JSON]) -> None:
        history = state.get("history", [])
        if not isinstance(history, list):
            raise ValueError(f"{self.name}: the checkpoint's history is a "
                             f"{type(history).__name__}, not a list of validations")
        self.history = [_validation(entry, self.name) for entry in history]

    def evaluate(self, variables: Variables) -> Metrics:
        """``{prefix + name: value}`` over every row of the source, for ``variables``."""
        if self._engine is None:
            self._engine = self._prepare(dict(variables))
        totals = self._engine.run(variables, ((transformed_targets(self.program, batch), mask)
                                              for batch, mask in self.source.iter_padded()))
        return {self.prefix + key: value for key, value in totals.values.items()}

    def _variables(self, loop: LoopLike, state: PyTree) -> Variables:
        """The variables to evaluate: ``model``'s, in a loop over several models."""
        return _variables(model_state(loop, state, self.model, "Validation"), self.name)

    def _prepare(self, variables: Variables) -> Engine:
        """The engine, checked on the first batch: the metrics given or the outputs'."""
        source = str(getattr(self.source, "name", None) or type(self.source).__name__)
        first = next(iter(self.source.iter_padded()), None)
        if first is None:
            raise ValueError(f"{self.name}: the source {source!r} is empty (it yielded no "
                             "batch); nothing to validate")
        check_evaluation_data(self.program, self.source, first[0], self.name)
        first = (transformed_targets(self.program, first[0]), first[1])  # as the cost saw them
        chosen = self.metrics
        if chosen is None:
            bare = prepare(self.program, variables, first[0], [], who=self.name,
                           source=source, hint=_HINT)
            outputs = output_shapes(bare, variables, first[0], who=self.name, source=source)
            chosen = [Output(key) for key in named_outputs(outputs)]
        return prepare(self.program, variables, first[0], chosen, who=self.name,
                       source=source, hint=_HINT)


def _validation(entry: JSON, who: str) -> tuple[int, Metrics]:
    """One validation of a checkpoint's history, ``[step, {name: value}]`` (arrays as lists)."""
    step, results = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
    if isinstance(step, bool) or not isinstance(step, int) or not isinstance(results, dict):
        raise ValueError(f"{who}: the checkpoint's history holds {str(entry)[:100]}, not a "
                         "[step, {metric: value}] validation")
    values: Metrics = {}
    for name, value in results.items():
        if isinstance(value, list):
            values[name] = np.asarray(value)
        elif isinstance(value, int | float):
            values[name] = value
        else:
            raise ValueError(f"{who}: the checkpoint's validation at step {step} holds "
                             f"{name}={value!r}, not a number or an array")
    return step, values


def _protocol(metrics: object) -> list[_metrics.Metric]:
    """``metrics=`` as metrics of the one protocol: functions as :class:`Mean`."""
    if isinstance(metrics, Mapping) and metrics:
        for key, fn in metrics.items():
            if not isinstance(key, str) or not callable(fn):
                raise TypeError(f"Validation(metrics=...): entry {key!r} must map a "
                                f"name to fn(outputs, batch), got {fn!r}")
        return [_metrics.Mean(fn, name=key) for key, fn in metrics.items()]
    if isinstance(metrics, Sequence) and not isinstance(metrics, str) and metrics:
        return metric_list(metrics, "Validation")
    raise TypeError(f"Validation(metrics=...): expected a non-empty dict "
                    f"{{name: fn(outputs, batch)}} or list of metrics, got {metrics!r}")


def _variables(state: PyTree, who: str) -> Variables:
    # a TrainState's: for a schedule-free optimizer, not the point it trains at
    variables = getattr(state, "evaluation_variables", getattr(state, "variables", state))
    if not isinstance(variables, Mapping) or "model" not in variables:
        raise TypeError(f"{who}: the loop's train state has no program variables (expected "
                        f"a graphmod.TrainState with .variables, got {type(state).__name__})")
    return dict(variables)
