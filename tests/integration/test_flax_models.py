"""Managers on unmodified Flax NNX models: every module method call is an application.

The CNN follows Flax's MNIST example (``examples/mnist``, Apache-2.0, smaller sizes); the
MLP is the plain ``nnx.Linear`` + ``nnx.relu`` model of Flax's documentation. Neither knows
graphmod: no brick, no decorator, no marker.
"""

from __future__ import annotations

import threading
import warnings
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod._core._tracing._frame import crc32
from tests.conftest import has_random

TOL = {"rtol": 1e-5, "atol": 1e-5}
X = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
IMAGES = np.random.default_rng(1).normal(size=(3, 8, 8, 1)).astype(np.float32)
KEY = jax.random.key(3)
FLAX_LINEAR_CALL = nnx.Linear.__call__


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(4, 8, rngs=rngs)
        self.linear2 = nnx.Linear(8, 3, rngs=rngs)

    def encode(self, x: jax.Array) -> jax.Array:
        return nnx.relu(self.linear1(x))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(self.encode(x))


class CNN(nnx.Module):
    """Flax's MNIST CNN, with 8x8 inputs and fewer features."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(32, 16, rngs=rngs)
        self.linear2 = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.linear1(x))
        return self.linear2(x)


def loss(model: Any, x: jax.Array) -> jax.Array:
    return (model(x) ** 2).mean()


def step_key(manager: str, path: str, application: str, role: str, name: str) -> jax.Array:
    """The key graphmod draws from for call 0 of (path, application) in a step with KEY."""
    return jax.random.fold_in(KEY, crc32(f"{manager}|{path}|{application}|{role}|{name}#0"))


def rewrites(program: gm.Program, mode: str = "train") -> list[tuple[str, str, str, str]]:
    return [(r.path, r.application, r.role, r.name) for r in program.rewrites[mode]]


def test_weight_noise_over_weight_roles_of_plain_linears_draws_per_path() -> None:
    model = MLP(rngs=nnx.Rngs(0))
    program = gm.compile(loss, model, managers=[managers.WeightNoise(0.1, roles=[roles.WEIGHT])])
    variables = program.init(X)
    out, _ = program.train(variables, X, rng=KEY)
    assert rewrites(program) == [("/linear1", "apply", "WEIGHT", "kernel"),
                                 ("/linear2", "apply", "WEIGHT", "kernel")]
    # By hand, in plain NNX: the same kernels plus the noise drawn from the same keys.
    noisy = nnx.clone(model)
    for name in ("linear1", "linear2"):
        layer = getattr(noisy, name)
        # a parameter's key: folded with its path, not the application's (tied weights)
        key = step_key("weight_noise", f"/{name}.kernel", "", "WEIGHT", "kernel")
        layer.kernel[...] += 0.1 * jax.random.normal(key, layer.kernel.shape)
    np.testing.assert_allclose(out, loss(noisy, X), **TOL)
    np.testing.assert_allclose(program.infer(variables, X), loss(model, X), **TOL)


@pytest.mark.parametrize("select", ["class", "instance"])
def test_dropout_on_inputs_of_flax_linears_by_class_or_instance(select: str) -> None:
    model = MLP(rngs=nnx.Rngs(0))
    bricks = [nnx.Linear] if select == "class" else [model.linear1]
    dropout = managers.Dropout(0.5, bricks=bricks, roles=[roles.INPUT])
    program = gm.compile(lambda m, x: m(x), model, managers=[dropout])
    variables = program.init(X)
    out, _ = program.train(variables, X, rng=KEY)
    paths = ["/linear1", "/linear2"] if select == "class" else ["/linear1"]
    assert rewrites(program) == [(p, "apply", "INPUT", "inputs") for p in paths]

    def drop(path: str, x: jax.Array) -> jax.Array:
        if path not in paths:
            return x
        mask = jax.random.bernoulli(step_key("dropout", path, "apply", "INPUT", "inputs"),
                                    0.5, x.shape)
        return jnp.where(mask, x / 0.5, 0.0)

    hidden = nnx.relu(model.linear1(drop("/linear1", X)))
    np.testing.assert_allclose(out, model.linear2(drop("/linear2", hidden)), **TOL)
    np.testing.assert_allclose(program.infer(variables, X), model(X), **TOL)


def test_batch_norm_on_the_output_of_a_flax_linear() -> None:
    model = MLP(rngs=nnx.Rngs(0))
    norm = managers.BatchNorm(bricks=[model.linear1], roles=[roles.OUTPUT])
    program = gm.compile(lambda m, x: m(x), model, managers=[norm])
    variables = program.init(X)
    out, new = program.train(variables, X, rng=KEY)
    h = model.linear1(X)
    mean, var = h.mean(0), h.var(0)
    expected = model.linear2(nnx.relu((h - mean) / jnp.sqrt(var + 1e-5)))
    np.testing.assert_allclose(out, expected, **TOL)
    state = new["managers"]["batch_norm"]["/linear1"]["apply"]
    np.testing.assert_allclose(state["output.mean"], 0.01 * mean, **TOL)
    # Inference: the running statistics (after init: mean 0, variance 1).
    np.testing.assert_allclose(program.infer(variables, X),
                               model.linear2(nnx.relu(h / jnp.sqrt(1.0 + 1e-5))), **TOL)


def test_rates_zero_equal_eager_flax_with_equal_gradients_and_no_random_in_infer() -> None:
    model = CNN(rngs=nnx.Rngs(0))
    chosen = [managers.Dropout(0.0, bricks=[nnx.Linear], roles=[roles.INPUT]),
              managers.WeightNoise(0.0, roles=[roles.WEIGHT])]
    program = gm.compile(loss, model, managers=chosen)
    variables = program.init(IMAGES)
    out, _ = program.train(variables, IMAGES, rng=KEY)
    np.testing.assert_allclose(out, loss(model, IMAGES), **TOL)
    np.testing.assert_allclose(program.infer(variables, IMAGES), loss(model, IMAGES), **TOL)
    grads = jax.grad(lambda v: program.train(v, IMAGES, rng=KEY)[0])(variables)["model"]
    expected = nnx.to_pure_dict(nnx.grad(loss)(model, IMAGES))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), grads, expected)
    assert not has_random(jax.make_jaxpr(program.infer)(variables, IMAGES))


def test_rewrite_trace_lists_the_flax_paths_of_the_cnn() -> None:
    model = CNN(rngs=nnx.Rngs(0))
    program = gm.compile(loss, model, managers=[managers.WeightNoise(0.1, roles=[roles.WEIGHT])])
    program.init(IMAGES)
    assert [path for path, *_ in rewrites(program, "init")] == [
        "/conv1", "/conv2", "/linear1", "/linear2"]


def test_named_methods_of_the_users_module_are_applications() -> None:
    model = MLP(rngs=nnx.Rngs(0))
    double = managers.GaussianNoise(0.0, applications=["encode"], roles=[roles.OUTPUT])
    program = gm.compile(lambda m, x: m(x), model, managers=[double],
                         applications={MLP: ["encode"]})
    program.init(X)
    assert rewrites(program, "init") == []  # std 0: identity, but the filter matched
    unknown = managers.GaussianNoise(0.1, applications=["encode"], roles=[roles.OUTPUT])
    with pytest.raises(ValueError, match="matched nothing"):
        gm.compile(lambda m, x: m(x), model, managers=[unknown]).init(X)
    with pytest.raises(ValueError, match="has no method 'decode'"):
        gm.compile(lambda m, x: m(x), model, applications={MLP: ["decode"]})
    with pytest.raises(TypeError, match="applications="):
        gm.compile(lambda m, x: m(x), model, applications={"MLP": ["encode"]})


def _assert_plain_flax(model: MLP) -> None:
    assert type(model.linear1) is nnx.Linear and type(model) is MLP
    assert nnx.Linear.__call__ is FLAX_LINEAR_CALL
    assert type(model.linear1).__call__ is FLAX_LINEAR_CALL


def test_classes_and_methods_are_unchanged_outside_traces_also_after_an_error() -> None:
    model = MLP(rngs=nnx.Rngs(0))
    program = gm.compile(loss, model, managers=[managers.WeightNoise(0.1, roles=[roles.WEIGHT])],
                         applications={MLP: ["encode"]})
    _assert_plain_flax(model)
    variables = program.init(X)
    program.train(variables, X, rng=KEY)
    _assert_plain_flax(model)
    seen: list[type] = []

    def failing(m: MLP, x: jax.Array) -> jax.Array:
        seen.append(type(m.linear1))
        m(x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        program.derive(failing).init(X)
    assert seen and seen[0] is not nnx.Linear and issubclass(seen[0], nnx.Linear)
    _assert_plain_flax(model)
    # Eagerly the model is plain Flax: its own outputs, no managers.
    np.testing.assert_array_equal(model(X), model.linear2(nnx.relu(model.linear1(X))))


class WithFlaxRegularizers(nnx.Module):
    """Flax's own Dropout (with stored Rngs) and BatchNorm inside an unmodified model."""

    def __init__(self, *, rngs: nnx.Rngs, deterministic: bool = False,
                 use_running_average: bool = False) -> None:
        self.linear1 = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, use_running_average=use_running_average, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, deterministic=deterministic, rngs=rngs)
        self.linear2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(self.dropout(nnx.relu(self.norm(self.linear1(x)))))


