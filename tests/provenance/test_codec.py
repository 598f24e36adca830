"""One class per provenance tag (issue 10, part 4): every tag round-trips.

For each tag: encoding a value and decoding it (through JSON text, after the check pass
that imports nothing) gives an equal value, the record's text mentions it, and
``import_paths`` lists exactly the import paths rebuild checks for it.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._bricks._construction import Encoder, config_of
from graphmod._core._codec import TAGS, import_paths
from graphmod._core._model._layout import Layout
from graphmod._core._selection._filter import BoundApplication, ClassApplication
from graphmod._records._collect import filter_record, modules
from graphmod._records._summary import readable
from graphmod._train._evaluate import _variables_record
from graphmod.provenance import RebuildError
from graphmod.provenance._decoder import RecordDecoder
from graphmod.provenance._names import Rules

SETTINGS = settings(max_examples=25, deadline=None)


def encode(value: Any, *, by_path: bool = False) -> Any:
    """``value`` encoded, then written and read as JSON text as a record is."""
    return json.loads(json.dumps(Encoder(by_path=by_path)(value)))


def decode(record: Any, bricks: dict[str, Any] | None = None) -> Any:
    """The check pass (nothing imported), then the decoded value."""
    RecordDecoder(Rules(), None, dry=True)(record, "value")
    return RecordDecoder(Rules(), bricks, dry=False)(record, "value")


def tag_of(record: Any) -> str:
    assert isinstance(record, dict) and len(record) == 1, record
    return next(iter(record))


def roundtrip(value: Any, tag: str, mentions: str,
              paths: tuple[tuple[str, str], ...] = ()) -> Any:
    """The decoded value of ``value``, after checking its tag, text and import paths."""
    record = encode(value)
    assert tag_of(record) == tag
    assert mentions in readable(record, 500)
    assert [(path, kind) for path, kind, _ in import_paths(record)] == list(paths)
    return decode(record)


COVERED: set[str] = set()


def covers(*tags: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Notes the tags a test round-trips (checked against the registry at the end)."""
    COVERED.update(tags)
    return lambda test: test


scalars = st.one_of(st.integers(-10**6, 10**6), st.text(max_size=5), st.booleans(),
                    st.none(), st.floats(allow_nan=False, allow_infinity=False))


@covers("$tuple")
@SETTINGS
@given(st.lists(scalars, max_size=4).map(tuple))
def test_tuple(value: tuple) -> None:
    assert roundtrip(value, "$tuple", "(") == value


@covers("$dict")
@SETTINGS
@given(st.dictionaries(st.text(max_size=4), scalars, max_size=3))
def test_dict(value: dict) -> None:
    assert roundtrip(value, "$dict", "{") == value


@covers("$items")
@SETTINGS
@given(st.dictionaries(st.one_of(st.integers(), st.tuples(st.integers(), st.text(max_size=3))),
                       scalars, min_size=1, max_size=3))
def test_items(value: dict) -> None:
    first = next(iter(value))
    assert roundtrip(value, "$items", str(first[0] if isinstance(first, tuple) else first)) \
        == value


@covers("$float")
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_float(value: float) -> None:
    again = roundtrip(value, "$float", repr(value))
    assert repr(again) == repr(value)


@covers("$dtype")
@pytest.mark.parametrize("value", [np.float32, np.dtype("int8"), np.bool_, jax.numpy.bfloat16])
def test_dtype(value: Any) -> None:
    assert roundtrip(value, "$dtype", np.dtype(value).name) == np.dtype(value)


@covers("$array")
@SETTINGS
@given(hnp.arrays(st.sampled_from([np.float32, np.int16, np.uint8, np.bool_]),
                  hnp.array_shapes(min_dims=0, max_dims=3, max_side=4)),
       st.sampled_from(["numpy", "jax", "scalar"]))
def test_array(array: np.ndarray, kind: str) -> None:
    value = jax.numpy.asarray(array) if kind == "jax" else \
        array[()] if kind == "scalar" and array.ndim == 0 else array
    again = roundtrip(value, "$array", f"array{array.shape}")
    assert type(again) is type(value)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(value))
    assert np.asarray(again).dtype == array.dtype


@covers("$key")
@SETTINGS
@given(st.integers(0, 2**31 - 1))
def test_key(seed: int) -> None:
    key = jax.random.key(seed)
    again = roundtrip(key, "$key", "key(")
    assert (jax.random.key_data(again) == jax.random.key_data(key)).all()


