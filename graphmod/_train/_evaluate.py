"""``evaluate``: metrics of a program over a data source, with the evaluation's provenance.

Every example is seen once: the source's short final batch is padded and masked
(``ArraySource.iter_padded``), so nothing is dropped and nothing retraces. It runs on the
evaluation engine ``Validation`` runs on (``graphmod._train._engine``): per-batch sums of
every metric and the predictions in one jitted function, added up in float64 on the host,
the engine reused when the same program and metrics are evaluated again (no retrace).
Before the first batch runs, evaluation checks the variables against the
program's layout (paths, shapes, dtypes), that the data have the fields the program's inputs
and the metrics' targets need, that the features fit the program's inputs, and that
predictions and targets can be compared; each error names the culprit. Each batch's
targets, on the host already, are checked before the batch runs (``Metric.check_batch``: a
label outside the classes is named by its example index); targets a source yields on the
device are left to the metrics' own sums, checked once at the end, so that no batch waits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time as _time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from graphmod._core._bricks._construction import class_path
from graphmod._core._clock import utc_now
from graphmod._core._codec import hash_array, host_array
from graphmod._core._display._table import html_table, text_table
from graphmod._core._program._program_checks import check_variables
from graphmod._core._program._program_core import ProgramCore
from graphmod._records._collect import data_record, function_record
from graphmod._records._environment import platform_record, versions
from graphmod._records._record import Provenance
from graphmod._train._batch import Field, pick
from graphmod._train._data_checks import check_evaluation_data, transformed_targets
from graphmod._train._engine import (
    Engine,
    Mask,
    PaddedSource,
    Totals,
    metric_list,
    output_shapes,
    prepare,
)
from graphmod._train._program import Program
from graphmod.data import ArraySource
from graphmod.data._grain import as_source
from graphmod.metrics import Metric
from graphmod.typing import JSON, ArrayLike, Variables


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The result of :func:`evaluate`: metrics, predictions if asked for, provenance.

    ``evaluation["accuracy"]`` reads a metric; per-class metrics are arrays over classes.
    Prints as a table (HTML in notebooks).

    Attributes:
        metrics: metric name → value (a float, or an array for per-class metrics).
        predictions: the predictions for every example in source order (``predictions=True``),
            else None.
        examples: how many examples were evaluated.
        provenance: the evaluation's record, holding the model's and the data's.

    Examples:
        >>> import numpy as np, graphmod as gm
        >>> result = gm.Evaluation({"accuracy": 0.5, "f1": np.array([0.4, 0.6])}, None, 10,
        ...                        gm.Provenance("evaluation", {"data": {"name": "toy"}}))
        >>> print(result)
        evaluation of 10 examples of 'toy'
        metric    value
        --------  -----
        accuracy  0.5
        <BLANKLINE>
        class  f1
        -----  ------
        0      0.4000
        1      0.6000
    """

    metrics: Mapping[str, ArrayLike]
    predictions: np.ndarray | None
    examples: int
    provenance: Provenance

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", types.MappingProxyType(dict(self.metrics)))

    def __repr__(self) -> str:
        shown = {k: (round(v, 6) if isinstance(v, float) else f"<{np.shape(v)} array>")
                 for k, v in self.metrics.items()}
        return f"Evaluation(examples={self.examples}, metrics={shown})"

    def __getitem__(self, name: str) -> ArrayLike:
        try:
            return self.metrics[name]
        except KeyError:
            raise KeyError(f"no metric {name!r} in this evaluation; it has "
                           f"{', '.join(self.metrics)}") from None

    def _tables(self) -> tuple[list[tuple[str, str]], list[str], list[list[str]]]:
        scalars = [(k, f"{v:.6g}") for k, v in self.metrics.items() if np.ndim(v) == 0]
        per_class = {k: np.asarray(v) for k, v in self.metrics.items()
                     if np.ndim(v) == 1}
        headers = ["class", *per_class]
        classes = max((len(v) for v in per_class.values()), default=0)
        rows = [[str(c), *(f"{v[c]:.4f}" for v in per_class.values())] for c in range(classes)]
        return scalars, headers, rows

    def _caption(self) -> str:
        data = self.provenance.inputs.get("data") or {}
        return f"evaluation of {self.examples} examples of {data.get('name', 'data')!r}"

    def __str__(self) -> str:
        scalars, headers, rows = self._tables()
        parts = [self._caption(), text_table(("metric", "value"), scalars)]
        if rows:
            parts += ["", text_table(headers, rows)]
        if "confusion_matrix" in self.metrics:
            parts += ["", "confusion matrix (rows: targets, columns: predictions)",
                      str(self.metrics["confusion_matrix"])]
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        scalars, headers, rows = self._tables()
        out = html_table(("metric", "value"), scalars, self._caption())
        if rows:
            out += html_table(headers, rows, "per class")
        return out


