"""The manager library against independent references: the papers' formulas by hand,
flax.nnx's layers and optax's transformations; optimize's trainable= and grad_norms."""

from __future__ import annotations

import contextlib
import io
import math
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import ad_checkpoint

import graphmod as gm
import managers
from graphmod import roles
from tests.managers.helpers import array, key, linear, normal

X = normal(1, 6, 3)
TOL = {"rtol": 1e-5, "atol": 1e-6}


def mean_square(model: gm.Brick, x: jax.Array) -> jax.Array:
    return jnp.mean(model(x) ** 2)


def owned(variables: dict, manager: str) -> dict:
    return variables["managers"][manager]["/"]["W"]


def test_weight_norm_is_the_identity_at_init_and_flax_weight_norm_with_unit_scale() -> None:
    lin = linear()
    program = gm.compile(lambda m, x: m(x), lin, managers=[managers.WeightNorm(
        roles=[roles.WEIGHT])])
    variables = program.init(X)
    np.testing.assert_allclose(program.infer(variables, X), lin(X), **TOL)
    w = array(lin.W[...])
    g = np.sqrt((w ** 2).sum(0) + 1e-12)
    np.testing.assert_allclose(owned(variables, "weight_norm")["g"], g, rtol=1e-6)
    # With g = 1 it is flax.nnx.WeightNorm at its init (scale 1): W / ||W|| per column.
    variables["managers"]["weight_norm"]["/"]["W"]["g"] = jnp.ones(4)
    flax_linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    flax_linear.kernel[...] = lin.W[...]
    flax_linear.bias[...] = lin.b[...]
    reference = nnx.WeightNorm(flax_linear, rngs=nnx.Rngs(1))
    np.testing.assert_allclose(program.infer(variables, X), reference(X), **TOL)
    np.testing.assert_allclose(program.infer(variables, X), array(X) @ (w / g) + array(lin.b),
                               rtol=1e-4, atol=1e-5)


def test_spectral_norm_follows_the_power_iteration_and_flax_spectral_norm() -> None:
    lin = linear()
    program = gm.compile(lambda m, x: m(x), lin, managers=[managers.SpectralNorm(
        roles=[roles.WEIGHT])])
    variables = program.init(X)
    w = array(lin.W[...]).astype(np.float64)
    u = np.full((1, 4), 0.5)
    v = u @ w.T
    v /= np.linalg.norm(v)
    u = v @ w
    u /= np.linalg.norm(u)
    sigma = (v @ w @ u.T).item()
    out, new = program.train(variables, X, rng=key(0))
    np.testing.assert_allclose(out, array(X) @ (w / sigma) + array(lin.b), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(owned(new, "spectral_norm")["sigma"], sigma, rtol=1e-5)
    np.testing.assert_allclose(owned(new, "spectral_norm")["u"], u, rtol=1e-5, atol=1e-6)
    # flax.nnx.SpectralNorm from the same u: the same output and estimate.
    flax_linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    flax_linear.kernel[...] = lin.W[...]
    flax_linear.bias[...] = lin.b[...]
    reference = nnx.SpectralNorm(flax_linear, rngs=nnx.Rngs(1))
    [(u_path, _)] = [(p, s) for p, s in reference.batch_stats.items() if p[-1] == "u"]
    reference.batch_stats[u_path][...] = jnp.full((1, 4), 0.5)
    np.testing.assert_allclose(out, reference(X, update_stats=True), **TOL)
    # inference divides by the stored estimate
    np.testing.assert_allclose(program.infer(new, X), out, **TOL)


def test_weight_decay_is_optax_add_decayed_weights_and_l2_is_reported() -> None:
    lin = linear()
    base = gm.compile(mean_square, lin)
    decayed = gm.compile(mean_square, lin, managers=[managers.WeightDecay(0.3)])
    x = normal(2, 8, 3)
    ours = gm.optimize(decayed, optax.sgd(0.1))
    state, metrics = ours(ours.init(decayed.init(x), key(0)), x)
    theirs = gm.optimize(base, optax.chain(
        optax.masked(optax.add_decayed_weights(0.3), lambda params: jax.tree_util.
                     tree_map_with_path(lambda path, _: path[-1].key == "W", params)),
        optax.sgd(0.1)))
    reference, plain = theirs(theirs.init(base.init(x), key(0)), x)
    for name in ("W", "b"):
        np.testing.assert_allclose(state.variables["model"][name],
                                   reference.variables["model"][name], **TOL)
    cost = 0.15 * float((array(lin.W[...]) ** 2).sum())
    np.testing.assert_allclose(metrics["weight_decay"], cost, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], plain["loss"] + cost, rtol=1e-5)


