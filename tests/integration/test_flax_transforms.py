"""Stored ``nnx.Rngs``, in-place writes, ``sow`` and lifted transforms inside programs.

The models are unmodified Flax NNX code: ``nnx.Rngs`` kept in the model, counters written
with ``var.value += 1`` / ``var[...] = x`` / ``var.value = x`` (the lm1b decode-cache
pattern), ``sow``, ``nnx.MultiHeadAttention`` with its default ``keep_rngs=True``,
``nnx.RNN(nnx.LSTMCell)``, the scan-over-layers MLP of Flax's
``examples/nnx_toy_examples/06_scan_over_layers.py`` (``examples/flax_nnx``), and
``nnx.remat``/``nnx.jit``/``nnx.cond``/``nnx.fori_loop``/``nnx.vmap`` over model modules.
"""

from __future__ import annotations

import warnings
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from examples.flax_nnx.scan_over_layers import ScanMLP
from graphmod import roles
from graphmod._core._tracing._frame import Frame, crc32

TOL = {"rtol": 1e-5, "atol": 1e-5}
X = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
SEQ = np.random.default_rng(1).normal(size=(2, 5, 4)).astype(np.float32)
KEY = jax.random.key(3)


class StoredNoise(nnx.Module):
    """Draws from an ``nnx.Rngs`` it keeps (no rngs passed to the call)."""

    def __init__(self, seed: int = 0) -> None:
        self.rngs = nnx.Rngs(noise=seed)
        self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x) + 0.1 * jax.random.normal(self.rngs.noise(), (x.shape[0], 3))


class Counter(nnx.Module):
    """Counts its calls and keeps the last input, writing in place (one spelling each)."""

    def __init__(self, spelling: str) -> None:
        self.spelling = spelling
        self.count = nnx.Variable(jnp.zeros((), jnp.int32))
        self.last = nnx.Variable(jnp.zeros((4,), jnp.float32))
        self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.spelling == "value +=":
            self.count.value += 1
        elif self.spelling == "[...] +=":
            self.count[...] += 1
        else:
            self.count.value = self.count.value + 1
        self.last[...] = x[0]
        return self.linear(x) * self.count.value