def test_flax_dropout_draws_from_the_program_key_and_is_the_identity_in_inference() -> None:
    model = WithFlaxRegularizers(rngs=nnx.Rngs(0))
    program = gm.compile(lambda m, x: m(x), model)
    variables = program.init(X)
    out, new = program.train(variables, X, rng=KEY)
    assert rewrites(program) == [("/dropout", "apply", "OUTPUT", "output")]
    assert program.rewrites["train"][0].manager == "nnx.Dropout"
    marked = program.graph(X).rewritten  # the graph marks it too
    assert [(r.tag.path, r.manager) for r in marked] == [("/dropout.apply.output",
                                                          "nnx.Dropout")]
    hidden = nnx.relu(nnx.clone(model).norm(model.linear1(X)))  # batch statistics
    drawn = nnx.clone(model).dropout.rngs()  # its stored stream's draw, as Flax makes it
    key = jax.random.fold_in(step_key("", "/dropout", "apply", "", ""),
                             jax.random.bits(drawn, (), jnp.uint32))
    mask = jax.random.bernoulli(key, 0.5, hidden.shape)
    np.testing.assert_allclose(out, model.linear2(jnp.where(mask, hidden / 0.5, 0.0)), **TOL)
    count = lambda v: int(v["model"]["dropout"]["rngs"]["count"])
    assert count(new) == count(variables) + 1  # the stream advanced, as in Flax
    other, _ = program.train(variables, X, rng=jax.random.key(4))
    assert not np.allclose(out, other)  # a new mask for another step key
    inferred = program.infer(variables, X)  # traced while the model's flags say training
    assert not has_random(jax.make_jaxpr(program.infer)(variables, X))
    model.eval()
    np.testing.assert_allclose(inferred, model(X), **TOL)


