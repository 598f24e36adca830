"""Programs on a mesh of 8 virtual CPU devices (``tests/conftest.py`` asks XLA for them):
variables placed by rules, the one-device results, no retrace, bad rules refused."""

from __future__ import annotations

import inspect
import json
import warnings
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import graphmod as gm
import managers
from examples.flax_nnx import lm1b
from examples.flax_nnx.scan_over_layers import ScanMLP
from graphmod import On, at
from graphmod import roles as R
from graphmod._train._loop._steps import bounded, steps_in_flight
from graphmod.plugins import Checkpoint
from tests.test_ensembles import Ensemble

X = np.random.RandomState(0).randn(32, 8).astype(np.float32)
Y = np.random.RandomState(1).randn(32, 4).astype(np.float32)
TOKENS = np.random.RandomState(2).randn(16, 5, 16).astype(np.float32)


def squared_error(model: Any, x: jax.Array, y: jax.Array | None = None) -> jax.Array:
    out = model(x)
    return jnp.mean((out - (0.0 if y is None else y)) ** 2)


def regularizers() -> list[gm.Manager]:
    linear = [gm.bricks.Linear]
    return [managers.Dropout(0.2, roles=[R.INPUT], bricks=linear),
            managers.WeightNoise(0.01, roles=[R.WEIGHT]),
            managers.BatchNorm(roles=[R.OUTPUT], bricks=linear)]


def mlp() -> gm.bricks.MLP:
    return gm.bricks.MLP([8, 16, 8, 4], rngs=nnx.Rngs(0))


def transformer() -> gm.bricks.TransformerBlock:
    return gm.bricks.TransformerBlock(16, 4, 32, rngs=nnx.Rngs(0))


MODELS = {"mlp": (mlp, (X, Y)), "transformer": (transformer, (TOKENS,))}
PRESETS = {"data_parallel": ((8,), ("data",), gm.sharding.data_parallel()),
           "fsdp": ((8,), ("data",), gm.sharding.fsdp()),
           "tensor_parallel": ((2, 4), ("data", "model"), gm.sharding.tensor_parallel())}


def train(program: gm.Program, batch: tuple, steps: int = 4) -> tuple[gm.TrainState, list]:
    step = gm.optimize(program, optax.sgd(0.1), grad_norms=True)
    state = step.init(program.init(*(b[:8] for b in batch)), jax.random.key(1))
    metrics = []
    for _ in range(steps):
        state, m = step(state, *batch)
        metrics.append(jax.device_get(m))
    return state, metrics