@covers("$rngs")
@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(0, 3))
def test_rngs(seed: int, draws: int) -> None:
    rngs = nnx.Rngs(seed, dropout=seed + 1)
    for _ in range(draws):
        rngs.dropout()
    again = roundtrip(rngs, "$rngs", f"@{draws}")
    for name in ("default", "dropout"):
        assert (jax.random.key_data(getattr(again, name).key[...])
                == jax.random.key_data(getattr(rngs, name).key[...])).all()
        assert int(getattr(again, name).count[...]) == int(getattr(rngs, name).count[...])


@covers("$role")
@pytest.mark.parametrize("value", [roles.WEIGHT, roles.INPUT,
                                   roles.add_role("CODEC_GATE", roles.OUTPUT)])
def test_role(value: roles.Role) -> None:
    assert roundtrip(value, "$role", value.name) is value


@covers("$enum")
def test_enum() -> None:
    value = jax.lax.Precision.HIGHEST
    assert roundtrip(value, "$enum", "HIGHEST",
                     (("jax.lax.Precision", "class"),)) is value


@covers("$class")
@pytest.mark.parametrize("value", [gm.bricks.Linear, managers.Dropout, nnx.Linear])
def test_class(value: type) -> None:
    path = encode(value)["$class"]
    assert roundtrip(value, "$class", path, ((path, "class"),)) is value


@covers("$callable")
@pytest.mark.parametrize("value", [jax.nn.relu, jax.numpy.tanh])
def test_callable(value: Any) -> None:
    path = encode(value)["$callable"]
    assert roundtrip(value, "$callable", path, ((path, "function"),)) is value


@covers("$call")
@SETTINGS
@given(st.floats(0.01, 10))
def test_call(stddev: float) -> None:
    value = jax.nn.initializers.normal(stddev)
    again = roundtrip(value, "$call", "jax.nn.initializers.normal(",
                      (("jax.nn.initializers.normal", "factory"),))
    assert encode(again) == encode(value)
    key = jax.random.key(0)
    assert (again(key, (3,)) == value(key, (3,))).all()


@covers("$partial")
def test_partial() -> None:
    value = functools.partial(jax.nn.gelu, approximate=False)
    again = roundtrip(value, "$partial", "partial(", (("jax.nn.gelu", "partial"),))
    assert again.func is jax.nn.gelu and again.keywords == {"approximate": False}


@covers("$application")
def test_application() -> None:
    assert roundtrip(gm.bricks.Linear.apply, "$application", "application 'apply'") == "apply"


@covers("$class_application")
def test_class_application() -> None:
    again = roundtrip(nnx.Linear.__call__, "$class_application", ".apply",
                      (("flax.nnx.nn.linear.Linear", "class"),))
    assert again == ClassApplication(nnx.Linear, "apply")


@covers("$brick", "$bound_application")
@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 100))
def test_brick_and_bound_application(inputs: int, outputs: int, seed: int) -> None:
    brick = gm.bricks.Linear(inputs, outputs, rngs=nnx.Rngs(seed))
    again = roundtrip(brick, "$brick", "graphmod.bricks.Linear(",
                      (("graphmod.bricks.Linear", "class"),))
    assert type(again) is gm.bricks.Linear and config_of(again) == config_of(brick)
    assert (again.W[...] == brick.W[...]).all()
    bound = roundtrip(brick.apply, "$bound_application", "Linear(",
                      (("graphmod.bricks.Linear", "class"),))
    assert isinstance(bound, BoundApplication) and bound.name == "apply"
    assert (bound.brick.W[...] == brick.W[...]).all()


@covers("$dynamic")
@SETTINGS
@given(st.floats(0, 1))
def test_dynamic(rate: float) -> None:
    again = roundtrip(gm.dynamic(rate), "$dynamic", f"dynamic({rate})")
    assert getattr(again, "__graphmod_dynamic__", False) and again.value == rate


@covers("$filter")
def test_filter() -> None:
    value = gm.VariableFilter(roles=[roles.WEIGHT], bricks=[gm.bricks.Linear],
                              applications=[gm.bricks.Linear.apply, nnx.Linear.__call__],
                              name_regex="W", call_id=[0, 2], each_role=True)
    again = roundtrip(value, "$filter", "VariableFilter(", (
        ("graphmod.bricks.Linear", "class"), ("flax.nnx.nn.linear.Linear", "class")))
    assert repr(again) == repr(value)


