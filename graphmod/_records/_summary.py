"""Readable text for recorded values and a short summary of a record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from graphmod._core._codec import TAGS, cut
from graphmod._core._codec import call_text as tag_call_text
from graphmod._records._frozen import FrozenDict


class _Summarised(Protocol):
    """A record as its summary reads it: a :class:`graphmod.Provenance` (whose module
    imports this one)."""

    @property
    def kind(self) -> str: ...

    @property
    def inputs(self) -> FrozenDict: ...

    @property
    def derived(self) -> FrozenDict: ...

    @property
    def inputs_hash(self) -> str: ...

    @property
    def model(self) -> _Summarised | None: ...


def readable(value: object, limit: int = 80) -> str:
    """A recorded value as short text: tags shown as what they stand for.

    Examples:
        >>> from graphmod._records._summary import readable
        >>> readable({"$callable": "jax.nn.relu"}), readable({"$tuple": [1, 2]})
        ('jax.nn.relu', '(1, 2)')
    """
    return cut(_text(value), limit)


def _text(value: object) -> str:
    if isinstance(value, Mapping):
        if len(value) == 1 and next(iter(value)) in TAGS:
            (tag, inner), = value.items()
            return TAGS[tag].text(inner, _text)
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if value is None:
        return "None"
    return repr(value) if isinstance(value, str) else str(value)


def call_text(name: object, arguments: Mapping[str, object], limit: int = 200) -> str:
    """``name(arg=value, ...)`` of recorded arguments."""
    return tag_call_text(name, arguments, _text, limit)


def _model_line(inputs: FrozenDict) -> str | None:
    bricks = inputs.get("bricks")
    if not bricks:
        return None
    root = bricks.get("/", {})
    parameters = inputs.get("parameters", {})
    numbers = 0
    for record in parameters.values():
        size = 1
        for dim in record["shape"]:
            size *= dim
        numbers += size
    call = call_text(root.get("class"), root.get("arguments", {}), 120) \
        if root.get("recorded", True) else f"{root.get('class')} (construction not recorded)"
    return (f"{call}; {len(bricks)} modules, {len(parameters)} variables, "
            f"{numbers:,} numbers")


def data_text(data: Mapping[str, Any]) -> str:
    """A data source's description (``ArraySource.describe()``) in one line."""
    if data.get("described") is False:
        return f"{data.get('name')} (not described)"
    parts = [str(data.get("name")), f"{data.get('size')} rows"]
    if data.get("batch_size") is not None:
        parts.append(f"batch {data['batch_size']}")
    if data.get("shuffle"):
        parts.append(f"shuffled (seed {data.get('seed')})")
    if data.get("shapes") is not None:
        parts.append("shapes " + ", ".join(f"{list(s)} {d}" for s, d in
                                            zip(data["shapes"], data.get("dtypes", ()),
                                                strict=False)))
    if data.get("sha256"):
        parts.append(f"sha256:{str(data['sha256'])[:12]}…")
    return ", ".join(parts)


def optimizer_text(opt: Mapping[str, Any], hint: bool = False) -> str:
    """A recorded optimizer (``optimizer_record``) in one line; with ``hint``, how one not
    recorded would be."""
    if opt.get("name"):
        return call_text(opt.get("name"), opt.get("arguments", {}))
    return f"not recorded ({opt.get('type')})" + (
        "; to record one, make it with graphmod.provenance.optimizer(name, **arguments), "
        "e.g. optimizer('sgd', learning_rate=0.1), or pass optimize(config=...)"
        if hint else "")


def summary_lines(prov: _Summarised) -> list[tuple[str, str]]:
    """``(field, text)`` lines summarising a record."""
    inputs, derived = prov.inputs, prov.derived
    lines: list[tuple[str, str]] = [("record", f"{prov.kind}, inputs {prov.inputs_hash[:19]}…")]
    nested = prov.model
    if nested is not None:
        lines.append(("model", f"{nested.kind} record, inputs {nested.inputs_hash[:19]}…"))
        lines += [(f"model.{k}", v) for k, v in summary_lines(nested)[1:]
                  if k in ("bricks", "managers", "optimizer", "data", "fingerprint", "steps")]
    return lines + _configuration_lines(inputs) + _outcome_lines(derived) \
        + _environment_lines(inputs)


def _configuration_lines(inputs: FrozenDict) -> list[tuple[str, str]]:
    """What a record was made from: model, managers, optimizer, data, metrics, seeds."""
    lines: list[tuple[str, str]] = []
    model = _model_line(inputs)
    if model:
        lines.append(("bricks", model))
    for name, manager in (inputs.get("managers") or {}).items():
        lines.append(("managers", f"{name} = " + call_text(manager.get("class"),
                                                           manager.get("arguments", {}), 140)))
    if "optimizer" in inputs:
        lines.append(("optimizer", optimizer_text(inputs["optimizer"], hint=True)))
    if isinstance(inputs.get("data"), Mapping):
        lines.append(("data", data_text(inputs["data"])))
    if inputs.get("metrics"):
        lines.append(("metrics", ", ".join(str(m.get("name")) for m in inputs["metrics"])))
    seeds = inputs.get("seeds") or {}
    shown = [f"{k} {list(v['data'])}" for k, v in seeds.items() if isinstance(v, Mapping)]
    if shown:
        lines.append(("seeds", "; ".join(shown)))
    return lines


def _outcome_lines(derived: FrozenDict) -> list[tuple[str, str]]:
    """What came of it: fingerprint, steps or examples, times."""
    lines: list[tuple[str, str]] = []
    if derived.get("fingerprint"):
        lines.append(("fingerprint", str(derived["fingerprint"])))
    if "steps" in derived:
        lines.append(("steps", f"{derived['steps']} steps, {derived.get('examples')} examples, "
                               f"{derived.get('epochs')} epochs, {derived.get('seconds')} s"))
    elif "examples" in derived:
        lines.append(("examples", str(derived["examples"])))
    if derived.get("started"):
        lines.append(("time", f"{derived['started']} → {derived.get('ended')}"))
    elif derived.get("created"):
        lines.append(("created", str(derived["created"])))
    return lines


def _environment_lines(inputs: FrozenDict) -> list[tuple[str, str]]:
    """Where it ran: library versions and platform."""
    lines: list[tuple[str, str]] = []
    versions = inputs.get("versions")
    if versions:
        lines.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
    plat = inputs.get("platform")
    if plat:
        lines.append(("platform", f"{plat.get('system')} {plat.get('machine')}, "
                                  f"{plat.get('backend')}: {plat.get('device_count')} x "
                                  f"{', '.join(plat.get('device_kinds', ()))}"))
    return lines