def placed(leaf: Any) -> tuple:
    """The mesh axes of each dimension of ``leaf``, an array or its sharding (trailing whole
    dimensions dropped, as JAX writes the spec of a step's output)."""
    spec = tuple(getattr(leaf, "sharding", leaf).spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def test_eight_devices() -> None:
    assert jax.device_count() == 8  # the mesh tests below need them


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_mesh_runs_the_one_device_program(preset: str, model: str) -> None:
    make, batch = MODELS[model]
    shape, axes, rules = PRESETS[preset]
    one, one_metrics = train(gm.compile(squared_error, make(), managers=regularizers()), batch)
    mesh = jax.make_mesh(shape, axes)
    program = gm.compile(squared_error, make(), managers=regularizers(), mesh=mesh, **rules)
    state, metrics = train(program, batch)
    for name in one_metrics[0]:  # the loss and every parameter's gradient norm
        np.testing.assert_allclose([m[name] for m in metrics], [m[name] for m in one_metrics],
                                   rtol=2e-5, atol=1e-6, err_msg=name)
    chex.assert_trees_all_close(jax.device_get(state.variables),
                                jax.device_get(one.variables), rtol=1e-4, atol=1e-6)
    assert {d for leaf in jax.tree.leaves(state) for d in leaf.sharding.device_set} == set(
        mesh.devices.flat)


def test_variables_and_optimizer_state_are_placed_as_the_rules_say() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    lora = managers.LoRA(rank=4, roles=[R.WEIGHT])
    program = gm.compile(squared_error, mlp(), managers=[lora], mesh=mesh,
                         **gm.sharding.tensor_parallel())
    step = gm.optimize(program, optax.adam(1e-3), trainable=[lora])
    state = step.init(program.init(X[:8], Y[:8]), jax.random.key(0))
    state, _ = step(state, X, Y)
    layers = state.variables["model"]["linear_layers"]
    expected = {(0, "W"): (None, "model"), (0, "b"): ("model",), (1, "W"): ("model",),
                (1, "b"): (), (2, "W"): (None, "model"), (2, "b"): ("model",)}
    for (layer, name), spec in expected.items():
        assert placed(layers[layer][name]) == spec, (layer, name)
    adapters = state.variables["managers"]["lora"]
    # a (in, rank) and b (rank, out) take W's axis where their sizes agree with W's
    assert placed(adapters["/linear_layers/0"]["W"]["a"]) == ()
    assert placed(adapters["/linear_layers/0"]["W"]["b"]) == (None, "model")
    assert placed(adapters["/linear_layers/1"]["W"]["a"]) == ("model",)
    # Adam's moments (of the adapters alone: trainable=[lora]) are placed as the adapters
    trained = step._parameters(state.variables)[0]
    assert len(jax.tree.leaves(trained)) == 6 and not jax.tree.leaves(trained["model"])
    for moments in (state.opt_state[0].mu, state.opt_state[0].nu):
        assert jax.tree.map(placed, moments) == jax.tree.map(placed, trained)
    assert placed(state.step) == () and placed(state.rng) == ()
    table = program.sharding(state.variables)
    rows = {row["path"]: row for row in table.rows}
    assert rows["model/linear_layers/0/W"]["placement"] == "P(None, 'model')"
    assert rows["model/linear_layers/0/W"]["per device"] == 8 * 16 * 4 // 4  # a quarter
    assert rows["model/linear_layers/1/b"]["placement"] == "replicated"
    assert "per device" in repr(table).splitlines()[0] and "per device" in table._repr_html_()
    assert gm.VariablesTable(state.variables).placement  # several devices: shown unasked


def test_loaded_variables_are_placed_as_init_places_them(tmp_path) -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    program = gm.compile(squared_error, mlp(), mesh=mesh, **gm.sharding.tensor_parallel())
    variables = program.init(X[:8], Y[:8])
    program.save(tmp_path / "saved", variables)
    loaded = program.load(tmp_path / "saved")  # whole arrays on disk, split again
    assert jax.tree.map(lambda a: a.sharding, loaded) == jax.tree.map(lambda a: a.sharding,
                                                                      variables)
    assert placed(loaded["model"]["linear_layers"][0]["W"]) == (None, "model")
    chex.assert_trees_all_equal(loaded, variables)


def test_no_rule_means_replicated() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    program = gm.compile(squared_error, mlp(), mesh=mesh, batch_axis="data")
    variables = program.init(X[:8], Y[:8])
    assert all(placed(leaf) == () and len(leaf.sharding.device_set) == 8
               for leaf in jax.tree.leaves(variables))


def test_a_presets_rule_may_select_nothing_a_users_rule_may_not() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    preset = gm.sharding.tensor_parallel("data", batch_axis=None)["rules"]
    attention = preset[0]  # */query.W: an MLP has no attention
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the preset's MLP rules place the MLP: no warning
        gm.compile(squared_error, mlp(), mesh=mesh, rules=preset)
    with pytest.raises(ValueError, match=r"rules\[0\] \(VariableFilter\(path='\*/query\.W'\), "
                                         r"P\(None, 'data'\)\) selects no variable"):
        gm.compile(squared_error, mlp(), mesh=mesh, rules=[(attention[0], P(None, "data"))])
    with pytest.warns(UserWarning, match=r"no rule of the preset selects a variable of the "
                                         r"model, so every variable is replicated"):
        gm.compile(squared_error, mlp(), mesh=mesh, rules=[attention])


def test_a_batch_the_devices_do_not_divide_is_replicated_with_a_warning() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    program = gm.compile(squared_error, mlp(), mesh=mesh, batch_axis="data")
    variables = program.init(X[:8], Y[:8])
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(variables, jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 16 rows: split, nothing said
        state, _ = step(state, X[:16], Y[:16])
    with pytest.warns(UserWarning, match=r"shape \(10, \d\) is not split over the 8 devices "
                      r"of batch axis 'data'.*multiple of 8 \(e\.g\. 8\)"):
        _, metrics = step(state, X[:10], Y[:10])
    one_device = gm.compile(squared_error, mlp())  # the same result, replicated
    expected = gm.optimize(one_device, optax.sgd(0.1))
    plain = expected.init(one_device.init(X[:8], Y[:8]), jax.random.key(0))
    plain, _ = expected(plain, X[:16], Y[:16])
    np.testing.assert_allclose(metrics["loss"], expected(plain, X[:10], Y[:10])[1]["loss"],
                               rtol=1e-5)


def test_steps_neither_retrace_nor_wait_for_the_host() -> None:
    traces = []

    def counted(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        traces.append(1)
        return squared_error(model, x, y)

    mesh = jax.make_mesh((8,), ("data",))
    program = gm.compile(counted, mlp(), managers=regularizers(), mesh=mesh,
                         **gm.sharding.fsdp())
    step = gm.optimize(program, optax.adam(1e-3))
    state = step.init(program.init(X[:8], Y[:8]), jax.random.key(0))
    batch = program.placement.put_batch((X, Y))
    state, _ = step(state, *batch)
    after_first = len(traces)
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            state, metrics = step(state, *batch)
    assert len(traces) == after_first
    assert metrics["loss"].sharding.device_set == set(mesh.devices.flat)


def test_put_batch_splits_what_divides_and_leaves_placed_batches_alone() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    program = gm.compile(squared_error, mlp(), mesh=mesh, **gm.sharding.data_parallel())
    placement = program.placement
    batch = placement.put_batch((X, Y, np.float32(0.5), np.ones(6, np.float32)))
    assert [placed(leaf) for leaf in batch] == [("data",), ("data",), (), ()]
    split = batch[:2]
    assert placement.put_batch(split) is split  # every leaf split by this placement
    again = placement.put_batch(batch)  # whole leaves too: each leaf is looked at
    assert all(a is b for a, b in zip(again, batch, strict=True))
    whole = jax.device_put(X, placement.replicated())  # on the mesh, but not split
    assert placed(placement.put_batch((whole,))[0]) == ("data",)
    stacked = placement.put_batch((np.stack([X, X]),), stacked=True)
    assert placed(stacked[0]) == (None, "data")
    assert placement.put_batch(stacked, stacked=True) is stacked


def test_a_train_step_splits_its_batch_inside_its_jitted_function(monkeypatch) -> None:
    def scaled(model: Any, x: jax.Array, y: jax.Array, scale: float = 1.0) -> jax.Array:
        return scale * squared_error(model, x, y)

    mesh = jax.make_mesh((8,), ("data",))
    program = gm.compile(scaled, mlp(), mesh=mesh, **gm.sharding.data_parallel())
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(X[:8], Y[:8]), jax.random.key(0))
    placed_batch = program.placement.put_batch((X, Y))
    # NumPy, as it is passed: XLA splits it; the step looks at no batch in Python.
    monkeypatch.setattr(type(program.placement), "put_batch", None)
    args, kwargs = step._step.lower(state, X, Y, scale=np.float32(1.0)).compile().input_shardings
    assert [placed(s) for s in (*args[1:], kwargs["scale"])] == [("data",), ("data",), ()]
    from_numpy, metrics = step(jax.tree.map(jnp.copy, state), X, Y)
    from_placed, placed_metrics = step(state, *placed_batch)
    assert metrics["loss"] == placed_metrics["loss"]
    chex.assert_trees_all_equal(from_numpy.variables, from_placed.variables)
    stacked = np.stack([X, X]), np.stack([Y, Y])  # fused steps split the batch dimension
    fused = step._steps.lower(from_placed, stacked).compile().input_shardings[0][1]
    assert [placed(s) for s in jax.tree.leaves(fused)] == [(None, "data"), (None, "data")]
    assert step.steps(from_placed, stacked)[1]["loss"].shape == (2,)
    assert list(inspect.signature(step).parameters) == ["state", "batch", "kwargs"]
    variables = program.init(X[:8], Y[:8])  # train and infer split a NumPy batch likewise
    inferred = program.infer(variables, X, Y)
    _, trained = program.train(variables, X, Y, rng=jax.random.key(0))
    np.testing.assert_allclose(inferred, metrics["loss"], rtol=1e-6)
    assert trained["model"]["linear_layers"][0]["W"].sharding.is_equivalent_to(
        program.placement.replicated(), 2)
    lowered = program._infer.lower(variables, X, Y).compile()
    assert [placed(s) for s in lowered.input_shardings[0][1:]] == [("data",), ("data",)]
    one_device = jax.device_put(X, jax.devices()[0])  # committed elsewhere: JAX refuses it
    with pytest.raises(ValueError, match=r"incompatible devices.*batch"):
        step(from_placed, one_device, Y)


def test_the_loop_trains_on_sharded_batches_as_on_one_device() -> None:
    source = lambda: gm.data.ArraySource((X, Y), batch_size=16, shuffle=True, seed=0)

    def run(**placement: Any) -> dict:
        program = gm.compile(squared_error, mlp(), managers=regularizers(), **placement)
        step = gm.optimize(program, optax.sgd(0.1))
        state = step.init(program.init(X[:8], Y[:8]), jax.random.key(0))
        return jax.device_get(gm.Loop(step, source(), epochs=2, steps_per_call=2)
                              .run(state).variables)

    mesh = jax.make_mesh((8,), ("data",))
    chex.assert_trees_all_close(run(mesh=mesh, **gm.sharding.data_parallel()), run(),
                                rtol=1e-4, atol=1e-6)


def test_the_sharding_manager_constrains_activations() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    # attention weights (batch, heads, query, key): split by example and by head
    heads = managers.Sharding(("data", "model"), roles=[R.OUTPUT], variable_name="weights",
                              bricks=[gm.bricks.MultiHeadAttention])
    program = gm.compile(squared_error, transformer(), managers=[heads], mesh=mesh,
                         batch_axis="data")
    variables = program.init(TOKENS[:8])
    jaxpr = jax.make_jaxpr(lambda v: program.train(v, TOKENS, rng=jax.random.key(0)))(
        variables)
    assert "sharding_constraint" in str(jaxpr)
    plain = gm.compile(squared_error, transformer())
    np.testing.assert_allclose(program.infer(variables, TOKENS),
                               plain.infer(plain.init(TOKENS[:8]), TOKENS), rtol=1e-5)
    assert [r.manager for r in program.rewrites["train"] if r.manager == "sharding"]


def test_the_sharding_manager_refuses_what_does_not_fit() -> None:
    alone = gm.compile(squared_error, mlp(), managers=[managers.Sharding(("data",),
                                                                         roles=[R.OUTPUT])])
    with pytest.raises(ValueError, match=r"Sharding 'sharding'.*has none: compile it with mesh="):
        alone.init(X[:8], Y[:8])
    mesh = jax.make_mesh((8,), ("data",))
    wide = gm.compile(squared_error, mlp(), mesh=mesh, managers=[
        managers.Sharding(("data", None, None), roles=[R.OUTPUT])])
    with pytest.raises(ValueError, match=r"spec \('data', None, None\) does not fit.*"
                                         r"\(8, 16\): the spec names 3 dimensions"):
        wide.init(X[:8], Y[:8])
    elsewhere = gm.compile(squared_error, mlp(), mesh=mesh, managers=[
        managers.Sharding(("model",), roles=[R.OUTPUT])])
    with pytest.raises(ValueError, match=r"of shape \(8, 16\): the mesh has no axis 'model'"):
        elsewhere.init(X[:8], Y[:8])
    with pytest.raises(TypeError, match="Sharding\\(spec='data'\\)"):
        managers.Sharding("data")


def test_bad_rules_are_refused_before_anything_runs() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    weights = gm.VariableFilter(roles=[R.WEIGHT])
    with pytest.raises(ValueError, match=r"rules\[0\].*names mesh axis 'model'.*\('data',\)"):
        gm.compile(squared_error, mlp(), mesh=mesh, rules=[(weights, P(None, "model"))])
    with pytest.raises(ValueError, match=r"batch_axis='batch'.*no axis 'batch'"):
        gm.compile(squared_error, mlp(), mesh=mesh, batch_axis="batch")
    with pytest.raises(ValueError, match="pass mesh= too"):
        gm.compile(squared_error, mlp(), rules=[(weights, P("data"))])
    with pytest.raises(TypeError, match=r"rules\[0\] must be a \(VariableFilter, PartitionSpec"
                                        r".*: write the spec as PartitionSpec\('data'\)"):
        gm.compile(squared_error, mlp(), mesh=mesh, rules=[(weights, ("data",))])
    with pytest.raises(TypeError, match=r"rules= is a list of pairs, rules=\[\(filter, spec\)\]"):
        gm.compile(squared_error, mlp(), mesh=mesh, rules=(weights, P("data")))
    with pytest.raises(ValueError, match=r"rules\[0\].*names mesh axis 'data' twice"):
        gm.compile(squared_error, mlp(), mesh=mesh, rules=[(weights, P("data", "data"))])
    with pytest.raises(TypeError, match=r"per_layer\(spec\): expected a PartitionSpec, got "
                                        r"'data'"):
        gm.sharding.per_layer("data")
    with pytest.raises(ValueError, match=r"rules\[0\] \(VariableFilter\(roles=\(WEIGHT,\)\), "
                                         r"per_layer\(P\('model',\)\)\) names mesh axis 'model'"):
        gm.compile(squared_error, mlp(), mesh=mesh,
                   rules=[(weights, gm.sharding.per_layer(P("model")))])
    tabled = gm.VariableFilter(path="model/linear_layers/0/W")  # as program.sharding() prints
    with pytest.raises(ValueError, match=r"rules\[1\] \(VariableFilter\(path='model/linear_"
                       r"layers/0/W'\), P\(None, 'data'\)\) selects no variable of the model, "
                       r"so it would place nothing; .* such as /linear_layers/0\.W.*Fix its "
                       r"filter, or drop the rule"):
        gm.compile(squared_error, mlp(), mesh=mesh,
                   rules=[(weights, P(None, "data")), (tabled, P(None, "data"))])
    listed = gm.compile(squared_error, mlp(), mesh=mesh, batch_axis=["data"])  # as a tuple
    assert listed.placement.batch_axis == ("data",)
    with pytest.raises(TypeError, match=r"expected a jax\.sharding\.Mesh"):
        gm.compile(squared_error, mlp(), mesh=jax.devices())
    # (8, 6): the 8-way axis does not divide dimension 1
    narrow = gm.compile(squared_error, gm.bricks.MLP([8, 6, 4], rngs=nnx.Rngs(0)), mesh=mesh,
                        rules=[(weights, P(None, "data"))])
    with pytest.raises(ValueError, match=r"rules\[0\].*/linear_layers/0\.W of shape \(8, 6\): "
                                         r"dimension 1 \(6\) is not divisible.*size 8; .*keep "
                                         r"this one whole with a rule before it \(VariableFilter"
                                         r"\(path='/linear_layers/0\.W'\), PartitionSpec\(\)\)"):
        narrow.init(X[:8], Y[:8])
    assert narrow.record.examples is None  # the failed init kept nothing
    # Flax's scan over layers split along the 4 layers; the fix splits the next dimension
    stacked = gm.compile(lambda m, x: m(x).sum(), ScanMLP(8, n_layers=4, rngs=nnx.Rngs(0)),
                         mesh=mesh, rules=[(weights, P("data"))])
    with pytest.raises(ValueError, match=r"kernel of shape \(4, 8, 8\): dimension 0 \(4\).*"
                       r"split a later dimension with a rule before it .*\(VariableFilter\("
                       r"path='/layers/linear\.kernel'\), P\(None, 'data'\)\)"):
        stacked.init(X[:8])
    with pytest.raises(ValueError, match=r"names 3 dimensions, the array has 2"):
        gm.compile(squared_error, mlp(), mesh=mesh,
                   rules=[(weights, P(None, None, "data"))]).init(X[:8], Y[:8])


def test_fsdp_on_flax_scan_over_layers_splits_each_layer_and_gathers_one_at_a_time() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    model = ScanMLP(8, n_layers=8, rngs=nnx.Rngs(0))  # 8 layers: P('data') would fit them
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), model, mesh=mesh,
                         **gm.sharding.fsdp())
    variables = program.init(X)
    assert variables["model"]["layers"]["linear"]["kernel"].sharding.spec == P(None, "data")
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(variables, jax.random.key(0))
    hlo = step._step.lower(state, X).compile().as_text()
    gathered = [line for line in hlo.splitlines() if " all-gather(" in line]
    assert gathered and all("f32[8,8]{" in line for line in gathered), gathered
    alone = gm.compile(lambda m, x: (m(x) ** 2).mean(), model)
    np.testing.assert_allclose(program.infer(variables, X), alone.infer(alone.init(X), X),
                               rtol=1e-5)


