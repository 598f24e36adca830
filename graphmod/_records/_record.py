"""``Provenance``: an immutable JSON record of how a program, a run or an evaluation came to be."""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Mapping
from typing import Any

from graphmod._core._naming import did_you_mean
from graphmod._core._number_checks import is_whole_number
from graphmod._records._frozen import (
    Frozen,
    FrozenDict,
    canonical_json,
    freeze,
    parse,
    sha256,
    thaw,
    to_text,
)
from graphmod._records._summary import summary_lines

FORMAT = 1
KINDS = ("program", "training", "evaluation")


class ProvenanceError(ValueError):
    """A provenance record is damaged, or was not written by graphmod: the message says
    what is wrong and where (a line and column of the JSON text, or a field).

    Examples:
        >>> import graphmod as gm
        >>> try:
        ...     gm.Provenance.from_json("{not json")
        ... except gm.provenance.ProvenanceError as error:
        ...     print(str(error)[:72])
        Provenance.from_json: the text is not JSON (Expecting property name encl
    """


def is_record(value: object) -> bool:
    """Whether ``value`` is a record as ``Provenance.to_dict`` writes it (four fields)."""
    return isinstance(value, Mapping) and set(value) == {"format", "kind", "inputs", "derived"}


class Provenance:
    """How a program, a training run or an evaluation came to be, after Tribuo.

    A record has a ``kind`` (``"program"``, ``"training"`` or ``"evaluation"``), *inputs*
    (what determines the result: bricks with their class, constructor configuration, RNG
    key data and parameter shapes; managers with their configuration, filter, order and
    priority; the function; optimizer; data; seeds; library versions; platform) and
    *derived* fields (what happened: the graph fingerprint, the rewrite trace, step and
    example counts, times). Records are immutable (every mapping is read-only, every list a
    tuple), made of JSON values only, and round-trip through :meth:`to_json` and
    :meth:`from_json` exactly; loading JSON never imports or runs anything.
    ``graphmod.rebuild`` constructs the model and managers again from a record, and
    ``graphmod.provenance.diff`` compares two. The training record of a run of several
    models holds each model's own record under its name (:attr:`models`).

    Examples:
        >>> import graphmod as gm
        >>> prov = gm.Provenance("program", {"seeds": {"init": [0, 0]}}, {"fingerprint": None})
        >>> prov.inputs["seeds"]["init"]
        (0, 0)
        >>> gm.Provenance.from_json(prov.to_json()) == prov
        True
        >>> prov.kind = "training"
        Traceback (most recent call last):
        ...
        AttributeError: Provenance records are immutable: cannot set 'kind'
    """

    __slots__ = ("_derived", "_format", "_inputs", "_kind")

    def __init__(self, kind: str, inputs: Mapping[str, object],
                 derived: Mapping[str, object] | None = None, *, format: int = FORMAT) -> None:
        if kind not in KINDS:
            raise ValueError(f"Provenance(kind={kind!r}): must be one of {', '.join(KINDS)}")
        if not is_whole_number(format) or format > FORMAT:
            raise ValueError(f"Provenance(format={format!r}): this graphmod reads formats up "
                             f"to {FORMAT}; upgrade graphmod to read this record")
        for label, value in (("inputs", inputs), ("derived", derived or {})):
            if not isinstance(value, Mapping):
                raise TypeError(f"Provenance({label}=...): expected a mapping, got "
                                f"{type(value).__name__}")
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_format", format)
        object.__setattr__(self, "_inputs", freeze(inputs, "inputs"))
        object.__setattr__(self, "_derived", freeze(derived or {}, "derived"))

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError(f"Provenance records are immutable: cannot set {key!r}")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"Provenance records are immutable: cannot delete {key!r}")

    # -- the record ---------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """``"program"``, ``"training"`` or ``"evaluation"``."""
        return self._kind

    @property
    def format(self) -> int:
        """The version of the record's layout."""
        return self._format

    @property
    def inputs(self) -> FrozenDict:
        """What determines the result (read-only mapping)."""
        return self._inputs

    @property
    def derived(self) -> FrozenDict:
        """What happened: fingerprint, rewrites, counts, times (read-only mapping)."""
        return self._derived

    def __getitem__(self, field: str) -> Any:
        if field in self._inputs:
            return self._inputs[field]
        if field in self._derived:
            return self._derived[field]
        raise KeyError(f"{self._kind} provenance has no field {field!r}"
                       f"{did_you_mean(field, [*self._inputs, *self._derived])}; inputs: "
                       f"{', '.join(self._inputs)}; derived: {', '.join(self._derived)}")

    def get(self, field: str, default: object = None) -> Any:
        """The input or derived ``field``, or ``default``."""
        try:
            return self[field]
        except KeyError:
            return default

    @property
    def fingerprint(self) -> str | None:
        """Hash of the canonical training-mode jaxpr for the example shapes (or None)."""
        value = self._derived.get("fingerprint")
        if value is None and self._kind == "evaluation" and self.model is not None:
            return self.model.fingerprint
        return value

    @property
    def model(self) -> Provenance | None:
        """The provenance of the evaluated model (evaluation records), else None."""
        nested = self._inputs.get("model")
        return Provenance.from_dict(nested) if is_record(nested) else None

    @property
    def models(self) -> dict[str, Provenance | None] | None:
        """The records of a run of several models (``graphmod.Loop({"disc": ..., "gen":
        ...}, ...)``): each model's own training record by name, in the loop's order (None
        for a frozen model, which has no program); None for any other record.

        Raises:
            ProvenanceError: the record lists a model whose record is missing or damaged.

        Examples:
            >>> import graphmod as gm
            >>> gen = gm.Provenance("training", {"optimizer": {"name": "sgd"}})
            >>> run = gm.Provenance("training", {"models": {"gen": gen.to_dict(),
            ...                     "teacher": None}, "order": ["gen", "teacher"]})
            >>> run.models["gen"]["optimizer"]["name"], run.models["teacher"], gen.models
            ('sgd', None, None)
        """
        order = several_models(self)
        if order is None:
            return None
        nested = self._inputs["models"]
        out: dict[str, Provenance | None] = {}
        for name in order:
            record = nested[name]
            try:
                out[name] = None if record is None else Provenance.from_dict(record)
            except ProvenanceError as error:
                raise ProvenanceError(f"models[{name!r}]: {error}; the record is damaged"
                                      ) from None
        return out

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:  # JSON, read as a record's kind lays it out
        """The record as plain dicts and lists."""
        return {"format": self._format, "kind": self._kind, "inputs": thaw(self._inputs),
                "derived": thaw(self._derived)}

    def _frozen(self) -> FrozenDict:
        return FrozenDict({"format": self._format, "kind": self._kind,
                           "inputs": self._inputs, "derived": self._derived})

    def to_json(self, *, indent: int | None = 2) -> str:
        """The record as JSON text (field order kept; :meth:`from_json` reads it back exactly).

        Examples:
            >>> import graphmod as gm
            >>> print(gm.Provenance("program", {"a": 1}).to_json(indent=None))
            {"format":1,"kind":"program","inputs":{"a":1},"derived":{}}
        """
        return to_text(self._frozen(), indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Provenance:
        """Reads a record written by :meth:`to_json`: only JSON data, nothing is imported.

        Examples:
            >>> import graphmod as gm
            >>> gm.Provenance.from_json('{"format": 1, "kind": "program", "inputs": {},'
            ...                         ' "derived": {}}').kind
            'program'
        """
        try:
            value = parse(text)
        except json.JSONDecodeError as error:
            raise ProvenanceError(
                f"Provenance.from_json: the text is not JSON ({error.msg} at line "
                f"{error.lineno}, column {error.colno}): {_excerpt(error.doc, error.pos)!r}; "
                "pass the text Provenance.to_json wrote") from None
        except UnicodeDecodeError as error:
            raise ProvenanceError(f"Provenance.from_json: the bytes are not UTF-8 text "
                                  f"(byte {error.start}): {error.reason}") from None
        except RecursionError:
            raise ProvenanceError("Provenance.from_json: the JSON is nested too deeply to be a "
                                  "provenance record") from None
        except ValueError as error:  # a non-finite constant such as NaN
            raise ProvenanceError(f"Provenance.from_json: {error}") from None
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, record: object) -> Provenance:
        """A record from :meth:`to_dict`'s mapping (checked; nothing is imported).

        Raises:
            ProvenanceError: ``record`` is not a provenance record; the message names the
                field that is missing or wrong.
        """
        if not isinstance(record, Mapping) or not is_record(record):
            keys = sorted(map(str, record)) if isinstance(record, Mapping) \
                else type(record).__name__
            raise ProvenanceError("not a provenance record: expected the keys format, kind, "
                                  f"inputs and derived, got {keys}")
        try:
            return cls(record["kind"], record["inputs"], record["derived"],
                       format=record["format"])
        except (TypeError, ValueError) as error:
            raise ProvenanceError(f"not a provenance record: {error}") from None

    # -- identity -------------------------------------------------------------------------------
    @property
    def hash(self) -> str:
        """A content hash of the whole record (``"sha256:..."``)."""
        return sha256(canonical_json(self._frozen()))

    @property
    def inputs_hash(self) -> str:
        """A content hash of the inputs alone (nested records' derived fields left out):
        two records with the same recipe share it."""
        return sha256(canonical_json(_strip_derived(self._inputs)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Provenance):
            return NotImplemented
        return canonical_json(self._frozen()) == canonical_json(other._frozen())

    def __hash__(self) -> int:
        return hash(canonical_json(self._frozen()))

    def replace(self, *, inputs: Mapping[str, object] | None = None,
                derived: Mapping[str, object] | None = None) -> Provenance:
        """A new record with these input and derived fields added or replaced.

        Examples:
            >>> import graphmod as gm
            >>> gm.Provenance("training", {}).replace(derived={"steps": 3})["steps"]
            3
        """
        return Provenance(self._kind, {**self._inputs, **(inputs or {})},
                          {**self._derived, **(derived or {})}, format=self._format)

    def __copy__(self) -> Provenance:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Provenance:
        return self

    def __reduce__(self) -> tuple[Callable[[str], Provenance], tuple[str]]:
        return Provenance.from_json, (self.to_json(indent=None),)

    # -- display --------------------------------------------------------------------------------
    def summary(self) -> list[tuple[str, str]]:
        """``(field, text)`` lines describing the record briefly (for a run of several
        models, each model's too, under its name)."""
        lines = summary_lines(self)
        try:
            models = self.models
        except ProvenanceError as error:  # shown, never raised: inspect prints crafted records
            return [lines[0], ("models", f"unreadable ({error})"), *lines[1:]]
        if models is None:
            return lines
        return [lines[0], *_models_lines(self._inputs, models), *lines[1:]]

    def __str__(self) -> str:
        lines = self.summary()
        width = max((len(k) for k, _ in lines), default=0)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)

    def __repr__(self) -> str:
        return (f"Provenance(kind={self._kind!r}, inputs_hash={self.inputs_hash[:19]!r}, "
                f"fingerprint={(self.fingerprint or 'None')[:19]!r})")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                       f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
                       for k, v in self.summary())
        return (f"<table><caption>{html.escape(self._kind)} provenance</caption>{rows}</table>"
                f"<details><summary>JSON</summary><pre>{html.escape(self.to_json(indent=2))}"
                "</pre></details>")


