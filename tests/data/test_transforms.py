"""Transformations fitted on the training data: NumPy's numbers, one arithmetic in and out of
jit, JSON records rebuilt through an allow list, and bad input refused first."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from graphmod.data import (
    ArraySource,
    Bin,
    Clip,
    FittedTransforms,
    MinMax,
    OneHot,
    Standardize,
    Transformation,
    Transforms,
    Vocabulary,
)


def _split(n: int = 80) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    data = {"x": rng.normal(2.0, 3.0, (n, 4)).astype(np.float32),
            "image": rng.uniform(0, 255, (n, 3, 3, 2)).astype(np.float32),
            "y": rng.integers(0, 5, n) * 10}
    cut = n * 3 // 4
    return ({f: a[:cut] for f, a in data.items()}, {f: a[cut:].copy() for f, a in data.items()})


SPEC = {"x": Standardize(), "image": MinMax(-1.0, 1.0), "y": Vocabulary()}


def _fitted_numbers(fitted: FittedTransforms, field: str) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in fitted.record()["transforms"][field][0]["fitted"].items()}


def _per_feature(array: np.ndarray, reduce: object) -> np.ndarray:
    return reduce(array.astype(np.float64), axis=tuple(range(array.ndim - 1)))


@pytest.mark.parametrize("streamed", [False, True])
def test_fitted_numbers_equal_numpys_over_the_training_split(streamed: bool) -> None:
    train, _ = _split()
    source = ([{f: a[b:b + 7] for f, a in train.items()} for b in range(0, 60, 7)] if streamed
              else ArraySource(train, batch_size=16))
    fitted = Transforms(SPEC).fit(source)
    check = ((lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-12)) if streamed
             else np.testing.assert_array_equal)
    x, image = _fitted_numbers(fitted, "x"), _fitted_numbers(fitted, "image")
    check(x["mean"], _per_feature(train["x"], np.mean))
    check(x["std"], _per_feature(train["x"], np.std))
    check(image["min"], _per_feature(train["image"], np.min))  # per channel of NHWC
    check(image["max"], _per_feature(train["image"], np.max))
    assert image["min"].shape == (2,)
    values, counts = np.unique(train["y"], return_counts=True)
    assert _fitted_numbers(fitted, "y")["values"].tolist() == values.tolist()
    assert fitted.metadata["y"].labels == tuple(zip(values.tolist(), counts.tolist(),
                                                    strict=True))
    assert (fitted.source is None) == streamed


def test_changing_evaluation_rows_changes_no_fitted_value() -> None:
    train, evaluation = _split()
    source = ArraySource(train, batch_size=16)
    before = json.dumps(Transforms(SPEC).fit(source).record())
    for array in evaluation.values():
        array[...] = array * 7 + 3
    assert json.dumps(Transforms(SPEC).fit(source).record()) == before
    assert Transforms(SPEC).fit(ArraySource(train, batch_size=16)) == Transforms(SPEC).fit(source)
    # The check could fail: fitting on the evaluation rows would give other numbers.
    assert json.dumps(Transforms(SPEC).fit(ArraySource(evaluation, 4)).record()) != before


def _hand(field: str, x: np.ndarray, n: dict[str, np.ndarray]) -> np.ndarray:
    f32 = np.float32
    if field == "x":
        inverse_std = 1 / np.maximum(n["std"], 1e-8)
        return (x.astype(f32) - n["mean"].astype(f32)) * inverse_std.astype(f32)
    if field == "image":
        scale = 2.0 / (n["max"] - n["min"])
        return (x - (n["min"] + 1.0 / scale).astype(f32)) * scale.astype(f32)
    return np.searchsorted(n["values"], x).astype(np.int32)


def test_apply_inside_jit_equals_apply_host_and_the_hand_written_arithmetic() -> None:
    train, evaluation = _split()
    fitted = Transforms(SPEC).fit(ArraySource(train, batch_size=16))
    device = jax.jit(fitted.apply)(evaluation)
    host = fitted.apply_host(evaluation)
    for field in SPEC:
        hand = _hand(field, evaluation[field], _fitted_numbers(fitted, field))
        assert device[field].dtype == host[field].dtype == hand.dtype
        np.testing.assert_array_equal(np.asarray(device[field]), hand)
        np.testing.assert_array_equal(host[field], hand)
    assert float(jnp.abs(device["x"]).max()) > 0.5  # the values were transformed


@pytest.mark.parametrize(("link", "x", "expected"), [
    (Clip(low=0.0), np.array([-2.0, 1.0, 9.0]), np.array([0.0, 1.0, 3.0])),
    (Clip(), np.array([-2.0, 1.0, 9.0]), np.array([-1.0, 1.0, 3.0])),
    (OneHot(), np.array([3, -1]), np.array([[0, 0, 1], [1, 0, 0]], np.float32)),
    (Bin(bins=2), np.array([-1.0, 0.9, 1.0, 3.0]), np.array([0, 0, 1, 1], np.int32)),
    (Bin(edges=(0.0, 2.0)), np.array([-1.0, 0.0, 2.0, 3.0]), np.array([0, 1, 2, 2], np.int32)),
])
def test_each_kind_computes_its_numbers_in_and_out_of_jit(link: Transformation, x: np.ndarray,
                                                           expected: np.ndarray) -> None:
    train = np.array([-1.0, 0.0, 3.0]) if x.dtype.kind == "f" else np.array([-1, 0, 3])
    fitted = Transforms({0: link}).fit(ArraySource(train, batch_size=1))
    host = fitted.apply_host(x)
    assert host.dtype == (x.dtype if isinstance(link, Clip) else expected.dtype)
    np.testing.assert_array_equal(host, expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(fitted.apply)({0: x})[0]),
                                  host.astype(jnp.asarray(x).dtype) if isinstance(link, Clip)
                                  else host)


def test_a_chain_fits_each_link_on_the_output_of_those_before() -> None:
    x = np.array([[0.0, 5.0], [1.0, 6.0], [8.0, 7.0]])
    fitted = Transforms({0: [Clip(high=2.0), Standardize()]}).fit(ArraySource((x,), 1))
    clipped = np.minimum(x, 2.0).astype(np.float32)  # what Standardize receives
    numbers = fitted.record()["transforms"]["#0"][1]["fitted"]
    np.testing.assert_array_equal(numbers["mean"], _per_feature(clipped, np.mean))
    np.testing.assert_array_equal(numbers["std"], _per_feature(clipped, np.std))
    tokens = Transforms({0: [Bin(edges=(2.0, 6.0)), Vocabulary()]}).fit(ArraySource(x, 1))
    assert tokens.record()["transforms"]["#0"][1]["fitted"] == {"values": [0, 1, 2]}


def test_the_record_round_trips_through_json_and_applies_identically() -> None:
    train, evaluation = _split()
    spec = {**SPEC, "x": [Clip(-1.0, 6.0), Standardize(eps=1e-3)],
            "image": [MinMax(), Bin(bins=4)]}
    fitted = Transforms(spec).fit(ArraySource(train, batch_size=16, name="train"))
    back = FittedTransforms.from_record(json.loads(json.dumps(fitted.record())))
    assert back == fitted and back.metadata == fitted.metadata
    assert back.source == fitted.source and back.source["name"] == "train"
    for field, value in fitted.apply_host(evaluation).items():
        np.testing.assert_array_equal(back.apply_host(evaluation)[field], value)
    np.testing.assert_array_equal(back.inverse("y", np.array([0, 4])),
                                  np.unique(train["y"])[[0, 4]])


def test_a_record_with_an_unknown_kind_is_refused_naming_it() -> None:
    train, _ = _split()
    record = Transforms(SPEC).fit(ArraySource(train, batch_size=16)).record()
    record["transforms"]["x"][0]["kind"] = "os.system"
    with pytest.raises(ValueError, match=r"unknown transformation kind 'os.system' for field "
                                         r"'x'; known kinds are \['Bin', 'Clip'"):
        FittedTransforms.from_record(record)
    record["transforms"]["x"][0].update(kind="Standardize", config={"scale": 2})
    with pytest.raises(ValueError, match=r"Standardize config \{'scale': 2\}"):
        FittedTransforms.from_record(record)


def test_fitted_transforms_check_apply_only_the_fields_given_and_stay_immutable() -> None:
    train, evaluation = _split()
    fitted = Transforms({"x": Standardize()}).fit(ArraySource(train, batch_size=16))
    assert fitted.fields() == ("image", "x", "y")  # every field is checked
    out = fitted.apply({"x": evaluation["x"], "image": evaluation["image"]})
    assert out.keys() == {"x", "image"} and out["image"] is evaluation["image"]
    with pytest.raises(ValueError, match=r"infer: field 'x' has per-example shape \(3,\)"):
        fitted.check({"x": jax.ShapeDtypeStruct((1, 3), jnp.float32)}, "infer")
    with pytest.raises(AttributeError, match="immutable"):
        fitted.metadata = None  # type: ignore[misc]
    before = fitted.apply_host({"x": evaluation["x"]})["x"]
    fitted.record()["transforms"]["x"][0]["fitted"]["mean"][0] = 99.0
    fitted.source["sha256"] = "changed"
    np.testing.assert_array_equal(fitted.apply_host({"x": evaluation["x"]})["x"], before)
    assert fitted.record()["transforms"]["x"][0]["fitted"]["mean"][0] != 99.0
    assert fitted.source["sha256"] != "changed"
    with pytest.raises(ValueError, match="field 'x' has no chain ending in Vocabulary"):
        fitted.inverse("x", np.array([0]))
    assert "Standardize(1e-08)" in repr(fitted) and "<table>" in fitted._repr_html_()


def test_apply_host_keeps_the_batch_structure() -> None:
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    fitted = Transforms({0: Clip(high=2.0)}).fit(ArraySource((x, np.array([0, 1])), 1))
    out = fitted.apply_host([x, np.array([1, 0])])
    assert isinstance(out, list) and out[0].max() == 2.0 and out[1].tolist() == [1, 0]


def test_float64_inputs_stay_float64_only_under_x64() -> None:
    x = np.array([1.0, 3.0])
    fitted = Transforms({0: Standardize()}).fit(ArraySource(x, 1))
    assert fitted.apply_host(x).dtype == np.float32
    with jax.enable_x64(True):
        assert fitted.apply_host(x).dtype == np.float64
        assert jax.jit(fitted.apply)({0: x})[0].dtype == jnp.float64
        assert fitted.apply_host(x.astype(np.float32)).dtype == np.float32


def test_bad_input_is_refused_before_anything_is_fitted() -> None:
    train, _ = _split()
    source = ArraySource(train, batch_size=16)
    with pytest.raises(ValueError, match=r"the data has no field 'z'; its fields are "
                                         r"\['image', 'x', 'y'\]"):
        Transforms({"z": Standardize()}).fit(source)
    with pytest.raises(ValueError, match="the source is empty"):
        Transforms({"x": Standardize()}).fit([])
    with pytest.raises(ValueError, match=r"Transforms.fit: field 'x': Vocabulary takes integer "
                                         r"or bool values .* the field is float32"):
        Transforms({"x": Vocabulary()}).fit(source)
    with pytest.raises(TypeError, match=r"field 'x' maps to 'standardize', not a "
                                        r"transformation"):
        Transforms({"x": "standardize"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="field 'x' maps to"):
        Transforms({"x": [Standardize(), np.mean]})  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not a field"):
        Transforms({1.5: Standardize()})  # type: ignore[dict-key]
    batches = [{"x": train["x"][:8]}, {"x": train["x"][8:16]}]
    with pytest.raises(ValueError, match="field 'x' chains 2 transformations, but the source "
                                         "streams its batches"):
        Transforms({"x": [Clip(), Standardize()]}).fit(batches)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Standardize(eps=0.0), "Standardize"),
    (lambda: MinMax(1.0, 1.0), "low < high"),
    (lambda: Clip(2.0, 1.0), "low <= high"),
    (lambda: Bin(), "give exactly one"),
    (lambda: Bin(edges=(1.0, 1.0)), "strictly increasing"),
    (lambda: Bin(bins=0), "positive int"),
])
def test_bad_configurations_are_refused_at_construction(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_apply_maps_one_example_under_vmap_as_it_maps_a_batch() -> None:
    rng = np.random.default_rng(2)
    data = {"w": rng.normal(size=12), "v": rng.normal(size=(12, 3)), "k": rng.integers(0, 3, 12)}
    spec = {"w": [Clip(high=0.5), Standardize()], "v": [MinMax(), Bin(bins=3)],
            "k": OneHot()}
    fitted = Transforms(spec).fit(ArraySource(data, batch_size=4))
    batched = fitted.apply(data)
    mapped = jax.vmap(fitted.apply)(data)
    for field, value in batched.items():
        assert mapped[field].shape == value.shape
        np.testing.assert_array_equal(np.asarray(mapped[field]), np.asarray(value))
    assert batched["w"].shape == (12,) and batched["k"].shape == (12, 3)