def test_an_ensemble_split_over_devices_keeps_each_members_manager_state_with_it() -> None:
    mesh = jax.make_mesh((4, 2), ("members", "data"))
    rules = [(gm.VariableFilter(path="/members/*"), P("members"))]  # the stored member axis
    x = X[:8, :4]

    def build(**placement: Any) -> gm.Program:
        norm = managers.BatchNorm(bricks=[nnx.Linear], roles=[R.OUTPUT])
        return gm.compile(lambda m, x: m(x), Ensemble(4), managers=[norm, managers.LoRA(rank=2)],
                          **placement)

    program = build(mesh=mesh, rules=rules, batch_axis="data")
    variables = program.init(x)
    stats = variables["managers"]["batch_norm"]["/members/l1"]["apply"]["output.mean"]
    adapter = variables["managers"]["lora"]["/members/l1"]["kernel"]["a"]
    assert stats.shape == (4, 8) and stats.sharding.spec == P("members")
    assert adapter.sharding.spec == P("members", None, None)  # follows the kernel
    alone = build()
    out, new = program.train(variables, x, rng=jax.random.key(0))
    out_alone, new_alone = alone.train(alone.init(x), x, rng=jax.random.key(0))
    np.testing.assert_allclose(out, out_alone, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new["managers"], new_alone["managers"], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_saved_on_eight_devices_resumes_on_eight_four_and_one(tmp_path) -> None:
    source = lambda: gm.data.ArraySource((X, Y), batch_size=16, shuffle=True, seed=0)

    def step_on(devices: int) -> gm.TrainStep:
        placement = {} if devices == 1 else dict(
            mesh=jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices]),
            **gm.sharding.fsdp())
        program = gm.compile(squared_error, mlp(), managers=regularizers(), **placement)
        program.init(X[:8], Y[:8])
        return gm.optimize(program, optax.sgd(0.1))

    def start(step: gm.TrainStep) -> gm.TrainState:
        return step.init(step.program.init(X[:8], Y[:8]), jax.random.key(0))

    eight = step_on(8)
    whole = jax.device_get(gm.Loop(eight, source(), epochs=4).run(start(eight)))
    loop = gm.Loop(eight, source(), epochs=4, plugins=[Checkpoint(tmp_path / "run")])
    loop.on(On("epoch_end", epoch=at(2)), lambda e: e.loop.terminate())
    saved = jax.device_get(loop.run(start(eight)))
    for devices in (8, 4, 1):
        step = step_on(devices)
        # restored as saved, bit for bit, onto this mesh (a loop with nothing left to run)
        restored = gm.Loop.resume(str(tmp_path / "run"), step, source(), epochs=2)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), saved)
        resumed = gm.Loop.resume(str(tmp_path / "run"), step, source())
        assert int(resumed.step) == 8
        assert {d for leaf in jax.tree.leaves(resumed) for d in leaf.sharding.device_set} \
            == set(jax.devices()[:devices])
        if devices == 8:  # the same mesh continues the run bit for bit
            jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), whole)
        else:  # another mesh: the same run, up to the order of float sums
            chex.assert_trees_all_close(jax.device_get(resumed.variables), whole.variables,
                                        rtol=1e-4, atol=1e-5)