def test_flax_batch_norm_follows_the_program_mode() -> None:
    model = WithFlaxRegularizers(rngs=nnx.Rngs(0), deterministic=True)
    program = gm.compile(lambda m, x: m(x), model)
    with pytest.warns(UserWarning, match=r"training: /dropout \(Dropout.deterministic=True\)\."):
        variables = program.init(X)
        out, new = program.train(variables, X, rng=KEY)
    eager = nnx.clone(model)
    np.testing.assert_allclose(out, eager(X), **TOL)  # batch statistics, no dropout
    np.testing.assert_allclose(new["model"]["norm"]["mean"], eager.norm.mean[...], **TOL)
    np.testing.assert_allclose(new["model"]["norm"]["var"], eager.norm.var[...], **TOL)
    assert rewrites(program) == []  # deterministic=True set by the user wins
    inferred = program.infer(variables, X)  # running averages, whatever the model's flag
    model.eval()
    np.testing.assert_allclose(inferred, model(X), **TOL)


@pytest.mark.parametrize("manager", [
    lambda: managers.WeightNoise(1.0, path="/norm*"),  # by path: its statistics too
    lambda: managers.Dropout(0.5, path="/norm*"),
    lambda: managers.Precision("bfloat16"),
])
def test_batch_norm_statistics_are_rewritten_only_where_roles_name_state(manager: Any) -> None:
    model = WithFlaxRegularizers(rngs=nnx.Rngs(0), deterministic=True)
    program = gm.compile(lambda m, x: m(x), model, managers=[manager()])
    with pytest.warns(UserWarning, match=r"Dropout.deterministic=True"):
        variables = program.init(X)
        _, new = program.train(variables, X, rng=KEY)
    assert all(r.role != "STATE" for r in program.rewrites["train"])
    mean, var = new["model"]["norm"]["mean"], new["model"]["norm"]["var"]
    assert mean.dtype == var.dtype == jnp.float32  # kept as Flax keeps them
    # One step of momentum 0.99 from (0, 1): noise or dropout on them moved them far.
    assert np.abs(mean).max() < 0.1 and np.abs(var - 1).max() < 0.1
    assert np.isfinite(program.infer(new, X)).all()
    chosen = gm.compile(lambda m, x: m(x), model,  # named by roles=: rewritten
                        managers=[managers.StopGradient(roles=[roles.STATE])])
    chosen.init(X)
    assert {r.name for r in chosen.rewrites["init"]} == {"mean", "var"}


