"""diff: what differs between two records, input fields first, derived apart."""

from __future__ import annotations

import numpy as np

import graphmod as gm
from tests.provenance.provenance_workload import train


def test_runs_differing_only_in_the_dropout_rate_differ_in_that_input_alone() -> None:
    a = gm.provenance.capture(train(rate=0.1, epochs=1)[0])
    b = gm.provenance.capture(train(rate=0.3, epochs=1)[0])
    differences = gm.provenance.diff(a, b)
    assert differences.fields == ["managers.dropout.arguments.rate"]
    (only,) = differences.inputs
    assert (only.a, only.b, only.derived) == (0.1, 0.3, False)
    assert {"fingerprint", "created", "started", "ended"} <= set(differences.derived_fields)
    assert not any(d.startswith("managers") for d in differences.derived_fields)
    text = str(differences)
    assert text.index("\ninput fields\n") < text.index("\nderived fields\n")
    assert "managers.dropout.arguments.rate  0.1" in text
    html = differences._repr_html_()
    assert html.count("<table>") == 2 and "managers.dropout.arguments.rate" in html


def test_identical_records_do_not_differ_and_json_is_accepted() -> None:
    a = gm.provenance.capture(train(epochs=1)[0])
    assert not gm.provenance.diff(a, a) and len(gm.provenance.diff(a, a)) == 0
    assert not gm.provenance.diff(a.to_json(), a)


def test_fields_missing_on_one_side_are_listed_and_nested_records_flattened() -> None:
    a = gm.Provenance("evaluation", {
        "model": gm.Provenance("training", {"seeds": {"train": [0, 1]}},
                               {"fingerprint": "sha256:a"}).to_dict(),
        "data": {"size": 10}})
    b = gm.Provenance("evaluation", {
        "model": gm.Provenance("training", {"seeds": {"train": [0, 2]}},
                               {"fingerprint": "sha256:b"}).to_dict(),
        "data": {"size": 10, "name": "test"}})
    differences = gm.provenance.diff(a, b)
    assert differences.fields == ["model.seeds.train[1]", "data.name"]
    assert differences.derived_fields == ["model.fingerprint"]
    missing = differences.inputs[1]
    assert (missing.in_a, missing.in_b) == (False, True)
    assert "(absent)" in str(differences)


def test_bricks_are_named_by_path() -> None:
    from flax import nnx

    def record(out: int) -> gm.Provenance:
        mlp = gm.bricks.MLP([3, 4, out], rngs=nnx.Rngs(0))
        program = gm.compile(lambda m, x: m(x).sum(), mlp)
        program.init(np.ones((1, 3), np.float32))
        return program.provenance

    fields = gm.provenance.diff(record(2), record(5)).fields
    assert "bricks['/linear_layers/1'].arguments.out_features" in fields
    assert "parameters['/linear_layers/1.W'].shape[1]" in fields