def _models_lines(inputs: FrozenDict, models: Mapping[str, Provenance | None]
                  ) -> list[tuple[str, str]]:
    """Summary lines of each model of a run of several models: when it steps, what it
    reads, and its own record's model, managers, optimizer and fingerprint."""
    schedules, reads = inputs.get("schedules"), inputs.get("reads")
    schedules = schedules if isinstance(schedules, Mapping) else {}
    reads = reads if isinstance(reads, Mapping) else {}
    lines = [("models", ", ".join(models))]
    for name, record in models.items():
        if record is None:
            lines.append((name, "frozen (no program: its state is carried and read)"))
            continue
        read = reads.get(name)
        lines.append((name, f"steps at {schedules.get(name) or 'every iteration'}"
                      + (f", reads {', '.join(map(str, read))}" if read else "")))
        lines += [(f"{name}.{k}", v) for k, v in summary_lines(record)[1:]
                  if k in ("bricks", "managers", "optimizer", "seeds", "fingerprint")]
    return lines


def several_models(record: Provenance) -> tuple[str, ...] | None:
    """The model names of a training record of several models (its ``order``), or None for
    any other record (one without ``models`` and ``order``).

    Raises:
        ProvenanceError: ``models`` or ``order`` is malformed."""
    inputs = record.inputs
    if record.kind != "training" or "models" not in inputs or "order" not in inputs:
        return None
    order, nested = inputs["order"], inputs["models"]
    if not (isinstance(order, tuple) and order and isinstance(nested, Mapping)):
        raise ProvenanceError("models, order: a record of several models holds a mapping of "
                              "their records and the list of their names; the record is "
                              "damaged")
    if not all(isinstance(name, str) for name in order) or len(set(order)) != len(order) \
            or sorted(order) != sorted(nested):
        raise ProvenanceError(f"order: lists {list(order)}, but the record holds the models "
                              f"{list(nested)}; the record is damaged")
    return order


def _excerpt(text: str, position: int) -> str:
    """Up to 30 characters of ``text`` around ``position``."""
    return text[max(0, position - 10):position + 20]


def _strip_derived(value: Frozen) -> Frozen:
    if isinstance(value, FrozenDict) and is_record(value):
        return FrozenDict({"kind": value["kind"], "inputs": _strip_derived(value["inputs"])})
    if isinstance(value, Mapping):
        return FrozenDict({k: _strip_derived(v) for k, v in value.items()})
    if isinstance(value, tuple):
        return tuple(_strip_derived(v) for v in value)
    return value