class Sower(nnx.Module):
    def __init__(self) -> None:
        self.linear1 = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.linear2 = nnx.Linear(8, 3, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = nnx.relu(self.linear1(x))
        self.sow(nnx.Intermediate, "features", hidden)
        return self.linear2(hidden)


class Attention(nnx.Module):
    """``nnx.MultiHeadAttention`` with its default ``keep_rngs=True`` (stored Rngs)."""

    def __init__(self, rate: float) -> None:
        self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=4, qkv_features=4,
                                                dropout_rate=rate, decode=False,
                                                rngs=nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.attention(x)


def square_loss(model: Any, x: jax.Array) -> jax.Array:
    return (model(x) ** 2).mean()


def program_of(model: nnx.Module, fn: Any = square_loss, *, managers: Any = (),
               **kwargs: Any) -> gm.Program:
    return gm.compile(fn, model, managers=managers, **kwargs)


def assert_trees_close(actual: Any, expected: Any) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        np.testing.assert_allclose(a, e, **TOL)


# -- stored Rngs -------------------------------------------------------------------------
def test_stored_rngs_draw_like_eager_flax_and_their_count_comes_out_of_train() -> None:
    model = StoredNoise()
    program = program_of(model, lambda m, x: m(x))
    variables = program.init(X)
    eager = nnx.clone(model)
    for step in (1, 2):
        out, variables = program.train(variables, X, rng=KEY)
        np.testing.assert_allclose(out, eager(X), **TOL)
        assert int(variables["model"]["rngs"]["noise"]["count"]) == step
    # Inference draws from the stream too (the user's own randomness) but returns no state.
    np.testing.assert_allclose(program.infer(variables, X), nnx.clone(eager)(X), **TOL)
    assert int(model.rngs.noise.count[...]) == 0  # the model itself is untouched


def test_the_stored_key_comes_from_the_variables_not_the_trace() -> None:
    program = program_of(StoredNoise(seed=0), lambda m, x: m(x))
    variables = program.init(X)
    other = program_of(StoredNoise(seed=7), lambda m, x: m(x)).init(X)
    variables["model"]["rngs"] = other["model"]["rngs"]  # same shapes: no retrace
    out, _ = program.train(variables, X, rng=KEY)
    np.testing.assert_allclose(out, StoredNoise(seed=7)(X), **TOL)


def test_gradients_through_stored_rngs_equal_nnx_grad() -> None:
    model = StoredNoise()
    program = program_of(model)
    variables = program.init(X)
    grads = jax.grad(lambda v: program.train(v, X, rng=KEY)[0], allow_int=True)(variables)
    expected = nnx.grad(square_loss)(nnx.clone(model), X)
    assert_trees_close(grads["model"]["linear"], nnx.to_pure_dict(expected)["linear"])


def test_multi_head_attention_keeping_its_rngs_equals_eager_flax() -> None:
    # Its dropout follows the program (tests/integration/test_flax_models.py); here none.
    model = Attention(0.0)
    model.train()
    program = program_of(model, lambda m, x: m(x))
    variables = program.init(SEQ)
    eager = nnx.clone(model)
    for _ in range(2):
        out, variables = program.train(variables, SEQ, rng=KEY)
        np.testing.assert_allclose(out, eager(SEQ), **TOL)
    grads = jax.grad(lambda v: square_loss_program(program, v), allow_int=True)(variables)
    expected = nnx.grad(square_loss)(nnx.clone(eager), SEQ)
    params = nnx.to_pure_dict(nnx.state(expected, nnx.Param))
    assert_trees_close(
        {k: v for k, v in grads["model"]["attention"].items() if k != "rngs"},
        params["attention"])


def square_loss_program(program: gm.Program, variables: dict) -> jax.Array:
    return (program.train(variables, SEQ, rng=KEY)[0] ** 2).mean()


# -- in-place writes ---------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["value +=", "[...] +=", "value ="])
def test_in_place_writes_go_to_the_program_and_come_out_of_train(spelling: str) -> None:
    model = Counter(spelling)
    program = program_of(model)
    variables = program.init(X)
    eager = nnx.clone(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Flax deprecates .value
        for step in (1, 2):
            out, variables = program.train(variables, X, rng=KEY)
            np.testing.assert_allclose(out, square_loss(eager, X), **TOL)
            assert int(variables["model"]["count"]) == step
            np.testing.assert_allclose(variables["model"]["last"], X[0])
        # Inference sees the written value within its call, and returns no state.
        np.testing.assert_allclose(program.infer(variables, X),
                                   square_loss(nnx.clone(eager), X), **TOL)
        grads = jax.grad(lambda v: program.train(v, X, rng=KEY)[0], allow_int=True)(variables)
        expected = nnx.grad(square_loss)(nnx.clone(eager), X)
    assert_trees_close(grads["model"]["linear"], nnx.to_pure_dict(expected)["linear"])
    assert int(model.count[...]) == 0


# -- sow ---------------------------------------------------------------------------------
def test_sown_values_are_monitorable_auxiliary_variables_and_the_module_is_untouched() -> None:
    model = Sower()
    program = program_of(model, monitor=gm.VariableFilter(roles=[roles.AUXILIARY]))
    variables = program.init(X)
    out, _, monitored = program.train(variables, X, rng=KEY)
    features = nnx.relu(model.linear1(X))
    np.testing.assert_allclose(out, (model.linear2(features) ** 2).mean(), **TOL)
    np.testing.assert_allclose(monitored["/.apply.features"], features, **TOL)
    _, monitored = program.infer(variables, X)
    np.testing.assert_allclose(monitored["/.apply.features"], features, **TOL)
    assert not hasattr(model, "features")


# -- lifted transforms -------------------------------------------------------------------
class Recurrent(nnx.Module):
    """``nnx.RNN(nnx.LSTMCell)``: ``nnx.scan`` over time, the carry drawn from stored Rngs."""

    def __init__(self) -> None:
        self.rnn = nnx.RNN(nnx.LSTMCell(4, 5, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.rnn(x)


class Lifted(nnx.Module):
    """A linear layer and a batch norm called through one NNX lifted transform."""

    def __init__(self, transform: str) -> None:
        self.transform = transform
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
        self.steps = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:
        layer = lambda m, x: m.bn(m.linear(x))
        if self.transform == "remat":
            return nnx.remat(layer)(self, x)
        if self.transform == "jit":
            return nnx.jit(layer)(self, x)
        if self.transform == "cond":
            return nnx.cond(x.sum() > 0, layer, lambda m, x: layer(m, -x), self, x)
        if self.transform == "vmap":
            return nnx.vmap(lambda m, x: m.linear(x), in_axes=(None, 0))(self, x)

        def body(i: jax.Array, carry: tuple) -> tuple:
            m, x = carry
            m.steps[...] += 1
            return m, m.linear(x)

        return nnx.fori_loop(0, 3, body, (self, x))[1]


# without_dropout switches Flax's dropout off with its module flag, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:these Flax layers stay in eval mode")


def without_dropout(model: nnx.Module) -> nnx.Module:
    """The model in training mode with its dropout off (set explicitly: wins in programs)."""
    model.train()
    model.set_attributes(nnx.Dropout, deterministic=True, raise_if_not_found=False)
    return model


def assert_like_eager_flax(model: nnx.Module, x: jax.Array) -> None:
    """train (two steps, state included) and infer equal eager Flax; gradients nnx.grad's."""
    program = program_of(model)
    variables = program.init(x)
    eager = nnx.clone(model)
    for _ in range(2):
        out, variables = program.train(variables, x, rng=KEY)
        np.testing.assert_allclose(out, square_loss(eager, x), **TOL)
        assert_trees_close(variables["model"], nnx.to_pure_dict(nnx.state(eager)))
    evaluated = nnx.clone(eager)
    evaluated.eval()
    np.testing.assert_allclose(program.infer(variables, x), square_loss(evaluated, x), **TOL)
    grads = jax.grad(lambda v: program.train(v, x, rng=KEY)[0], allow_int=True)(variables)
    expected = nnx.to_pure_dict(nnx.grad(square_loss)(nnx.clone(eager), x))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    flat_grads = dict(nnx.traversals.flatten_mapping(grads["model"]))
    for path, expected_grad in nnx.traversals.flatten_mapping(expected).items():
        assert path in dict(nnx.traversals.flatten_mapping(params))
        np.testing.assert_allclose(flat_grads[path], expected_grad, **TOL)


def test_scan_over_layers_mlp_equals_eager_flax() -> None:
    assert_like_eager_flax(without_dropout(ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0))), X)


def test_rnn_of_an_lstm_cell_equals_eager_flax_and_carries_its_rng_count() -> None:
    model = Recurrent()
    assert_like_eager_flax(model, SEQ)
    program = program_of(model)
    _, variables = program.train(program.init(SEQ), SEQ, rng=KEY)
    model(SEQ)  # eagerly: the stream advances as in the program
    assert int(variables["model"]["rnn"]["rngs"]["count"]) == int(model.rnn.rngs.count[...]) > 0


@pytest.mark.parametrize("transform", ["remat", "jit", "cond", "vmap", "fori_loop"])
def test_lifted_transforms_over_model_modules_equal_eager_flax(transform: str) -> None:
    model = Lifted(transform)
    model.train()
    assert_like_eager_flax(model, X)
    if transform == "fori_loop":
        program = program_of(model)
        _, variables = program.train(program.init(X), X, rng=KEY)
        assert int(variables["model"]["steps"]) == 3


def test_a_model_stays_mutable_after_lifted_transforms_ran_in_programs() -> None:
    model = ScanMLP(4, n_layers=2, rngs=nnx.Rngs(0))
    program = program_of(model)
    program.train(program.init(X), X, rng=KEY)
    model.eval()  # sets attributes: refused by Flax if the trace left its state behind
    model.layers.linear.kernel[...] = jnp.zeros((2, 4, 4))
    assert model.layers.bn.use_running_average
    np.testing.assert_allclose(model.layers.bn.mean[...], 0.0)  # the model was not updated


def test_managers_apply_inside_nnx_scan_and_their_state_comes_out_per_layer() -> None:
    model = without_dropout(ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0)))
    noise = managers.WeightNoise(0.1, roles=[roles.WEIGHT])
    program = program_of(model, managers=[noise])
    out, _ = program.train(program.init(X), X, rng=KEY)
    assert [(r.path, r.name) for r in program.rewrites["train"]] == [("/layers/linear", "kernel")]
    assert not np.allclose(out, square_loss(nnx.clone(model), X))
    norm = managers.BatchNorm(bricks=[nnx.Linear], roles=[roles.OUTPUT])
    program = program_of(model, managers=[norm])
    _, variables = program.train(program.init(X), X, rng=KEY)
    mean = variables["managers"]["batch_norm"]["/layers/linear"]["apply"]["output.mean"]
    assert mean.shape == (3, 4) and not np.allclose(mean[0], mean[1])  # tests/test_loop_state