def _as_source(source: object, batch_size: int) -> PaddedSource:
    source = as_source(source)  # a Grain pipeline of batches: a GrainSource
    if isinstance(source, PaddedSource):
        return source
    if isinstance(source, Mapping | tuple | list | np.ndarray | jax.Array):
        leaves = jax.tree.leaves(source)
        if not leaves:
            raise ValueError("evaluate: the source holds no arrays; nothing to evaluate")
        rows = [np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves]
        if 0 in rows:
            raise ValueError("evaluate: the source is empty (0 examples); nothing to evaluate. "
                             "Pass the arrays of the examples to evaluate")
        size = rows[0] if rows[0] is not None else 1
        return ArraySource(source, min(batch_size, size), drop_remainder=False)
    raise TypeError(f"evaluate: source must be a graphmod.data.ArraySource or arrays (a dict "
                    f"or tuple of arrays), got {type(source).__name__}")


def _first_batch(data: PaddedSource, source_name: str
                 ) -> tuple[object, Iterator[tuple[object, Mask]]]:
    """The first batch (to check against) and every ``(batch, mask)``, the first included."""
    batches = iter(data.iter_padded())
    try:
        first = next(batches)
    except StopIteration:
        raise ValueError(f"evaluate: the source {source_name!r} is empty (it yielded no "
                         "batch); nothing to evaluate") from None
    return first[0], itertools.chain([first], batches)


def _checked_targets(batches: Iterator[tuple[object, Mask]], engine: Engine,
                     metrics: Sequence[Metric], predictions: jax.ShapeDtypeStruct
                     ) -> Iterator[tuple[object, Mask]]:
    """Every ``(batch, mask)``, its targets' real rows checked by each metric first when
    they are NumPy arrays (reading device arrays would wait on every batch)."""
    field, first = str(engine.target), 0
    for batch, mask in batches:
        targets = pick(batch, engine.target)
        if isinstance(targets, np.ndarray):
            real = targets[np.asarray(mask, bool)]
            for metric in metrics:
                if not metric.takes_batch:
                    metric.check_batch(predictions, real, field, first)
        first += int(np.sum(mask))
        yield batch, mask


def _checked_variables(program: object, variables: object) -> Variables:
    """The variables (of a train state too), checked against the program's layout."""
    if not isinstance(program, Program):
        raise TypeError(f"evaluate(program, ...): expected a graphmod Program, got "
                        f"{type(program).__name__}")
    inner = getattr(variables, "variables", None)
    if inner is not None and hasattr(variables, "opt_state"):  # a train state's
        variables = inner
    if not isinstance(variables, Mapping):
        check_variables(variables, program.layout, None)  # refuses it, naming what they are
    assert isinstance(variables, Mapping)  # check_variables refused anything else
    variables = variables if isinstance(variables, dict) else dict(variables)
    program._unpack(variables)  # paths, shapes, dtypes: named before any data is read
    return variables


def _variables_record(variables: Variables) -> dict[str, JSON]:
    digest = hashlib.sha256()
    count = numbers = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        host = host_array(leaf)
        hash_array(digest, host, f"{jax.tree_util.keystr(path)}{host.dtype.str}{host.shape}")
        count += 1
        numbers += host.size
    return {"sha256": "sha256:" + digest.hexdigest(), "arrays": count, "numbers": numbers}