def test_explicit_use_running_average_wins_in_training() -> None:
    model = WithFlaxRegularizers(rngs=nnx.Rngs(0), deterministic=True, use_running_average=True)
    program = gm.compile(lambda m, x: m(x), model)
    with pytest.warns(UserWarning, match=r"/norm \(BatchNorm.use_running_average=True\)"):
        variables = program.init(X)
        out, new = program.train(variables, X, rng=KEY)
    np.testing.assert_allclose(out, model(X), **TOL)
    np.testing.assert_array_equal(new["model"]["norm"]["mean"], variables["model"]["norm"]["mean"])


class CalledFrozen(WithFlaxRegularizers):
    """Its flags given in the calls: frozen on purpose."""

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = self.norm(self.linear1(x), use_running_average=True)
        return self.linear2(self.dropout(nnx.relu(hidden), deterministic=True))


def test_a_model_left_in_eval_mode_warns_which_layers_stay_off_in_training() -> None:
    model = WithFlaxRegularizers(rngs=nnx.Rngs(0))
    model.eval()  # e.g. after an eager look at the model in a notebook
    program = gm.compile(lambda m, x: m(x), model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        variables = program.init(X)  # init: also for a model meant for inference only
    with pytest.warns(UserWarning, match=r"stay in eval mode in the program's training: "
                      r"/norm \(BatchNorm.use_running_average=True\), /dropout "
                      r"\(Dropout.deterministic=True\).*call model.train\(\)"):
        program.train(variables, X, rng=KEY)
    model.train()
    trained = gm.compile(lambda m, x: m(x), model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trained.train(trained.init(X), X, rng=KEY)  # in training mode: no warning
        program.infer(variables, X)  # inference: layers are meant to be off
        frozen = gm.compile(lambda m, x: m(x), CalledFrozen(rngs=nnx.Rngs(0)))
        frozen.train(frozen.init(X), X, rng=KEY)  # flags in the calls: no warning
    assert rewrites(trained) == [("/dropout", "apply", "OUTPUT", "output")]


class DictHead(nnx.Module):
    """Returns a dict, as Flax's DETR tutorial's model does."""

    def __init__(self) -> None:
        self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> dict[str, Any]:
        logits = self.linear(x)
        return {"pred_logits": logits, "pred_boxes": nnx.sigmoid(logits), "queries": 3}


def test_a_module_returning_a_dict_gives_its_caller_the_dict_its_outputs_tagged() -> None:
    def loss(model: DictHead, x: jax.Array) -> jax.Array:
        out = model(x)
        return (out["pred_logits"].sum() + out["pred_boxes"].sum()) * out["queries"]

    head = DictHead()
    dropout = managers.Dropout(0.5, bricks=[DictHead], roles=[roles.OUTPUT])
    program = gm.compile(loss, head, managers=[dropout])
    variables = program.init(X)
    assert rewrites(program, "init") == [("/", "apply", "OUTPUT", "output.pred_logits"),
                                         ("/", "apply", "OUTPUT", "output.pred_boxes")]
    np.testing.assert_allclose(program.infer(variables, X), loss(head, X), **TOL)
    out, _ = program.train(variables, X, rng=KEY)
    assert not np.allclose(out, loss(head, X))  # dropped, and still read by key


HEAD = nnx.Linear(2, 1, rngs=nnx.Rngs(1))  # a module the loss reads by its global name


def test_a_module_read_from_outside_the_model_warns_that_it_stays_constant() -> None:
    body = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    teacher = MLP(rngs=nnx.Rngs(2))
    with pytest.warns(UserWarning, match=r"fn reads modules from outside the model, "
                      r"'teacher' \(MLP\), 'HEAD' \(Linear\): a program holds their variables "
                      r"as constants .*nnx\.Dict\(model=model, head=head\)"):
        program = gm.compile(lambda m, x: (HEAD(m(x)) + teacher(x).sum()).mean(), body)
    _, trained = program.train(program.init(X[:, :4]), X[:, :4], rng=KEY)
    assert set(trained["model"]) == {"kernel", "bias"}  # HEAD's variables are not the model's
    both = nnx.Dict(body=body, head=HEAD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read from the model argument: no warning
        gm.compile(lambda m, x: HEAD(m.body(x)).mean(), both)  # HEAD is in the model
        gm.compile(lambda m, x: m.head(m.body(x)).mean(), both)


def test_many_layers_held_in_eval_mode_are_named_in_a_readable_warning() -> None:
    frozen = nnx.Sequential(*[nnx.Dropout(0.5, deterministic=True) for _ in range(9)])
    program = gm.compile(lambda m, x: m(x).sum(), frozen)
    with pytest.warns(UserWarning, match=r"/layers/0 \(Dropout.deterministic=True\), .*"
                      r"/layers/5 \(Dropout.deterministic=True\) and 3 more\. A flag"):
        program.train(program.init(X), X, rng=KEY)


def test_overlapping_traces_in_two_threads_share_the_switch_and_restore_it() -> None:
    model = MLP(rngs=nnx.Rngs(0))
    barrier = threading.Barrier(2, timeout=60)
    seen: list[type] = []

    def fn(m: MLP, x: jax.Array) -> jax.Array:
        barrier.wait()  # both traces are in progress here
        seen.append(type(m.linear1))
        out = m(x)
        barrier.wait()  # neither has ended: the first to end must not restore the class
        seen.append(type(m.linear1))
        return out

    programs = [gm.compile(fn, model, managers=[managers.WeightNoise(0.0, roles=[roles.WEIGHT])])
                for _ in range(2)]
    results: list[Any] = [None, None]

    def run(index: int) -> None:
        results[index] = programs[index].init(X)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is not None for r in results)
    assert len(seen) == 4 and all(c is not nnx.Linear and issubclass(c, nnx.Linear) for c in seen)
    assert rewrites(programs[0], "init") == []  # std 0, but both traces saw applications
    _assert_plain_flax(model)


def test_a_trace_inside_a_trace_keeps_the_outer_switch() -> None:
    model = MLP(rngs=nnx.Rngs(0))
    inner = gm.compile(lambda m, x: m(x), model)
    inner_variables = inner.init(X)
    seen: list[type] = []

    def outer_fn(m: MLP, x: jax.Array) -> jax.Array:
        y = inner.infer(inner_variables, x)
        seen.append(type(m.linear1))
        return m(x) + y

    outer = gm.compile(outer_fn, model)
    variables = outer.init(X)
    np.testing.assert_allclose(outer.infer(variables, X), 2 * model(X), **TOL)
    assert seen and all(c is not nnx.Linear for c in seen)
    _assert_plain_flax(model)


def test_embed_attend_is_an_application_of_its_own() -> None:
    class TiedLM(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(10, 4, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            return self.embed.attend(self.embed(tokens))

    model = TiedLM(rngs=nnx.Rngs(0))
    tokens = jnp.array([[1, 2, 3]])
    program = gm.compile(lambda m, t: m(t), model,
                         managers=[managers.WeightNoise(0.1, roles=[roles.WEIGHT])])
    variables = program.init(tokens)
    assert rewrites(program, "init") == [("/embed", "apply", "WEIGHT", "embedding"),
                                         ("/embed", "attend", "WEIGHT", "embedding")]
    np.testing.assert_allclose(program.infer(variables, tokens), model(tokens), **TOL)


def test_attention_dropout_draws_from_the_program_key_and_is_off_in_inference() -> None:
    model = SelfAttention(rngs=nnx.Rngs(0))  # keeps its Rngs: folded into the step key
    program = gm.compile(lambda m, x: m(x), model)
    variables = program.init(SEQUENCE)
    out, _ = program.train(variables, SEQUENCE, rng=KEY)
    assert ("/attention", "apply", "AUXILIARY", "attention_weights") in rewrites(program)
    key = jax.random.fold_in(step_key("", "/attention", "apply", "", ""), jax.random.bits(
        nnx.clone(model).attention.rngs(), (), jnp.uint32))
    eager = nnx.clone(model).attention(SEQUENCE, deterministic=False, rngs=lambda: key)
    np.testing.assert_allclose(out, eager, **TOL)
    other, _ = program.train(variables, SEQUENCE, rng=jax.random.key(4))
    assert not np.allclose(out, other)
    inferred = program.infer(variables, SEQUENCE)
    assert not has_random(jax.make_jaxpr(program.infer)(variables, SEQUENCE))
    np.testing.assert_allclose(inferred, model.attention(SEQUENCE, deterministic=True), **TOL)
    frozen = SelfAttention(rngs=nnx.Rngs(0), deterministic=True)  # the user's flag wins
    program = gm.compile(lambda m, x: m(x), frozen)
    with pytest.warns(UserWarning, match=r"/attention \(MultiHeadAttention.deterministic"):
        out, _ = program.train(program.init(SEQUENCE), SEQUENCE, rng=KEY)
    np.testing.assert_allclose(out, frozen(SEQUENCE), **TOL)
    assert rewrites(program) == []


class SelfAttention(nnx.Module):
    """``nnx.MultiHeadAttention`` with attention-weight dropout and its stored Rngs."""

    def __init__(self, *, rngs: nnx.Rngs, deterministic: bool | None = None) -> None:
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=4, qkv_features=4, dropout_rate=0.5, decode=False,
            deterministic=deterministic, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.attention(x)


SEQUENCE = np.random.default_rng(2).normal(size=(2, 5, 4)).astype(np.float32)


class WithCell(nnx.Module):
    """An LSTM cell called with its carry tuple."""

    def __init__(self) -> None:
        self.cell = nnx.LSTMCell(4, 3, rngs=nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        carry = (jnp.ones((x.shape[0], 3)), jnp.zeros((x.shape[0], 3)))
        _, y = self.cell(carry, x)
        return y


def test_arrays_nested_in_arguments_are_inputs_named_by_their_keys() -> None:
    model = WithCell()
    noise = managers.GaussianNoise(0.5, bricks=[nnx.LSTMCell], roles=[roles.INPUT],
                                   variable_name="carry.0")
    program = gm.compile(lambda m, x: m(x), model, managers=[noise],
                         monitor=gm.VariableFilter(bricks=[nnx.LSTMCell], roles=[roles.INPUT]))
    variables = program.init(X)
    out, _, monitored = program.train(variables, X, rng=KEY)
    assert sorted(monitored) == ["/cell.apply.carry.0", "/cell.apply.carry.1",
                                 "/cell.apply.inputs"]
    assert rewrites(program) == [("/cell", "apply", "INPUT", "carry.0")]
    # the cell saw the noisy first carry and the untouched second one
    c0 = monitored["/cell.apply.carry.0"]
    assert not np.allclose(c0, 1.0)
    np.testing.assert_array_equal(monitored["/cell.apply.carry.1"], 0.0)
    _, expected = nnx.clone(model).cell((c0, jnp.zeros((X.shape[0], 3))), X)
    np.testing.assert_allclose(out, expected, **TOL)
    np.testing.assert_allclose(program.infer(variables, X)[0], model(X), **TOL)


class Scaled(nnx.Module):
    def __call__(self, *xs: jax.Array, **extra: jax.Array) -> jax.Array:
        return sum(xs) * extra["scale"]


def test_var_positional_and_var_keyword_arrays_are_inputs() -> None:
    program = gm.compile(lambda m, x: m(x, 2 * x, scale=jnp.float32(3.0)), Scaled(),
                         monitor=gm.VariableFilter(roles=[roles.INPUT]))
    variables = program.init(X)
    out, _, monitored = program.train(variables, X, rng=KEY)
    assert sorted(monitored) == ["/.apply.scale", "/.apply.xs.0", "/.apply.xs.1"]
    np.testing.assert_allclose(out, 9 * X, **TOL)