def test_a_new_module_attribute_left_when_the_trace_ends_is_refused() -> None:
    # Taken off again in the function, it is allowed: tests/integration/test_flax_intermediates
    class Stash(nnx.Module):
        def __init__(self) -> None:
            self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

        def __call__(self, x: jax.Array) -> jax.Array:
            self.stash = x  # would leak a tracer into the model
            return self.linear(x)

    model = Stash()
    with pytest.raises(flax.errors.TraceContextError, match="Stash"):
        program_of(model).init(X)
    assert not hasattr(model, "stash")


# -- per-layer and per-iteration keys in loop bodies -------------------------------------------
def recorded_keys(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[str, int]]:
    """Filled while a program traces: what each manager's draw (``""``: Flax's own
    Dropout's) folds into the step key outside loops (its parts and call id)."""
    seen: dict[str, tuple[str, int]] = {}
    rng = Frame.rng

    def spy(frame: Frame, parts: tuple[str, ...], call_id: int, **kwargs: Any) -> Any:
        seen[parts[0]] = ("|".join(parts), call_id)
        return rng(frame, parts, call_id, **kwargs)

    monkeypatch.setattr(Frame, "rng", spy)
    return seen


def layer_key(seen: dict[str, tuple[str, int]], manager: str, index: int) -> jax.Array:
    """The key of layer (iteration) ``index``, as ``Frame.rng`` documents it."""
    parts, call_id = seen[manager]
    return jax.random.fold_in(jax.random.fold_in(KEY, crc32(f"{parts}#{call_id}")), index)


