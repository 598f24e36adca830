"""``evaluate``: metrics of a program over a data source, with the evaluation's provenance.

Every example is seen once: the source's short final batch is padded and masked
(``ArraySource.iter_padded``), so nothing is dropped and nothing retraces. Metrics add up
per-batch sums (computed on the device, in one jitted function for all metrics) in float64
on the host. Before the first batch runs, evaluation checks the variables against the
program's layout (paths, shapes, dtypes), that the data have the fields the program's inputs
and the metrics' targets need, that the features fit the program's inputs, and that
predictions and targets can be compared; each error names the culprit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time as _time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from graphmod import metrics as _metrics
from graphmod._clock import utc_now
from graphmod._program import Program
from graphmod._table import html_table, text_table
from graphmod._validation import is_key
from graphmod.provenance._capture import class_path
from graphmod.provenance._collect import data_record, function_record
from graphmod.provenance._environment import platform_record, versions
from graphmod.provenance._record import Provenance


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

    metrics: Mapping[str, Any]
    predictions: np.ndarray | None
    examples: int
    provenance: Provenance

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", types.MappingProxyType(dict(self.metrics)))

    def __repr__(self) -> str:
        shown = {k: (round(v, 6) if isinstance(v, float) else f"<{np.shape(v)} array>")
                 for k, v in self.metrics.items()}
        return f"Evaluation(examples={self.examples}, metrics={shown})"

    def __getitem__(self, name: str) -> Any:
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


def _leaves_size(tree: Any) -> int:
    sizes = {int(np.shape(leaf)[0]) for leaf in jax.tree.leaves(tree) if np.ndim(leaf) > 0}
    return sizes.pop() if len(sizes) == 1 else -1


def _as_source(source: Any, batch_size: int) -> Any:
    from graphmod.data import ArraySource

    if hasattr(source, "iter_padded"):
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


def _fields(batch: Any) -> list[Any]:
    if isinstance(batch, Mapping):
        return list(batch)
    if isinstance(batch, tuple | list):
        return list(range(len(batch)))
    return [None]


def _pick(batch: Any, field: Any) -> Any:
    return batch if field is None else batch[field]


def _choose_fields(batch: Any, names: list[str], inputs: Sequence[Any] | None,
                   targets: Any, source_name: str) -> tuple[list[Any], Any]:
    """The batch fields fed to the program, and the targets field (or None)."""
    fields = _fields(batch)
    shown = ", ".join(map(repr, fields))
    if inputs is None:
        if isinstance(batch, Mapping):
            missing = [n for n in names if n not in batch]
            if missing or not names:
                raise ValueError(
                    f"evaluate: the program's inputs {names} are not all fields of the source "
                    f"{source_name!r} (fields: {shown}; missing: {missing}). Rename the "
                    "fields, or pass inputs=[field, ...]")
            inputs = names
        elif isinstance(batch, tuple | list):
            count = len(names) if names else max(len(batch) - 1, 1)
            if count > len(batch):
                raise ValueError(f"evaluate: the program takes {count} inputs ({names}) but "
                                 f"the source {source_name!r} yields {len(batch)} arrays")
            inputs = list(range(count))
        else:
            inputs = [None]
    for field in inputs:
        if field not in fields:
            raise ValueError(f"evaluate: inputs= names {field!r}, which is not a field of the "
                             f"source {source_name!r} (fields: {shown})")
    if targets is None:
        rest = [f for f in fields if f not in inputs and f is not None]
        targets = rest[0] if len(rest) == 1 else None
    elif targets not in fields:
        raise ValueError(f"evaluate: targets={targets!r} is not a field of the source "
                         f"{source_name!r} (fields: {shown})")
    return list(inputs), targets


def _variables_record(variables: Any) -> dict[str, Any]:
    digest = hashlib.sha256()
    count = numbers = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        if is_key(leaf):
            leaf = jax.random.key_data(leaf)
        host = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}{host.dtype.str}{host.shape}".encode())
        digest.update(np.ascontiguousarray(host).tobytes())
        count += 1
        numbers += host.size
    return {"sha256": "sha256:" + digest.hexdigest(), "arrays": count, "numbers": numbers}


def evaluate(program: Program, variables: Any, source: Any, *, metrics: Sequence[Any],
             predict: Callable[..., Any] | None = None, inputs: Sequence[Any] | None = None,
             targets: Any = None, predictions: bool = False, batch_size: int = 256,
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
    if not isinstance(program, Program):
        raise TypeError(f"evaluate(program, ...): expected a graphmod Program, got "
                        f"{type(program).__name__}")
    if hasattr(variables, "variables") and hasattr(variables, "opt_state"):
        variables = variables.variables
    program._unpack(variables)  # paths, shapes, dtypes: named before any data is read
    if isinstance(metrics, str) or not isinstance(metrics, Sequence):
        raise TypeError(f"evaluate(metrics=...): expected a list of metrics, got {metrics!r}")
    chosen = [_metrics.get(m) for m in metrics]
    names = [m.name for m in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"evaluate(metrics=...): metric names repeat: {names}")
    data = _as_source(source, batch_size)
    description = data_record(data)
    source_name = str(description.get("name", type(data).__name__))
    predictor = program.derive(predict) if predict is not None else program
    batches = iter(data.iter_padded())
    try:
        first, first_mask = next(batches)
    except StopIteration:
        raise ValueError(f"evaluate: the source {source_name!r} is empty (it yielded no "
                         "batch); nothing to evaluate") from None
    input_fields, target_field = _choose_fields(first, predictor._argument_names, inputs,
                                                targets, source_name)
    needing = [m.name for m in chosen if m.needs_targets]
    if needing and target_field is None:
        raise ValueError(
            f"evaluate: the metrics {', '.join(needing)} need targets, but the source "
            f"{source_name!r} has no field for them besides the program's inputs (fields: "
            f"{', '.join(map(repr, _fields(first)))}; inputs: "
            f"{', '.join(map(repr, input_fields))}). Add the targets to the source, or name "
            "their field with targets=...")

    def run(batch: Any) -> Any:
        out = predictor.infer(variables, *[_pick(batch, f) for f in input_fields])
        return out[0] if predictor._monitor else out

    try:
        shapes = jax.eval_shape(run, first)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"evaluate: the data of source {source_name!r} do not fit the program's inputs "
            f"(fields {', '.join(map(repr, input_fields))} → arguments "
            f"{predictor._argument_names}): {error}") from error
    if not isinstance(shapes, jax.ShapeDtypeStruct):
        raise ValueError(
            f"evaluate: the program returns {jax.tree.structure(shapes)}, not an array of "
            "predictions; pass predict=lambda model, x: model(x) (a function returning "
            "predictions)")
    rows = _leaves_size(first)
    if not shapes.shape or shapes.shape[0] != rows:
        raise ValueError(
            f"evaluate: the predictions have shape {shapes.shape}, but a batch of source "
            f"{source_name!r} has {rows} examples: the program must return one prediction per "
            "example (batch first); pass predict= a function returning predictions")
    target_shape = None if target_field is None else jax.eval_shape(
        lambda b: _pick(b, target_field), first)
    for metric in chosen:
        metric.check(shapes, target_shape, str(target_field))

    @jax.jit
    def statistics(out: Any, target: Any, mask: Any) -> dict[str, Any]:
        weights = mask.astype(np.float32)
        return {m.name: m.statistics(out, target, weights) for m in chosen}

    sums: list[Any] = []
    kept: list[tuple[Any, np.ndarray]] = []
    examples = count = 0
    for batch, mask in _chain(first, first_mask, batches):
        out = run(batch)
        target = None if target_field is None else _pick(batch, target_field)
        if chosen:
            sums.append(statistics(out, target, mask))
        if predictions:
            kept.append((out, mask))
        examples += int(np.sum(mask))
        count += 1
    totals = _add(jax.device_get(sums))
    values = {m.name: m.result(totals[m.name]) for m in chosen}
    kept_predictions = None
    if predictions:
        host = jax.device_get([o for o, _ in kept])
        kept_predictions = np.concatenate([h[np.asarray(m, bool)]
                                           for h, (_, m) in zip(host, kept, strict=True)])
    if model_provenance is None:  # the program the predictor was derived from, if any
        model_provenance = (program._origin or program).provenance
    model = model_provenance
    record = Provenance("evaluation", {
        "model": model.to_dict(),
        "variables": _variables_record(variables),
        "data": description,
        "fields": {"inputs": [str(f) for f in input_fields],
                   "targets": None if target_field is None else str(target_field)},
        "predict": function_record(predictor.fn),
        "metrics": [m.config() for m in chosen],
        "versions": versions(),
        "platform": platform_record(),
    }, {
        "examples": examples,
        "batches": count,
        "started": started,
        "ended": utc_now(),
        "seconds": round(_time.perf_counter() - clock, 6),
        "source": class_path(type(data)),
    })
    return Evaluation(values, kept_predictions, examples, record)


def _chain(first: Any, mask: Any, rest: Any) -> Any:
    yield first, mask
    yield from rest


def _add(sums: list[Any]) -> Any:
    if not sums:
        return {}
    return jax.tree.map(lambda *xs: np.sum(np.asarray(xs, np.float64), axis=0), *sums)
