"""Manager-owned variables inside loop bodies JAX traces once: one per iteration, stacked."""

from __future__ import annotations

import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from examples.flax_nnx.scan_over_layers import ScanMLP
from graphmod import roles
from graphmod._core._loops import _loop_keys, _loop_resolution
from graphmod._core._model._owned import OwnedStore
from graphmod._core._tracing._trace import TraceScope
from tests.test_loop_keys import Stack

TOL = {"rtol": 1e-4, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-3, "atol": 1e-5}  # two batch norms per layer over 6 rows, in float32
KEY = jax.random.key(3)
X = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
LAYERS = 3


def scan_mlp(running_average: bool = False) -> ScanMLP:
    """Flax's scan-over-layers MLP in training mode, its own dropout off (set explicitly;
    ``running_average``: its own BatchNorm too, which otherwise cancels the manager's scale
    and bias)."""
    model = ScanMLP(4, n_layers=LAYERS, rngs=nnx.Rngs(0))
    model.train()
    model.set_attributes(nnx.Dropout, deterministic=True, raise_if_not_found=False)
    if running_average:
        model.set_attributes(nnx.BatchNorm, use_running_average=True)
    return model


def perturbed(tree: dict, seed: int) -> dict:
    """``tree`` with each leaf replaced by a different random array of its shape."""
    leaves, structure = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(structure, [0.5 + 0.3 * jax.random.normal(k, jnp.shape(a))
                                          for k, a in zip(keys, leaves, strict=True)])


def normalize(h: jax.Array, mean: jax.Array, var: jax.Array) -> jax.Array:
    return (h - mean) * jax.lax.rsqrt(var + 1e-5)