class _Affine(nnx.Module):
    """Written as Flax's toy examples write a layer: parameters named ``w`` and ``b``
    (PARAMETER, not WEIGHT and BIAS: roles come from Flax's names, kernel and bias)."""

    def __init__(self, din: int, dout: int, seed: int) -> None:
        self.w = nnx.Param(normal(seed, din, dout))
        self.b = nnx.Param(jnp.ones((dout,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w[...] + self.b[...]


def test_a_parameter_cost_chosen_by_name_or_path_needs_no_roles() -> None:
    model = nnx.Sequential(_Affine(3, 4, 1), _Affine(4, 2, 2))
    chosen = [managers.L2(0.1, variable_name="w"),
              managers.WeightDecay(0.2, path="/layers/1.b", manager_name="decay")]
    program = gm.compile(mean_square, model, managers=chosen)
    step = gm.optimize(program, optax.sgd(0.1))
    _, metrics = step(step.init(program.init(X), key(0)), X)
    layers = model.layers
    squares = sum(float((array(layer.w[...]) ** 2).sum()) for layer in layers)
    np.testing.assert_allclose(metrics["l2"], 0.1 * squares, rtol=1e-5)
    np.testing.assert_allclose(metrics["decay"], 0.1 * float((array(layers[1].b[...]) ** 2
                                                               ).sum()), rtol=1e-5)


def test_lora_trains_only_its_adapters_and_merges_into_the_weights() -> None:
    lin = linear()
    lora = managers.LoRA(2, alpha=gm.dynamic(4.0), roles=[roles.WEIGHT])
    program = gm.compile(mean_square, lin, managers=[lora])
    variables = program.init(X)
    np.testing.assert_allclose(program.infer(variables, X), jnp.mean(lin(X) ** 2), **TOL)
    step = gm.optimize(program, optax.adam(0.05), trainable=[lora])
    state = step.init(variables, key(0))
    trained_leaves = jax.tree_util.tree_flatten_with_path(state.opt_state[0].mu)[0]
    assert [jax.tree_util.keystr(path) for path, _ in trained_leaves] == [
        "['managers']['lora']['/']['W']['a']", "['managers']['lora']['/']['W']['b']"]
    for _ in range(3):
        state, _ = step(state, X)
    trained = state.variables
    np.testing.assert_array_equal(trained["model"]["W"], lin.W[...])  # frozen
    assert np.abs(array(owned(trained, "lora")["b"])).sum() > 0
    plain = gm.compile(mean_square, lin)
    merged = lora.merge(trained)
    np.testing.assert_allclose(plain.infer(merged, X), program.infer(trained, X), **TOL)
    a, b = array(owned(trained, "lora")["a"]), array(owned(trained, "lora")["b"])
    np.testing.assert_allclose(merged["model"]["W"], array(lin.W[...]) + 2.0 * a @ b,
                               rtol=1e-5, atol=1e-6)


def test_trainable_filters_name_the_culprit_and_grad_norms_are_reported() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    program = gm.compile(mean_square, mlp)
    variables = program.init(X)
    head = gm.VariableFilter(bricks=[mlp.linear_layers[1]])
    step = gm.optimize(program, optax.sgd(0.1), trainable=head, grad_norms=True)
    state, metrics = step(step.init(variables, key(0)), X)
    layers = state.variables["model"]["linear_layers"]
    np.testing.assert_array_equal(layers[0]["W"], variables["model"]["linear_layers"][0]["W"])
    assert not np.array_equal(layers[1]["W"], variables["model"]["linear_layers"][1]["W"])
    assert sorted(k for k in metrics if k.startswith("grad_norm/")) == [
        "grad_norm/model/linear_layers/1/W", "grad_norm/model/linear_layers/1/b"]
    with pytest.raises(ValueError, match=r"trainable=.*selects no PARAMETER leaf"):
        gm.optimize(program, optax.sgd(0.1), trainable=gm.VariableFilter(name="nope")).init(
            variables, key(0))
    with pytest.raises(TypeError, match=r"trainable=\.\.\.\): got 'W': a string is a Flax "):
        gm.optimize(program, optax.sgd(0.1), trainable="W")
    # a manager of the same name as the program's stands in for nothing
    own = managers.LoRA(2, roles=[gm.roles.WEIGHT])
    adapted = gm.compile(mean_square, mlp, managers=[own])
    with pytest.raises(ValueError, match=r"trainable=\.\.\.\): LoRA 'lora' is not one of the "
                       r"program's managers \(its managers: lora\); pass the manager object"):
        gm.optimize(adapted, optax.sgd(0.1), trainable=[managers.LoRA(2, roles=[gm.roles.BIAS])])
    gm.optimize(adapted, optax.sgd(0.1), trainable=[own])
    with pytest.raises(ValueError, match=r"selects no PARAMETER leaf.*a manager's parameters "
                       r"are chosen by the manager itself \(trainable=\[lora\]\)"):
        gm.optimize(adapted, optax.sgd(0.1), trainable=nnx.LoRAParam).init(
            adapted.init(X), key(0))


def test_a_trainable_filter_leaving_out_managers_parameters_warns_naming_them() -> None:
    mlp = gm.bricks.MLP([3, 4, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    lora = managers.LoRA(2, bricks=[mlp.linear_layers[0]], roles=[roles.WEIGHT])
    noise = managers.Dropout(gm.dynamic(0.1), roles=[roles.INPUT])  # a hyperparameter only
    program = gm.compile(mean_square, mlp, managers=[lora, noise])
    variables = program.init(X)
    head = gm.VariableFilter(bricks=[mlp.linear_layers[1]])
    with pytest.warns(UserWarning, match=r"trainable=\.\.\.\) leaves out the parameters of "
                      r"the managers \['lora'\]: they stay as initialized.*\[\.\.\., lora\]"):
        gm.optimize(program, optax.sgd(0.1), trainable=head).init(variables, key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # listed, or everything trains: nothing left out
        gm.optimize(program, optax.sgd(0.1), trainable=[head, lora]).init(variables, key(0))
        gm.optimize(program, optax.sgd(0.1)).init(variables, key(0))


def _activation_bytes(fn: Any, *args: Any) -> int:
    """Bytes of the residuals the backward pass of ``fn`` keeps, besides its arguments (as
    ``jax.ad_checkpoint.print_saved_residuals`` lists them)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ad_checkpoint.print_saved_residuals(fn, *args)
    total = 0
    for line in out.getvalue().splitlines():
        kind, shape = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
        if "from the argument" not in line:
            size = math.prod(int(n) for n in shape.split(",") if n)
            total += size * jnp.dtype({"f32": "float32", "bf16": "bfloat16"}.get(
                kind, "int32")).itemsize
    return total


def test_remat_gives_the_same_gradients_and_keeps_fewer_activations() -> None:
    mlp = gm.bricks.MLP([64] * 9, activation=jnp.tanh, rngs=nnx.Rngs(0))
    x = normal(3, 256, 64)

    def measured(chosen: list) -> tuple[dict, int, int]:
        program = gm.compile(mean_square, mlp, managers=chosen)
        variables = program.init(x)
        loss = lambda v: program._train_traced(v, key(0), (x,), {})[0]
        # XLA's own count: the compiled forward pass returns what the backward pass needs
        # (jax.vjp's residuals), the memory held between the two passes.
        forward = jax.jit(lambda v: jax.vjp(loss, v)[1]).lower(variables).compile()
        memory = forward.memory_analysis()
        peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                + memory.temp_size_in_bytes)
        return jax.grad(loss)(variables), _activation_bytes(loss, variables), peak

    plain, plain_bytes, plain_peak = measured([])
    remat, remat_bytes, remat_peak = measured([managers.Remat(bricks=[mlp])])  # the stack
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 plain["model"], remat["model"])
    print(f"activations kept for the backward pass: plain {plain_bytes} B, "
          f"remat {remat_bytes} B; compiled forward pass peak: plain {plain_peak} B, "
          f"remat {remat_peak} B")
    assert remat_bytes < plain_bytes / 4
    assert remat_peak < plain_peak / 2  # about 1.30 MB against 0.46 MB


def test_the_rewrite_trace_lists_each_call_remat_wrapped_before_the_rewrites_inside() -> None:
    mlp = gm.bricks.MLP([3, 4, 1], activation=jnp.tanh, rngs=nnx.Rngs(0))
    program = gm.compile(mean_square, mlp, managers=[
        managers.Remat(bricks=mlp.linear_layers),
        managers.Precision("bfloat16", bricks=mlp.linear_layers[:1], roles=[roles.INPUT])])
    x = normal(5, 2, 3)
    program.train(program.init(x), x, rng=key(0))
    assert [(r.manager, r.path, r.role, r.name) for r in program.rewrites["train"]] == [
        ("remat", "/linear_layers/0", "CALL", ""),
        ("precision", "/linear_layers/0", "INPUT", "input_"),
        ("remat", "/linear_layers/1", "CALL", "")]
    table = str(program.rewrites["train"])
    assert "remat      /linear_layers/1  apply        0     CALL   -         -" in table


def test_remat_selects_calls_by_their_path_and_wraps_no_other() -> None:
    mlp = gm.bricks.MLP([3, 4, 1], activation=jnp.tanh, rngs=nnx.Rngs(0))
    x = normal(5, 2, 3)

    def wrapped(remat: gm.Manager) -> list[str]:
        program = gm.compile(mean_square, mlp, managers=[remat])
        program.train(program.init(x), x, rng=key(0))
        jaxpr = str(jax.make_jaxpr(lambda v: jax.grad(lambda v: program.train(
            v, x, rng=key(0))[0])(v))(program.init(x)))
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) == bool(program.rewrites["train"])
        return [r.path for r in program.rewrites["train"]]

    assert wrapped(managers.Remat(path="/linear_layers/1*")) == ["/linear_layers/1"]
    assert wrapped(managers.Remat(path="*.apply")) == ["/", "/linear_layers/0",
                                                       "/linear_layers/1"]
    # A variable's path (".W") or role names no call: nothing is wrapped, and it says so.
    assert wrapped(managers.Remat(path="*.W", strict=False)) == []
    with pytest.raises(gm.errors.ManagerMatchedNothing, match=r"'remat'.*matched nothing"):
        wrapped(managers.Remat(roles=[roles.WEIGHT]))


class NormedBlock(nnx.Module):
    """A block that writes state when called: Flax's BatchNorm and a stored RNG stream."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
        self.rngs = rngs.fork()

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm(self.linear(x))
        return h + 0.1 * jax.random.normal(self.rngs.noise(), h.shape)


class TwoBlocks(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0, noise=1)
        self.blocks = nnx.List([NormedBlock(rngs), NormedBlock(rngs)])
        self.blocks[1].linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.blocks[1](jnp.tanh(self.blocks[0](x)))


def test_remat_of_blocks_that_write_state_gives_the_program_without_it() -> None:
    model = TwoBlocks()
    x = normal(4, 6, 3)

    def run(remat: list) -> tuple[Any, Any, Any, str]:
        program = gm.compile(mean_square, model, managers=[*remat, managers.BatchNorm(
            bricks=[nnx.Linear], roles=[roles.OUTPUT]), managers.Dropout(0.3, bricks=[
                nnx.Linear], roles=[roles.INPUT])], monitor=gm.VariableFilter(
                    bricks=[model.blocks[1].norm], roles=[roles.OUTPUT]))
        variables = program.init(x)
        train = lambda v: program.train(v, x, rng=key(2))
        (out, (written, monitored)), grads = jax.value_and_grad(
            lambda v: (lambda o: (o[0], (o[1], o[2])))(train(v)), has_aux=True,
            allow_int=True)(variables)
        jaxpr = str(jax.make_jaxpr(lambda v: jax.grad(lambda v: train(v)[0], allow_int=True)(
            v))(variables))
        return (out, written, monitored), grads["model"], variables, jaxpr

    (plain, plain_grads, variables, plain_jaxpr) = run([])
    (remat, remat_grads, _, remat_jaxpr) = run([managers.Remat(bricks=[model.blocks])])
    assert "checkpoint" in remat_jaxpr or "remat" in remat_jaxpr
    assert not ("checkpoint" in plain_jaxpr or "remat" in plain_jaxpr)
    # The loss, what the blocks wrote (running statistics of Flax's BatchNorm and of the
    # BatchNorm manager, the streams' counts), the monitored output and every gradient.
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(a, b, **TOL)
    written = plain[1]
    assert not np.allclose(written["model"]["blocks"][1]["norm"]["mean"],
                           variables["model"]["blocks"][1]["norm"]["mean"])
    assert int(written["model"]["blocks"][0]["rngs"]["noise"]["count"][...]) == 1
    assert not np.allclose(written["managers"]["batch_norm"]["/blocks/1/linear"]["apply"][
        "output.mean"], 0.0)
    for a, b in zip(jax.tree.leaves(plain_grads), jax.tree.leaves(remat_grads), strict=True):
        if a.dtype != jax.dtypes.float0:  # the streams' counts and keys have no gradient
            np.testing.assert_allclose(a, b, **TOL)
    # An auxiliary cost (L2 of the weights read in the region) and measurements made there
    # reach optimize's loss and metrics as without Remat.
    metrics = []
    for remat in ([], [managers.Remat(bricks=[model.blocks])]):
        program = gm.compile(mean_square, model, managers=[
            *remat, managers.L2(0.1), managers.ActivationStats(bricks=[nnx.Linear])])
        step = gm.optimize(program, optax.sgd(0.1))
        metrics.append(step(step.init(program.init(x), key(0)), x)[1])
    assert "l2" in metrics[0] and len(metrics[0]) == 18
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), *metrics)


def test_precision_computes_in_bf16_and_keeps_the_stored_parameters_f32() -> None:
    lin = linear()
    program = gm.compile(mean_square, lin, managers=[managers.Precision("bfloat16")])
    variables = program.init(X)
    out = program.infer(variables, X)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, jnp.mean(lin(X) ** 2), rtol=2e-2)
    step = gm.optimize(program, optax.adam(0.01))
    state, _ = step(step.init(variables, key(0)), X)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.variables)} == {jnp.dtype("float32")}
    assert {leaf.dtype for leaf in jax.tree.leaves(state.opt_state)
            if jnp.issubdtype(leaf.dtype, jnp.floating)} == {jnp.dtype("float32")}


def test_fake_quant_is_quantize_dequantize_with_a_straight_through_gradient() -> None:
    lin = linear()
    program = gm.compile(lambda m, x: m(x), lin, managers=[managers.FakeQuant(
        4, roles=[roles.WEIGHT])])
    variables = program.init(X)
    w = array(lin.W[...])
    scale = np.abs(w).max(0, keepdims=True) / 7
    quantized = np.clip(np.round(w / scale), -7, 7) * scale
    np.testing.assert_allclose(program.infer(variables, X), array(X) @ quantized
                               + array(lin.b), rtol=1e-5, atol=1e-5)
    weights = normal(4, 6, 4)
    grads = jax.grad(lambda v: jnp.sum(program.train(v, X, rng=key(0))[0] * weights))(
        variables)
    np.testing.assert_allclose(grads["model"]["W"], array(X).T @ array(weights), rtol=1e-5)


def test_fake_quant_given_bricks_quantizes_their_weights_and_activations_not_biases() -> None:
    model = gm.bricks.MLP([3, 4, 2], activation=jnp.tanh, rngs=nnx.Rngs(0))
    quant = managers.FakeQuant(bricks=model.linear_layers[:1])
    assert quant.filter.roles == (roles.WEIGHT, roles.INPUT, roles.OUTPUT)
    program = gm.compile(mean_square, model, managers=[quant])
    program.train(program.init(X), X, rng=key(0))
    assert [(r.path, r.role, r.name) for r in program.rewrites["train"]] == [
        ("/linear_layers/0", "INPUT", "input_"), ("/linear_layers/0", "WEIGHT", "W"),
        ("/linear_layers/0", "OUTPUT", "output")]
    with pytest.raises(ValueError, match=r"'b' of shape \(4,\).*roles=\[graphmod.roles.WEIGHT"):
        program = gm.compile(mean_square, model, managers=[managers.FakeQuant(
            bricks=model.linear_layers[:1], roles=[roles.PARAMETER])])
        program.init(X)


def test_annealing_a_strength_does_not_retrace() -> None:
    lin = linear()
    chosen = [managers.MaxNorm(gm.dynamic(0.5), roles=[roles.WEIGHT]),
              managers.L2(gm.dynamic(0.1))]
    traces = []
    program = gm.compile(lambda m, x: traces.append(1) or mean_square(m, x), lin,
                         managers=chosen)
    step = gm.optimize(program, optax.sgd(0.1))
    state = step.init(program.init(X), key(0))
    state, first = step(state, X)
    count = len(traces)
    for manager, name in ((chosen[0], "max_norm"), (chosen[1], "strength")):
        handle = manager.hparam(name)
        state = state._replace(variables=handle.set(state.variables, 0.05))
    state, second = step(state, X)
    assert len(traces) == count and float(second["l2"]) < float(first["l2"])


def test_an_auxiliary_cost_inside_a_scan_body_names_the_fix() -> None:
    cell = gm.bricks.SimpleRecurrent(3, 3, rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, xs: jnp.mean(m(xs) ** 2), cell, managers=[managers.L2(0.1)])
    xs = normal(5, 4, 2, 3)
    step = gm.optimize(program, optax.sgd(0.1))
    with pytest.raises(gm.errors.StateEscapesTransform, match="auxiliary cost"):
        step(step.init(program.init(xs), key(0)), xs)


def test_activation_stats_are_the_activations_statistics_in_the_step_metrics() -> None:
    lin = linear()
    stats = managers.ActivationStats(roles=[roles.OUTPUT])
    program = gm.compile(lambda m, x: jnp.mean(jax.nn.relu(m(x))), lin, managers=[stats])
    step = gm.optimize(program, optax.sgd(0.1))
    _, metrics = step(step.init(program.init(X), key(0)), X)
    y = array(X) @ array(lin.W[...]) + array(lin.b[...])
    expected = {"mean": y.mean(), "std": y.std(), "zeros": (y == 0).mean(),
                "max_abs": np.abs(y).max()}
    for statistic, value in expected.items():
        np.testing.assert_allclose(metrics[f"activation_stats:/.apply.output.{statistic}"],
                                   value, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"statistics=\['median'\]\): choose from"):
        managers.ActivationStats(statistics=["median"])
