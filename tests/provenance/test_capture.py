"""Bricks and managers record their configuration on construction, with no user code."""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import treescope
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._bricks._construction import CONFIG, config_of


class Scaled(gm.Brick):
    def __init__(self, features: int, *, scale: float = 1.0, rngs: nnx.Rngs) -> None:
        self.lin = gm.bricks.Linear(features, features, rngs=rngs)
        self.scale = scale

    @gm.application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        return self.scale * self.lin(input_)


class MoreScaled(Scaled):
    def __init__(self, features: int, factor: int, *, rngs: nnx.Rngs) -> None:
        super().__init__(features, scale=2.0 * factor, rngs=rngs)


class Bare(gm.Brick):
    pass


def test_bricks_record_class_arguments_defaults_and_rng_key_data() -> None:
    rngs = nnx.Rngs(params=3, dropout=4)
    rngs.params()  # the stream has been used once before this brick is built
    lin = gm.bricks.Linear(2, 3, use_bias=False, rngs=rngs)
    config = config_of(lin)
    assert config["class"] == "graphmod.bricks.Linear"
    assert config["arguments"]["in_features"] == 2 and config["arguments"]["use_bias"] is False
    streams = config["arguments"]["rngs"]["$rngs"]
    assert streams["params"] == {"key": {"impl": "threefry2x32", "data": [0, 3]}, "count": 1}
    assert streams["dropout"]["count"] == 0
    assert config["defaults"]["bias_init"] == {"$callable": "jax.nn.initializers.zeros"}


def test_only_the_outermost_init_records() -> None:
    brick = MoreScaled(3, 2, rngs=nnx.Rngs(0))
    config = config_of(brick)
    assert config["class"].endswith("test_capture.MoreScaled")
    assert set(config["arguments"]) == {"features", "factor", "rngs"}  # not Scaled's scale=
    assert config_of(brick.lin)["class"] == "graphmod.bricks.Linear"
    assert config_of(Bare()) == {"class": config_of(Bare())["class"], "arguments": {},
                                 "defaults": {}}


def test_brick_arguments_are_nested_and_callables_recorded_by_path() -> None:
    seq = gm.bricks.Sequence(gm.bricks.Linear(2, 4, rngs=nnx.Rngs(0)), jax.nn.gelu,
                             jnp.tanh, lambda x: x)
    layers = config_of(seq)["arguments"]["layers"]
    assert layers[0]["$brick"]["class"] == "graphmod.bricks.Linear"
    assert layers[1:3] == [{"$callable": "jax.nn.gelu"}, {"$callable": "jax.numpy.tanh"}]
    assert layers[3]["$opaque"]["kind"] == "callable"


def test_the_record_adds_no_nnx_state_and_survives_copies() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0))
    state = nnx.state(mlp)
    paths = sorted(jax.tree_util.keystr(p) for p, _ in
                   jax.tree_util.tree_flatten_with_path(state)[0])
    assert paths == ["['linear_layers'][0]['W'].value", "['linear_layers'][0]['b'].value",
                     "['linear_layers'][1]['W'].value", "['linear_layers'][1]['b'].value"]
    graphdef, state = nnx.split(mlp)
    assert CONFIG not in str(state)
    for copied in (nnx.clone(mlp), copy.deepcopy(mlp), nnx.merge(graphdef, state)):
        assert config_of(copied) == config_of(mlp)
    # Two bricks built alike have equal graph definitions (nnx.jit caches are shared).
    assert nnx.split(gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0)))[0] == graphdef
    assert CONFIG not in repr(mlp)
    assert CONFIG not in treescope.render_to_text(mlp) and "linear_layers" in \
        treescope.render_to_text(mlp)


def test_construction_under_a_transform_still_works() -> None:
    abstract = nnx.eval_shape(lambda: gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
    config = config_of(abstract)
    assert config["arguments"]["rngs"]["$opaque"]["kind"] == "traced rngs"


def test_managers_record_configuration_and_bricks_by_path_at_compile() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0))
    dropout = managers.Dropout(gm.dynamic(0.2), broadcast_dims=(0,),
                               bricks=mlp.linear_layers[1:], roles=[roles.INPUT],
                               manager_name="drop")
    norm = managers.BatchNorm(momentum=0.9, filter=gm.VariableFilter(
        bricks=[gm.bricks.Linear], roles=[roles.OUTPUT]), strict=False)
    config = config_of(dropout)
    assert config["arguments"]["rate"] == {"$dynamic": 0.2}
    assert config["arguments"]["broadcast_dims"] == {"$tuple": [0]}
    assert config["arguments"]["bricks"] == [{"$brick_instance": 0}]
    program = gm.compile(lambda m, x: m(x).sum(), mlp, managers=[dropout, norm])
    program.init(np.ones((2, 3), np.float32))
    record = program.provenance["managers"]
    assert list(record) == ["drop", "batch_norm"]
    assert record["drop"]["arguments"]["bricks"] == ({"$brick_path": "/linear_layers/1"},)
    assert record["drop"]["arguments"]["roles"] == (
        {"$role": {"name": "INPUT", "parents": ()}},)
    assert record["batch_norm"]["arguments"]["filter"]["$filter"]["bricks"] == {
        "$tuple": ({"$class": "graphmod.bricks.Linear"},)}
    assert record["batch_norm"]["filter"] == {"roles": ("OUTPUT",), "bricks": (
        {"$class": "graphmod.bricks.Linear"},)}
    assert (record["batch_norm"]["order"], record["batch_norm"]["strict"]) == (1, False)