def flax_stats(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Batch statistics as ``nnx.BatchNorm`` computes them (its fast variance)."""
    mean = y.mean(0)
    return mean, jnp.maximum(0.0, jnp.square(y).mean(0) - jnp.square(mean))


# -- batch norm of the scanned Linear's output -------------------------------------------------
def batch_norm_program(running_average: bool = False) -> gm.Program:
    norm = managers.BatchNorm(bricks=[nnx.Linear], roles=[roles.OUTPUT])
    return gm.compile(lambda m, x: m(x), scan_mlp(running_average), managers=[norm])


def owned_norm(variables: dict) -> dict:
    return variables["managers"]["batch_norm"]["/layers/linear"]["apply"]


def hand_batch_norm(model: dict, norm: dict, x: jax.Array, training: bool,
                    running_average: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The managed ScanMLP by hand, layer by layer: its output and the new running stats."""
    layers, means, variances = model["layers"], [], []
    for i in range(LAYERS):
        h = x @ layers["linear"]["kernel"][i] + layers["linear"]["bias"][i]
        if training:
            mean, var = h.mean(0), h.var(0)
        else:
            mean, var = norm["output.mean"][i], norm["output.var"][i]
        means.append(0.99 * norm["output.mean"][i] + 0.01 * mean)
        variances.append(0.99 * norm["output.var"][i] + 0.01 * var)
        y = normalize(h, mean, var) * norm["output.scale"][i] + norm["output.bias"][i]
        bn = layers["bn"]
        own_batch = training and not running_average
        stats = flax_stats(y) if own_batch else (bn["mean"][i], bn["var"][i])
        x = jax.nn.gelu(normalize(y, *stats) * bn["scale"][i] + bn["bias"][i])
    return x, jnp.stack(means), jnp.stack(variances)


def test_batch_norm_on_a_scanned_linear_keeps_running_stats_per_layer() -> None:
    program = batch_norm_program()
    variables = program.init(X)
    norm = owned_norm(variables)
    assert {name: a.shape for name, a in norm.items()} == {
        name: (LAYERS, 4) for name in ("output.bias", "output.mean", "output.scale",
                                       "output.var")}
    np.testing.assert_array_equal(norm["output.var"], 1.0)
    norm = {**norm, **perturbed({k: norm[k] for k in ("output.scale", "output.bias")}, 1)}
    variables["managers"]["batch_norm"]["/layers/linear"]["apply"] = norm
    out, new = program.train(variables, X, rng=KEY)
    expected, means, variances = hand_batch_norm(variables["model"], norm, X, training=True)
    np.testing.assert_allclose(out, expected, **TOL)
    new_norm = owned_norm(new)
    np.testing.assert_allclose(new_norm["output.mean"], means, **TOL)
    np.testing.assert_allclose(new_norm["output.var"], variances, **TOL)
    assert not np.allclose(new_norm["output.mean"][0], new_norm["output.mean"][1])
    np.testing.assert_array_equal(new_norm["output.scale"], norm["output.scale"])
    # Inference reads each layer's running stats (and Flax's BatchNorm its own).
    inferred = program.infer(new, X)
    np.testing.assert_allclose(inferred, hand_batch_norm(new["model"], new_norm, X,
                                                         training=False)[0], **TOL)
    mixed = {**new_norm, "output.mean": new_norm["output.mean"][::-1]}
    assert not np.allclose(inferred, hand_batch_norm(new["model"], mixed, X, False)[0])


def test_batch_norm_on_a_scanned_linear_has_the_gradients_of_the_hand_loop() -> None:
    program = batch_norm_program(running_average=True)
    variables = program.init(X)
    norm = owned_norm(variables)
    variables["managers"]["batch_norm"]["/layers/linear"]["apply"] = {
        **norm, **perturbed({k: norm[k] for k in ("output.scale", "output.bias")}, 2)}

    def cost(v: dict) -> jax.Array:
        return (program.train(v, X, rng=KEY)[0] ** 2).sum()

    def hand_cost(v: dict) -> jax.Array:
        hand = hand_batch_norm(v["model"], owned_norm(v), X, True, running_average=True)
        return (hand[0] ** 2).sum()

    grads = jax.grad(cost, allow_int=True)(variables)
    expected = jax.grad(hand_cost, allow_int=True)(variables)
    for name in ("output.scale", "output.bias"):
        np.testing.assert_allclose(owned_norm(grads)[name], owned_norm(expected)[name],
                                   **GRAD_TOL)
    linear = grads["model"]["layers"]["linear"]
    np.testing.assert_allclose(linear["kernel"],
                               expected["model"]["layers"]["linear"]["kernel"], **GRAD_TOL)
    assert not np.allclose(owned_norm(grads)["output.scale"][0],
                           owned_norm(grads)["output.scale"][1])


# -- a LoRA pair per layer ---------------------------------------------------------------------
class LoRA(gm.Manager):
    """``W + a @ b``, the pair made from the weight's shape only."""

    def rewrite_parameter(self, call: gm.ApplicationCall, name: str, value: jax.Array
                          ) -> jax.Array:
        rows, cols = value.shape
        a = call.variable("a", lambda: jnp.full((rows, 2), 0.5), role=roles.PARAMETER)
        b = call.variable("b", lambda: jnp.zeros((2, cols)), role=roles.PARAMETER)
        return value + a.value @ b.value


def test_a_lora_pair_per_scanned_layer_gets_its_own_gradients() -> None:
    model = scan_mlp()
    program = gm.compile(lambda m, x: (m(x) ** 2).sum(), model,
                         managers=[LoRA(roles=[roles.WEIGHT], manager_name="lora")])
    variables = program.init(X)
    pair = variables["managers"]["lora"]["/layers/linear"]["kernel"]
    assert (pair["a"].shape, pair["b"].shape) == ((LAYERS, 4, 2), (LAYERS, 2, 4))
    np.testing.assert_array_equal(pair["a"], 0.5)
    pair = variables["managers"]["lora"]["/layers/linear"]["kernel"] = perturbed(pair, 3)
    model_state = variables["model"]

    def hand(pair: dict, x: jax.Array) -> jax.Array:
        layers = model_state["layers"]
        for i in range(LAYERS):
            kernel = layers["linear"]["kernel"][i] + pair["a"][i] @ pair["b"][i]
            h = x @ kernel + layers["linear"]["bias"][i]
            bn = layers["bn"]
            x = jax.nn.gelu(normalize(h, *flax_stats(h)) * bn["scale"][i] + bn["bias"][i])
        return (x ** 2).sum()

    cost, new = program.train(variables, X, rng=KEY)
    np.testing.assert_allclose(cost, hand(pair, X), **TOL)
    unchanged = jax.tree.map(np.array_equal, new["managers"], variables["managers"])
    assert jax.tree.all(unchanged)
    grads = jax.grad(lambda v: program.train(v, X, rng=KEY)[0], allow_int=True)(variables)
    grads = grads["managers"]["lora"]["/layers/linear"]["kernel"]
    expected = jax.grad(hand)(pair, X)
    for name in ("a", "b"):
        np.testing.assert_allclose(grads[name], expected[name], **TOL)
        assert not np.allclose(grads[name][0], grads[name][1])


def lora_key(seed: int, parameter: str) -> jax.Array:
    """The key of LoRA's initial ``A`` outside loops: CRC32 of its seed and the parameter."""
    return jax.random.key(zlib.crc32(f"{seed}:{parameter}".encode()) & 0x7FFFFFFF)


def test_each_scanned_layer_starts_from_its_own_lora_a() -> None:
    lora = managers.LoRA(rank=2, roles=[roles.WEIGHT], seed=5)
    program = gm.compile(lambda m, x: (m(x) ** 2).sum(), scan_mlp(), managers=[lora])
    a = program.init(X)["managers"]["lora"]["/layers/linear"]["kernel"]["a"]
    key = lora_key(5, "/layers/linear.kernel")
    for i in range(LAYERS):  # layer i from fold_in(key, i), as call.rng() in a scan body
        expected = jax.random.normal(jax.random.fold_in(key, i), (4, 2)) / 2.0  # / sqrt(4)
        np.testing.assert_allclose(a[i], expected, **TOL)
    assert not np.allclose(a[0], a[1])
    again = program.init(X)["managers"]["lora"]["/layers/linear"]["kernel"]["a"]
    np.testing.assert_array_equal(a, again)  # the same at every init


def test_a_cell_broadcast_over_time_steps_has_one_lora_a_drawn_as_outside_loops() -> None:
    rnn = nnx.RNN(nnx.LSTMCell(4, 8, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    lora = managers.LoRA(rank=2, bricks=[nnx.Linear], roles=[roles.WEIGHT], seed=5)
    program = gm.compile(lambda m, x: m(x).sum(), rnn, managers=[lora])
    a = program.init(np.ones((2, 5, 4), np.float32))["managers"]["lora"]["/cell/ii"]["kernel"]
    expected = jax.random.normal(lora_key(5, "/cell/ii.kernel"), (4, 2)) / 2.0
    np.testing.assert_allclose(a["a"], expected, **TOL)


def test_a_cell_broadcast_over_time_steps_shares_its_variables_at_any_length() -> None:
    rnn = nnx.RNN(nnx.LSTMCell(4, 8, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))  # a scan over time
    lora = LoRA(bricks=[nnx.Linear], roles=[roles.WEIGHT], manager_name="lora")
    program = gm.compile(lambda m, x: m(x).sum(), rnn, managers=[lora])
    variables = program.init(np.ones((2, 5, 4), np.float32))
    # the loop does not slice the cell's weights: one pair for every time step
    assert variables["managers"]["lora"]["/cell/ii"]["kernel"]["a"].shape == (4, 2)
    for length in (5, 7):
        cost, _ = program.train(variables, np.ones((2, length, 4), np.float32), rng=KEY)
        assert np.isfinite(cost)


def test_state_of_a_cell_broadcast_over_time_steps_cannot_be_updated_in_the_loop() -> None:
    rnn = nnx.RNN(nnx.LSTMCell(4, 8, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    norm = managers.BatchNorm(bricks=[nnx.Linear], roles=[roles.OUTPUT])
    program = gm.compile(lambda m, x: m(x).sum(), rnn, managers=[norm])
    variables = program.init(np.ones((2, 5, 4), np.float32))
    with pytest.raises(RuntimeError, match=r"(?s)shared by every iteration.*of /cell/.*"
                       r"graphmod\.scan"):
        program.train(variables, np.ones((2, 5, 4), np.float32), rng=KEY)


# -- what stays as it was ----------------------------------------------------------------------
class Outside(nnx.Module):
    """A Linear before Flax's scan over layers; or repeated in a while loop (``fori_loop``
    with traced bounds), or mapped over the batch (``nnx.vmap``)."""

    def __init__(self, loop: str = "scan") -> None:
        self.loop = loop
        self.first = nnx.Linear(4, 4, rngs=nnx.Rngs(1))
        self.scanned = scan_mlp()

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.loop == "while":
            n = jnp.int32(x.shape[0]) + jnp.zeros((), jnp.int32) * x[0, 0].astype(jnp.int32)
            return nnx.fori_loop(0, n, lambda i, c: (c[0], c[0].first(c[1])), (self, x))[1]
        if self.loop == "vmap":
            return nnx.vmap(lambda m, x: m.first(x[None])[0], in_axes=(None, 0))(self, x)
        return self.scanned(self.first(x))


def test_a_model_without_owned_variables_in_loops_keeps_its_jaxpr() -> None:
    outside = Outside()
    norm = managers.BatchNorm(bricks=[outside.first], roles=[roles.OUTPUT])
    for program in (gm.compile(lambda m, x: m(x).sum(), scan_mlp()),
                    gm.compile(lambda m, x: m(x).sum(), outside, managers=[norm])):
        variables = program.init(X)
        args = (variables, KEY, (X,), {})
        unresolved = functools.partial(gm.Program._train_traced, program)
        before = str(jax.make_jaxpr(unresolved)(*args))
        assert str(jax.make_jaxpr(program._train_traced)(*args)) == before
        assert "owned" not in before


@pytest.mark.parametrize("loop", ["while", "vmap"])
def test_owned_state_in_a_while_loop_or_under_vmap_is_refused_with_the_way_around_it(
        loop: str) -> None:
    outside = Outside(loop)
    norm = managers.BatchNorm(bricks=[outside.first], roles=[roles.OUTPUT])
    program = gm.compile(lambda m, x: m(x).sum(), outside, managers=[norm])
    with pytest.raises(RuntimeError, match=r"(?s)batch_norm variable 'output.mean', shared by "
                       r"every iteration.*application 'apply' of /first.*Use graphmod\.scan"):
        program.train(program.init(X), X, rng=KEY)


# -- the mechanism on plain JAX loops ----------------------------------------------------------
def test_nested_scans_stack_slices_outermost_first_through_remat_and_cond() -> None:
    key = ("m", "/p", "apply", None, "s")

    def f(stack: jax.Array) -> jax.Array:
        def inner(c: jax.Array, j: jax.Array) -> tuple[jax.Array, None]:
            def step(c: jax.Array) -> jax.Array:
                old = _loop_keys.read_slice(stack, 2, key)
                _loop_keys.write_slice(old + 10 * c + j, key)
                return c + old.sum()
            c = jax.lax.cond(j > 0, jax.checkpoint(step), step, c)
            return c, None

        def outer(c: jax.Array, _: None) -> tuple[jax.Array, None]:
            return jax.lax.scan(inner, c + 1, jnp.arange(3.0))[0], None

        jax.lax.scan(outer, 0.0, length=2)
        return _loop_keys.stacked(stack, key, fresh=False)

    stack = jnp.arange(12.0).reshape(2, 3, 2)
    out = jax.jit(_loop_resolution.resolving(f))(stack)
    expected, c = np.zeros((2, 3, 2)), 0.0
    for i in range(2):
        c += 1
        for j in range(3):
            expected[i, j] = stack[i, j] + 10 * c + j
            c += float(stack[i, j].sum())
    np.testing.assert_allclose(out, expected)
    grad = jax.grad(lambda s: _loop_resolution.resolving(f)(s).sum())(stack)
    assert grad.shape == stack.shape and not np.allclose(grad, grad[0, 0])


def test_a_scan_over_layers_under_remat_keeps_the_state_of_the_same_step_without_it() -> None:
    results = []
    for remat in (False, True):
        model = Stack(remat)
        norm = managers.BatchNorm(bricks=[nnx.Linear], roles=[roles.OUTPUT])
        program = gm.compile(lambda m, x: (m(x) ** 2).mean(), model, managers=[norm])
        variables = program.init(X)
        cost, new = program.train(variables, X, rng=KEY)
        grads = jax.grad(lambda v, p=program: p.train(v, X, rng=KEY)[0])(variables)
        results.append((cost, new["managers"], grads["managers"]))
    assert np.shape(results[0][1]["batch_norm"]["/layers"]["apply"]["output.mean"]) == (3, 4)
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_remat_of_a_scanned_flax_block_gives_the_program_without_it() -> None:
    """Remat(bricks=[Block]) on Flax's scan over layers: the checkpoint runs inside the scan
    body, where the layer's BatchNorm statistics and Dropout stream count are the scan's
    copies (Flax refuses their writes from the checkpoint's level unless lifted), and the
    managers' masks and statistics are each layer's."""
    from examples.flax_nnx.scan_over_layers import Block
    results = []
    for remat in ([], [managers.Remat(bricks=[Block])]):
        model = ScanMLP(4, n_layers=LAYERS, rngs=nnx.Rngs(0))
        model.train()  # Flax's own dropout and batch statistics on
        program = gm.compile(lambda m, x: (m(x) ** 2).sum(), model, managers=[
            *remat, managers.Dropout(0.3, bricks=[nnx.Linear], roles=[roles.INPUT]),
            managers.BatchNorm(bricks=[nnx.Linear], roles=[roles.OUTPUT])])
        variables = program.init(X)
        (cost, new), grads = jax.value_and_grad(
            lambda v, p=program: p.train(v, X, rng=KEY), has_aux=True, allow_int=True)(
                variables)
        jaxpr = str(jax.make_jaxpr(lambda v, p=program: p.train(v, X, rng=KEY)[0])(variables))
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) == bool(remat)
        results.append((cost, new["model"], grads["model"], new["managers"]["batch_norm"]))
    assert np.shape(results[0][3]["/layers/linear"]["apply"]["output.mean"]) == (LAYERS, 4)
    stats = results[0][3]["/layers/linear"]["apply"]["output.mean"]
    assert np.shape(stats) == (LAYERS, 4) and not np.allclose(stats[0], stats[1])
    np.testing.assert_array_equal(results[0][1]["layers"]["dropout"]["rngs"]["count"], 1)
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if a.dtype != jax.dtypes.float0:  # the streams' counts and keys have no gradient
            np.testing.assert_allclose(a, b, **TOL)


def test_l2_on_a_scanned_layer_is_the_penalty_on_the_whole_stacked_kernel() -> None:
    """Each layer's cost leaves the scan body as a slice, summed over the layers: the step
    equals one whose function adds the penalty itself, also with each layer or the whole
    scan rematerialized."""
    from examples.flax_nnx.scan_over_layers import Block

    def stepped(cost: Any, chosen: list) -> tuple[dict, dict]:
        model = scan_mlp()
        program = gm.compile(cost, model, managers=chosen)
        step = gm.optimize(program, optax.sgd(0.1))
        state, metrics = step(step.init(program.init(X), KEY), X)
        return state.variables["model"], metrics

    plain = lambda m, x: (m(x) ** 2).mean()
    by_hand = lambda m, x: plain(m, x) + 0.01 * (m.layers.linear.kernel[...] ** 2).sum()
    expected, hand_metrics = stepped(by_hand, [])
    kernel = scan_mlp().layers.linear.kernel[...]
    for chosen in ([managers.L2(0.01)], [managers.L2(0.01), managers.Remat(bricks=[Block])],
                   [managers.L2(0.01), managers.Remat(bricks=[ScanMLP])]):  # around the scan
        model, metrics = stepped(plain, chosen)
        np.testing.assert_allclose(metrics["l2"], 0.01 * (kernel ** 2).sum(), **TOL)
        np.testing.assert_allclose(metrics["loss"], hand_metrics["loss"], **TOL)
        for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(expected), strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_allclose(a, b, **TOL)


def test_activation_stats_of_a_scanned_layer_are_one_per_layer() -> None:
    program = gm.compile(lambda m, x: (m(x) ** 2).mean(), scan_mlp(), managers=[
        managers.ActivationStats(bricks=[nnx.Linear], statistics=["mean", "std"])])
    variables = program.init(X)
    step = gm.optimize(program, optax.sgd(0.1))
    _, metrics = step(step.init(variables, KEY), X)
    layers, x, expected = variables["model"]["layers"], jnp.asarray(X), []
    for i in range(LAYERS):  # the layers unrolled by hand
        h = x @ layers["linear"]["kernel"][i] + layers["linear"]["bias"][i]
        expected.append((x.mean(), h.mean(), h.std()))
        bn = layers["bn"]
        x = jax.nn.gelu(normalize(h, *flax_stats(h)) * bn["scale"][i] + bn["bias"][i])
    prefix = "activation_stats:/layers/linear.apply."
    for column, name in enumerate(("inputs.mean", "output.mean", "output.std")):
        assert np.shape(metrics[prefix + name]) == (LAYERS,)
        np.testing.assert_allclose(metrics[prefix + name], [e[column] for e in expected],
                                   **TOL)


def test_a_layer_cost_written_in_two_loops_is_refused_naming_the_cost() -> None:
    key = ("cost", "l2", "l2:/layers/linear.kernel.cost")  # as Collected writes a layer's

    def f(x: jax.Array) -> jax.Array:
        for _ in range(2):
            jax.lax.scan(lambda c, _: (c, _loop_keys.write_slice(c.sum(), key)), x, None,
                         length=3)
        return _loop_keys.stacked(jnp.zeros((3,)), key, fresh=False).sum()

    with pytest.raises(RuntimeError, match=r"the auxiliary cost l2:/layers/linear\.kernel\.cost "
                                           r"is updated in two loops of one step"):
        _loop_resolution.resolving(f)(jnp.ones(2))


MEAN = ("batch_norm", "/layers/linear", "apply", None, "mean")  # an owned variable's key


def test_a_stack_read_in_loops_of_other_lengths_than_at_init_is_refused() -> None:
    def f(stack: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, _: (c, _loop_keys.read_slice(stack, 1, MEAN)), 0.0,
                            length=2)[1]

    with pytest.raises(RuntimeError, match=r"batch_norm variable 'mean' of "
                       r"/layers/linear\.apply is stacked over loops of lengths \(3,\) \(as "
                       r"at init\) and read in loops of lengths \(2,\)"):
        _loop_resolution.resolving(f)(jnp.zeros((3, 2)))


def test_a_slice_written_in_some_branches_of_a_cond_only_is_refused() -> None:
    def f(x: jax.Array) -> jax.Array:
        def write(c: jax.Array) -> jax.Array:
            _loop_keys.write_slice(c, MEAN)
            return c

        y = jax.lax.scan(lambda c, p: (jax.lax.cond(p > 0, write, lambda c: c, c), None), x,
                         jnp.arange(3.0))[0]
        return _loop_keys.stacked(jnp.zeros((3, 2)), MEAN, fresh=False).sum() + y.sum()

    with pytest.raises(RuntimeError, match=r"batch_norm variable 'mean' of /layers/linear\."
                       r"apply is updated in some branches of a cond only"):
        _loop_resolution.resolving(f)(jnp.ones(2))


def test_a_variable_read_at_the_base_trace_after_a_loop_wrote_it_is_refused() -> None:
    store = OwnedStore({MEAN: jnp.zeros((3, 2))}, "train", TraceScope(), lambda *a: None)

    def body(c: jax.Array, _: None) -> tuple[jax.Array, None]:
        store.ensure(MEAN, jnp.zeros(2), roles.STATE)
        store.write(MEAN, store.read(MEAN) + c)
        return c, None

    jax.lax.scan(body, jnp.ones(2), length=3)
    with pytest.raises(gm.errors.StateEscapesTransform,
                       match=r"batch_norm variable 'mean' of /layers/linear\.apply is read "
                             r"outside the loop body that updated it in this step"):
        store.read(MEAN)