@covers("$brick_path")
def test_brick_path_and_the_plain_filter_of_program_records() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0))
    value = gm.VariableFilter(roles=[roles.OUTPUT], bricks=[mlp.linear_layers[1]],
                              applications=[mlp.linear_layers[0].apply])
    record = json.loads(json.dumps(filter_record(value, Layout(mlp))))
    assert record == {"roles": ["OUTPUT"], "bricks": [{"$brick_path": "/linear_layers/1"}],
                      "applications": [{"$bound_application": {
                          "brick": {"$brick_path": "/linear_layers/0"}, "name": "apply"}}]}
    assert "/linear_layers/1" in readable({"$filter": record}, 500)
    assert import_paths({"$filter": record}) == []
    again = decode({"$filter": record}, modules(mlp))
    assert again.bricks == (mlp.linear_layers[1],) and again.roles == (roles.OUTPUT,)
    assert again.applications[0].brick is mlp.linear_layers[0]


@covers("$brick_instance")
def test_a_brick_instance_is_resolved_at_compile_and_never_read_back() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0))
    record = encode(mlp.linear_layers[0], by_path=True)
    assert record == {"$brick_instance": 0} and "brick #0" in readable(record)
    with pytest.raises(RebuildError, match=r"value names a brick by its place"):
        decode(record)


@covers("$optimizer")
def test_optimizer() -> None:
    schedule = gm.provenance.optimizer("exponential_decay", 0.1, 100, 0.5)
    value = gm.provenance.optimizer("chain", gm.provenance.optimizer("clip", 1.0),
                                    gm.provenance.optimizer("adam", learning_rate=schedule))
    again = roundtrip(value, "$optimizer", "chain(", (
        ("optax.chain", "factory"), ("optax.clip", "factory"), ("optax.adam", "factory"),
        ("optax.exponential_decay", "factory")))
    assert again.config == value.config


@covers("$opaque")
def test_opaque() -> None:
    record = encode(lambda x: x)
    assert tag_of(record) == "$opaque" and "<lambda>" in readable(record, 500)
    with pytest.raises(ValueError, match=r"value was recorded as opaque"):
        import_paths(record)
    with pytest.raises(RebuildError, match=r"recorded as opaque"):
        decode(record)


def test_every_tag_has_a_round_trip_test() -> None:
    assert set(TAGS) == COVERED


def test_one_filter_encoding_for_construction_and_program_records() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0))
    norm = managers.BatchNorm(filter=gm.VariableFilter(
        roles=[roles.OUTPUT], bricks=[mlp.linear_layers[0], gm.bricks.Linear], call_id=[0]))
    program = gm.compile(lambda m, x: m(x).sum(), mlp, managers=[norm])
    program.init(np.ones((2, 3), np.float32))
    record = program.provenance["managers"]["batch_norm"]
    constructed = record["arguments"]["filter"]["$filter"]
    assert constructed["roles"] == {"$tuple": ({"$role": {"name": "OUTPUT", "parents": ()}},)}
    assert record["filter"] == {"roles": ("OUTPUT",), "bricks": (
        {"$brick_path": "/linear_layers/0"}, {"$class": "graphmod.bricks.Linear"}),
        "call_id": (0,)}
    assert constructed["bricks"] == {"$tuple": record["filter"]["bricks"]}


def test_the_one_array_hash_keeps_the_hashes_records_hold() -> None:
    """Data, variables and large arguments are hashed by ``hash_array``; the values are
    those records written before it held (so old records still check)."""
    source = gm.data.ArraySource({"x": np.arange(20.).reshape(10, 2), "y": np.arange(10)},
                                 batch_size=2)
    assert source.describe()["sha256"] == \
        "65d21d411dcc83193bdaf4f81713026ea19284b29435207e60371ecac11b6433"
    assert encode(np.zeros(5000))["$opaque"]["sha256"] == \
        "e7e2dcff542de95352682dc186432e98f0188084896773f1973276b0577d5305"
    variables = {"a": np.ones((2, 2)), "k": jax.random.key(3), "b": [np.zeros(3, np.int8)]}
    assert _variables_record(variables)["sha256"] == \
        "sha256:2b00710658f72e96b75cc0ea76a4840a7ad4cc7d50df28461c12d8d07702acbc"