def test_your_own_bricks_rebuild_when_you_allow_their_package() -> None:
    brick = MoreScaled(3, 2, rngs=nnx.Rngs(4))
    program = gm.compile(lambda m, x: m(x).sum(), brick)
    package = type(brick).__module__.split(".")[0]
    with pytest.raises(gm.provenance.RebuildError, match=rf"allow=\['{package}'\]"):
        gm.rebuild(program.provenance)
    again = gm.rebuild(program.provenance, allow=[package])
    assert type(again.model) is MoreScaled and again.model.scale == 4.0
    np.testing.assert_array_equal(again.model.lin.W[...], brick.lin.W[...])


@dataclasses.dataclass(eq=False, repr=False)
class Gated(gm.Brick):
    """A brick whose ``__init__`` is made by ``dataclasses``."""

    features: int
    rngs: dataclasses.InitVar[nnx.Rngs]
    gate: float = 0.5

    def __post_init__(self, rngs: nnx.Rngs) -> None:
        self.lin = gm.bricks.Linear(self.features, self.features, rngs=rngs)

    @gm.application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        return self.gate * self.lin(input_)


def test_a_dataclass_brick_records_its_generated_init_and_rebuilds() -> None:
    brick = Gated(3, nnx.Rngs(5), gate=0.25)
    config = config_of(brick)
    assert config["arguments"]["features"] == 3 and config["arguments"]["gate"] == 0.25
    assert config["arguments"]["rngs"]["$rngs"]["default"]["key"]["data"] == [0, 5]
    program = gm.compile(lambda m, x: m(x).sum(), brick)
    again = gm.rebuild(program.provenance, allow=[type(brick).__module__.split(".")[0]])
    assert type(again.model) is Gated and again.model.gate == 0.25
    np.testing.assert_array_equal(again.model.lin.W[...], brick.lin.W[...])


class Mode(enum.Enum):
    FAST = 1
    SLOW = 2


class Everything(gm.Brick, pytree=False):
    """Stores whatever it is given, to check each kind of value round-trips."""

    def __init__(self, *values: object, **named: object) -> None:
        self.values = tuple(values)
        self.named = dict(named)


def test_each_kind_of_argument_round_trips_through_rebuild() -> None:
    values = ((1, "a", None), {"k": [1.5, True]}, {3: "int key"}, float("inf"),
              np.arange(6, dtype=np.int16).reshape(2, 3), np.float32(0.25),
              jnp.array([1.0, float("nan")]), np.dtype("bfloat16"), jnp.float32,
              functools.partial(jax.nn.leaky_relu, negative_slope=0.2), Mode.SLOW,
              gm.dynamic(0.3), roles.WEIGHT, gm.bricks.Linear)
    brick = Everything(*values, key=jax.random.key(5), rngs_free="ok")
    record = gm.Provenance("program", {"bricks": {"/": config_of(brick)}})
    again = gm.rebuild(gm.Provenance.from_json(record.to_json()), verify=False,
                       allow=[type(brick).__module__.split(".")[0]]).model
    got = again.values
    assert got[:4] == values[:4]
    np.testing.assert_array_equal(got[4], values[4])
    assert got[4].dtype == np.int16 and type(got[5]) is np.float32 and got[5] == 0.25
    assert isinstance(got[6], jax.Array)
    np.testing.assert_array_equal(np.asarray(got[6]), np.asarray(values[6]))
    assert got[7] == np.dtype("bfloat16") and got[8] == np.dtype("float32")
    assert got[9].func is jax.nn.leaky_relu and got[9].keywords == {"negative_slope": 0.2}
    assert got[10] is Mode.SLOW and got[11] == gm.dynamic(0.3)
    assert got[12] is roles.WEIGHT and got[13] is gm.bricks.Linear
    assert jax.random.key_data(again.named["key"]).tolist() == [0, 5]
    assert again.named["rngs_free"] == "ok"
