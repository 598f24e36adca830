"""compile → Program: variables layout, init copies, derive, split/merge, monitor, hparams."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles


def _cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _data(n: int = 16) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (n, 6))
    return x, (jnp.arange(n) % 3).astype(jnp.int32)


def _mlp() -> gm.bricks.MLP:
    return gm.bricks.MLP([6, 8, 3], activation=jax.nn.relu, rngs=nnx.Rngs(0))


def test_variables_layout_matches_the_design() -> None:
    mlp = _mlp()
    with managers.Dropout(gm.dynamic(0.5), bricks=mlp.linear_layers, roles=[roles.INPUT]), \
            managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[roles.OUTPUT]):
        program = gm.compile(_cost, mlp)
    variables = program.init(*_data())
    assert set(variables) == {"model", "managers"}
    assert set(variables["model"]["linear_layers"][0]) == {"W", "b"}
    rate = variables["managers"]["dropout"]["hparams"]["rate"]
    assert rate.dtype == jnp.float32 and rate.shape == () and float(rate) == 0.5
    bn = variables["managers"]["batch_norm"]["/linear_layers/0"]["apply"]
    assert sorted(bn) == ["output.bias", "output.mean", "output.scale", "output.var"]
    assert program.managers[0].name == "dropout"


def test_init_returns_copies_and_update_model_writes_back() -> None:
    mlp = _mlp()
    with managers.Dropout(0.2, bricks=mlp.linear_layers, roles=[roles.INPUT]):
        program = gm.compile(_cost, mlp)
    x, y = _data()
    before = mlp(x)
    variables = program.init(x, y)
    step = gm.optimize(program, optax.adam(1e-2))
    key = jax.random.key(0)
    state = step.init(variables, key)
    for _ in range(20):
        state, _metrics = step(state, x, y)
    # Buffers were donated 20 times: the model, the init variables and the key still work.
    np.testing.assert_allclose(mlp(x), before)
    assert jnp.isfinite(program.infer(variables, x, y))
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(
        jax.random.key(0)))
    data = jax.random.key_data(key)  # a key given as its raw data is copied too
    step(step.init(variables, data), x, y)
    assert not data.is_deleted()
    program.update_model(state.variables)
    trained = program.derive(lambda m, x: m(x)).infer(state.variables, x)
    np.testing.assert_allclose(mlp(x), trained, rtol=1e-5, atol=1e-6)
    assert not np.allclose(mlp(x), before)


def test_update_model_checks_everything_before_writing() -> None:
    mlp = _mlp()
    program = gm.compile(_cost, mlp)
    variables = program.init(*_data())
    bad = jax.tree.map(lambda a: a, variables)
    bad["model"]["linear_layers"][1]["W"] = jnp.zeros((2, 2))
    bad["model"]["linear_layers"][0]["W"] = jnp.zeros((6, 8))
    with pytest.raises(ValueError, match=r"/linear_layers/1\.W has shape \(2, 2\)"):
        program.update_model(bad)
    assert not np.allclose(mlp.linear_layers[0].W.get_value(), 0.0)


def test_derive_shares_layout_and_ignores_unused_manager_entries() -> None:
    mlp = _mlp()
    with managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[roles.OUTPUT]):
        program = gm.compile(_cost, mlp)
    x, y = _data()
    variables = program.init(x, y)
    predict = program.derive(lambda m, x: m(x))
    foreign = {**variables, "managers": {**variables["managers"], "other": {"hparams": {}}}}
    np.testing.assert_allclose(predict.infer(foreign, x), predict.infer(variables, x))
    missing = {**variables, "managers": {}}
    with pytest.raises(gm.errors.VariablesMismatch,
                       match=r"batch_norm.*'output.mean'.*/linear_layers/0"):
        predict.infer(missing, x)


def test_a_derived_function_is_not_checked_against_init_examples_of_another() -> None:
    def cost(model: nnx.Linear, batch: tuple) -> jax.Array:  # Flax's miniGPT: (x, y)
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    program = gm.compile(cost, nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    x, y = np.ones((8, 4), np.float32), np.zeros(8, np.int32)
    variables = program.init((x, y))
    predict = program.derive(lambda model, batch: model(batch))  # its batch: the inputs
    assert predict.infer(variables, x).shape == (8, 3)
    with pytest.raises(ValueError, match=r"argument 'batch': expected a tuple \(\*, \*\) as "
                       r"in init's example, got an array"):
        program.infer(variables, x)  # the cost's own calls still are


def test_rewrites_iterate_over_the_traced_modes_and_refuse_unknown_ones() -> None:
    program = gm.compile(lambda m, x: m(x).sum(), nnx.Linear(2, 1, rngs=nnx.Rngs(0)),
                         managers=[managers.Dropout(0.5)])
    program.init(jnp.ones((1, 2)))
    assert "init" in program.rewrites and "train" not in program.rewrites  # ends at once
    assert list(program.rewrites) == ["init"] and len(program.rewrites) == 1
    assert program.rewrites["train"].rewrites == ()  # not traced yet: empty
    with pytest.raises(KeyError, match=r"rewrites\['training'\]: the modes are init, train"):
        program.rewrites["training"]


def test_split_and_merge_by_role() -> None:
    mlp = _mlp()
    with managers.BatchNorm(bricks=mlp.linear_layers[:-1], roles=[roles.OUTPUT]):
        program = gm.compile(_cost, mlp)
    variables = program.init(*_data())
    params, rest = program.split(variables, roles.PARAMETER)
    param_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    assert "['model']['linear_layers'][0]['W']" in param_paths
    assert "['managers']['batch_norm']['/linear_layers/0']['apply']['output.scale']" in param_paths
    assert not any("mean" in p or "var" in p for p in param_paths)
    merged = program.merge(params, rest)
    assert jax.tree.structure(merged) == jax.tree.structure(variables)
    # With no role, what an optimizer trains: the same split as PARAMETER's.
    default = program.split(variables)
    assert jax.tree.structure(default) == jax.tree.structure((params, rest))
    assert all(a is b for a, b in zip(jax.tree.leaves(default), jax.tree.leaves((params, rest)),
                                      strict=True))
    weights, _ = program.split(variables, roles.WEIGHT)
    assert len(jax.tree.leaves(weights)) == 2
    for leaf in jax.tree.leaves(params):
        assert jnp.issubdtype(leaf.dtype, jnp.floating)


def test_dynamic_hyperparameter_takes_effect_without_retrace() -> None:
    lin = gm.bricks.Linear(200, 200, rngs=nnx.Rngs(0))
    dropout = managers.Dropout(gm.dynamic(0.5), roles=[roles.INPUT])
    traces = []

    def fn(model: gm.Brick, x: jax.Array) -> jax.Array:
        traces.append(1)
        return model(x)

    program = gm.compile(fn, lin, managers=[dropout], monitor=gm.VariableFilter(
        roles=[roles.INPUT], bricks=[lin]))
    x = jnp.ones((4, 200))
    variables = program.init(x)
    traces.clear()
    handle = dropout.hparam("rate")
    fractions = []
    for rate in (0.5, 0.1, 0.9):
        variables = handle.set(variables, rate)
        _, _, monitored = program.train(variables, x, rng=jax.random.key(1))
        fractions.append(float((monitored["/.apply.input_"] == 0).mean()))
    assert len(traces) == 1
    np.testing.assert_allclose(fractions, [0.5, 0.1, 0.9], atol=0.03)


def test_constant_hyperparameter_has_no_handle() -> None:
    with pytest.raises(ValueError, match=r"dropout\.rate is a compile-time constant.*dynamic"):
        managers.Dropout(0.5).hparam("rate")


def test_monitor_returns_tagged_intermediates_from_the_jitted_step() -> None:
    mlp = _mlp()
    program = gm.compile(_cost, mlp, monitor={
        "act": gm.VariableFilter(roles=[roles.OUTPUT], bricks=[gm.bricks.Linear])})
    x, y = _data()
    variables = program.init(x, y)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(variables, jax.random.key(0))
    state, metrics = step(state, x, y)
    assert sorted(metrics) == ["act:/linear_layers/0.apply.output",
                               "act:/linear_layers/1.apply.output", "loss"]
    W0 = variables["model"]["linear_layers"][0]["W"]
    b0 = variables["model"]["linear_layers"][0]["b"]
    np.testing.assert_allclose(metrics["act:/linear_layers/0.apply.output"], x @ W0 + b0,
                               rtol=1e-5, atol=1e-5)
    _out, monitored = program.infer(variables, x, y)
    assert set(monitored) == {"act:/linear_layers/0.apply.output",
                              "act:/linear_layers/1.apply.output"}


def test_a_monitored_parameter_is_the_value_the_call_read_after_the_rewrites() -> None:
    mlp = _mlp()
    noise = managers.WeightNoise(0.5, bricks=[mlp.linear_layers[0]])
    program = gm.compile(_cost, mlp, managers=[noise], monitor={
        "w": gm.VariableFilter(roles=[roles.WEIGHT], bricks=[mlp.linear_layers[0]])})
    x, y = _data()
    variables = program.init(x, y)
    stored = variables["model"]["linear_layers"][0]["W"]
    _, monitored = program.infer(variables, x, y)
    assert list(monitored) == ["w:/linear_layers/0.apply.W"]
    np.testing.assert_array_equal(monitored["w:/linear_layers/0.apply.W"], stored)
    _, _, monitored = program.train(variables, x, y, rng=jax.random.key(0))
    noisy = monitored["w:/linear_layers/0.apply.W"]  # the weight the noisy call multiplied by
    assert noisy.shape == stored.shape and not np.allclose(noisy, stored)


def test_auxiliary_variables_are_tagged_and_monitorable() -> None:
    class Stats(gm.Brick):
        @gm.application(inputs=["x"], outputs=["y"])
        def apply(self, x: jax.Array, application_call: gm.ApplicationCall) -> jax.Array:
            application_call.add_auxiliary_variable(x.mean(), name="mean")
            return x * 2

    program = gm.compile(lambda m, x: m(x), Stats(),
                         monitor=gm.VariableFilter(roles=[roles.AUXILIARY]))
    variables = program.init(jnp.ones((2, 2)))
    _, monitored = program.infer(variables, jnp.full((2, 2), 3.0))
    assert float(monitored["/.apply.mean"]) == 3.0
    cg = program.graph(jnp.ones((2, 2)))
    assert [r.tag.name for r in cg.auxiliary_variables] == ["mean"]


def test_train_and_infer_are_pure_and_compose_with_grad_and_vmap() -> None:
    mlp = _mlp()
    program = gm.compile(_cost, mlp)
    x, y = _data()
    variables = program.init(x, y)
    grads = jax.grad(lambda v: program.train(v, x, y, rng=jax.random.key(0))[0])(variables)
    assert jax.tree.structure(grads) == jax.tree.structure(variables)
    per_example = jax.vmap(lambda xi, yi: program.infer(variables, xi[None], yi[None]))(x, y)
    assert per_example.shape == (16,)


def test_compiling_twice_gives_the_same_layout() -> None:
    mlp = _mlp()
    a = gm.compile(_cost, mlp).init(*_data())
    b = gm.compile(lambda m, x: m(x), mlp).init(_data()[0])
    assert jax.tree.structure(a) == jax.tree.structure(b)


def test_rewrite_trace_prints_as_a_table_and_html() -> None:
    mlp = _mlp()
    with managers.Dropout(0.5, bricks=mlp.linear_layers, roles=[roles.INPUT]):
        program = gm.compile(_cost, mlp)
    x, y = _data()
    variables = program.init(x, y)
    program.train(variables, x, y, rng=jax.random.key(0))
    text = str(program.rewrites)
    assert "train: 2 rewrites" in text and "/linear_layers/1" in text
    assert "<table>" in program.rewrites._repr_html_()
    assert [r.call_id for r in program.rewrites.train] == [0, 0]
    assert len(program.rewrites.infer) == 0
    program.infer(variables, x, y)  # dropout matches its two inputs and leaves them
    assert program.rewrites.infer.unchanged == (("dropout", 2),)
    assert str(program.rewrites.infer).startswith(
        "infer: 0 rewrites; variables matched and left as they were: dropout 2\n")


def test_managers_that_only_read_are_counted_in_the_rewrite_trace() -> None:
    mlp = _mlp()
    program = gm.compile(_cost, mlp, managers=[managers.L2(1e-3), managers.EMA(0.9),
                                               managers.WeightNoise(0.1, roles=[roles.BIAS])])
    state = gm.optimize(program, optax.sgd(0.1)).init(program.init(*_data()),
                                                         jax.random.key(0))
    program.train(state.variables, *_data(), rng=jax.random.key(1))
    trace = program.rewrites.train  # L2 reads the 2 weights, EMA all 4 parameters
    assert trace.unchanged == (("l2", 2), ("ema", 4))
    assert [(r.manager, r.role) for r in trace] == [("weight_noise", "BIAS")] * 2


def test_computation_graph_lists_variables_before_and_after_rewrites() -> None:
    mlp = _mlp()
    with managers.Dropout(0.5, bricks=mlp.linear_layers, roles=[roles.INPUT]):
        program = gm.compile(_cost, mlp)
    x, y = _data()
    cg = program.graph(x, y)
    outputs = cg.filter(gm.VariableFilter(roles=[roles.OUTPUT], bricks=[gm.bricks.Linear]))
    assert [r.tag.brick_path for r in outputs] == ["/linear_layers/0", "/linear_layers/1"]
    assert [r.manager for r in cg.rewritten] == ["dropout", "dropout"]
    assert len(cg.parameters) == 4 and len(cg.inputs) == 5
    assert "train graph" in str(cg)
    infer = program.graph(x, y, mode="infer")
    assert infer.rewritten == [] and len(infer.jaxpr.jaxpr.eqns) < len(cg.jaxpr.jaxpr.eqns)


def test_use_manager_scopes_a_manager_to_one_call() -> None:
    class Twice(gm.Brick):
        def __init__(self) -> None:
            self.lin = gm.bricks.Linear(2, 2, rngs=nnx.Rngs(0))

        @gm.application(inputs=["x"], outputs=["y"])
        def apply(self, x: jax.Array) -> jax.Array:
            scale = Scale(roles=[roles.OUTPUT])
            return self.lin(x) + self.lin(x, use_manager=scale)

    class Scale(gm.Manager):
        def rewrite_output(self, call: gm.ApplicationCall, name: str, value: jax.Array):
            return 10 * value

    model = Twice()
    program = gm.compile(lambda m, x: m(x), model)
    x = jnp.ones((1, 2))
    variables = program.init(x)
    np.testing.assert_allclose(program.infer(variables, x), 11 * model.lin(x), rtol=1e-6)
    assert [(r.manager, r.call_id) for r in program.rewrites.infer] == [("scale", 1)]


def test_managers_nest_in_their_order_around_a_wrap() -> None:
    # Inputs are rewritten outermost manager first, outputs innermost first; a wrap sees the
    # arguments as the managers outside it left them (rewrites without a wrap share a frame).
    class Affine(gm.Manager):
        def __init__(self, scale: float, shift: float, **kwargs) -> None:
            super().__init__(**kwargs)
            self.scale, self.shift = scale, shift

        def rewrite_input(self, call, name, value):
            return self.scale * value + self.shift

        def rewrite_output(self, call, name, value):
            return self.scale * value + self.shift

    class Negate(gm.Manager):
        def wrap(self, call, next, args, kwargs):
            return -next(-args[0])

    class Identity(gm.Brick):
        @gm.application(inputs=["x"], outputs=["y"])
        def apply(self, x: jax.Array) -> jax.Array:
            return x

    both = [roles.INPUT, roles.OUTPUT]
    chain = [Affine(2.0, 1.0, roles=both, manager_name="a"),
             Affine(3.0, 0.0, roles=both, manager_name="b"),
             Negate(manager_name="n"), Affine(1.0, 5.0, roles=both, manager_name="c")]
    program = gm.compile(lambda m, x: m(x), Identity(), managers=chain)
    x = jnp.float32(1.0)

    def by_hand(x):
        x = 3 * (2 * x + 1)  # a, b on the input
        y = -((-x + 5) + 5)  # n around c's input and output rewrites
        return 2 * (3 * y) + 1  # b, a on the output

    assert float(program.infer(program.init(x), x)) == by_hand(1.0)


def test_call_rng_outside_a_program_raises() -> None:
    class Draw(gm.Brick):
        @gm.application(inputs=["x"], outputs=["y"])
        def apply(self, x: jax.Array, application_call: gm.ApplicationCall) -> jax.Array:
            return x + jax.random.normal(application_call.rng(), x.shape)

    with pytest.raises(RuntimeError, match=r"call\.rng\(\).*needs a compiled program"):
        Draw()(jnp.ones(2))


class Sowing(gm.Brick):
    @gm.application(inputs=["x"], outputs=["y"])
    def apply(self, x: jax.Array) -> jax.Array:
        self.sow(nnx.Intermediate, "doubled", 2 * x)
        return x + 1


def test_sow_on_a_brick_is_monitorable_in_a_program_and_stored_eagerly() -> None:
    brick = Sowing()
    monitor = gm.VariableFilter(roles=[gm.roles.AUXILIARY])
    program = gm.compile(lambda m, x: m(x).sum(), brick, monitor=monitor)
    x = jnp.arange(3.0)
    _, _, monitored = program.train(program.init(x), x, rng=jax.random.key(0))
    np.testing.assert_array_equal(monitored["/.apply.doubled"], 2 * x)
    _, monitored = program.infer(program.init(x), x)
    np.testing.assert_array_equal(monitored["/.apply.doubled"], 2 * x)
    assert not hasattr(brick, "doubled")  # the program stored nothing on the brick
    brick(x)  # eagerly it is Flax's sow
    np.testing.assert_array_equal(brick.doubled.get_value()[0], 2 * x)


class Cached(nnx.Module):
    """A decode-style cache: each call appends its input at the cache index."""

    def __init__(self) -> None:
        self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.cache = nnx.Cache(jnp.zeros((3, 2)))
        self.index = nnx.Cache(jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.linear(x)
        self.cache[...] = self.cache[...].at[self.index[...]].set(y)
        self.index[...] += 1
        return self.cache[...].sum(0)


def test_infer_mutable_returns_the_models_writes_and_changes_no_parameter() -> None:
    model = Cached()
    monitor = gm.VariableFilter(roles=[roles.OUTPUT], bricks=[nnx.Linear])
    program = gm.compile(lambda m, x: m(x), model, monitor=monitor,
                         managers=[managers.Dropout(0.5, roles=[roles.INPUT])])
    variables = program.init(jnp.ones(2))
    outs = []
    for step in range(3):
        out, variables, monitored = program.infer(variables, jnp.full(2, step + 1.0),
                                                  mutable=True)
        outs.append(out)
    eager = nnx.clone(model)
    expected = [eager(jnp.full(2, step + 1.0)) for step in range(3)]  # no dropout: inference
    np.testing.assert_allclose(np.stack(outs), np.stack(expected), rtol=1e-6)
    assert int(variables["model"]["index"]) == 3
    np.testing.assert_array_equal(variables["model"]["linear"]["kernel"], model.linear.kernel[...])
    assert list(monitored) == ["/linear.apply.output"]
    assert program.infer(variables, jnp.ones(2), mutable=False)[0].shape == (2,)
    with pytest.raises(TypeError, match=r"mutable='yes'\): expected True or False"):
        program.infer(variables, jnp.ones(2), mutable="yes")


def test_infer_is_the_jitted_function_itself() -> None:
    # No Python frame in front of JAX's dispatch: program.infer is what jax.jit made.
    program = gm.compile(lambda m, x: m(x), gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0)))
    variables = program.init(jnp.ones((1, 2)))
    x = jnp.arange(8.0).reshape(4, 2)
    compiled = program.infer.lower(variables, x).compile()
    np.testing.assert_array_equal(compiled(variables, x), program.infer(variables, x))
    parameter = inspect.signature(program.infer).parameters["mutable"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is False
    out, kept = program.infer(variables, x, mutable=True)
    np.testing.assert_array_equal(out, compiled(variables, x))
    assert jax.tree.structure(kept) == jax.tree.structure(variables)


def test_a_string_argument_is_refused_by_init_train_and_graph_naming_it_and_the_fix() -> None:
    program = gm.compile(lambda m, x, mode: m(x).sum(), gm.bricks.Linear(2, 3,
                                                                          rngs=nnx.Rngs(0)))
    x = jnp.ones((1, 2))
    for call, where in [(lambda: program.init(x, "fast"), "program.init"),
                        (lambda: program.graph(x, mode="train", **{"extra": "fast"}),
                         "program.graph")]:
        with pytest.raises(TypeError, match=rf"{where}: argument '(mode|extra)' is 'fast' "
                           r"\(str\), not an array.*functools.partial\(fn, "):
            call()
    variables = program.init(x, 1.0)  # a number is traced like an array
    with pytest.raises(TypeError, match=r"program.train: argument 'mode' is 'fast' \(str\)"):
        program.train(variables, x, "fast", rng=jax.random.key(0))


def test_python_control_flow_on_a_traced_argument_gets_the_fix_in_one_note() -> None:
    def cost(model: nnx.Module, x: jax.Array, train: bool) -> jax.Array:
        out = model(x)
        return (out * 2 if train else out).sum()

    linear = gm.bricks.Linear(2, 3, rngs=nnx.Rngs(0))
    program = gm.compile(cost, linear)
    with pytest.raises(jax.errors.TracerBoolConversionError) as raised:
        program.init(jnp.ones((1, 2)), True)
    notes = [note for note in raised.value.__notes__ if note.startswith("graphmod:")]
    assert len(notes) == 1 and "functools.partial(fn, train=False)" in notes[0]
    inner = gm.compile(cost, linear)
    outer = gm.compile(lambda m, x: inner.infer(inner_variables, x, True), linear)
    inner_variables = gm.compile(lambda m, x: m(x).sum(), linear).init(jnp.ones((1, 2)))
    with pytest.raises(jax.errors.TracerBoolConversionError) as raised:
        outer.init(jnp.ones((1, 2)))  # nested traces: still one note
    assert sum(note.startswith("graphmod:") for note in raised.value.__notes__) == 1