LM_TOKENS = np.random.RandomState(3).randint(0, 32, (8, 8))


def flax_lm(names: lm1b.MeshRules | None = None) -> lm1b.TransformerLM:
    """Flax's lm1b model, its logical axis names annotated with ``names`` (none: no
    partitioning annotations)."""
    config = lm1b.TransformerConfig(
        vocab_size=32, output_vocab_size=32, logits_via_embedding=True, emb_dim=16,
        num_heads=2, num_layers=1, qkv_dim=16, mlp_dim=32, max_len=16,
        axis_rules=names or lm1b.MeshRules())
    with nnx.use_eager_sharding(False):
        model = lm1b.TransformerLM(config, rngs=nnx.Rngs(0))
    model.set_attributes(deterministic=True, decode=False)
    return model


def train_lm(model: Any, **placement: Any) -> tuple[gm.TrainState, list]:
    """Three steps of the lm1b model (next-token cross-entropy, Dropout on the inputs of
    every ``nnx.Linear``)."""
    def cost(model: Any, tokens: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model(tokens), tokens).mean()

    dropout = managers.Dropout(0.1, roles=[R.INPUT], bricks=[nnx.Linear])
    program = gm.compile(cost, model, managers=[dropout], **placement)
    return train(program, (LM_TOKENS,), steps=3)


