"""Dataset metadata: statistics equal NumPy's, JSON round trips, checks name the field."""

from __future__ import annotations

import itertools
import json

import jax
import numpy as np
import pytest

from graphmod.data import ArraySource, FieldInfo, Metadata


def _data(n: int = 60) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(3.0, 2.0, (n, 5)).astype(np.float32),
        "image": rng.uniform(-1, 4, (n, 4, 3, 2)),
        "y": rng.integers(0, 4, n),
        "w": rng.normal(size=n),
    }


def _numpy_stats(array: np.ndarray) -> dict[str, np.ndarray]:
    wide = array.astype(np.float64)
    axes = tuple(range(array.ndim - 1)) if array.ndim > 1 else (0,)
    return {name: np.atleast_1d(f(wide, axis=axes)) for name, f in
            (("min", np.min), ("max", np.max), ("mean", np.mean), ("std", np.std))}


def _assert_stats(meta: Metadata, data: dict[str, np.ndarray], rtol: float) -> None:
    for field, array in data.items():
        info = meta[field]
        assert (info.shape, info.dtype, info.count) == (array.shape[1:], array.dtype.name,
                                                        len(array))
        for name, expected in _numpy_stats(array).items():
            got = np.array(getattr(info, name))
            if rtol:
                np.testing.assert_allclose(got, expected, rtol=rtol, atol=0, err_msg=name)
            else:
                np.testing.assert_array_equal(got, expected, err_msg=name)


def test_an_array_source_gives_numpys_statistics_exactly_per_feature_and_channel() -> None:
    data = _data()
    meta = ArraySource(data, batch_size=8).metadata
    _assert_stats(meta, data, rtol=0)
    assert len(meta["image"].mean) == 2 and len(meta["x"].std) == 5 and len(meta["w"].min) == 1
    values, counts = np.unique(data["y"], return_counts=True)
    assert meta["y"].labels == tuple(zip(values.tolist(), counts.tolist(), strict=True))
    assert meta["x"].labels is None and meta["w"].labels is None  # floats are not labels


def test_a_streamed_list_of_batches_matches_numpy_to_1e_12() -> None:
    data = _data(61)
    cuts = [0, 7, 20, 21, 50, 61]  # uneven batches, one of a single example
    batches = [{f: a[b:e] for f, a in data.items()} for b, e in itertools.pairwise(cuts)]
    meta = Metadata.gather(batches)
    _assert_stats(meta, data, rtol=1e-12)
    assert meta["y"].labels == ArraySource(data, 8).metadata["y"].labels
    assert meta.fields == ("x", "image", "y", "w")


def test_tuple_and_single_array_batches_have_int_fields_and_labels_can_be_chosen() -> None:
    x, tokens = np.arange(12.0).reshape(6, 2), np.array([[1, 2], [2, 5], [5, 5]] * 2)
    meta = Metadata.gather(ArraySource((x, tokens), 2), labels=(1,))
    assert meta.fields == (0, 1) and meta[0].labels is None
    assert meta[1].labels == ((1, 2), (2, 4), (5, 6))
    assert Metadata.gather([x]).fields == (0,)
    with pytest.raises(ValueError, match=r"no positional field 3; its fields are \[0, 1\]"):
        Metadata.gather(ArraySource((x, tokens), 2), labels=(3,))


def test_metadata_round_trips_through_json_and_stays_immutable() -> None:
    meta = Metadata.gather([(np.array([1, 2]), np.ones((2, 3)))])
    text = json.dumps(Metadata.gather(ArraySource({"#odd": np.ones(3), "y": np.arange(3)}, 1))
                      .to_dict())
    back = Metadata.from_dict(json.loads(text))
    assert back.fields == ("#odd", "y") and back["y"].labels == ((0, 1), (1, 1), (2, 1))
    again = Metadata.from_dict(json.loads(json.dumps(meta.to_dict())))
    assert again == meta and again.fields == (0, 1) and isinstance(again[1], FieldInfo)
    with pytest.raises(AttributeError, match="immutable"):
        meta.fields = ()  # type: ignore[misc]
    with pytest.raises(KeyError, match="no field 'z'"):
        meta["z"]