def evaluate(program: Program, variables: object, source: object, *,
             metrics: Sequence[str | Metric], predict: Callable[..., object] | None = None,
             inputs: Sequence[Field] | None = None, targets: Field = None,
             predictions: bool = False, batch_size: int = 256,
             model_provenance: Provenance | None = None) -> Evaluation:
    """Evaluates ``program`` with ``variables`` on every example of ``source``.

    The program's function (or ``predict``, derived over the same model and managers)
    must return predictions; it runs in inference mode on the fields of each batch named
    like its arguments (``fn(model, x)`` reads field ``x``; tuples: the first ones); the
    targets are the field left over, or ``targets=``.

    Args:
        program: a compiled program (its variables' layout is the one evaluated).
        variables: the variables to evaluate (or a train state: its ``variables``).
        source: a :class:`graphmod.data.ArraySource` (its short final batch is padded and
            masked) or arrays (a dict or tuple of arrays, batched by ``batch_size``).
        metrics: metric names or :class:`graphmod.metrics.Metric` objects, e.g.
            ``["accuracy", "cross_entropy", "f1"]``.
        predict: ``predict(model, *inputs)`` returning predictions, when ``program``'s own
            function returns a cost.
        inputs, targets: the batch fields (names or indices) of the inputs and targets,
            when the defaults do not fit.
        predictions: keep the predictions (``evaluation.predictions``).
        batch_size: the batch size for sources given as arrays.
        model_provenance: the record of the model evaluated (e.g. a training run's, from
            ``graphmod.provenance.read(run_directory)``); default: the provenance of
            ``program`` (of the program it was derived from, if it was derived).

    Returns:
        An :class:`Evaluation`: ``metrics``, ``predictions``, ``examples``, ``provenance``.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, graphmod as gm
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0))
        >>> program = gm.compile(lambda m, x: m(x), lin)
        >>> x = np.eye(2, dtype=np.float32).repeat(5, 0)
        >>> variables = program.init(x[:1])
        >>> y = np.asarray(program.infer(variables, x)).argmax(-1)
        >>> result = gm.evaluate(program, variables, {"x": x, "y": y},
        ...                      metrics=["accuracy", "f1"], batch_size=4)
        >>> result["accuracy"], result.examples, result.provenance.kind
        (1.0, 10, 'evaluation')
    """
    started, clock = utc_now(), _time.perf_counter()
    variables = _checked_variables(program, variables)
    chosen = metric_list(metrics, "evaluate")
    data = _as_source(source, batch_size)
    description = data_record(data)
    source_name = str(description.get("name", type(data).__name__))
    predictor: ProgramCore = program.derive(predict) if predict is not None else program
    first, batches = _first_batch(data, source_name)
    check_evaluation_data(predictor, data, first, "evaluate")  # the training data's metadata
    first = transformed_targets(predictor, first)  # targets as the cost saw them
    batches = ((transformed_targets(predictor, batch), mask) for batch, mask in batches)
    engine = prepare(predictor, variables, first, chosen, who="evaluate", source=source_name,
                     inputs=inputs, targets=targets, keep=predictions, spare=1,
                     hint=", or pass inputs=[field, ...]")
    if engine.target is not None:
        shapes = output_shapes(engine, variables, first, who="evaluate", source=source_name)
        if isinstance(shapes, jax.ShapeDtypeStruct):  # else every metric reads the batch
            batches = _checked_targets(batches, engine, chosen, shapes)
    totals = engine.run(variables, batches)
    if model_provenance is None:  # the program the predictor was derived from, if any
        origin = program.origin  # a Program's origin is a Program (derive keeps its class)
        model_provenance = (origin if isinstance(origin, Program) else program).provenance
    inputs_record = {
        "model": model_provenance.to_dict(),
        "variables": _variables_record(variables),
        "data": description,
        "fields": {"inputs": [str(f) for f in engine.binding.fields],
                   "targets": None if engine.target is None else str(engine.target)},
        "predict": function_record(predictor.fn),
        "metrics": [m.config() for m in chosen],
    }
    return Evaluation(totals.values, totals.predictions, totals.examples,
                      _record(inputs_record, totals, data, started, clock))


def _record(inputs: dict[str, JSON], totals: Totals, data: object, started: str,
            clock: float) -> Provenance:
    """The evaluation's provenance: what it read, and what the run found and took."""
    return Provenance("evaluation", {
        **inputs, "versions": versions(), "platform": platform_record(),
    }, {
        "examples": totals.examples,
        "batches": totals.batches,
        "started": started,
        "ended": utc_now(),
        "seconds": round(_time.perf_counter() - clock, 6),
        "source": class_path(type(data)),
    })
