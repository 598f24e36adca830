"""``SelectiveBackprop``: each training step learns from the examples of the batch it gets
most wrong (Jiang et al., 2019, "Accelerating Deep Learning by Focusing on the Biggest
Losers"; as Composer's ``selective_backprop``).

A manager over the program's inputs and its cost (a :meth:`graphmod.Manager.wrap_program`
layer): in a training step an extra forward pass in inference mode (no dropout, running
statistics, no state written, no gradient) computes each example's loss; the fraction
``keep`` of the batch with the highest losses, in batch order, is what the step's function
then sees, forward and backward. The number kept is static (``int(keep * batch)``, from
``jax.lax.top_k``), so the step compiles once.

Per-example losses
    By default the program's own function on each example alone (``fn(model, x[i:i+1],
    y[i:i+1])``, its cost if it returns ``(cost, metrics)``), vmapped over the batch: right
    for a cost that is a mean over examples (cross-entropy, squared error). A cost that
    mixes examples (a contrastive loss), or a cheaper ranking, takes ``loss=``: a function
    of the program's arguments returning one loss per example, ``loss(model, x, y) -> (B,)``,
    run the same way (inference mode, no gradient).

The batch
    Every argument of the function (after the model) whose leaves have the batch on axis 0:
    by default each array leaf whose leading axis is that of the first; ``arguments=``
    names them instead. Other arguments are passed as they are.

Schedule
    ``start`` and ``end`` (steps, or fractions of ``steps`` when floats in [0, 1]) and
    ``interrupt`` (every ``interrupt``-th step a plain step, Composer's; 0: never): the
    step counts from the manager's own counter, ``variables["managers"][name]["/"]
    ["program"]["step"]``, so a resumed run selects at the same steps, and switching on and
    off is a traced flag (a ``lax.cond``): it never retraces. Always on (the default:
    ``start=0``, no ``end``, ``interrupt=0``) compiles the selecting step alone.

Metrics and trace
    ``metrics["selective_backprop.kept"]`` is the number of examples the step learned from,
    ``metrics["selective_backprop.batch_loss"]`` the mean loss over the whole batch (the
    ranking pass's when selecting, the step's own otherwise); ``metrics["loss"]`` is the
    kept examples'. The rewrite trace shows each batch argument cut, e.g.
    ``(128, 64)->(64, 64)``.

Randomness
    ``sample=True`` draws the kept examples as Composer does (without replacement, the
    example of loss rank ``r`` of ``B`` with probability proportional to
    ``((r + 0.5) / B) ** (1 / keep - 1)``), from the step key folded with CRC32 of the
    manager's name: bitwise the same in a resumed run. The default keeps the top losses,
    drawing nothing.

Order
    ``kinds = ("batch_selection",)``, ``runs_before = ("augmentation",)``: it ranks the
    examples before ``Mixup`` or ``LabelSmoothing`` rewrite them, wherever it is listed.

Sharp edges
    What the function computes from the batch (its metrics, monitored activations) is of
    the kept examples. The ranking pass reads what inference reads: with ``EMA``, the
    averages. With a schedule, a monitored value's shape must not depend on the batch (the
    two ways of the step return the same shapes), and the ``lax.cond`` costs time: each way
    is rematerialized in the backward pass (but the kept batch, saved), which brought the
    character LM's plain steps inside it from 1.5x to 1.14x the plain step's time on CPU
    (and its selecting steps from 1.19x to 0.72x; always on: 0.41x). ``keep * batch``
    must be at least 1; keep 1.0 is the plain step.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Unpack

import jax
import jax.numpy as jnp

import graphmod as gm
from graphmod.typing import ProgramContext, PyTree
from managers._checks import ManagerOptions


class SelectiveBackprop(gm.Manager):
    """Selective Backprop: each training step backpropagates through the ``keep``
    fraction of the batch with the highest losses, ranked by an extra forward pass in
    inference mode (see the module docstring). Named ``"selective_backprop"``.

    Args:
        keep: in (0, 1]: the fraction of the batch kept (Composer's default 0.5).
        start, end: where the selecting steps start and end: step numbers (ints), or
            fractions of ``steps`` (floats in [0, 1]); ``end=None``: never.
        interrupt: every ``interrupt``-th step of the interval is a plain step (0: none).
        steps: the run's length in steps, for fractional ``start``/``end``.
        sample: draw the kept examples by loss rank (Composer's) instead of the top ones.
        loss: ``loss(model, *args, **kwargs) -> (batch,)`` losses to rank by (default:
            the function's cost on each example alone).
        arguments: names of the function's arguments that hold the batch (default: every
            array whose axis 0 is the batch).

    Examples:
        >>> import jax, jax.numpy as jnp, optax, graphmod as gm, managers
        >>> from flax import nnx
        >>> lin = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> cost = lambda m, x, y: ((m(x) - y) ** 2).mean()
        >>> program = gm.compile(cost, lin, managers=[managers.SelectiveBackprop(0.5)])
        >>> x, y = jnp.ones((8, 2)), jnp.arange(8.0)[:, None]
        >>> step = gm.optimize(program, optax.sgd(0.1))
        >>> state, metrics = step(step.init(program.init(x, y), jax.random.key(0)), x, y)
        >>> int(metrics["selective_backprop.kept"]), program.rewrites.train[0].shape_out
        (4, (4, 2))
    """

    kinds = ("batch_selection",)
    runs_before = ("augmentation",)  # rank the examples as they come, then mix them

    def __init__(self, keep: float = 0.5, *, start: float = 0, end: float | None = None,
                 interrupt: int = 0, steps: int | None = None, sample: bool = False,
                 loss: Callable[..., jax.Array] | None = None,
                 arguments: Sequence[str] | None = None,
                 **kwargs: Unpack[ManagerOptions]) -> None:
        if any(kwargs.get(f) is not None for f in ("bricks", "roles", "applications", "path",
                                                   "variable_name", "name_regex", "call_id",
                                                   "filter")):
            raise TypeError("SelectiveBackprop selects examples of the program's batch, not "
                            "variables: it takes no filter fields (bricks=, roles=, ...); "
                            "name the batch's arguments with arguments=")
        super().__init__(**kwargs)
        if isinstance(keep, bool) or not isinstance(keep, numbers.Real) or not 0 < keep <= 1:
            raise ValueError(f"SelectiveBackprop(keep={keep!r}): must be a float in (0, 1], "
                             "the fraction of the batch kept (0.5 is usual)")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                                  or steps < 1):
            raise ValueError(f"SelectiveBackprop(steps={steps!r}): must be an int >= 1, the "
                             "run's length in steps")
        self.keep = float(keep)
        self.start = _step_of("start", start, steps)
        self.end = None if end is None else _step_of("end", end, steps)
        if self.end is not None and self.end <= self.start:
            raise ValueError(f"SelectiveBackprop(start={start!r}, end={end!r}): end must "
                             "come after start")
        if isinstance(interrupt, bool) or not isinstance(interrupt, int) or interrupt < 0:
            raise ValueError(f"SelectiveBackprop(interrupt={interrupt!r}): must be an int "
                             ">= 0 (every interrupt-th step is a plain one; 0: none)")
        if not isinstance(sample, bool):
            raise TypeError(f"SelectiveBackprop(sample={sample!r}): expected True or False")
        if loss is not None and not callable(loss):
            raise TypeError(f"SelectiveBackprop(loss={loss!r}): expected a function "
                            "loss(model, *args, **kwargs) returning one loss per example")
        if arguments is not None and (isinstance(arguments, str) or not all(
                isinstance(a, str) for a in arguments)):
            raise TypeError(f"SelectiveBackprop(arguments={arguments!r}): expected a list "
                            "of argument names, e.g. ['x', 'y']")
        self.interrupt = interrupt
        self.steps = steps
        self.sample = sample
        self.loss = loss
        self.arguments = None if arguments is None else tuple(arguments)

    @property
    def always(self) -> bool:
        """Whether every training step selects (no schedule: nothing to switch)."""
        return self.start == 0 and self.end is None and self.interrupt == 0

    def wrap_program(self, call: ProgramContext, next: Callable[..., PyTree],
                     args: tuple[PyTree, ...], kwargs: dict[str, PyTree]) -> PyTree:
        if not call.training:
            return next(*args, **kwargs)
        counter = call.variable("step", lambda: jnp.zeros((), jnp.int32))
        if call.mode == "init":
            return next(*args, **kwargs)
        # A gm.OwnedVariable: its stored, which OwnedVariableLike does not name.
        step = counter.stored  # pyright: ignore[reportAttributeAccessIssue]
        counter.value = step + 1
        bound = inspect.signature(call.function).bind(call.model, *args, **kwargs)
        batch = self._batch(call, dict(list(bound.arguments.items())[1:]))
        size = jnp.shape(jax.tree.leaves(batch)[0])[0]
        kept = int(self.keep * size)
        if kept < 1:
            raise ValueError(f"SelectiveBackprop(keep={self.keep}) keeps "
                             f"int({self.keep} * {size}) = 0 examples of a batch of {size}: "
                             "raise keep or the batch size")
        if kept == size:  # keep 1.0: the plain step
            call.report("kept", jnp.int32(size))
            return next(*args, **kwargs)

        def selecting() -> PyTree:
            losses = call.infer(self._losses, call, next, bound, batch)
            call.report("kept", jnp.int32(kept))
            call.report("batch_loss", jnp.mean(losses))
            chosen = self._chosen(call, losses, kept)
            for name, value in batch.items():  # saved: a backward pass ranks nothing again
                cut = call.saved(jax.tree.map(lambda leaf: jnp.take(leaf, chosen, axis=0), value))
                call.note_input(name, value, cut)
                bound.arguments[name] = cut
            return next(*bound.args[1:], **bound.kwargs)

        def whole() -> PyTree:
            call.report("kept", jnp.int32(size))
            out = next(*args, **kwargs)
            call.report("batch_loss", jax.lax.stop_gradient(_cost(out, self)))
            return out

        return call.switch(True if self.always else self._on(step), selecting, whole)

    def _on(self, step: jax.Array) -> jax.Array:
        """Whether step ``step`` (from 0) selects: Composer's ``should_selective_backprop``."""
        on = step >= self.start
        if self.end is not None:
            on &= step < self.end
        if self.interrupt:
            on &= (step + 1) % self.interrupt != 0
        return on

    def _batch(self, call: ProgramContext, arguments: Mapping[str, PyTree]
               ) -> dict[str, PyTree]:
        """The function's arguments that hold the batch, by name (see the module docstring)."""
        if self.arguments is not None:
            missing = [a for a in self.arguments if a not in arguments]
            if missing:
                raise TypeError(f"SelectiveBackprop(arguments={list(self.arguments)}): "
                                f"{call.name} has no argument {missing[0]!r}; its arguments "
                                f"are {list(arguments)}")
            chosen = {a: arguments[a] for a in self.arguments}
        else:
            chosen = {a: v for a, v in arguments.items()
                      if jax.tree.leaves(v) and all(jnp.ndim(leaf) >= 1 for leaf in
                                                    jax.tree.leaves(v))}
        sizes = {a: {jnp.shape(leaf)[0] for leaf in jax.tree.leaves(v) if jnp.ndim(leaf)}
                 for a, v in chosen.items()}
        if not chosen:
            raise TypeError(f"SelectiveBackprop: {call.name} takes no batched array after "
                            "the model; name the batch's arguments with arguments=[...]")
        size = next(iter(sizes[next(iter(chosen))]))
        if self.arguments is None:
            chosen = {a: v for a, v in chosen.items() if sizes[a] == {size}}
        for name, found in sizes.items():
            if name in chosen and found != {size}:
                raise ValueError(f"SelectiveBackprop: argument {name!r} of {call.name} has "
                                 f"leading axes {sorted(found)}, not the batch's {size}: "
                                 "every argument named in arguments= holds the batch on axis 0")
        return chosen

    def _losses(self, call: ProgramContext, next: Callable[..., PyTree],
                bound: inspect.BoundArguments, batch: dict[str, PyTree]) -> jax.Array:
        """One loss per example of ``batch``, as the ranking pass computes them."""
        rest = {a: v for a, v in bound.arguments.items() if a not in batch}
        if self.loss is not None:
            losses = self.loss(*bound.args, **bound.kwargs)
        else:
            def alone(example: dict[str, PyTree]) -> jax.Array:
                arguments = {**rest, **example}
                again = bound.signature.bind(**arguments)
                return _cost(next(*again.args[1:], **again.kwargs), self)

            ones = jax.tree.map(lambda leaf: leaf[:, None], batch)  # each a batch of one
            losses = jax.vmap(alone)(ones)
        size = jnp.shape(jax.tree.leaves(batch)[0])[0]
        if jnp.shape(losses) != (size,):
            raise ValueError(f"SelectiveBackprop: the losses to rank have shape "
                             f"{jnp.shape(losses)}; expected one per example, ({size},)")
        return losses.astype(jnp.float32)

    def _chosen(self, call: ProgramContext, losses: jax.Array, kept: int) -> jax.Array:
        """The positions of the examples kept, in batch order."""
        scores = losses
        if self.sample:  # Gumbel top-k: a draw without replacement by rank probability
            size = losses.shape[0]
            rank = jnp.argsort(jnp.argsort(losses))  # 0: the lowest loss
            log_p = (1 / self.keep - 1) * jnp.log((rank + 0.5) / size)
            scores = log_p + jax.random.gumbel(call.rng("select"), (size,))
        return jnp.sort(jax.lax.top_k(scores, kept)[1])


def _step_of(argument: str, value: float, steps: int | None) -> int:
    """A schedule bound as a step: an int as it is, a float in [0, 1] of ``steps``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
        raise ValueError(f"SelectiveBackprop({argument}={value!r}): must be a step (an int "
                         ">= 0) or a fraction of steps= (a float in [0, 1])")
    if isinstance(value, numbers.Integral):
        return int(value)
    if value > 1:
        raise ValueError(f"SelectiveBackprop({argument}={value!r}): a float is a fraction of "
                         "the run, in [0, 1]; give a step as an int")
    if steps is None:
        raise ValueError(f"SelectiveBackprop({argument}={value!r}) is a fraction of the run: "
                         "pass steps= (the run's length in steps), or give a step as an int")
    return int(value * steps)


def _cost(out: PyTree, manager: SelectiveBackprop) -> jax.Array:
    """The cost of what the program's function returned: a cost or ``(cost, metrics)``."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        out = out[0]
    cost = jnp.asarray(out)  # the traced cost itself (no copy, no operation)
    if cost.ndim != 0:
        raise ValueError(
            f"SelectiveBackprop {manager.name!r} ranks examples by the function's cost on "
            f"each alone, but it returned shape {cost.shape}: return a scalar cost (or "
            "(cost, metrics)), or pass loss=lambda model, *args: per_example_losses")
    return cost