def layer(model: ScanMLP, index: int) -> nnx.Module:
    graphdef, state = nnx.split(model.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))


def test_scan_over_layers_draws_its_own_dropout_mask_per_layer_and_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0))
    model.train()
    keys = recorded_keys(monkeypatch)
    program = program_of(model, lambda m, x: m(x))
    variables = program.init(X)
    out, _ = program.train(variables, X, rng=KEY)
    parts, call_id = keys[""]  # each layer's stream (split at construction) sets its mask
    masks = [jax.random.bernoulli(jax.random.fold_in(
        jax.random.fold_in(KEY, crc32(f"{parts}#{call_id}")),
        jax.random.bits(layer(model, i).dropout.rngs(), (), jnp.uint32)), 0.5, X.shape)
        for i in range(3)]
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    x = X
    for i, mask in enumerate(masks):
        block = layer(model, i)
        x = jax.nn.gelu(jnp.where(mask, block.bn(block.linear(x)) / 0.5, 0.0))
    np.testing.assert_allclose(out, x, **TOL)
    next_step, _ = program.train(variables, X, rng=jax.random.key(4))
    assert not np.allclose(next_step, out)


class RecurrentCell(nnx.Module):
    """Flax's randomness guide's ``RNNCell``, its output the dropped state: the masks."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(8, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs, rng_collection="recurrent_dropout")

    def __call__(self, h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        dropped = self.drop(h)  # recurrent dropout
        return nnx.relu(self.linear(jnp.concatenate([dropped, x], -1))) + 1, dropped / h


def recurrent_masks(cell: RecurrentCell, x: jax.Array, *, broadcast: bool) -> jax.Array:
    """The guide's ``rnn_forward``: one mask for every step where the stream is broadcast
    (``nnx.with_rngs``), a mask per step where it is split."""
    h = jnp.ones((x.shape[0], 4))
    streams = nnx.with_rngs(cell, **{"broadcast" if broadcast else "split": x.shape[1]},
                            graph=False)
    in_axes = nnx.prefix(streams, {"recurrent_dropout": 0, ...: None}, graph=False)

    @nnx.scan(in_axes=(in_axes, nnx.Carry, 1), out_axes=(nnx.Carry, 1), graph=False)
    def unroll(cell: RecurrentCell, h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return cell(h, x)

    return unroll(streams, h, x)[1]


@pytest.mark.parametrize("broadcast", [True, False])
def test_recurrent_dropout_keeps_the_streams_structure(broadcast: bool) -> None:
    cell = RecurrentCell(nnx.Rngs(params=0, recurrent_dropout=1))
    sequence = jnp.ones((2, 5, 4))
    program = program_of(cell, lambda c, x: recurrent_masks(c, x, broadcast=broadcast))
    variables = program.init(sequence)
    masks, trained = program.train(variables, sequence, rng=KEY)
    steps = [np.asarray(masks[:, t]) for t in range(5)]
    assert set(np.unique(steps)) == {0.0, 2.0}
    same = [np.array_equal(steps[0], step) for step in steps[1:]]
    assert all(same) if broadcast else not any(same)  # as eager Flax draws them
    eager = recurrent_masks(nnx.clone(cell), sequence, broadcast=broadcast)
    assert all(np.array_equal(eager[:, 0], eager[:, t]) for t in range(5)) == broadcast
    other, _ = program.train(variables, sequence, rng=jax.random.key(4))
    assert not np.array_equal(other, masks)  # the step key still sets the masks
    assert not np.array_equal(trained["model"]["drop"]["rngs"]["count"],
                              variables["model"]["drop"]["rngs"]["count"])


def test_managers_inside_a_scan_over_layers_draw_per_layer_from_the_layer_index(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = without_dropout(ScanMLP(4, n_layers=3, rngs=nnx.Rngs(0)))
    noise = managers.WeightNoise(0.3, roles=[roles.WEIGHT])
    drop = managers.Dropout(0.5, bricks=[nnx.Linear], roles=[roles.OUTPUT])
    keys = recorded_keys(monkeypatch)
    program = program_of(model, lambda m, x: m(x), managers=[noise, drop])
    out, _ = program.train(program.init(X), X, rng=KEY)
    x = X
    for i in range(3):
        block = layer(model, i)
        kernel = block.linear.kernel[...] + 0.3 * jax.random.normal(
            layer_key(keys, noise.name, i), (4, 4))
        hidden = x @ kernel + block.linear.bias[...]
        mask = jax.random.bernoulli(layer_key(keys, drop.name, i), 0.5, hidden.shape)
        x = jax.nn.gelu(block.bn(jnp.where(mask, hidden / 0.5, 0.0)))
    np.testing.assert_allclose(out, x, **TOL)


def test_a_fori_loop_body_draws_per_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Lifted("fori_loop")
    model.train()
    noise = managers.GaussianNoise(0.5, bricks=[nnx.Linear], roles=[roles.OUTPUT])
    keys = recorded_keys(monkeypatch)
    program = program_of(model, lambda m, x: m(x), managers=[noise])
    out, _ = program.train(program.init(X), X, rng=KEY)
    x = X
    for i in range(3):
        x = model.linear(x) + 0.5 * jax.random.normal(layer_key(keys, noise.name, i),
                                                      x.shape)
    np.testing.assert_allclose(out, x, **TOL)