def assert_same_run(run: tuple[gm.TrainState, list], alone: tuple[gm.TrainState, list]
                    ) -> None:
    np.testing.assert_allclose([m["loss"] for m in run[1]], [m["loss"] for m in alone[1]],
                               rtol=2e-5)
    chex.assert_trees_all_close(jax.device_get(run[0].variables),
                                jax.device_get(alone[0].variables), rtol=1e-4, atol=1e-6)


def test_annotated_maps_logical_names_by_flaxs_rules_in_force_or_the_variables_own() -> None:
    pairs = (("embed", None), ("hidden", "model"))  # Flax's GSPMD guide's sharding_rules
    names = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
    own = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"),
                                sharding_rules=pairs)
    with nnx.use_eager_sharding(False):
        layer = nnx.Linear(8, 8, kernel_init=names, use_bias=False, rngs=nnx.Rngs(0))
        ruled = nnx.Linear(8, 8, kernel_init=own, use_bias=False, rngs=nnx.Rngs(0))

    def shown(preset: dict) -> list[tuple[str, Any]]:
        return [(repr(f), spec) for f, spec in preset["rules"]]

    expected = [("VariableFilter(path='/.kernel')", P(None, "model"))]
    with nnx.logical_axis_rules(pairs):
        assert shown(gm.sharding.annotated(layer)) == expected
    assert shown(gm.sharding.annotated(ruled)) == expected
    assert shown(gm.sharding.annotated(layer, pairs)) == expected
    with pytest.raises(TypeError, match=r"annotated\(model\): expected a Flax NNX model, got dict"):
        gm.sharding.annotated({"kernel": layer.kernel})


