"""VariableFilter: Blocks semantics over tagged variables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles


def _graph() -> tuple[gm.ComputationGraph, gm.bricks.MLP]:
    mlp = gm.bricks.MLP([3, 4, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    return gm.compile(lambda m, x: m(x), mlp).graph(jnp.ones((2, 3))), mlp


def paths(records: list) -> list[str]:
    return [r.tag.path for r in records]


def test_roles_match_sub_roles_and_each_role_requires_all() -> None:
    cg, _ = _graph()
    assert paths(cg.filter(gm.VariableFilter(roles=[roles.PARAMETER]))) == [
        "/linear_layers/0.W", "/linear_layers/0.b", "/linear_layers/1.W",
        "/linear_layers/1.b", "/linear_layers/2.W", "/linear_layers/2.b"]
    both = gm.VariableFilter(roles=[roles.PARAMETER, roles.WEIGHT], each_role=True)
    assert paths(cg.filter(both)) == ["/linear_layers/0.W", "/linear_layers/1.W",
                                      "/linear_layers/2.W"]


def test_brick_instances_match_their_own_applications_not_their_childrens() -> None:
    cg, mlp = _graph()
    own = cg.filter(gm.VariableFilter(bricks=[mlp], roles=[roles.INPUT]))
    assert paths(own) == ["/.apply.input_"]
    layer = cg.filter(gm.VariableFilter(bricks=[mlp.linear_layers[1]], roles=[roles.OUTPUT]))
    assert paths(layer) == ["/linear_layers/1.apply.output"]
    by_class = cg.filter(gm.VariableFilter(bricks=[gm.bricks.MLP]))
    assert {r.tag.brick_path for r in by_class} == {"/"}


class Held(nnx.Module):
    """Layers in an ``nnx.List`` and a head in an ``nnx.Dict`` (as Flax's Gemma holds its
    blocks)."""

    def __init__(self) -> None:
        self.layers = nnx.List([nnx.Linear(3, 3, rngs=nnx.Rngs(i)) for i in range(2)])
        self.heads = nnx.Dict(out=nnx.Linear(3, 1, rngs=nnx.Rngs(2)))

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return self.heads["out"](x)


def test_an_nnx_list_or_dict_in_bricks_stands_for_the_modules_it_holds() -> None:
    model = Held()
    assert gm.VariableFilter(bricks=[model.layers, model.heads]).bricks == (
        *model.layers, model.heads["out"])
    assert gm.VariableFilter(bricks=model.heads).bricks == (model.heads["out"],)
    program = gm.compile(lambda m, x: m(x).sum(), model, managers=[
        managers.Dropout(0.5, bricks=[model.layers], roles=[roles.INPUT])])
    x = jnp.ones((2, 3))
    program.train(program.init(x), x, rng=jax.random.key(0))
    assert [r.path for r in program.rewrites["train"]] == ["/layers/0", "/layers/1"]


def test_name_regex_path_glob_applications_and_call_id() -> None:
    cg, _ = _graph()
    assert len(cg.filter(gm.VariableFilter(name="W"))) == 3
    assert len(cg.filter(gm.VariableFilter(name_regex="^[Wb]$"))) == 6
    assert paths(cg.filter(gm.VariableFilter(path="/linear_layers/2.*"))) == [
        "/linear_layers/2.apply.input_", "/linear_layers/2.W", "/linear_layers/2.b",
        "/linear_layers/2.apply.output"]
    # Applications match by name (Blocks): MLP.apply and Linear.apply are both "apply".
    assert len(cg.filter(gm.VariableFilter(applications=[gm.bricks.Linear.apply]))) == 14
    assert cg.filter(gm.VariableFilter(call_id=1)) == []
    assert len(cg.filter(gm.VariableFilter(call_id=[0]))) == len(cg)


def test_a_bound_application_selects_its_instance_and_an_unbound_one_every_instance() -> None:
    cg, mlp = _graph()
    one = cg.filter(gm.VariableFilter(applications=[mlp.linear_layers[1].apply]))
    assert paths(one) == ["/linear_layers/1.apply.input_", "/linear_layers/1.W",
                          "/linear_layers/1.b", "/linear_layers/1.apply.output"]
    root = cg.filter(gm.VariableFilter(applications=[mlp.apply], roles=[roles.INPUT]))
    assert paths(root) == ["/.apply.input_"]  # a parent's own application, not its children's
    both = gm.VariableFilter(applications=["apply", mlp.linear_layers[1].apply])
    assert len(cg.filter(both)) == len(cg)
    assert len(cg.filter(gm.VariableFilter(applications=[gm.bricks.Linear.apply]))) == 14


def test_a_bound_application_of_a_brick_outside_the_model_raises_naming_it() -> None:
    cg, _ = _graph()
    stranger = gm.bricks.Linear(3, 4, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"Linear at 0x.* applications= is not part of"):
        cg.filter(gm.VariableFilter(applications=[stranger.apply]))


def test_filters_print_their_fields() -> None:
    f = gm.VariableFilter(roles=roles.WEIGHT, path="*.W")
    assert repr(f) == "VariableFilter(roles=(WEIGHT,), path='*.W')"


def test_a_bound_application_is_recorded_by_path_and_rebuilt_on_the_new_model() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], rngs=nnx.Rngs(0))
    dropout = managers.Dropout(0.5, applications=[mlp.linear_layers[1].apply],
                               roles=[roles.INPUT])
    program = gm.compile(lambda m, x: m(x).sum(), mlp, managers=[dropout])
    program.init(jnp.ones((2, 3)))
    bound = {"$bound_application": {"brick": {"$brick_path": "/linear_layers/1"},
                                    "name": "apply"}}
    record = program.provenance["managers"]["dropout"]
    assert record["arguments"]["applications"] == (bound,)
    assert record["filter"]["applications"] == (bound,)
    again = gm.rebuild(program.provenance)
    application, = again.managers[0].filter.applications
    assert application.brick is again.model.linear_layers[1] and application.name == "apply"


class TwoFlaxLinears(nnx.Module):
    def __init__(self) -> None:
        self.linear1 = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.linear2 = nnx.Linear(4, 2, rngs=nnx.Rngs(1))
        self.embed = nnx.Embed(5, 2, rngs=nnx.Rngs(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.embed.attend(self.linear2(self.linear1(x)))


def _flax_rewrites(applications: list) -> list[tuple[str, str]]:
    model = TwoFlaxLinears()
    noise = managers.WeightNoise(0.1, roles=[roles.PARAMETER], applications=applications)
    program = gm.compile(lambda m, x: m(x), model, managers=[noise])
    program.init(jnp.ones((2, 3)))
    return [(r.path, r.application) for r in program.rewrites["init"]]


def test_flax_methods_select_by_class_unbound_and_by_instance_bound() -> None:
    model = TwoFlaxLinears()
    bias = [("/linear1", "apply"), ("/linear2", "apply")]
    assert _flax_rewrites([nnx.Linear.__call__]) == [b for b in bias for _ in (0, 1)]
    assert _flax_rewrites([nnx.Embed.attend]) == [("/embed", "attend")]
    one = gm.VariableFilter(applications=[model.linear2.__call__]).applications[0]
    assert one.brick is model.linear2 and one.name == "apply"
    # the parent's own __call__ reads no parameter itself (its children's calls do)
    with pytest.raises(ValueError, match=r"matched nothing.*TwoFlaxLinears'>, name='apply'"):
        _flax_rewrites([TwoFlaxLinears.__call__])


def test_a_bound_flax_method_rewrites_that_instance_only() -> None:
    model = TwoFlaxLinears()
    noise = managers.WeightNoise(0.1, roles=[roles.PARAMETER],
                                 applications=[model.linear2.__call__])
    program = gm.compile(lambda m, x: m(x), model, managers=[noise])
    program.init(jnp.ones((2, 3)))
    assert {r.path for r in program.rewrites["init"]} == {"/linear2"}
    record = program.provenance["managers"]["weight_noise"]["filter"]["applications"]
    assert record == ({"$bound_application": {"brick": {"$brick_path": "/linear2"},
                                              "name": "apply"}},)


def test_an_unbound_flax_method_is_recorded_by_class_and_rebuilt() -> None:
    from graphmod.provenance._decoder import RecordDecoder
    from graphmod.provenance._names import Rules

    noise = managers.WeightNoise(0.1, applications=[nnx.Linear.__call__])
    program = gm.compile(lambda m, x: m(x), TwoFlaxLinears(), managers=[noise])
    program.init(jnp.ones((2, 3)))
    by_class = {"$class_application": {"class": {"$class": "flax.nnx.nn.linear.Linear"},
                                       "name": "apply"}}
    record = program.provenance["managers"]["weight_noise"]
    assert record["arguments"]["applications"] == (by_class,)
    assert record["filter"]["applications"] == (by_class,)
    decoded = RecordDecoder(Rules(), None, dry=False)(by_class, "x")
    assert decoded == noise.filter.applications[0]


def test_a_method_of_a_class_defined_in_a_function_names_the_way_around() -> None:
    class Local(nnx.Module):
        def encode(self, x: jax.Array) -> jax.Array:
            return x

    with pytest.raises(TypeError, match=r"bricks=\[TheClass\], applications=\['encode'\]"):
        gm.VariableFilter(applications=[Local.encode])
