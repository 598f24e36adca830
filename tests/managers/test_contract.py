"""One contract suite over every built-in manager (optax's ``_common_test`` pattern).

Each manager, on a small Linear brick: eager vs jit vs vmap vs grad agree; one trace per input
signature; hashable, picklable, deep-copyable; unique names; strictness; frozen after compile.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from tests.managers.helpers import Counted, apply_model, array, key, linear, normal

MAKERS: dict[str, Callable[..., gm.Manager]] = {
    "dropout": lambda **kw: managers.Dropout(0.5, roles=[roles.INPUT], **kw),
    "weight_noise": lambda **kw: managers.WeightNoise(0.1, roles=[roles.WEIGHT], **kw),
    "gaussian_noise": lambda **kw: managers.GaussianNoise(0.1, roles=[roles.OUTPUT], **kw),
    "batch_norm": lambda **kw: managers.BatchNorm(roles=[roles.OUTPUT], **kw),
    "weight_norm": lambda **kw: managers.WeightNorm(roles=[roles.WEIGHT], **kw),
    "weight_standardization": lambda **kw: managers.WeightStandardization(
        roles=[roles.WEIGHT], **kw),
    "spectral_norm": lambda **kw: managers.SpectralNorm(roles=[roles.WEIGHT], **kw),
    "max_norm": lambda **kw: managers.MaxNorm(0.2, roles=[roles.WEIGHT], **kw),
    "lora": lambda **kw: managers.LoRA(2, roles=[roles.WEIGHT], **kw),
    "l2": lambda **kw: managers.L2(0.1, roles=[roles.WEIGHT], **kw),
    "weight_decay": lambda **kw: managers.WeightDecay(0.1, roles=[roles.WEIGHT], **kw),
    "stop_gradient": lambda **kw: managers.StopGradient(roles=[roles.INPUT], **kw),
    "remat": lambda **kw: managers.Remat(policy="dots_saveable", **kw),
    "precision": lambda **kw: managers.Precision("bfloat16", **kw),
    "mixed_precision": lambda **kw: managers.MixedPrecision(output=None, **kw),
    "activation_stats": lambda **kw: managers.ActivationStats(roles=[roles.OUTPUT], **kw),
    "stochastic_depth": lambda **kw: managers.StochasticDepth(
        0.5, **({"roles": [roles.OUTPUT]} | kw)),  # any output: whole examples dropped
    "label_smoothing": lambda **kw: managers.LabelSmoothing(
        0.1, **({"roles": [roles.INPUT]} | kw)),  # the rows of x as probabilities
    "mixup": lambda **kw: managers.Mixup(0.4, **({"bricks": [gm.Brick]} | kw)),
    "fake_quant": lambda **kw: managers.FakeQuant(4, roles=[roles.WEIGHT, roles.OUTPUT], **kw),
    "ema": lambda **kw: managers.EMA(0.9, **kw),
}
# Managers whose forward pass at init is the plain model's (B = 0, g = ||W||, a cost
# only optimize adds, a gradient-only or memory-only change, an average only inference
# reads).
IDENTITY_AT_INIT = {"weight_norm", "lora", "l2", "weight_decay", "stop_gradient", "remat",
                    "activation_stats", "ema"}
# Costs, measurements and averages leave the values of training as they are: nothing in
# its rewrite trace (a middleware's wrap, Remat's, is a CALL row).
UNTRACED = {"l2", "weight_decay", "activation_stats", "ema"}
# Gradients that are not the forward pass's derivative, by design: the straight-through
# estimator, and power-iteration vectors held constant (as flax.nnx.SpectralNorm does).
NOT_DERIVATIVES = {"fake_quant", "spectral_norm"}
TOLERANCE = {"precision": {"rtol": 2e-2, "atol": 2e-3}}  # bf16 rounds eager and jit apart
# Integer variables pass unchanged.
ANY_DTYPE = {"remat", "precision", "mixed_precision", "stop_gradient"}
LABELS = {"label_smoothing"}  # integers are labels: one-hot rows, given num_classes



def cost(model: gm.bricks.Linear, x: jax.Array) -> tuple[jax.Array, dict]:
    y = model(x)
    return jnp.mean(jnp.sin(y) + y ** 2), {"y": y}


@dataclasses.dataclass
class Case:
    name: str
    manager: gm.Manager
    model: gm.bricks.Linear
    program: gm.Program
    fn: Counted
    variables: dict
    x: jax.Array
    out: Any
    new: dict


@pytest.fixture(scope="module", params=sorted(MAKERS))
def case(request: pytest.FixtureRequest) -> Case:
    manager = MAKERS[request.param]()
    model = linear()
    fn = Counted(cost)
    program = gm.compile(fn, model, managers=[manager])
    x = normal(1, 5, 3)
    variables = program.init(x)
    out, new = program.train(variables, x, rng=key(0))
    return Case(request.param, manager, model, program, fn, variables, x, out, new)


def assert_trees_close(a: Any, b: Any, **tolerance: float) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for left, right in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(array(left), array(right),
                                   **(tolerance or {"rtol": 1e-5, "atol": 1e-6}))


# -- transformations agree ------------------------------------------------------------------------

def plain_cost(model: gm.bricks.Linear, x: jax.Array) -> float:
    """``cost`` without managers, in NumPy."""
    y = array(x).astype(np.float64) @ array(model.W[...]) + array(model.b[...])
    return float(np.mean(np.sin(y) + y ** 2))


def test_the_manager_rewrites_in_training(case: Case) -> None:
    unchanged = np.isclose(float(case.out[0]), plain_cost(case.model, case.x), rtol=1e-5)
    assert unchanged == (case.name in IDENTITY_AT_INIT)
    names = {r.manager for r in case.program.rewrites.train}
    assert names == (set() if case.name in UNTRACED else {case.name})


def test_eager_and_jit_agree(case: Case) -> None:
    with jax.disable_jit():
        eager = case.program.train(case.variables, case.x, rng=key(0))
    assert_trees_close(eager, (case.out, case.new), **TOLERANCE.get(case.name, {}))


def test_grad_agrees_with_the_forward_pass_and_finite_differences(case: Case) -> None:
    def loss(variables: dict) -> tuple[jax.Array, Any]:
        (value, metrics), new = case.program.train(variables, case.x, rng=key(0))
        return value, (metrics, new)

    (value, (metrics, new)), grads = jax.value_and_grad(loss, has_aux=True)(case.variables)
    # the forward pass inside grad is the one of train (same rewrites, masks, statistics)
    assert_trees_close(((value, metrics), new), (case.out, case.new))
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.isfinite(array(leaf)))
    assert np.abs(array(grads["model"]["W"])).sum() > 0
    if case.name in NOT_DERIVATIVES:
        return
    # a central difference along a random direction of the parameters, same key
    rng = np.random.default_rng(0)
    direction = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32),
                             case.variables["model"])
    eps = 1e-2

    def moved(sign: float) -> float:
        model = jax.tree.map(lambda p, d: p + sign * eps * d, case.variables["model"], direction)
        return float(loss({**case.variables, "model": model})[0])

    numeric = (moved(1.0) - moved(-1.0)) / (2 * eps)
    analytic = sum(float(np.vdot(array(g), d)) for g, d in zip(
        jax.tree.leaves(grads["model"]), jax.tree.leaves(direction), strict=True))
    np.testing.assert_allclose(numeric, analytic, rtol=2e-2, atol=1e-3)


def test_vmap_agrees_with_single_calls(case: Case) -> None:
    xs = jnp.stack([case.x, normal(2, 5, 3), normal(3, 5, 3)])
    outs, news = jax.vmap(lambda x: case.program.train(case.variables, x, rng=key(0)))(xs)
    for i in range(3):
        single = case.program.train(case.variables, xs[i], rng=key(0))
        assert_trees_close(jax.tree.map(lambda leaf, i=i: leaf[i], (outs, news)), single)


# -- tracing --------------------------------------------------------------------------------------

def test_traces_once_per_input_signature(case: Case) -> None:
    program, fn = case.program, case.fn
    traces, cached = fn.count, program._train._cache_size()
    program.train(case.new, normal(4, 5, 3), rng=key(7))  # the fixture traced this signature
    assert (fn.count, program._train._cache_size()) == (traces, cached)
    program.infer(case.variables, case.x)
    traces = fn.count
    program.infer(case.new, normal(5, 5, 3))
    assert fn.count == traces
    # another batch size: one new trace, then none
    program.infer(case.variables, normal(2, 9, 3))
    program.infer(case.new, normal(3, 9, 3))
    assert fn.count == traces + 1
    assert program._train._cache_size() == cached


# -- the manager as an object ---------------------------------------------------------------------

def _config(manager: gm.Manager) -> dict:
    return {k: repr(v) for k, v in vars(manager).items()}


def test_manager_is_hashable_picklable_and_deep_copyable(case: Case) -> None:
    assert hash(case.manager) == hash(case.manager)
    assert case.manager in {case.manager}
    for original in (case.manager, MAKERS[case.name]()):  # compiled (frozen) and fresh
        for clone in (pickle.loads(pickle.dumps(original)), copy.deepcopy(original)):
            assert clone is not original
            assert type(clone) is type(original)
            assert _config(clone) == _config(original)
            assert clone in {clone}
    # an unpickled copy compiled over the same model rewrites what the original rewrites,
    # and owns variables of the same layout
    clone = pickle.loads(pickle.dumps(case.manager))
    program = gm.compile(cost, case.model, managers=[clone])
    variables = program.init(case.x)
    assert list(program.rewrites["init"]) == list(case.program.rewrites["init"])
    assert jax.tree.structure(variables) == jax.tree.structure(case.variables)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_an_active_manager_is_picklable_and_deep_copyable(name: str) -> None:
    manager = MAKERS[name]()
    with manager:
        clones = [pickle.loads(pickle.dumps(manager)), copy.deepcopy(manager)]
    assert [_config(c)["name"] for c in clones] == [repr(name)] * 2
    for clone in clones:  # a copy is in no with block: it can enter and leave its own
        with clone:
            pass


def test_a_duplicate_name_raises_at_compile_unless_renamed(case: Case) -> None:
    model = case.model
    with pytest.raises(ValueError, match=repr(case.name)):
        gm.compile(cost, model, managers=[MAKERS[case.name](), MAKERS[case.name]()])
    with pytest.raises(ValueError, match=repr(case.name)), MAKERS[case.name](), \
            MAKERS[case.name]():
        gm.compile(cost, model)
    program = gm.compile(cost, model, managers=[MAKERS[case.name](),
                                                MAKERS[case.name](manager_name="another")])
    assert [m.name for m in program.managers] == [case.name, "another"]


def test_a_filter_matching_nothing_raises_naming_the_manager(case: Case) -> None:
    strict = MAKERS[case.name](path="/nowhere*")
    program = gm.compile(cost, case.model, managers=[strict])
    with pytest.raises(ValueError, match=rf"{case.name!r}.*matched nothing"):
        program.init(case.x)
    lenient = MAKERS[case.name](path="/nowhere*", strict=False)
    program = gm.compile(cost, case.model, managers=[lenient])
    variables = program.init(case.x)
    (value, _), _ = program.train(variables, case.x, rng=key(0))
    np.testing.assert_allclose(float(value), plain_cost(case.model, case.x), rtol=1e-5)
    assert list(program.rewrites.train) == []


def test_the_manager_is_frozen_after_compile(case: Case) -> None:
    fresh = MAKERS[case.name]()
    fresh.priority = 1  # allowed before compile
    gm.compile(cost, case.model, managers=[fresh])
    with pytest.raises(AttributeError, match=repr(case.name)):
        fresh.priority = 2
    with pytest.raises(AttributeError, match="frozen"):
        case.manager.strict = False
    assert fresh.priority == 1 and case.manager.strict


class Ints(gm.Brick):
    """Integer input, weight and output (token ids, counters)."""

    def __init__(self) -> None:
        self.W = gm.Weight(jnp.asarray(np.arange(3), jnp.int32))

    @gm.application(inputs=["input_"], outputs=["output"])
    def apply(self, input_: jax.Array) -> jax.Array:
        return input_ + self.W


def test_an_integer_variable_selected_raises_naming_manager_variable_and_path(
        case: Case) -> None:
    program = gm.compile(apply_model, Ints(), managers=[MAKERS[case.name]()])
    x = jnp.asarray(np.arange(15).reshape(5, 3), jnp.int32)
    if case.name in ANY_DTYPE:  # casts and gradients leave integers alone
        variables = program.init(x)
        np.testing.assert_array_equal(program.train(variables, x, rng=key(0))[0], x + Ints().W)
        return
    if case.name in LABELS:
        with pytest.raises(ValueError, match=r"'input_' of / holds integer labels; pass "
                                             "num_classes="):
            program.init(x)
        return
    with pytest.raises(TypeError, match=rf"{case.name!r} selected .* at /, of dtype int32"):
        program.init(x)


# -- inside graphmod.scan, through provenance, in low precision ----------------------------------

class Unrolled(gm.Brick):
    """The Linear applied at every step of a ``graphmod.scan`` over the leading axis."""

    def __init__(self, model: gm.bricks.Linear) -> None:
        self.lin = model

    @gm.application(inputs=["xs"], outputs=["ys"])
    def apply(self, xs: jax.Array) -> jax.Array:
        return gm.scan(lambda carry, x: (carry, self.lin(x)), jnp.float32(0), xs)[1]


def test_inside_graphmod_scan_eager_and_jit_agree_and_rewrite_once(case: Case) -> None:
    model = Unrolled(case.model)
    program = gm.compile(lambda m, xs: jnp.mean(m(xs) ** 2), model,
                         managers=[MAKERS[case.name](bricks=[case.model])])
    xs = jnp.stack([case.x, normal(6, 5, 3), normal(7, 5, 3)])
    variables = program.init(xs)
    out, new = program.train(variables, xs, rng=key(0))
    # the body's calls are recorded once, as call 0 of the Linear
    assert {(r.manager, r.path, r.call_id) for r in program.rewrites.train} == (
        set() if case.name in UNTRACED else {(case.name, "/lin", 0)})
    with jax.disable_jit():
        eager = program.train(variables, xs, rng=key(0))
    assert_trees_close(eager, (out, new), **TOLERANCE.get(case.name, {}))
    assert np.isfinite(float(out))
    assert jax.tree.map(jnp.shape, new) == jax.tree.map(jnp.shape, variables)


def test_provenance_round_trips_and_rebuilds_the_same_program(case: Case) -> None:
    model = gm.bricks.Linear(3, 4, rngs=nnx.Rngs(3))
    program = gm.compile(cost, model, managers=[MAKERS[case.name]()])
    variables = program.init(case.x)
    record = program.provenance
    assert gm.Provenance.from_json(record.to_json()) == record
    again = gm.rebuild(record)
    assert [type(m) for m in again.managers] == [type(case.manager)]
    recorded = {k: v for k, v in _config(program.managers[0]).items() if k != "_frozen"}
    assert {k: v for k, v in _config(again.managers[0]).items() if k != "_frozen"} == recorded
    rebuilt = gm.compile(cost, again.model, managers=list(again.managers))
    assert_trees_close(rebuilt.train(rebuilt.init(case.x), case.x, rng=key(0)),
                       program.train(variables, case.x, rng=key(0)))
    assert rebuilt.provenance.fingerprint == record.fingerprint


def test_low_precision_dtypes_are_kept(case: Case) -> None:
    low = jnp.bfloat16
    model = gm.bricks.Linear(
        3, 4, rngs=nnx.Rngs(0),
        kernel_init=lambda _, shape: normal(10, *shape, dtype=low),
        bias_init=lambda _, shape: normal(11, *shape, dtype=low) / 10)
    program = gm.compile(apply_model, model, managers=[MAKERS[case.name]()])
    x = normal(1, 5, 3, dtype=low)
    variables = program.init(x)
    out, new = program.train(variables, x, rng=key(0))
    assert out.dtype == low and program.infer(variables, x).dtype == low
    assert jax.tree.map(jnp.result_type, new) == jax.tree.map(jnp.result_type, variables)