@pytest.mark.filterwarnings(r"ignore:'\.value' (access|setter) is now deprecated")
def test_a_flax_models_own_annotations_place_it_unmodified() -> None:
    names = lm1b.MeshRules(embed="embed", mlp="mlp", kv="kv", vocab="vocab")
    model = flax_lm(names)
    rules = gm.sharding.annotated(model, {"embed": None, "mlp": "model", "kv": "model",
                                          "vocab": None})
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state, metrics = train_lm(model, mesh=mesh, **rules)
    assert_same_run((state, metrics), train_lm(flax_lm()))
    mlp_in = state.variables["model"]["decoder"]["encoderdecoderblock_0"]["mlp"]["linear1"]
    assert placed(mlp_in["kernel"]) == (None, "model") and placed(mlp_in["bias"]) == ("model",)


@pytest.mark.filterwarnings(r"ignore:'\.value' (access|setter) is now deprecated")
def test_the_tensor_parallel_preset_splits_flax_attention_by_heads() -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state, metrics = train_lm(flax_lm(), mesh=mesh, **gm.sharding.tensor_parallel())
    assert_same_run((state, metrics), train_lm(flax_lm()))
    block = state.variables["model"]["decoder"]["encoderdecoderblock_0"]
    for projection in ("query", "key", "value"):
        assert placed(block["attention"][projection]["kernel"]) == (None, "model")
    assert placed(block["attention"]["out"]["kernel"]) == ("model",)
    assert placed(block["mlp"]["linear1"]["kernel"]) == ()  # no names to pair Flax's MLP by