def _meta() -> Metadata:
    return Metadata.gather(ArraySource({"x": np.ones((8, 3), np.float32),
                                        "y": np.array([0, 1, 2, 1] * 2)}, 4))


def test_check_accepts_batches_and_abstract_values_like_the_training_data() -> None:
    meta = _meta()
    meta.check({"x": np.zeros((2, 3), np.float32), "y": np.zeros(2, np.int32)}, "evaluate")
    meta.check({"x": jax.ShapeDtypeStruct((5, 3), np.float32)}, "infer")  # no labels: fine


@pytest.mark.parametrize(("value", "match"), [
    (np.zeros((2, 4), np.float32), r"evaluate: field 'x' has per-example shape \(4,\), but the "
     r"training data had \(3,\); pass inputs shaped \(batch, 3\)"),
    (jax.ShapeDtypeStruct((2, 3), np.int32), r"field 'x' has dtype int32, but the training data "
     r"had float32; convert it \(x.astype\('float32'\)\)"),
    (np.zeros(3, np.float32), r"field 'x' has per-example shape \(\), but the training data"),
])
def test_check_refuses_another_feature_count_or_dtype_naming_the_field(value: object,
                                                                         match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _meta().check({"x": value}, "evaluate")


def test_check_refuses_a_field_the_metadata_lacks() -> None:
    with pytest.raises(ValueError, match=r"field 'z' is not in the training data's metadata "
                                         r"\(fields \['x', 'y'\]\)"):
        _meta().check({"x": np.zeros((2, 3), np.float32), "z": np.zeros(2)}, "evaluate")


def test_check_labels_names_the_field_and_the_unseen_values() -> None:
    meta = _meta()
    meta.check_labels({"y": np.array([2, 0]), "x": np.full((2, 3), 9.0)}, "evaluate")
    with pytest.raises(ValueError, match=r"evaluate: field 'y' holds labels the training data "
                                         r"never held: \[3, 7\] \(it held \[0, 1, 2\]\)"):
        meta.check_labels({"y": np.array([7, 0, 3, 3])}, "evaluate")


def test_bad_sources_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="the source is empty"):
        Metadata.gather([])
    with pytest.raises(ValueError, match=r"not a source of batches; wrap arrays in "
                                         r"graphmod.data.ArraySource"):
        Metadata.gather({"x": np.ones(3)})
    with pytest.raises(ValueError, match=r"batch 1 field 'x' is float64 with per-example "
                                         r"shape \(3,\), batch 0 was float64 \(2,\)"):
        Metadata.gather([{"x": np.ones((2, 2))}, {"x": np.ones((2, 3))}])
    with pytest.raises(ValueError, match="batch 1 has the fields"):
        Metadata.gather([{"x": np.ones(2)}, {"y": np.ones(2)}])
    with pytest.raises(ValueError, match="pass a sequence of fields"):
        Metadata.gather([{"y": np.ones(2)}], labels="y")  # type: ignore[arg-type]


def test_repr_and_html_show_one_row_per_field() -> None:
    meta = _meta()
    text = repr(meta)
    assert text.startswith("Metadata of 2 fields") and "'x'" in text
    assert "3: 0 (2), 1 (4), 2 (2)" in text and "0 / 2" in text and "float32" in text
    assert meta._repr_html_().count("<tr>") == 3  # the header and two fields


def test_string_label_fields_hold_their_classes_whatever_the_width() -> None:
    batches = [{"name": np.array(["cat", "dog"])}, {"name": np.array(["bird", "cat"])}]
    meta = Metadata.gather(batches, labels=("name",))
    assert meta["name"].dtype == "str" and meta["name"].mean is None
    assert meta["name"].labels == (("bird", 1), ("cat", 2), ("dog", 1))
    meta.check({"name": np.array(["a much longer name"])}, "evaluate")
    with pytest.raises(ValueError, match=r"field 'name' holds labels the training data never "
                                         r"held: \['cow'\]"):
        meta.check_labels({"name": np.array(["cow", "cat"])}, "evaluate")
    with pytest.raises(ValueError, match="field 'name' has dtype int64, but the training data "
                                         "had str"):
        meta.check({"name": np.array([1, 2])}, "evaluate")
