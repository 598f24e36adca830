"""Readable text for recorded values and a short summary of a record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def readable(value: Any, limit: int = 80) -> str:
    """A recorded value as short text: tags shown as what they stand for.

    Examples:
        >>> from graphmod.provenance._summary import readable
        >>> readable({"$callable": "jax.nn.relu"}), readable({"$tuple": [1, 2]})
        ('jax.nn.relu', '(1, 2)')
    """
    return _cut(_text(value), limit)


def _text(value: Any) -> str:
    if isinstance(value, Mapping):
        if len(value) == 1:
            (tag, inner), = value.items()
            text = _tagged(tag, inner)
            if text is not None:
                return text
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if value is None:
        return "None"
    return repr(value) if isinstance(value, str) else str(value)


def _tagged(tag: str, inner: Any) -> str | None:
    if tag == "$tuple":
        items = [_text(v) for v in inner]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if tag == "$dict":
        return "{" + ", ".join(f"{k!r}: {_text(v)}" for k, v in inner.items()) + "}"
    if tag in ("$callable", "$class", "$brick_path"):
        return str(inner)
    if tag == "$application":
        return f"application {inner!r}"
    if tag == "$dynamic":
        return f"dynamic({_text(inner)})"
    if tag == "$float":
        return str(inner)
    if tag == "$dtype":
        return str(inner)
    if tag == "$role":
        return str(inner["name"])
    if tag == "$rngs":
        streams = [f"{name}={list(s['key']['data'])}@{s['count']}" for name, s in inner.items()]
        return f"Rngs({', '.join(streams)})"
    if tag == "$key":
        return f"key({list(inner['data'])})"
    if tag == "$array":
        return f"array{tuple(inner['shape'])} {inner['dtype']}"
    if tag == "$call":
        return call_text(inner["function"], inner["kwargs"])
    if tag == "$partial":
        return f"partial({_text(inner['function'])}, ...)"
    if tag in ("$brick", "$optimizer"):
        return call_text(inner.get("class", inner.get("name")), inner.get("arguments", {}))
    if tag == "$filter":
        return "VariableFilter(" + ", ".join(f"{k}={_text(v)}" for k, v in inner.items()) + ")"
    if tag == "$enum":
        return f"{inner['class']}.{inner['name']}"
    if tag in ("$bound_application", "$class_application"):
        return f"{_text(inner.get('brick', inner.get('class')))}.{inner['name']}"
    if tag == "$opaque":
        return f"<opaque {inner.get('repr', inner.get('type'))}>"
    return None


def call_text(name: Any, arguments: Mapping[str, Any], limit: int = 200) -> str:
    """``name(arg=value, ...)`` of recorded arguments."""
    parts = [f"{k}={_text(v)}" for k, v in (arguments or {}).items()]
    return _cut(f"{name}({', '.join(parts)})", limit)


def _model_line(inputs: Mapping[str, Any]) -> str | None:
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


def _data_line(data: Mapping[str, Any]) -> str:
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


def summary_lines(prov: Any) -> list[tuple[str, str]]:
    """``(field, text)`` lines summarising a record."""
    inputs, derived = prov.inputs, prov.derived
    lines: list[tuple[str, str]] = [("record", f"{prov.kind}, inputs {prov.inputs_hash[:19]}…")]
    nested = prov.model
    if nested is not None:
        lines.append(("model", f"{nested.kind} record, inputs {nested.inputs_hash[:19]}…"))
        lines += [(f"model.{k}", v) for k, v in summary_lines(nested)[1:]
                  if k in ("bricks", "managers", "optimizer", "data", "fingerprint", "steps")]
    model = _model_line(inputs)
    if model:
        lines.append(("bricks", model))
    for name, manager in (inputs.get("managers") or {}).items():
        lines.append(("managers", f"{name} = " + call_text(manager.get("class"),
                                                           manager.get("arguments", {}), 140)))
    if "optimizer" in inputs:
        opt = inputs["optimizer"]
        lines.append(("optimizer", call_text(opt.get("name"), opt.get("arguments", {}))
                      if opt.get("name") else f"not recorded ({opt.get('type')})"))
    if isinstance(inputs.get("data"), Mapping):
        lines.append(("data", _data_line(inputs["data"])))
    if inputs.get("metrics"):
        lines.append(("metrics", ", ".join(str(m.get("name")) for m in inputs["metrics"])))
    seeds = inputs.get("seeds") or {}
    shown = [f"{k} {list(v['data'])}" for k, v in seeds.items() if isinstance(v, Mapping)]
    if shown:
        lines.append(("seeds", "; ".join(shown)))
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
    versions = inputs.get("versions")
    if versions:
        lines.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
    plat = inputs.get("platform")
    if plat:
        lines.append(("platform", f"{plat.get('system')} {plat.get('machine')}, "
                                  f"{plat.get('backend')}: {plat.get('device_count')} x "
                                  f"{', '.join(plat.get('device_kinds', ()))}"))
    return lines
