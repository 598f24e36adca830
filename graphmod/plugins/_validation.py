"""``Validation``: a nested inference pass over a held-out source, fired as ``validated``.

What is averaged
    The inference program's outputs become metrics in one of two ways. With
    ``metrics={"accuracy": fn}``, each ``fn(outputs, batch)`` returns a per-example array
    (first axis the batch; any further axes are averaged per example), and the metric is
    its mean over the real rows. Without ``metrics``, the program's own output is taken
    apart: a dict of values, ``(cost, dict)`` as a training function returns (the cost as
    ``"loss"``), or a lone scalar (``"loss"``); per-example values are averaged over the
    real rows, scalar values are averaged over batches weighted by their real rows.

Padding
    :meth:`ArraySource.iter_padded` pads the short final batch by repeating its last row,
    so every batch has one shape and the program compiles once; the mask drops the padding
    from per-example means exactly. A scalar a program computes over a whole padded batch
    cannot be unpadded (the repeated row weighs in): return per-example values where
    exactness matters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphmod._events import Event, On, Template
from graphmod._plugin import Plugin
from graphmod._program import Program
from graphmod.plugins._common import template_or

MetricFn = Callable[[Any, Any], Any]
"""``fn(outputs, batch) -> per-example array``, traced with ``jax.jit`` (use ``jnp``)."""


class Validation(Plugin):
    """Evaluates the current variables on ``source`` and fires a ``validated`` event.

    On each due event it runs ``program.infer`` (in inference mode: no dropout, running
    batch-norm statistics) with ``event.state.variables`` over every row of ``source``
    once, in padded batches, and fires ``validated`` with
    ``metrics={prefix + name: float}`` (plugins such as ``EarlyStopping`` and ``Print``
    read them there). The inference call gets the entries of each batch its function
    takes: a dict batch by argument name, a tuple batch by position (so
    ``program.derive(lambda m, x: m(x))`` over ``(x, y)`` batches gets ``x``); metric
    functions get the whole batch. One jitted function computes each batch's masked sums,
    and the loop waits on the device once per evaluation. See the module docstring for
    what is averaged.

    Args:
        program: an inference program over the trained model, e.g.
            ``program.derive(lambda m, x: m(x))``, or the training program itself.
        source: an :class:`graphmod.data.ArraySource` of held-out data.
        metrics: ``{name: fn(outputs, batch) -> per-example array}`` (default: the
            program's own outputs).
        every: the events to validate on (default: ``On("epoch_end")``).
        prefix: put before every metric name.
        name: the plugin's name (and the ``issuer`` of its events).

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
    """

    def __init__(self, program: Program, source: Any, *,
                 metrics: Mapping[str, MetricFn] | None = None, every: Template | str | None = None,
                 prefix: str = "valid/", name: str = "validation") -> None:
        if not isinstance(program, Program):
            raise TypeError(f"Validation(program): expected a graphmod Program (e.g. "
                            f"program.derive(lambda m, x: m(x))), got {type(program).__name__}")
        if not hasattr(source, "iter_padded"):
            raise TypeError(f"Validation(source): expected a graphmod.data.ArraySource (it "
                            f"pads and masks the final batch), got {type(source).__name__}")
        if metrics is not None:
            if not isinstance(metrics, Mapping) or not metrics:
                raise TypeError(f"Validation(metrics=...): expected a non-empty dict "
                                f"{{name: fn(outputs, batch)}}, got {metrics!r}")
            for key, fn in metrics.items():
                if not isinstance(key, str) or not callable(fn):
                    raise TypeError(f"Validation(metrics=...): entry {key!r} must map a "
                                    f"name to fn(outputs, batch), got {fn!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"Validation(prefix={prefix!r}): expected a string")
        super().__init__(name=name,
                         every=template_or(every, On("epoch_end"), "Validation"))
        self.program = program
        self.source = source
        self.metrics = dict(metrics) if metrics is not None else None
        self.prefix = prefix
        self.history: list[tuple[int, dict[str, float]]] = []
        self._parameters = _parameters(program.fn)
        self._sums = jax.jit(self._batch_sums)

    def __call__(self, event: Event) -> None:
        results = self.evaluate(_variables(event.state, self.name))
        self.history.append((event.time.step, results))
        event.loop.fire("validated", metrics=results)

    def evaluate(self, variables: dict) -> dict[str, float]:
        """``{prefix + name: mean}`` over every row of the source, for ``variables``."""
        totals: Any = None
        rows = 0
        for batch, mask in self.source.iter_padded():
            sums = self._sums(variables, batch, mask)
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
            rows += int(mask.sum())
        host = jax.device_get(totals)  # the one wait on the device
        return {self.prefix + key: float(value) / rows for key, value in host.items()}

    # -- traced ---------------------------------------------------------------------------------
    def _batch_sums(self, variables: dict, batch: Any, mask: jax.Array) -> dict[str, jax.Array]:
        args, kwargs = self._arguments(batch)
        outputs = self.program.infer(variables, *args, **kwargs)
        if self.metrics is not None:
            values = {key: fn(outputs, batch) for key, fn in self.metrics.items()}
        else:
            values = _as_metrics(outputs)
        rows = mask.shape[0]
        sums = {}
        for key, value in values.items():
            value = jnp.asarray(value)
            if not jnp.issubdtype(value.dtype, jnp.floating):
                value = value.astype(jnp.float32)
            if value.ndim == 0:
                sums[key] = value * mask.sum()
            elif value.shape[0] == rows:
                per_example = value.reshape(rows, -1).mean(axis=1)
                sums[key] = jnp.where(mask, per_example, 0).sum()
            else:
                raise ValueError(
                    f"{self.name}: metric {key!r} has shape {value.shape}; expected a scalar "
                    f"or per-example values with a first axis of the batch size {rows} "
                    f"(return per-example values, or pass metrics={{name: fn}})")
        return sums

    def _arguments(self, batch: Any) -> tuple[tuple, dict]:
        """The entries of ``batch`` that the program's function takes."""
        positional, names, var_args, var_kwargs = self._parameters
        if isinstance(batch, Mapping):
            if var_kwargs:
                return (), dict(batch)
            missing = [n for n, required in names.items() if required and n not in batch]
            if missing:
                raise ValueError(f"{self.name}: the program's function takes {missing}, which "
                                 f"the batches of the source lack (they have {sorted(batch)})")
            return (), {k: batch[k] for k in names if k in batch}
        if isinstance(batch, tuple | list):
            return (tuple(batch) if var_args else tuple(batch[:positional])), {}
        return (batch,), {}


def _parameters(fn: Callable[..., Any]) -> tuple[int, dict[str, bool], bool, bool]:
    """Of ``fn(model, ...)``: positional count, names (required?), *args, **kwargs."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return 0, {}, True, True  # unknown: pass the whole batch
    kinds = inspect.Parameter
    positional = sum(p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
                     for p in parameters)
    names = {p.name: p.default is kinds.empty for p in parameters
             if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    return (positional, names, any(p.kind is kinds.VAR_POSITIONAL for p in parameters),
            any(p.kind is kinds.VAR_KEYWORD for p in parameters))


def _as_metrics(outputs: Any) -> dict[str, Any]:
    """A program's output as named values: a dict, ``(cost, dict)``, or a scalar loss."""
    if isinstance(outputs, Mapping):
        return dict(outputs)
    if isinstance(outputs, tuple) and len(outputs) == 2 and isinstance(outputs[1], Mapping):
        first = outputs[0]
        base = _as_metrics(first) if isinstance(first, Mapping | tuple) else {"loss": first}
        return {**base, **outputs[1]}
    if not isinstance(outputs, tuple | list) and np.ndim(outputs) == 0:
        return {"loss": outputs}
    shape = getattr(outputs, "shape", type(outputs).__name__)
    raise TypeError(f"Validation: the program returned {shape}, not metrics (a dict of "
                    "per-example or scalar values, (cost, dict), or a scalar); pass "
                    "metrics={name: fn(outputs, batch) -> per-example array}")


def _variables(state: Any, who: str) -> dict:
    variables = getattr(state, "variables", state)
    if not isinstance(variables, Mapping) or "model" not in variables:
        raise TypeError(f"{who}: the loop's train state has no program variables (expected "
                        f"a graphmod.TrainState with .variables, got {type(state).__name__})")
    return dict(variables)
