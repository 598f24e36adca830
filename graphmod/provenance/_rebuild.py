"""``rebuild``: the bricks, managers and optimizer of a record, constructed again.

Safety: a record is data, and one from elsewhere may be crafted (the threat model is in
``docs/concepts/provenance.md``). One walker,
:class:`~graphmod.provenance._decoder.RecordDecoder`, reads every tag by its class in
``graphmod._core._codec``, in two passes over everything rebuild will construct (root brick,
managers, monitor filters, optimizer):

1. **Check** (``dry=True``): every import path is checked by
   :meth:`~graphmod.provenance._names.Rules.check` (public, on the allow list of
   constructors and pure functions or an exact name the caller allowed, calls only to listed
   factories; see ``_names``), and every
   entry's shape (a ``$call`` has a function and keyword arguments, a ``$partial`` wraps a
   function, dtypes are numeric, tags are known, nothing is opaque). Nothing is imported,
   constructed or called, so a crafted record is refused, with the field that names the
   culprit, before anything it names is imported.
2. **Construct**: the same walk, each path checked again and resolved by
   :meth:`~graphmod.provenance._names.Rules.resolve`, which verifies what it reached. The root
   and ``$brick`` classes must be graphmod bricks, managers graphmod ``Manager`` subclasses,
   a ``$class`` a brick, manager or Flax module class, an ``$enum`` an ``enum.Enum``. Only
   listed factories are called; functions recorded as values are handed to the bricks that
   take them, never called here. Nothing is unpickled or evaluated.

Any malformed entry raises :class:`RebuildError` naming its field, never a bare
``KeyError`` or ``TypeError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
import optax
from flax import nnx

from graphmod._core._codec import construct
from graphmod._core._managers._manager import Manager
from graphmod._core._model._layout import Layout
from graphmod._core._selection._filter import VariableFilter
from graphmod._records._collect import Described, brick_records, modules, parameter_records
from graphmod._records._frozen import Frozen
from graphmod._records._record import Provenance, several_models
from graphmod._train._program import Program, compile
from graphmod.data import FittedTransforms
from graphmod.provenance._decoder import RecordDecoder
from graphmod.provenance._names import RebuildError, Rules
from graphmod.provenance._transforms import transforms as read_transforms
from graphmod.typing import ArrayTree

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """What :func:`rebuild` constructed from a record.

    Attributes:
        model: the root brick, built with the recorded arguments and RNG key data (or
            the model given to ``rebuild(..., model=...)``).
        managers: the managers, in the recorded chain order, their bricks resolved by path.
        optimizer: the optax transformation, or None when the record does not say how to
            make it (see ``provenance.optimizer``).
        monitor: the program's monitor filters (a dict; empty if none).
        seeds: name → typed PRNG key (``"init"``: ``program.init``'s, ``"train"``: the one
            given to ``step.init``).
        trainable: what a training record's ``optimize(..., trainable=...)`` trained, for
            ``optimize`` again: a filter per recorded parameter path and the managers whose
            parameters trained; None when every parameter trained (or for a program record).
        provenance: the record rebuilt from.
        allowed: the names this rebuild admitted beyond graphmod's list, as the caller gave
            them (``allow=`` and ``allow_factories=``), sorted; empty by default.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> program = gm.compile(lambda m, x: m(x).sum(),
        ...                      gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> _ = program.init(jnp.ones((4, 2)))
        >>> again = gm.rebuild(program.provenance)
        >>> again
        Rebuilt(Linear from a program record; managers: none; optimizer: none; seeds: init)
        >>> args, kwargs = again.example_arguments()
        >>> args[0].shape, again.managers, again.optimizer, again.allowed
        ((4, 2), (), None, ())
    """

    model: nnx.Module
    managers: tuple[Manager, ...]
    optimizer: optax.GradientTransformation | None
    monitor: Mapping[str, VariableFilter]
    seeds: Mapping[str, jax.Array]
    trainable: tuple[VariableFilter | Manager, ...] | None
    provenance: Provenance
    allowed: tuple[str, ...] = ()

    def __repr__(self) -> str:
        """One line: the model's class, the record's kind, the managers, optimizer and
        seeds (the model itself can print as thousands of lines)."""
        managers = ", ".join(f"{m.name}: {type(m).__name__}" for m in self.managers)
        optimizer = "made" if self.optimizer is not None else "none"
        return (f"Rebuilt({type(self.model).__name__} from a {self.provenance.kind} record;"
                f" managers: {managers or 'none'}; optimizer: {optimizer}; seeds: "
                f"{', '.join(self.seeds) or 'none'}"
                + ("" if self.trainable is None else f"; trainable: {len(self.trainable)}")
                + (f"; allowed: {', '.join(self.allowed)}" if self.allowed else "") + ")")

    @property
    def transforms(self) -> FittedTransforms | None:
        """The fitted transforms the record holds (a ``graphmod.data.FittedTransforms``;
        None without), which :meth:`compile` passes on."""
        return read_transforms(self.provenance)

    def compile(self, fn: Callable[..., object], **kwargs: Any) -> Program:
        """``graphmod.compile(fn, model, managers=managers, monitor=..., transforms=...)``."""
        kwargs.setdefault("managers", self.managers)
        if "transforms" not in kwargs and (fitted := self.transforms) is not None:
            kwargs["transforms"] = fitted
        if self.monitor:
            kwargs.setdefault("monitor", self.monitor.get("", self.monitor)
                              if set(self.monitor) == {""} else dict(self.monitor))
        axis = self.provenance.inputs.get("axis_name")
        if axis is not None:
            kwargs.setdefault("axis_name", axis)
        return compile(fn, self.model, **kwargs)

    def example_arguments(self) -> tuple[tuple[ArrayTree, ...], dict[str, ArrayTree]]:
        """Zeros of the recorded example shapes: ``(args, kwargs)`` for ``program.init``."""
        examples = self.provenance.inputs.get("example_shapes")
        if examples is None:
            raise RebuildError("rebuild: the record holds no example shapes (its program's "
                               "init had not run)")

        def make(node: Frozen) -> ArrayTree:
            if isinstance(node, Mapping) and set(node) == {"shape", "dtype"}:
                return np.zeros(node["shape"], np.dtype(node["dtype"]))
            if isinstance(node, Mapping):
                return {k: make(v) for k, v in node.items()}
            if not isinstance(node, tuple):
                raise TypeError(f"rebuild: example_shapes holds {node!r}, not a shape, list "
                                "or mapping; the record is damaged")
            return [make(v) for v in node]

        arguments = examples["arguments"]
        positional = list(examples["positional"])
        args = tuple(make(arguments[name]) for name in positional)
        kwargs = {k: make(v) for k, v in arguments.items() if k not in positional}
        return args, kwargs

    def check_data(self, source: object, *, name: str = "data") -> None:
        """Raises unless ``source`` describes itself as the recorded data (same content
        hash, size and shapes)."""
        recorded = self.provenance.inputs.get(name)
        if recorded is None or not (isinstance(source, Described) and callable(source.describe)):
            raise RebuildError(f"check_data: the record has no {name!r} description, or the "
                               "source cannot describe itself")
        actual = source.describe()
        differing = [k for k in ("sha256", "size", "shapes", "dtypes")
                     if k in recorded and _thaw(recorded[k]) != actual.get(k)]
        if differing:
            raise RebuildError(f"check_data: the source differs from the recorded data in "
                               f"{', '.join(differing)}")


def _thaw(value: object) -> object:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _verify(record: Provenance, model: nnx.Module, decoder: RecordDecoder) -> None:
    """Raises if the rebuilt model's modules or parameters differ from the record's."""
    recorded_bricks = decoder.mapping(record.inputs.get("bricks") or {}, "bricks")
    recorded_params = decoder.mapping(record.inputs.get("parameters") or {}, "parameters")
    bricks = brick_records(model)
    params = parameter_records(Layout(model))
    problems = []
    for path in sorted(set(recorded_bricks) | set(bricks)):
        a, b = recorded_bricks.get(path), bricks.get(path)
        if a is None or b is None:
            problems.append(f"module {path}: {'only rebuilt' if a is None else 'missing'}")
        elif (recorded := decoder.mapping(a, f"bricks[{path!r}]").get("class")) != b["class"]:
            problems.append(f"module {path}: recorded {recorded}, rebuilt {b['class']}")
    for path in sorted(set(recorded_params) | set(params)):
        a, b = recorded_params.get(path), params.get(path)
        if a is None or b is None:
            problems.append(f"variable {path}: {'only rebuilt' if a is None else 'missing'}")
            continue
        for field in ("shape", "dtype", "role", "aliases"):
            recorded = _thaw(decoder.mapping(a, f"parameters[{path!r}]").get(field))
            if recorded != b[field]:
                problems.append(f"variable {path}: {field} recorded {recorded}, "
                                f"rebuilt {b[field]}")
    if problems:
        raise RebuildError(
            "rebuild: the rebuilt model differs from the recorded one (was the model changed "
            "after construction, or did a library change?):\n  " + "\n  ".join(problems[:20]))


def rebuild(provenance: Provenance | str, *, model: nnx.Module | None = None,
            allow: Iterable[str] = (), allow_factories: Iterable[str] = (),
            verify: bool = True) -> Rebuilt:
    """Constructs the model, managers and optimizer a provenance record describes.

    The root brick is constructed with its recorded arguments (RNG streams restored with
    their recorded key data and counts, so its parameters come out the same), then each
    manager (bricks it names resolved by path in the new model), then the optimizer if it
    was recorded. Compiling the same function over them gives the same graph fingerprint.
    A model whose construction is not recorded (an unmodified Flax model: graphmod records
    how bricks are made, not other modules) is yours to construct and pass as ``model=``;
    it is checked against the record like a rebuilt one, and the rest is rebuilt for it.

    A record is data and may be crafted: every name in it must be on an allow list of
    constructors and pure functions (``graphmod.provenance.default_names()``: layers,
    initializers, activations, optax's functions, dtypes) or one you add; rebuild constructs
    only graphmod bricks and managers and calls only the factories of
    ``graphmod.provenance.DEFAULT_FACTORIES`` (initializers, optax transformations and
    schedules); functions recorded as values (``jax.nn.relu``) are never called by rebuild
    itself. Every import path in the record is checked *before anything it names is
    imported*; a refusal names the record's field. See "Threat model" in the provenance
    docs.

    Args:
        provenance: a program, training or evaluation record (for an evaluation, its
            model's), or its JSON text.
        model: the model to use instead of constructing the recorded root brick (the
            same model as recorded, e.g. constructed by your code as before).
        allow: names to admit besides the default list: exact dotted names of your classes
            and functions as the record gives them (``["mypackage.layers.Scaled",
            "mypackage.activations.swish"]``; each is imported now, and must be public), or a
            top-level package of yours (``["mypackage"]``), which admits the classes defined
            in it and nothing else of it. The distributions of the default list (graphmod,
            managers, jax, flax, optax) cannot be given as packages.
        allow_factories: exact names of public Python functions rebuild may also call with
            recorded arguments (``["mypackage.initializers.scaled"]``: an initializer made
            by your own factory); each is admitted as a name too.
        verify: check that the rebuilt model's modules, classes and parameter shapes,
            dtypes, roles and aliases are the recorded ones.

    Returns:
        :class:`Rebuilt` with ``model``, ``managers``, ``optimizer``, ``monitor``,
        ``seeds`` and ``compile(fn)``.

    Raises:
        TypeError: ``allow=`` or ``allow_factories=`` is not a list of strings, or ``model``
            is not a Flax module.
        ValueError: an ``allow=`` or ``allow_factories=`` entry is not an exact public name
            of a class or function (or a package name), or cannot be imported.
        RebuildError: the record names something not allowed (nothing is imported then),
            something missing, a malformed entry or a value recorded as opaque; or the
            rebuilt model differs from the record.
        ProvenanceError: ``provenance`` is text that is not a provenance record.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm, managers
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([3, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> drop = managers.Dropout(0.5, bricks=mlp.linear_layers, roles=[gm.roles.INPUT])
        >>> cost = lambda m, x: (m(x) ** 2).mean()
        >>> program = gm.compile(cost, mlp, managers=[drop])
        >>> _ = program.init(jnp.ones((2, 3)))
        >>> again = gm.rebuild(gm.Provenance.from_json(program.provenance.to_json()))
        >>> twin = again.compile(cost)
        >>> _ = twin.init(jnp.ones((2, 3)))
        >>> twin.provenance.fingerprint == program.provenance.fingerprint
        True
        >>> bool((again.model.linear_layers[0].W[...] == mlp.linear_layers[0].W[...]).all())
        True
    """
    provenance = _record(provenance, "rebuild")
    if several_models(provenance) is not None:
        names = list(provenance.inputs["order"])
        raise RebuildError(
            f"rebuild: this record is a run of several models ({', '.join(names)}); rebuild "
            "them all with graphmod.provenance.rebuild_models(record), or one with "
            f"rebuild(record.models[{names[-1]!r}])")
    if provenance.kind == "evaluation":
        nested = provenance.model
        if nested is None:
            raise RebuildError("rebuild: this evaluation record holds no model record")
        provenance = nested
    model = _module(model, "rebuild(model=...)")
    plan = _Plan(provenance, model, Rules.widened(allow, allow_factories))  # imports nothing
    return plan.build(verify)


def rebuild_models(provenance: Provenance | str, *,
                   models: Mapping[str, nnx.Module] | None = None, allow: Iterable[str] = (),
                   allow_factories: Iterable[str] = (), verify: bool = True
                   ) -> dict[str, Rebuilt]:
    """Rebuilds every stepping model of a run of several models, as :func:`rebuild` does one.

    A record of ``graphmod.Loop({"disc": d_step, "gen": g_step}, ...)`` (from
    ``capture(loop)`` or a checkpoint, ``graphmod.provenance.read(directory)``) holds each
    model's own training record under its name (``record.models``). Each one is checked
    as :func:`rebuild` checks a record, *all of them before anything any of them names is
    imported*, then each is constructed. A frozen model (step None) has no program: it is
    left out, and its state (its variables) is yours to give again.

    Args:
        provenance: a training record of several models, or its JSON text.
        models: by model name, the model to use instead of constructing that model's
            recorded root brick (``rebuild(..., model=...)`` for each).
        allow, allow_factories, verify: as for :func:`rebuild`, for every model.

    Returns:
        ``{name: Rebuilt}`` for each stepping model, in the loop's order.

    Raises:
        RebuildError: as :func:`rebuild`, the message naming the model
            (``models['gen']: ...``); or the record is not one of several models.
        TypeError, ValueError: as :func:`rebuild`; ``models=`` names a model the record
            lacks or a frozen one.

    Examples:
        >>> import jax, jax.numpy as jnp, graphmod as gm
        >>> from flax import nnx
        >>> programs = {name: gm.compile(lambda m, x: (m(x) ** 2).mean(),
        ...                              gm.bricks.Linear(2, 1, rngs=nnx.Rngs(seed)))
        ...             for seed, name in enumerate(["a", "b"])}
        >>> steps = {k: gm.optimize(p, gm.provenance.optimizer("sgd", 0.1))
        ...          for k, p in programs.items()}
        >>> loop = gm.Loop(steps, [(jnp.ones((4, 2)),)] * 2)
        >>> _ = loop.run({k: steps[k].init(p.init(jnp.ones((4, 2))), jax.random.key(0))
        ...               for k, p in programs.items()})
        >>> again = gm.provenance.rebuild_models(gm.provenance.capture(loop))
        >>> sorted(again), again["b"].optimizer is not None
        (['a', 'b'], True)
        >>> bool((again["b"].model.W[...] == programs["b"].model.W[...]).all())
        True
    """
    provenance = _record(provenance, "rebuild_models")
    if several_models(provenance) is None:
        raise RebuildError("rebuild_models: this record is not a run of several models (it "
                           "holds no models and order); rebuild it with "
                           "graphmod.provenance.rebuild(record)")
    records = provenance.models or {}
    if models is not None and not isinstance(models, Mapping):
        raise TypeError("rebuild_models(models=...): expected a dict of models by name, got "
                        f"{type(models).__name__}")
    given = {name: _module(model, f"rebuild_models(models={{{name!r}: ...}})")
             for name, model in (models or {}).items()}
    for name in given:
        if records.get(name) is None:
            raise ValueError(
                f"rebuild_models(models={{{name!r}: ...}}): the record "
                f"{'freezes' if name in records else 'has no'} model {name!r}; its stepping "
                f"models are {[k for k, v in records.items() if v is not None]}")
    rules = Rules.widened(allow, allow_factories)
    plans = {}
    for name, record in records.items():  # 1. every model checked: nothing imported yet
        if record is not None:
            with _naming(name):
                plans[name] = _Plan(record, given.get(name), rules)
    built = {}
    for name, plan in plans.items():  # 2. constructed
        with _naming(name):
            built[name] = plan.build(verify)
    return built


def _record(provenance: object, who: str) -> Provenance:
    """``provenance`` as a record (JSON text read), or a TypeError."""
    if isinstance(provenance, str | bytes):
        provenance = Provenance.from_json(provenance)
    if not isinstance(provenance, Provenance):
        raise TypeError(f"{who}: expected a Provenance, got {type(provenance).__name__}")
    return provenance


def _module(model: object, argument: str) -> nnx.Module | None:
    if model is not None and not isinstance(model, nnx.Module):
        raise TypeError(f"{argument}: expected the flax.nnx.Module the record describes, got "
                        f"{type(model).__name__}")
    return model


@contextlib.contextmanager
def _naming(name: str) -> Iterator[None]:
    """Prefixes a :class:`RebuildError` raised inside with the model it concerns."""
    try:
        yield
    except RebuildError as error:
        raise RebuildError(f"models[{name!r}]: {error}") from error.__cause__


class _Plan:
    """One record checked for :func:`rebuild` (the first pass: nothing imported), then
    built by :meth:`build` (the second)."""

    def __init__(self, provenance: Provenance, model: nnx.Module | None, rules: Rules) -> None:
        self.provenance, self.model, self.rules = provenance, model, rules
        inputs = provenance.inputs
        self.check = RecordDecoder(rules, None, dry=True)
        self.root = self.check.mapping(inputs.get("bricks") or {}, "bricks").get("/")
        if self.root is None:
            raise RebuildError("rebuild: the record holds no root brick (bricks['/'])")
        if model is None:
            construct(self.root, self.check, "bricks['/']", "brick",
                      fix="construct the model yourself and pass it, rebuild(record, "
                      "model=model)")
        _the_rest(inputs, self.check)

    def build(self, verify: bool) -> Rebuilt:
        """Constructs what the record describes (checked again as it is resolved)."""
        inputs, model = self.provenance.inputs, self.model
        if model is None:
            model = _built(nnx.Module, construct(self.root, RecordDecoder(
                self.rules, None, dry=False), "bricks['/']", "brick"), "bricks['/']")
        if verify:
            _verify(self.provenance, model, self.check)
        made, monitor, tx, seeds = _the_rest(inputs, RecordDecoder(self.rules, modules(model),
                                                                   dry=False))
        built = tuple(_built(Manager, manager, "managers") for manager in made)
        return Rebuilt(
            model, built,
            None if tx is None else _built(optax.GradientTransformation, tx, "optimizer"),
            {k: _built(VariableFilter, f, f"monitor[{k!r}]") for k, f in monitor.items()},
            {k: _built(jax.Array, key, f"seeds.{k}") for k, key in seeds.items()},
            _trainable(inputs, built), self.provenance, self.rules.added)


def _built(kind: type[_T], value: object, where: str) -> _T:
    """``value`` as the decoder constructed it from ``where``: a ``kind`` (the decoder
    makes nothing else there)."""
    if not isinstance(value, kind):
        raise RebuildError(f"rebuild: {where} was rebuilt as a {type(value).__name__}, not "
                           f"a {kind.__name__}")
    return value


def _trainable(inputs: Mapping[str, Frozen], managers: Sequence[Manager]
               ) -> tuple[VariableFilter | Manager, ...] | None:
    """``trainable=`` selectors from a training record's ``trainable`` entry (paths and
    manager names: data only), refused by field if malformed."""
    record = inputs.get("trainable")
    if record is None:
        return None
    by_name = {manager.name: manager for manager in managers}
    paths, names = (_strings(record, part) for part in ("model", "managers"))
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise RebuildError(f"rebuild: trainable.managers names {unknown}, which are not among "
                           f"the record's managers {sorted(by_name)}")
    # One filter per path, its glob characters taken literally.
    return (*(VariableFilter(path=re.sub(r"([*?\[])", r"[\1]", path)) for path in paths),
            *(by_name[name] for name in names))


def _strings(record: Frozen, part: str) -> Sequence[str]:
    """``record[part]``: a list of strings, or a RebuildError naming ``trainable.<part>``."""
    items = record.get(part) if isinstance(record, Mapping) else None
    if not (isinstance(items, list | tuple) and all(isinstance(item, str) for item in items)):
        raise RebuildError(f"rebuild: trainable.{part} is not a list of strings; the "
                           "record is damaged")
    return items


def _the_rest(inputs: Mapping[str, Frozen], decoder: RecordDecoder
              ) -> tuple[tuple[object, ...], dict[str, object], object, dict[str, object]]:
    """The managers, monitor filters, optimizer and seeds of a record (Nones when dry)."""
    managers = decoder.mapping(inputs.get("managers") or {}, "managers")
    orders: dict[str, int] = {}
    for name, record in managers.items():
        order = decoder.mapping(record, f"managers.{name}").get("order", 0)
        if not isinstance(order, int):
            raise RebuildError(f"rebuild: managers.{name}.order is not an integer")
        orders[name] = order
    ordered = sorted(managers.items(), key=lambda item: orders[item[0]])
    built = tuple(construct(record, decoder, f"managers.{name}", "manager")
                  for name, record in ordered)
    for (name, _), manager in zip(ordered, built, strict=True):
        if isinstance(manager, Manager) and manager.name != name:
            raise RebuildError(f"rebuild: managers.{name} was rebuilt named {manager.name!r}")
    # Program records write monitor filters in the plain form $filter also reads.
    monitor = {label: decoder.tagged("$filter", decoder.mapping(record, f"monitor[{label!r}]"),
                                     f"monitor[{label!r}]")
               for label, record in decoder.mapping(inputs.get("monitor") or {},
                                                    "monitor").items()}
    optimizer = inputs.get("optimizer")
    tx = decoder.tagged("$optimizer", optimizer, "optimizer") \
        if isinstance(optimizer, Mapping) and optimizer.get("name") is not None \
        and optimizer.get("source") != "explicit" else None
    seeds = {name: decoder({"$key": record}, f"seeds.{name}") for name, record
             in decoder.mapping(inputs.get("seeds") or {}, "seeds").items()
             if record is not None}
    return built, monitor, tx, seeds
