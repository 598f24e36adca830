"""The optimizer's state placed apart from the parameters, and a program under a mesh the
user set: Flax's optimization cookbook and SPMD guide, run through graphmod."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import graphmod as gm
import managers
from graphmod import roles as R
from tests.test_sharding import X, Y, mlp, placed, squared_error

WEIGHTS = gm.VariableFilter(roles=[R.WEIGHT])


def adam_run(program: gm.Program, steps: int = 3, **options: Any
             ) -> tuple[gm.TrainStep, gm.TrainState, list]:
    step = gm.optimize(program, optax.adam(1e-2), **options)
    state = step.init(program.init(X[:8], Y[:8]), jax.random.key(0))
    losses = []
    for _ in range(steps):
        state, metrics = step(state, X, Y)
        losses.append(float(metrics["loss"]))
    return step, state, losses


def test_optimizer_rules_split_the_moments_of_replicated_parameters() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    program = gm.compile(squared_error, mlp(), mesh=mesh, batch_axis="data")
    step, state, losses = adam_run(program, optimizer_rules=[(WEIGHTS, P("data"))])
    _, alone, alone_losses = adam_run(gm.compile(squared_error, mlp()))
    np.testing.assert_allclose(losses, alone_losses, rtol=2e-5)
    chex.assert_trees_all_close(jax.device_get(state.variables),
                                jax.device_get(alone.variables), rtol=1e-4, atol=1e-6)
    layers = state.variables["model"]["linear_layers"]
    for moments in (state.opt_state[0].mu, state.opt_state[0].nu):
        for index, layer in moments["model"]["linear_layers"].items():
            assert placed(layer["W"]) == ("data",), index  # split: ZeRO's first stage
            assert placed(layer["b"]) == (), index         # no rule: as the bias
            assert placed(layers[index]["W"]) == ()         # the parameter replicated
    table = gm.VariablesTable(state.opt_state)
    spread = sum(row["per device"] for row in table.rows)
    assert spread < table.nbytes / 4 and f"{gm.VariablesTable(state.opt_state).totals}" \
        .endswith("per device")
    # a restored state is placed as a step's output, and that as its input: nothing moves
    restored = step.place(jax.device_get(state))
    assert jax.tree.map(placed, step(state, X, Y)[0].opt_state) == jax.tree.map(
        placed, restored.opt_state)
    assert step.provenance.inputs["placement"]["optimizer_rules"] == (
        ({"roles": ("WEIGHT",)}, ("data",)),)
    assert "optimizer state placed by optimizer_rules[0]" in repr(step)


def make_model(rngs: nnx.Rngs, init: Any) -> nnx.Sequential:
    """The optimization cookbook's model, as Flax writes it."""
    return nnx.Sequential(nnx.Linear(2, 8, rngs=rngs, kernel_init=init),
                          nnx.Linear(8, 8, rngs=rngs, kernel_init=init))


def cookbook_loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def cookbook_run(init: Any, **placement: Any) -> tuple[gm.TrainState, list]:
    rngs = nnx.Rngs(0)
    x, y = rngs.normal((32, 2)), rngs.normal((32, 8))
    program = gm.compile(cookbook_loss, make_model(rngs, init), **placement)
    step = gm.optimize(program, optax.adam(1e-3))
    state = step.init(program.init(x, y), jax.random.key(0))
    losses = []
    for _ in range(3):
        state, metrics = step(state, x, y)
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize("axis_types", [AxisType.Auto, AxisType.Explicit])
def test_a_flax_models_optimizer_sharding_metadata_places_its_moments(axis_types) -> None:
    lecun = jax.nn.initializers.lecun_normal()
    sharded_init = nnx.with_metadata(lecun, optimizer_sharding=P("x", "y"))
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(axis_types,) * 2)
    with jax.set_mesh(mesh):  # as the cookbook sets it
        state, losses = cookbook_run(sharded_init, mesh=mesh, batch_axis="x")
    alone, alone_losses = cookbook_run(lecun)
    np.testing.assert_allclose(losses, alone_losses, rtol=2e-5)
    chex.assert_trees_all_close(jax.device_get(state.variables),
                                jax.device_get(alone.variables), rtol=1e-4, atol=1e-6)
    for index in (0, 1):
        assert placed(state.opt_state[0].mu["model"]["layers"][index]["kernel"]) == ("x", "y")
        assert placed(state.opt_state[0].nu["model"]["layers"][index]["bias"]) == ()
        assert placed(state.variables["model"]["layers"][index]["kernel"]) == ()


