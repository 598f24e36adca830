"""Provenance records: immutable, exact JSON round trip, data only, stable hashes."""

from __future__ import annotations

import copy
import json
import pathlib
import pickle
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles


def _record() -> gm.Provenance:
    mlp = gm.bricks.MLP([3, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), mlp, managers=[
        managers.Dropout(gm.dynamic(0.1), bricks=mlp.linear_layers, roles=[roles.INPUT])])
    program.init(jnp.ones((2, 3)))
    return program.provenance


def test_no_field_can_be_changed() -> None:
    prov = _record()
    with pytest.raises(AttributeError, match="immutable"):
        prov.kind = "training"
    with pytest.raises(AttributeError, match="immutable"):
        del prov.inputs
    with pytest.raises(TypeError):
        prov.inputs["managers"] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        prov.inputs["managers"]["dropout"]["arguments"]["rate"] = 0.9  # type: ignore[index]
    with pytest.raises(AttributeError):
        prov.derived["rewrites"].append({})  # tuples, not lists
    with pytest.raises(AttributeError, match="immutable"):
        prov.inputs._data = {}  # type: ignore[misc]
    assert copy.deepcopy(prov) is prov and copy.copy(prov) is prov


def test_the_record_holds_what_the_issue_lists() -> None:
    prov = _record()
    inputs, derived = prov.inputs, prov.derived
    root = inputs["bricks"]["/"]
    assert root["class"] == "graphmod.bricks.MLP"
    assert root["arguments"]["activation"] == {"$callable": "jax.nn.relu"}
    assert root["arguments"]["rngs"]["$rngs"]["default"]["key"]["data"] == (0, 0)
    assert inputs["parameters"]["/linear_layers/0.W"]["shape"] == (3, 4)
    assert inputs["parameters"]["/linear_layers/0.W"]["dtype"] == "float32"
    dropout = inputs["managers"]["dropout"]
    assert (dropout["class"], dropout["order"], dropout["priority"]) == \
        ("managers.Dropout", 0, 0)
    assert dropout["filter"]["bricks"] == ({"$brick_path": "/linear_layers/0"},
                                           {"$brick_path": "/linear_layers/1"})
    assert set(inputs["versions"]) >= {"python", "jax", "jaxlib", "flax", "optax", "graphmod"}
    assert inputs["platform"]["device_kinds"] and inputs["platform"]["backend"]
    assert inputs["example_shapes"]["arguments"]["x"] == {"shape": (2, 3), "dtype": "float32"}
    assert inputs["seeds"]["init"]["data"] == (0, 0)
    assert prov.fingerprint.startswith("sha256:") and len(prov.fingerprint) == 71
    assert [r["manager"] for r in derived["rewrites"]] == ["dropout", "dropout"]
    assert derived["created"].endswith("+00:00")


def test_json_round_trip_is_exact() -> None:
    prov = _record()
    text = prov.to_json()
    again = gm.Provenance.from_json(text)
    assert again == prov and hash(again) == hash(prov)
    assert again.to_json() == text and again.to_dict() == prov.to_dict()
    assert again.hash == prov.hash and again.inputs_hash == prov.inputs_hash
    assert list(again.inputs) == list(prov.inputs)  # stable ordering
    tricky = gm.Provenance("program", {"x": [0.1, 1e-300, 2**70, float("nan"), -0.0, "é"]})
    back = gm.Provenance.from_json(tricky.to_json())
    assert back == tricky and back.inputs["x"][3] == {"$float": "nan"}
    assert json.loads(tricky.to_json())["inputs"]["x"][1] == 1e-300
    assert pickle.loads(pickle.dumps(prov)) == prov  # pickling goes through JSON


def test_hashes_separate_the_recipe_from_what_happened() -> None:
    prov = _record()
    later = prov.replace(derived={"created": "another time"})
    assert later.inputs_hash == prov.inputs_hash and later.hash != prov.hash
    other = prov.replace(inputs={"seeds": {"init": None}})
    assert other.inputs_hash != prov.inputs_hash


def test_loading_json_never_executes_code(tmp_path: pathlib.Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "sneaky.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    record = _record().to_dict()
    record["inputs"]["bricks"]["/"]["class"] = "sneaky.Brick"
    record["inputs"]["managers"]["dropout"]["arguments"]["rate"] = {
        "$call": {"function": "sneaky.boom", "kwargs": {}}}
    record["inputs"]["__reduce__"] = ["os.system", ["echo pwned"]]
    text = json.dumps(record)
    prov = gm.Provenance.from_json(text)
    str(prov), repr(prov), prov._repr_html_(), prov.to_json()
    gm.provenance.diff(prov, _record())
    assert not marker.exists() and "sneaky" not in sys.modules
    assert prov.inputs["__reduce__"] == ("os.system", ("echo pwned",))  # just data


@pytest.mark.parametrize("text, message", [
    ('{"format": 1, "kind": "program", "inputs": {"x": NaN}, "derived": {}}', "NaN"),
    ('{"format": 9, "kind": "program", "inputs": {}, "derived": {}}', "formats up to 1"),
    ('{"format": 1, "kind": "model", "inputs": {}, "derived": {}}', "kind='model'"),
    ('{"kind": "program"}', "not a provenance record"),
])
def test_malformed_json_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gm.Provenance.from_json(text)


def test_records_print_as_a_summary_and_html() -> None:
    prov = _record()
    text = str(prov)
    assert "graphmod.bricks.MLP(dims=[3, 4, 2], activation=jax.nn.relu" in text
    assert "dropout = managers.Dropout(rate=dynamic(0.1)" in text
    assert "fingerprint" in text and "jax 0." in text
    assert "<table>" in prov._repr_html_() and "Provenance(kind='program'" in repr(prov)


def test_a_missing_field_is_named_with_the_closest_one() -> None:
    prov = gm.Provenance("program", {"seeds": {"init": [0, 0]}}, {"fingerprint": None})
    with pytest.raises(KeyError, match=r"program provenance has no field 'seed' \(did you "
                                       r"mean 'seeds'\?\); inputs: seeds; derived: "
                                       r"fingerprint"):
        prov["seed"]


class RematLayer(nnx.Module):
    """Two Flax dropouts whose stored streams a remat region advances: written state."""

    def __init__(self) -> None:
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.first = nnx.Dropout(0.1, rngs=nnx.Rngs(1))
        self.second = nnx.Dropout(0.1, rngs=nnx.Rngs(2))
        self.norm = nnx.BatchNorm(4, rngs=nnx.Rngs(3))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(self.second(self.linear(self.first(x))))


@pytest.mark.parametrize("looped", [False, True])
def test_the_fingerprint_of_state_written_in_a_remat_or_scan_does_not_follow_addresses(
        looped: bool) -> None:
    def fingerprint() -> str:
        layer = nnx.Sequential(RematLayer())  # at new addresses each time
        loss = (lambda m, x: gm.scan(lambda c, _: (m(c), None), x, length=2)[0].sum()) \
            if looped else (lambda m, x: m(x).sum())
        program = gm.compile(loss, layer, managers=[managers.Remat(bricks=[RematLayer])])
        program.init(jnp.ones((2, 4)))
        return program.provenance.fingerprint

    assert len({fingerprint() for _ in range(6)}) == 1