def test_a_long_epoch_on_eight_cpu_devices_never_has_too_many_steps_in_flight() -> None:
    # XLA's CPU all-reduce deadlocks with about 50 steps in flight on 8 devices (and aborts
    # the process): the loop waits for every 16th step of a multi-device CPU mesh.
    x = np.random.RandomState(4).randn(8 * 300, 8).astype(np.float32)
    program = gm.compile(squared_error, gm.bricks.MLP([8, 16, 4], rngs=nnx.Rngs(0)),
                         mesh=jax.make_mesh((8,), ("data",)), **gm.sharding.data_parallel())
    step = gm.optimize(program, optax.sgd(0.1))
    assert steps_in_flight(step) == 16
    assert steps_in_flight(gm.optimize(gm.compile(squared_error, mlp()), optax.sgd(0.1))) \
        is None
    loop = gm.Loop(step, gm.data.ArraySource((x, x[:, :4]), batch_size=8), epochs=1)
    state = loop.run(step.init(program.init(x[:8], x[:8, :4]), jax.random.key(0)))
    assert int(state.step) == 300


def test_bounded_calls_wait_for_every_nth_result(monkeypatch) -> None:
    waited = []
    monkeypatch.setattr(jax, "block_until_ready", waited.append)
    calls = bounded(lambda value: value, 3)
    assert [calls(i) for i in range(7)] == list(range(7))
    assert waited == [2, 5]
    assert bounded(len, None) is len