def test_a_program_runs_under_an_explicit_mesh_the_user_set() -> None:
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    source = lambda: gm.data.ArraySource((X, Y), batch_size=16, shuffle=True, seed=0)

    def run() -> tuple[dict, Any, dict]:
        with managers.Dropout(0.2, roles=[R.INPUT]):
            program = gm.compile(squared_error, mlp(), mesh=explicit, batch_axis="data")
        step = gm.optimize(program, optax.sgd(0.1))
        state = step.init(program.init(X[:8], Y[:8]), jax.random.key(0))
        state = gm.Loop(step, source(), epochs=2, steps_per_call=2).run(state)
        x, y = jnp.asarray(X), jnp.asarray(Y)  # typed on the user's mesh, when one is set
        state, _ = step(state, x, y)
        outputs = program.infer(state.variables, x, y)
        scores = gm.evaluate(program, state.variables, source(), metrics=["mse"],
                             predict=lambda model, x: model(x)).metrics["mse"]
        return jax.device_get(state.variables), outputs, scores

    with jax.set_mesh(explicit):
        variables, outputs, scores = run()
    chex.assert_trees_all_close((variables, outputs, scores), run(), rtol=1e-5, atol=1e-6)


def test_a_run_under_a_mesh_the_user_set_resumes_without_a_template(tmp_path) -> None:
    source = lambda: gm.data.ArraySource((X, Y), batch_size=16)

    def loop(epochs: int, directory: Any = None) -> gm.TrainState:
        program = gm.compile(squared_error, mlp())  # no mesh=: the user's mesh is the context
        step = gm.optimize(program, optax.adam(1e-2))
        if directory is not None and epochs == 2:
            return gm.Loop.resume(directory, step, source(), epochs=2)  # no state given
        plugins = [] if directory is None else [gm.plugins.Checkpoint(directory)]
        return gm.Loop(step, source(), epochs=epochs, plugins=plugins).run(
            step.init(program.init(X[:8], Y[:8]), jax.random.key(0)))

    with jax.set_mesh(jax.make_mesh((1, 1), ("batch", "model"))):  # as Flax's miniGPT
        loop(1, tmp_path)
        resumed = loop(2, tmp_path)  # its template is traced under the abstract mesh
        whole = loop(2)
    chex.assert_trees_all_equal(jax.device_get(resumed.variables),
                                jax.device_get(whole.variables))


class Embedding(nnx.Module):
    """Explicit-sharding model code, as Flax's miniGPT writes its token embedding."""

    def __init__(self, explicit: bool) -> None:
        self.embed, self.explicit = nnx.Embed(10, 4, rngs=nnx.Rngs(0)), explicit

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.explicit:  # refused for tokens on no mesh (passed from NumPy)
            return self.embed(tokens, out_sharding=jax.typeof(tokens).sharding).mean(1)
        return self.embed(tokens).mean(1)


def test_numpy_batches_join_the_mesh_the_user_set_in_loop_and_evaluate() -> None:
    tokens = np.random.RandomState(0).randint(0, 10, (32, 5)).astype(np.int32)

    def run(explicit: bool) -> tuple[dict, float, Any]:
        program = gm.compile(squared_error, Embedding(explicit))  # no mesh=
        step = gm.optimize(program, optax.sgd(0.1))
        state = step.init(program.init(tokens[:8], Y[:8]), jax.random.key(0))
        source = gm.data.ArraySource((tokens, Y), batch_size=16)
        state = gm.Loop(step, source, epochs=2).run(state)
        scores = gm.evaluate(program, state.variables, source, metrics=["mse"],
                             predict=lambda model, x: model(x))
        return (jax.device_get(state.variables), scores.metrics["mse"],
                program.infer(state.variables, tokens, Y))

    with jax.set_mesh(jax.make_mesh((2, 1), ("batch", "model"))):  # explicit axes
        on_mesh = run(explicit=True)
    chex.assert_trees_all_close(on_mesh, run(explicit=False), rtol=1e-5, atol=1e-6)


