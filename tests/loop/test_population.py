"""Populations (one vmapped step over N members) and population-based training (PBT)."""

from __future__ import annotations

import csv
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
import managers
from graphmod import roles
from graphmod.data import ArraySource
from graphmod.plugins import PBT, Checkpoint, Logger, ProgressBar

MEMBERS = 4
LRS = [3e-3, 1e-2, 3e-2, 1e-1]
RATES = [0.0, 0.1, 0.3, 0.5]


class Population:
    """A small regression MLP with a dynamic dropout rate and an injected learning rate."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(96, 4)).astype(np.float32)
        self.y = (self.x @ rng.normal(size=(4, 2))).astype(np.float32)
        mlp = gm.bricks.MLP([4, 16, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        self.traces = 0

        def cost(model: gm.Brick, x: jax.Array, y: jax.Array) -> jax.Array:
            self.traces += 1  # a trace, not a call: counts compilations
            return ((model(x) - y) ** 2).mean()

        self.dropout = managers.Dropout(gm.dynamic(0.1), bricks=mlp.linear_layers,
                                        roles=[roles.INPUT])
        self.rate = self.dropout.hparam("rate")
        self.program = gm.compile(cost, mlp, managers=[self.dropout])
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
        self.step = gm.optimize(self.program, tx)
        self.pop = gm.population(self.step, members=MEMBERS)
        self.keys = jax.random.split(jax.random.key(0), MEMBERS)
        shared = self.program.init(self.x[:2], self.y[:2])
        # Members start from different weights (an MLP of another seed each).
        self.variables = [{**shared, "model": nnx.to_pure_dict(nnx.state(gm.bricks.MLP(
            [4, 16, 2], activation=jax.nn.relu, rngs=nnx.Rngs(i))))} for i in range(MEMBERS)]

    def state(self, lrs: list[float] = LRS, rates: list[float] = RATES) -> gm.TrainState:
        return self.pop.init(self.variables, self.keys,
                             hparams={"learning_rate": lrs, self.rate: rates})

    def source(self) -> ArraySource:
        return ArraySource({"x": self.x, "y": self.y}, 16, shuffle=True, seed=1)


@pytest.fixture(scope="module")
def population() -> Population:
    return Population()


def leaves(tree: object) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def test_a_population_equals_separate_runs_with_the_same_seeds_and_hyperparameters(population):
    p = population
    state = p.state()
    batches = list(p.source().iter_epoch(0))[:4]
    for batch in batches:
        state, metrics = p.pop(state, **batch)
    assert metrics["loss"].shape == (MEMBERS,)
    for i in range(MEMBERS):
        alone = p.step.init(p.variables[i], p.keys[i])
        alone = alone._replace(variables=p.rate.set(alone.variables, RATES[i]))
        alone = alone._replace(opt_state=alone.opt_state._replace(hyperparams={
            **alone.opt_state.hyperparams, "learning_rate": jnp.float32(LRS[i])}))
        for batch in batches:
            alone, own = p.step(alone, **batch)
        member = p.pop.member(state, i)
        assert jax.tree.structure(member) == jax.tree.structure(alone)
        for got, want in zip(leaves(member), leaves(alone), strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(metrics["loss"][i], own["loss"], rtol=2e-5)
    # Dropout is on, and members draw their own masks: with one rate and one start, two
    # members with different keys still end apart.
    twins = p.pop.init(p.variables[0], p.keys, hparams={p.rate: 0.5})
    twins, _ = p.pop(twins, **batches[0])
    weights = np.asarray(twins.variables["model"]["linear_layers"][0]["W"])
    assert not np.array_equal(weights[0], weights[1])


def test_changing_a_members_hyperparameter_retraces_nothing(population):
    p = population
    state = p.state()
    batch = next(iter(p.source().iter_epoch(0)))
    state, _ = p.pop(state, **batch)
    traces = p.traces
    for lrs, rates in (([1e-3, 2e-3, 3e-3, 4e-3], [0.5, 0.4, 0.3, 0.2]),
                       (jnp.full(MEMBERS, 0.05), jnp.zeros(MEMBERS))):
        state = p.pop.set(state, "learning_rate", lrs)
        state = p.pop.set(state, p.rate, rates)
        state, _ = p.pop(state, **batch)
    np.testing.assert_array_equal(p.pop.get(state, p.rate), np.zeros(MEMBERS, np.float32))
    assert p.traces == traces
    assert p.pop._step._cache_size() == 1


def _run_to_step_3(p: Population, **pbt_options: object) -> tuple[gm.TrainState, PBT, list]:
    """A loop of 3 steps, PBT ranking by loss at step 3; also the state just before it."""
    before: list = []
    pbt = PBT("loss", ["learning_rate", p.rate], mode="min", seed=3,
              every=gm.On("step", step=gm.at(3)), **pbt_options)
    keep = lambda event: before.append(jax.tree.map(jnp.copy, event.state))
    loop = gm.Loop(p.pop, p.source(), steps=3)
    loop.on(gm.On("step", step=gm.at(3)), keep)  # registered first: sees the state before
    loop.on(None, pbt)
    state = loop.run(p.state(rates=[0.9] * MEMBERS))
    return state, pbt, [before[0], loop]


def test_an_exploit_copies_the_source_exactly_and_perturbs_its_hyperparameters(population):
    p = population
    state, pbt, (before, loop) = _run_to_step_3(p, fraction=0.5)
    assert len(pbt.decisions) == 2  # half of 4 members
    assert [(d.event, d.plugin) for d in loop.trace if d.event == "exploit"] == [
        ("exploit", "pbt.exploit")] * 2
    replaced = {d["member"]: d for d in pbt.decisions}
    for d in pbt.decisions:
        assert d["source"] not in replaced and d["step"] == 3
    rate_path = ("managers", "dropout", "hparams", "rate")
    for i in range(MEMBERS):
        got, old = p.pop.member(state, i), p.pop.member(before, i)
        if i not in replaced:  # untouched, bitwise
            for a, b in zip(leaves(got), leaves(old), strict=True):
                np.testing.assert_array_equal(a, b)
            continue
        d, source = replaced[i], p.pop.member(before, replaced[i]["source"])
        # Every array of the source's variables and optimizer state, bitwise, except the
        # perturbed hyperparameters; the member keeps its own key.
        flat = jax.tree_util.tree_flatten_with_path((got.variables, got.opt_state))[0]
        want = jax.tree.leaves((source.variables, source.opt_state))
        for (path, a), b in zip(flat, want, strict=True):
            keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
            if keys[1:] == rate_path or keys[-2:] == ("hyperparams", "learning_rate"):
                continue
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(keys))
        np.testing.assert_array_equal(got.rng, old.rng)
        for name, value, low, high in (("learning_rate", got.opt_state.hyperparams[
                "learning_rate"], 0.0, np.inf), ("dropout.rate", p.rate.get(got.variables),
                                                 0.0, 1.0)):
            change = d["hparams"][name]
            assert change["factor"] in (0.8, 1.2)
            src = float(p.pop.get(before, name if name == "learning_rate" else p.rate)[
                d["source"]])
            assert change["source"] == src
            expected = np.float32(min(max(src * change["factor"], low), high))
            assert change["new"] == float(expected) == float(value)
            assert change["old"] == float(p.pop.get(before, name if name == "learning_rate"
                                                    else p.rate)[i])
    # At 0.9, a rate drawn 1.2 is clipped to the top of Dropout's range.
    assert any(d["hparams"]["dropout.rate"]["new"] == 1.0 for d in pbt.decisions)
    assert all(d["hparams"]["learning_rate"]["new"] > 0 for d in pbt.decisions)


def test_a_resumed_pbt_run_makes_the_same_decisions_and_ends_bitwise_equal(population,
                                                                           tmp_path):
    p = population

    def plugins(directory: object, **options: object) -> list:
        return [PBT("loss", ["learning_rate", p.rate], mode="min", seed=7,
                    every=gm.On("step", step=gm.each(4))),
                Checkpoint(directory, every=gm.On("epoch_end"), **options)]

    bar = ProgressBar(file=io.StringIO(), every=gm.On("step"))
    whole = gm.Loop(p.pop, p.source(), epochs=3,
                    plugins=[*plugins(tmp_path / "whole"), bar,
                             Logger(tmp_path / "log.csv", every=gm.On("step", step=gm.each(6)))])
    want = whole.run(p.state())
    decisions = whole.plugins[0].decisions
    assert len(decisions) == 4 and {d["step"] for d in decisions} == {4, 8, 12, 16}

    first = gm.Loop(p.pop, p.source(), epochs=1, plugins=plugins(tmp_path / "cut"))
    first.run(p.state())
    resumed_plugins = plugins(tmp_path / "cut")
    got = gm.Loop.resume(tmp_path / "cut", p.pop, p.source(), plugins=resumed_plugins,
                         epochs=3)
    assert resumed_plugins[0].decisions == decisions
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(leaves(got), leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    # Per-member metrics: a column per member in the log, mean/min/max beside the bar.
    with open(tmp_path / "log.csv") as f:
        header = next(csv.reader(f))
    assert [c for c in header if c.startswith("loss")] == [f"loss[{i}]" for i in
                                                          range(MEMBERS)]
    assert sorted(bar.postfix) == ["loss max", "loss mean", "loss min"]
    # The checkpoint's record: the members' keys as the train seed, PBT among the plugins.
    record = gm.provenance.read(str(tmp_path / "cut"))
    assert np.shape(record["seeds"]["train"]["data"]) == (MEMBERS, 2)
    assert "graphmod.plugins.PBT" in [q["class"] for q in record["loop"]["plugins"]]
    # ... and every decision of the run, as the run's provenance lists them.
    assert [dict(d) for d in record.derived["decisions"]["pbt"]] == decisions
    assert [dict(d) for d in whole.provenance.derived["decisions"]["pbt"]] == decisions


def test_members_of_different_shapes_are_refused_naming_the_path(population):
    p = population
    wide = gm.bricks.MLP([4, 32, 2], activation=jax.nn.relu, rngs=nnx.Rngs(0))
    other = {**p.variables[0], "model": nnx.to_pure_dict(nnx.state(wide))}
    with pytest.raises(ValueError, match=r"members differ at variables\['model'\]"
                       r"\['linear_layers'\]\[0\]\['W'\]: member 0 has shape \(4, 16\) "
                       r"\(float32\), member 1 has shape \(4, 32\)"):
        gm.population(p.step, 2).init([p.variables[0], other], p.keys[:2])
    states = [p.step.init(p.variables[0], p.keys[0]), p.step.init(p.variables[1], p.keys[1])]
    states[1] = states[1]._replace(variables={**states[1].variables, "model": other["model"]})
    with pytest.raises(ValueError, match=r"members differ at state.*\['W'\]"):
        gm.population(p.step, 2).stack(states)
    with pytest.raises(ValueError, match="one key per member"):
        p.pop.init(p.variables, jax.random.key(0))


def test_pbt_refuses_a_missing_score_metric_and_a_fraction_outside_its_range(population):
    p = population
    for fraction in (0, 0.6, -0.1):
        with pytest.raises(ValueError, match=r"fraction=.*must be in \(0, 0.5\]"):
            PBT("loss", ["learning_rate"], fraction=fraction)
    pbt = PBT("valid/accuracy", ["learning_rate"], every=gm.On("step", step=gm.at(1)))
    loop = gm.Loop(p.pop, p.source(), steps=2, plugins=[pbt])
    with pytest.raises(gm.PluginError, match=r"no metric 'valid/accuracy'.*its metrics are "
                       r"\['loss'\]"):
        loop.run(p.state())
    assert pbt.decisions == []
    with pytest.raises(ValueError, match="no optimizer hyperparameter 'momentum' is dynamic"):
        p.pop.set(p.state(), "momentum", 0.9)