def test_the_provenance_record_says_where_a_program_ran() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    program = gm.compile(squared_error, mlp(), mesh=mesh, **gm.sharding.tensor_parallel())
    program.init(X[:8], Y[:8])
    placement = program.provenance.inputs["placement"]
    assert placement["mesh"] == {"data": 2, "model": 4} and placement["batch_axis"] == "data"
    first = placement["rules"][0]
    assert dict(first[0]) == {"path": "*/query.W"}
    assert list(first[1]["per_layer"]) == [None, "model"]  # the preset's spec: one layer's
    stored = json.loads(json.dumps(program.provenance.to_dict()))["inputs"]["placement"]
    assert stored["rules"][0] == [{"path": "*/query.W"}, {"per_layer": [None, "model"]}]
    assert len(stored["rules"]) == len(gm.sharding.tensor_parallel()["rules"])
    alone = gm.compile(squared_error, mlp())
    alone.init(X[:8], Y[:8])
    assert "placement" not in alone.provenance.inputs


class Constrained(nnx.Module):  # Flax's GSPMD guide: model code naming the mesh's axes
    def __init__(self) -> None:
        self.linear = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(self.linear(x), P("data", "model"))


def test_model_code_naming_the_mesh_axes_runs_in_every_trace_without_a_context_mesh() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    program = gm.compile(squared_error, Constrained(), mesh=mesh, batch_axis="data")
    variables = program.init(X[:8])  # JAX needs a context mesh: the program's, not the user's
    assert jax.eval_shape(program.init, X[:8])["model"]["linear"]["kernel"].shape == (8, 8)
    equations = program.graph(X[:8]).jaxpr.jaxpr.eqns
    assert "sharding_constraint" in [e.primitive.name for e in equations]
    step = gm.optimize(program, optax.sgd(0.1))
    _, metrics = step(step.init(variables, jax.random.key(0)), X)
    assert np.isfinite(metrics["loss"])