def test_bad_optimizer_rules_are_refused_naming_the_rule() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    program = gm.compile(squared_error, mlp(), mesh=mesh, batch_axis="data")
    variables = program.init(X[:8], Y[:8])
    with pytest.raises(ValueError, match=r"optimizer_rules=.*runs on one device.*mesh="):
        gm.optimize(gm.compile(squared_error, mlp()), optax.adam(1e-3),
                    optimizer_rules=[(WEIGHTS, P("data"))])
    with pytest.raises(TypeError, match=r"compile\(rules=.*expected a list of pairs, got "
                       r"<function annotated.*\*\*gm\.sharding\.fsdp\(\)"):
        gm.compile(squared_error, mlp(), mesh=mesh, rules=gm.sharding.annotated)
    with pytest.raises(TypeError, match=r"optimizer_rules\[0\] must be a \(VariableFilter, "):
        gm.optimize(program, optax.adam(1e-3), optimizer_rules=[P("data")])
    with pytest.raises(ValueError, match=r"optimizer_rules\[0\].*names mesh axis 'model'"):
        gm.optimize(program, optax.adam(1e-3), optimizer_rules=[(WEIGHTS, P("model"))])
    # the last layer's W is 8 x 4: its second dimension does not split 8 ways
    step = gm.optimize(program, optax.adam(1e-3), optimizer_rules=[(WEIGHTS, P(None, "data"))])
    with pytest.raises(ValueError, match=r"optimizer_rules\[0\] .* does not fit the "
                       r"optimizer's copies of parameter /linear_layers/2\.W of shape \(8, 4\)"):
        step.init(variables, jax.random.key(0))


def test_optimizer_sharding_metadata_that_does_not_fit_is_named() -> None:
    init = nnx.with_metadata(jax.nn.initializers.lecun_normal(), optimizer_sharding=P("x"))
    mesh = jax.make_mesh((8,), ("x",))
    with pytest.raises(ValueError, match=r"its optimizer_sharding metadata P\('x',\) does "
                       r"not fit .* parameter /layers/0\.kernel of shape \(2, 8\)"):
        cookbook_run(init, mesh=mesh, batch_axis="x")


class ShardedThenDropped(nnx.Module):
    """Explicit-sharding model code, as Flax's ViT tutorial writes its layers."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(8, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.linear(x, out_sharding=P("data", None)))


def test_flax_dropout_of_sharded_activations_runs_under_an_explicit_mesh() -> None:
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(explicit):
        program = gm.compile(lambda m, x: m(x), ShardedThenDropped(nnx.Rngs(0)))
        variables = program.init(X)
        trained, _ = program.train(variables, X, rng=jax.random.key(0))
        inferred = program.infer(variables, X)
    dropped = np.asarray(trained) == 0
    assert 0.3 < dropped.mean() < 0.7  # the mask, placed as the activations
    np.testing.assert_allclose(np.asarray(trained)[~dropped],
                               2 * np.asarray(inferred)[~dropped], rtol=1e-5)


def test_explicit_sharding_code_on_a_programs_mesh_gets_a_note_with_the_fix() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    program = gm.compile(lambda m, x: m(x), ShardedThenDropped(nnx.Rngs(0)), mesh=mesh,
                         batch_axis="data")
    with pytest.raises(ValueError, match="PartitionSpec") as raised:
        program.init(X)
    assert any("compile without mesh= inside `with jax.set_mesh(mesh):`" in note
               for note in raised.value.__notes__)
