"""A loop over several named models: schedules, order, reads, metrics, checkpoints, misuse."""

from __future__ import annotations

import csv
import json
import pathlib
import re
import shutil
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import graphmod as gm
from graphmod._train._checkpoint import CheckpointError, CheckpointReader
from graphmod.data import ArraySource
from graphmod.plugins import Anneal, Checkpoint, EarlyStopping, Logger, NaNGuard, Validation
from graphmod.provenance import RebuildError
from tests.loop.conftest import Problem

# -- plain steps that say when they ran --------------------------------------------------------


def numbered(count: int) -> list[np.ndarray]:
    """Batches holding their iteration number (counted from 1, as the step timeline)."""
    return [np.full((1,), t, np.int32) for t in range(1, count + 1)]


def recorder(name: str, log: list) -> Callable[..., tuple[int, dict]]:
    def step(state: int, batch: np.ndarray, **reads: int) -> tuple[int, dict]:
        log.append((name, int(batch[0]), dict(reads)))
        return state + 1, {"t": batch[0]}
    return step


schedules = st.recursive(
    st.builds(gm.each, st.integers(1, 4), st.integers(0, 3))
    | st.builds(lambda ts: gm.at(*ts), st.lists(st.integers(1, 12), min_size=1, max_size=3))
    | st.builds(gm.after, st.integers(0, 8)) | st.just(gm.always),
    lambda inner: st.builds(lambda a, b: a & b, inner, inner)
    | st.builds(lambda a, b: a | b, inner, inner) | st.builds(lambda a: ~a, inner),
    max_leaves=3)


@settings(max_examples=40, deadline=None)
@given(order=st.permutations(["a", "b", "c"]),
       chosen=st.dictionaries(st.sampled_from(["a", "b", "c"]), schedules))
def test_models_step_at_the_iterations_their_schedules_say_in_declared_order(order, chosen):
    log: list = []
    loop = gm.Loop({name: recorder(name, log) for name in order}, numbered(12),
                   schedules=chosen)
    loop.on("step", lambda event: None)  # plugin calls among the model steps
    states = loop.run(dict.fromkeys(order, 0))
    expected = [(name, t) for t in range(1, 13) for name in order
                if chosen.get(name, gm.always).holds_at(t)]
    steps = [d for d in loop.trace if d.kind == "model"]  # which model stepped when
    assert [(d.plugin, d.step) for d in steps] == expected
    assert [d.order for d in steps] == [order.index(name) for name, _ in expected]
    assert {d.event for d in steps} <= {"train"} and all(d.seconds >= 0 for d in steps)
    assert [(d.event, d.step) for d in loop.trace if d.kind == "plugin"] == [
        ("step", t) for t in range(1, 13)]
    assert [(name, t) for name, t, _ in log] == expected  # the steps' own log agrees
    assert states == {name: sum(1 for n, _ in expected if n == name) for name in order}


def test_a_loop_of_one_step_records_its_plugin_calls_only():
    loop = gm.Loop(step, numbered(3))
    loop.on("step", lambda event: None)
    loop.run(0)
    assert [d.event for d in loop.trace] == ["step"] * 3
    assert {d.kind for d in loop.trace} == {"plugin"}


@settings(max_examples=60, deadline=None)
@given(rule=schedules)
def test_a_schedules_description_parses_back_to_the_same_schedule(rule):
    again = gm.Schedule.parse(repr(rule))
    assert again == rule and repr(again) == repr(rule)
    assert [again.holds_at(t) for t in range(30)] == [rule.holds_at(t) for t in range(30)]


@pytest.mark.parametrize(("text", "why"), [
    ("__import__('os').system('true')", "unexpected '_' at 0"),
    ("each(2) | exec", "'exec' is no schedule"),
    ("each(2); at(1)", "unexpected ';' at 7"),
    ("each(2, start=1, 3)", "start= comes last"),
    ("after(1, 2)", r"after\(\) takes one number"),
    ("each(0)", r"each\(n\): n must be > 0"),
    ("each(True)", "unexpected 'T' at 5"),
    ("each(2) &", "it ends where a rule was expected"),
    ("(" * 200 + "always" + ")" * 200, "nested deeper than 100"),
    ("~" * 101 + "always", "it combines more than 100 rules"),
])
def test_any_other_text_is_refused_naming_the_field_and_the_text(text, why):
    with pytest.raises(ValueError, match=r"^models\[1\]\.schedule: .* is not a schedule: " + why):
        gm.Schedule.parse(text, field="models[1].schedule")


def test_a_reader_sees_a_model_declared_before_it_after_its_update_and_one_after_before():
    log: list = []
    loop = gm.Loop({"disc": recorder("disc", log), "gen": recorder("gen", log),
                    "late": recorder("late", log)}, numbered(4),
                   schedules={"disc": gm.each(2)}, reads={"gen": ["disc", "late"]})
    loop.run({"disc": 0, "gen": 0, "late": 100})
    seen = [(t, reads) for name, t, reads in log if name == "gen"]
    # disc steps at 2 and 4 before gen reads it; late steps after gen in every iteration.
    assert seen == [(1, {"disc": 0, "late": 100}), (2, {"disc": 1, "late": 101}),
                    (3, {"disc": 1, "late": 102}), (4, {"disc": 2, "late": 103})]


def test_metrics_are_named_by_model_and_keep_each_models_latest(tmp_path):
    log: list = []
    seen: list = []
    logger = Logger(tmp_path / "log.csv", every=gm.On("step"))
    loop = gm.Loop({"disc": recorder("disc", log), "gen": recorder("gen", log)},
                   numbered(5), schedules={"gen": gm.each(2)}, plugins=[logger])
    loop.on("step", lambda event: seen.append(
        {k: int(v) for k, v in event.metrics.items()}))
    loop.run({"disc": 0, "gen": 0})
    assert seen == [{"disc/t": 1}, {"disc/t": 2, "gen/t": 2}, {"disc/t": 3, "gen/t": 2},
                    {"disc/t": 4, "gen/t": 4}, {"disc/t": 5, "gen/t": 4}]
    with open(logger.path) as file:
        rows = list(csv.DictReader(file))
    assert [row["gen/t"] for row in rows] == ["", "2.0", "2.0", "4.0", "4.0"]
    assert [row["disc/t"] for row in rows] == ["1.0", "2.0", "3.0", "4.0", "5.0"]


def test_early_stopping_watches_one_models_metric():
    def constant(state: int, batch: np.ndarray) -> tuple[int, dict]:
        return state + 1, {"score": np.float32(1.0)}

    def improving(state: int, batch: np.ndarray) -> tuple[int, dict]:
        return state + 1, {"score": np.float32(-batch[0])}

    stop = EarlyStopping("gen/score", patience=2, every=gm.On("step"), restore_best=False)
    loop = gm.Loop({"disc": improving, "gen": constant}, numbered(10), plugins=[stop])
    states = loop.run({"disc": 0, "gen": 0})
    assert (stop.best_step, stop.stopped_step, states) == (1, 3, {"disc": 3, "gen": 3})


# -- two tiny models, a discriminator and a generator ------------------------------------------


class Pair:
    """A discriminator over 2 features and a generator from 3 noise features, each with its
    own program and SGD step; each cost reads the other model's variables."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(32, 2)).astype(np.float32)
        self.z = rng.normal(size=(32, 3)).astype(np.float32)
        self.gen_traces = 0
        disc = gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0))
        gen = gm.bricks.Linear(3, 2, rngs=nnx.Rngs(1))
        judge = gm.compile(lambda m, x: m(x), disc)
        draw = gm.compile(lambda m, z: m(z), gen)

        def d_cost(m, x, z, gen):
            fake = draw.infer(gen, z)
            return ((m(x) - 1.0) ** 2).mean() + (m(fake) ** 2).mean()

        def g_cost(m, x, z, disc):
            self.gen_traces += 1
            return ((judge.infer(disc, m(z)) - 1.0) ** 2).mean(), {"fake": m(z).mean()}

        self.judge, self.draw = judge, draw
        self.d_program = gm.compile(d_cost, disc)
        self.g_program = gm.compile(g_cost, gen)
        d_vars, g_vars = judge.init(self.x[:1]), draw.init(self.z[:1])
        self.d_vars = self.d_program.init(self.x[:4], self.z[:4], gen=g_vars)
        self.g_vars = self.g_program.init(self.x[:4], self.z[:4], disc=d_vars)
        self.d_step = gm.optimize(self.d_program, gm.provenance.optimizer("sgd", 0.1))
        self.g_step = gm.optimize(self.g_program, gm.provenance.optimizer("sgd", 0.1))

    def source(self) -> ArraySource:
        return ArraySource((self.x, self.z), batch_size=8)

    def states(self) -> dict[str, gm.TrainState]:
        return {"disc": self.d_step.init(self.d_vars, jax.random.key(0)),
                "gen": self.g_step.init(self.g_vars, jax.random.key(1))}


@pytest.fixture(scope="module")
def pair() -> Pair:
    return Pair()


def by_hand(pair: Pair, order: list[str], gen_every: int, iterations: int) -> tuple:
    """The same run with the two jitted steps called in a Python loop."""
    states, losses = pair.states(), []
    batches = list(pair.source())
    for t in range(1, iterations + 1):
        x, z = batches[(t - 1) % len(batches)]
        for name in order:
            if name == "disc":
                states["disc"], m = pair.d_step(states["disc"], x, z,
                                                gen=states["gen"].variables)
                losses.append(("disc", t, float(m["loss"])))
            elif t % gen_every == 0:
                states["gen"], m = pair.g_step(states["gen"], x, z,
                                               disc=states["disc"].variables)
                losses.append(("gen", t, float(m["loss"])))
    return states, losses


@pytest.mark.parametrize("order", [["disc", "gen"], ["gen", "disc"]])
def test_a_loop_of_two_models_matches_the_same_steps_called_by_hand(pair, order):
    steps = {"disc": pair.d_step, "gen": pair.g_step}
    losses: list = []

    def record(event):
        for name, t in ((n, event.time.step) for n in order):
            if name == "disc" or t % 2 == 0:
                losses.append((name, t, float(event.metrics[f"{name}/loss"])))

    loop = gm.Loop({name: steps[name] for name in order}, pair.source(), steps=6,
                   schedules={"gen": gm.each(2)}, reads={"gen": "disc", "disc": ["gen"]})
    loop.on("step", record)
    states = loop.run(pair.states())
    expected, expected_losses = by_hand(pair, order, 2, 6)
    assert losses == expected_losses
    assert (int(states["disc"].step), int(states["gen"].step)) == (6, 3)
    for a, b in zip(jax.tree.leaves(states), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_order_decides_what_a_reader_sees(pair):
    _, before = by_hand(pair, ["gen", "disc"], 1, 2)
    _, after = by_hand(pair, ["disc", "gen"], 1, 2)
    gen_loss = lambda losses: [loss for name, _, loss in losses if name == "gen"]
    assert gen_loss(before)[1] != gen_loss(after)[1]  # the two orders are told apart


def test_a_readers_step_differentiates_its_own_model_only(pair):
    states = pair.states()
    x, z = pair.x[:8], pair.z[:8]
    disc = states["disc"].variables
    g_params = states["gen"].variables["model"]

    def reference(params):  # the generator's cost in plain jnp, the discriminator constant
        fake = z @ params["W"] + params["b"]
        return (((fake @ disc["model"]["W"] + disc["model"]["b"]) - 1.0) ** 2).mean()

    grads = jax.grad(reference)(g_params)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, g_params, grads)
    before = jax.tree.map(np.array, disc)
    new, _ = pair.g_step(states["gen"], x, z, disc=disc)
    for a, b in zip(jax.tree.leaves(new.variables["model"]), jax.tree.leaves(want),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(disc), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)  # read, not donated nor changed


def test_a_reader_does_not_retrace_when_the_read_variables_change(pair):
    traces: list = []
    loop = gm.Loop({"disc": pair.d_step, "gen": pair.g_step}, pair.source(), steps=8,
                   reads={"gen": ["disc"], "disc": ["gen"]})
    loop.on("step", lambda event: traces.append(pair.gen_traces))
    states = pair.states()
    start = np.array(states["disc"].variables["model"]["W"])
    states = loop.run(states)
    assert traces == [traces[0]] * 8
    assert not np.array_equal(states["disc"].variables["model"]["W"], start)


def test_a_frozen_model_is_read_and_carried_but_never_steps(pair):
    teacher = jax.tree.map(jnp.copy, pair.states()["disc"].variables)
    log: list = []
    loop = gm.Loop({"disc": None, "gen": pair.g_step}, pair.source(), steps=3,
                   reads={"gen": ["disc"]})
    loop.on("step", lambda event: log.append(sorted(event.metrics)))
    states = loop.run({"disc": teacher, "gen": pair.states()["gen"]})
    assert log == [["gen/fake", "gen/loss"]] * 3 and int(states["gen"].step) == 3
    assert states["disc"] is teacher


def test_validation_evaluates_the_model_it_names(pair):
    x, z = ArraySource((pair.x[:10],), 4), ArraySource((pair.z[:10],), 4)
    mean = {"mean": lambda out, batch: out.mean(-1)}
    judged = Validation(pair.judge, x, metrics=mean, model="disc", every=gm.On("end"))
    drawn = Validation(pair.draw, z, metrics=mean, model="gen", every=gm.On("end"),
                       name="drawn")
    loop = gm.Loop({"disc": pair.d_step, "gen": pair.g_step}, pair.source(), steps=2,
                   reads={"gen": ["disc"], "disc": ["gen"]}, plugins=[judged, drawn])
    states = loop.run(pair.states())
    assert [sorted(m) for _, m in judged.history] == [["disc/valid/mean"]]
    assert [sorted(m) for _, m in drawn.history] == [["gen/valid/mean"]]
    want = np.asarray(pair.draw.infer(states["gen"].variables, pair.z[:10])).mean()
    np.testing.assert_allclose(drawn.history[0][1]["gen/valid/mean"], want, rtol=1e-5)


def test_a_checkpoint_holds_every_model_and_resumes_bitwise(pair, tmp_path):
    reads = {"gen": ["disc"], "disc": ["gen"]}
    steps = {"disc": pair.d_step, "gen": pair.g_step}
    whole = gm.Loop(steps, pair.source(), steps=8, schedules={"gen": gm.each(3)},
                    reads=reads).run(pair.states())
    first = gm.Loop(steps, pair.source(), steps=5, schedules={"gen": gm.each(3)},
                    reads=reads, plugins=[Checkpoint(tmp_path, every=gm.On("end"))])
    first.run(pair.states())
    shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}_copy")
    second = gm.Loop(steps, pair.source(), steps=8, schedules={"gen": gm.each(3)},
                     reads=reads, plugins=[Checkpoint(tmp_path, resume=True)])
    resumed = second.run(pair.states())
    # Neither schedules, reads nor states given: the checkpoint's record of the models and
    # the programs' init examples have them.
    again = gm.Loop.resume(tmp_path.parent / f"{tmp_path.name}_copy", steps, pair.source(),
                           steps=8)
    assert second.start_time.step == 5
    for a, b, c in zip(jax.tree.leaves(resumed), jax.tree.leaves(again),
                       jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)


# -- what a checkpoint records of the models, checked on resume --------------------------------


def _saved_pair(pair, directory, schedules=None) -> None:
    """Five steps of the pair, disc every iteration, gen at ``schedules`` (each(3)), saved."""
    gm.Loop({"disc": pair.d_step, "gen": pair.g_step}, pair.source(), steps=5,
            schedules=schedules or {"gen": gm.each(3)}, reads={"gen": ["disc"], "disc": "gen"},
            plugins=[Checkpoint(directory, every=gm.On("end"))]).run(pair.states())


def _files(directory) -> dict:
    return {path.relative_to(directory): path.read_bytes()
            for path in sorted(pathlib.Path(directory).rglob("*")) if path.is_file()}


def test_the_checkpoint_records_each_models_name_step_schedule_and_reads(pair, tmp_path):
    _saved_pair(pair, tmp_path)
    reader = CheckpointReader(tmp_path)
    try:
        models = reader.meta()["models"]
    finally:
        reader.close()
    assert models == [
        {"name": "disc", "steps": True, "schedule": None, "reads": ["gen"]},
        {"name": "gen", "steps": True, "schedule": "each(3)", "reads": ["disc"]}]
    shown = gm.inspect_run(tmp_path)
    assert "model disc: stepping, reads gen" in shown
    assert "model gen: stepping, at each(3), reads disc" in shown
    # The provenance's summary: each model's schedule, reads and own record.
    assert re.search(r"\n  gen +steps at each\(3\), reads disc\n", shown)
    assert re.search(r"\n  gen\.optimizer +sgd\(learning_rate=0\.1\)\n", shown)


def test_the_provenance_of_two_models_rebuilds_both_bitwise(pair, tmp_path):
    _saved_pair(pair, tmp_path)
    record = gm.provenance.read(tmp_path)
    assert (record.kind, record["order"], record["frozen"], record.derived["steps"]) == \
        ("training", ("disc", "gen"), (), 5)
    assert record["schedules"] == {"disc": None, "gen": "each(3)"}
    assert record["reads"] == {"disc": ("gen",), "gen": ("disc",)}
    data = record.to_dict()["inputs"]["data"]  # the description, and the data's metadata
    assert {k: v for k, v in data.items() if k != "metadata"} == pair.source().describe()
    assert data["metadata"] == pair.source().metadata.to_dict()
    for name, key, step in (("disc", 0, pair.d_step), ("gen", 1, pair.g_step)):
        own = record.models[name]  # the model's own training record, as its step makes it
        assert own.kind == "training" and own.fingerprint.startswith("sha256:")
        assert own["seeds"]["train"]["data"] == (0, key)
        assert own.to_dict()["inputs"]["bricks"] == step.provenance.to_dict()["inputs"]["bricks"]
    with pytest.raises(RebuildError, match=r"a run of several models \(disc, gen\); rebuild "
                                           r"them all with graphmod.provenance.rebuild_models"):
        gm.rebuild(record)

    rebuilt = gm.provenance.rebuild_models(record)
    assert list(rebuilt) == ["disc", "gen"]
    x, z = pair.x[:8], pair.z[:8]
    for name, step, variables, reads in (("disc", pair.d_step, pair.d_vars, "gen"),
                                         ("gen", pair.g_step, pair.g_vars, "disc")):
        again = rebuilt[name]
        program = again.compile(step.program.fn)  # the same function again
        args, kwargs = again.example_arguments()
        made = program.init(*args, rng=again.seeds["init"], **kwargs)
        for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(variables), strict=True):
            np.testing.assert_array_equal(a, b)
        assert program.provenance.fingerprint == record.models[name].fingerprint
        twin = gm.optimize(program, again.optimizer)
        assert twin.optimizer_record == step.optimizer_record
        other = {reads: pair.states()[reads].variables}
        ours, _ = twin(twin.init(made, again.seeds["train"]), x, z, **other)
        theirs, _ = step(pair.states()[name], x, z, **other)  # one step: the same update
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_crafted_model_record_is_refused_before_any_model_is_built(pair, tmp_path,
                                                                       monkeypatch):
    _saved_pair(pair, tmp_path)
    record = gm.provenance.read(tmp_path).to_dict()
    record["inputs"]["models"]["gen"]["inputs"]["bricks"]["/"]["class"] = "os.system"
    built: list = []
    original = gm.bricks.Linear.__init__
    monkeypatch.setattr(gm.bricks.Linear, "__init__",
                        lambda self, *a, **k: built.append(a) or original(self, *a, **k))
    with pytest.raises(RebuildError, match=r"^models\['gen'\]: rebuild: bricks\['/'\]"):
        gm.provenance.rebuild_models(gm.Provenance.from_dict(record))
    assert built == []  # disc's record, first and sound, was not built either
    with pytest.raises(ValueError, match=r"the record has no model 'critic'; its stepping "
                                         r"models are \['disc', 'gen'\]"):
        gm.provenance.rebuild_models(gm.Provenance.from_dict(record), models={"critic": None})
    with pytest.raises(RebuildError, match="not a run of several models"):
        gm.provenance.rebuild_models(pair.g_step.provenance)


def test_a_frozen_model_is_recorded_and_shown_as_frozen(pair, tmp_path):
    teacher = jax.tree.map(jnp.copy, pair.states()["disc"].variables)
    gm.Loop({"disc": None, "gen": pair.g_step}, pair.source(), steps=2,
            reads={"gen": ["disc"]}, plugins=[Checkpoint(tmp_path, every=gm.On("end"))]
            ).run({"disc": teacher, "gen": pair.states()["gen"]})
    shown = gm.inspect_run(tmp_path)
    assert "model disc: frozen" in shown and re.search(r"\n  disc +frozen \(no program", shown)
    record = gm.provenance.read(tmp_path)
    assert (record["frozen"], record.models["disc"], record["schedules"]) == \
        (("disc",), None, {"gen": None})
    assert list(gm.provenance.rebuild_models(record)) == ["gen"]  # nothing to build of disc


@pytest.mark.parametrize("how", ["plugin", "Loop.resume"])
def test_a_resume_with_other_model_names_is_refused_naming_both_and_changes_nothing(
        pair, tmp_path, how):
    _saved_pair(pair, tmp_path)
    before = _files(tmp_path)
    steps = {"disc": pair.d_step, "gen": pair.g_step, "teacher": None}
    states = {**pair.states(), "teacher": {"w": jnp.ones(2)}}
    reads = {"gen": ["disc"], "disc": "gen"}
    message = (r"holds the models \['disc', 'gen'\]; this loop's are "
               r"\['disc', 'gen', 'teacher'\] \(nothing was restored\)")
    with pytest.raises((ValueError, gm.PluginError), match=message):
        if how == "plugin":  # a PluginError naming the checkpoint plugin, from its setup
            gm.Loop(steps, pair.source(), steps=8, reads=reads,
                    plugins=[Checkpoint(tmp_path, resume=True)]).run(states)
        else:
            gm.Loop.resume(tmp_path, steps, pair.source(), state=states, steps=8, reads=reads)
    assert _files(tmp_path) == before


def test_a_changed_schedule_is_warned_of_and_recorded_as_a_setting_change(pair, tmp_path):
    _saved_pair(pair, tmp_path)
    loop = gm.Loop({"disc": pair.d_step, "gen": pair.g_step}, pair.source(), steps=8,
                   schedules={"gen": gm.each(2)}, reads={"gen": ["disc"], "disc": "gen"},
                   plugins=[Checkpoint(tmp_path, resume=True, every=gm.On("end"))])
    with pytest.warns(UserWarning, match=r"this run's \['schedules.gen'\] differ from those"):
        loop.run(pair.states())
    assert loop.setting_changes == [{"step": 5, "settings": {"schedules.gen": "each(3)"}}]
    assert "resumed with other settings at step 5: schedules.gen" in gm.inspect_run(tmp_path)


def test_unchanged_models_resume_without_a_warning(pair, tmp_path):
    _saved_pair(pair, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop = gm.Loop({"disc": pair.d_step, "gen": pair.g_step}, pair.source(), steps=6,
                       schedules={"gen": gm.each(3)}, reads={"gen": ["disc"], "disc": "gen"},
                       plugins=[Checkpoint(tmp_path, resume=True)])
        loop.run(pair.states())
    assert loop.setting_changes == []


def test_given_settings_override_the_recorded_ones_and_are_recorded_as_changes(pair, tmp_path):
    _saved_pair(pair, tmp_path)
    faster = gm.optimize(pair.g_program, gm.provenance.optimizer("sgd", 0.2))
    with pytest.warns(UserWarning, match=r"this run's \['optimizer.gen', 'schedules.gen'\] "
                                         r"differ from those"):
        gm.Loop.resume(tmp_path, {"disc": pair.d_step, "gen": faster}, pair.source(), steps=6,
                       schedules={"gen": gm.each(2)},
                       plugins=[Checkpoint(tmp_path, every=gm.On("end"))])
    reader = CheckpointReader(tmp_path)
    try:
        meta = reader.meta(6)
    finally:
        reader.close()
    (change,) = meta["setting_changes"]
    assert change["step"] == 5 and sorted(change["settings"]) == ["optimizer.gen",
                                                                  "schedules.gen"]
    assert change["settings"]["schedules.gen"] == "each(3)"
    assert change["settings"]["optimizer.gen"]["arguments"] == \
        pair.g_step.optimizer_record["arguments"]  # the optimizer before
    assert meta["models"][0]["reads"] == ["gen"]  # the reads not given: the recorded ones


def test_a_crafted_schedule_in_a_checkpoint_is_refused_and_nothing_runs(pair, tmp_path):
    _saved_pair(pair, tmp_path)
    path = tmp_path / "5" / "meta" / "metadata"
    record = json.loads(path.read_text())
    record["models"][1]["schedule"] = "__import__('os').system('touch pwned')"
    path.write_text(json.dumps(record))
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=r"the checkpoint of step 5: models\[1\]\.schedule "
                       r"\(model 'gen'\): \"__import__\('os'\).*\" is not a schedule: .*"
                       r"pass the schedules yourself"):
        gm.Loop.resume(tmp_path, {"disc": pair.d_step, "gen": pair.g_step}, pair.source(),
                       steps=8, plugins=[Checkpoint(tmp_path, every=gm.On("end"))])
    assert _files(tmp_path) == before and not pathlib.Path("pwned").exists()


@pytest.mark.parametrize(("inputs", "message"), [
    ({"models": {"a": {"kind": "training"}}, "order": ["a"]}, r"models\['a'\]: not a provenance"),
    ({"models": {"a": None}, "order": ["a", "b"]}, r"order: lists \['a', 'b'\], but the record "
                                                  r"holds the models \['a'\]"),
    ({"models": [], "order": ["a"]}, "holds a mapping of their records"),
])
def test_a_damaged_record_of_several_models_is_named_and_still_prints(inputs, message):
    record = gm.Provenance("training", inputs)
    with pytest.raises(gm.provenance.ProvenanceError, match=message):
        gm.provenance.rebuild_models(record)
    assert dict(record.summary())["models"].startswith("unreadable (")


def test_a_checkpoint_of_several_models_is_refused_to_a_loop_of_one_step(pair, tmp_path):
    _saved_pair(pair, tmp_path)
    with pytest.raises(ValueError, match=r"holds the models \['disc', 'gen'\]; this loop runs "
                                         r"one step, not named models"):
        gm.Loop.resume(tmp_path, lambda state, x, z: (state, {}), pair.source(),
                       state=pair.states()["disc"])


def test_changed_order_reads_and_frozen_models_are_each_named_with_the_value_before():
    from graphmod._train._loop._models import Models
    from graphmod._train._loop._resume import model_changes

    count = lambda state, x, **reads: (state + 1, {})
    saved = Models({"a": count, "b": count}, schedules={"b": gm.each(2)},
                   reads={"b": "a"}).record()
    same = Models({"a": count, "b": count}, schedules={"b": gm.each(2)}, reads={"b": "a"})
    other = Models({"b": count, "a": None}, reads={"b": "a"}, schedules={"b": gm.each(2)})
    unread = Models({"a": count, "b": count}, schedules={"b": gm.each(2)})
    assert model_changes(saved, same) == {} and model_changes(None, same) == {}
    assert model_changes(saved, other) == {"order": ["a", "b"], "frozen.a": False}
    assert model_changes(saved, unread) == {"reads.b": ["a"]}


@pytest.mark.parametrize(("models", "field"), [
    ({"disc": 1}, "'models'"),
    ([], "'models'"),
    (["disc"], r"'models\[0\]'"),
    ([{"name": "disc", "steps": True, "schedule": None}], r"'models\[0\]'"),
    ([{"name": 3, "steps": True, "schedule": None, "reads": []}], r"'models\[0\].name'"),
    ([{"name": "d", "steps": "yes", "schedule": None, "reads": []}], r"'models\[0\].steps'"),
    ([{"name": "d", "steps": True, "schedule": 5, "reads": []}], r"'models\[0\].schedule'"),
    ([{"name": "d", "steps": True, "schedule": None, "reads": "g"}], r"'models\[0\].reads'"),
    ([{"name": "d", "steps": True, "schedule": None, "reads": []}] * 2, "names a model twice"),
])
def test_a_malformed_models_record_is_refused_naming_the_field(pair, tmp_path, models, field):
    _saved_pair(pair, tmp_path)
    path = tmp_path / "5" / "meta" / "metadata"
    record = json.loads(path.read_text())
    record["models"] = models
    path.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=field):
        gm.Loop.resume(tmp_path, {"disc": pair.d_step, "gen": pair.g_step}, pair.source(),
                       state=pair.states(), steps=8, reads={"gen": ["disc"], "disc": "gen"})


# -- misuse, refused before anything runs ------------------------------------------------------


def step(state, batch):
    return state, {}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"schedules": {"critic": gm.each(2)}}, "'critic' is not a model of this loop"),
    ({"reads": {"critic": ["a"]}}, "'critic' is not a model of this loop"),
    ({"reads": {"a": ["critic"]}}, "'critic' is not a model of this loop"),
    ({"reads": {"a": ["a"]}}, "model 'a' reads itself"),
    ({"reads": {"a": ["b", "b"]}}, "a model is named twice"),
    ({"schedules": {"a": gm.each(2.5)}}, "between the iterations"),
    ({"schedules": {"a": 2}}, "expected a graphmod.Schedule"),
    ({"steps_per_call": 2}, "one iteration per dispatch"),
])
def test_bad_settings_are_refused_naming_the_culprit(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        gm.Loop({"a": step, "b": step}, numbered(2), **kwargs)


@pytest.mark.parametrize(("steps", "message"), [
    ({}, "non-empty dict of steps"),
    ({"a/b": step}, "without '/'"),
    ({"a": 3}, "model 'a''s step must be callable"),
    ({"a": None}, "give at least one a train step"),
])
def test_bad_steps_are_refused(steps, message):
    with pytest.raises((ValueError, TypeError), match=message):
        gm.Loop(steps, numbered(2))


def test_a_frozen_model_has_no_schedule_and_reads_nothing():
    with pytest.raises(ValueError, match="model 'b' is frozen"):
        gm.Loop({"a": step, "b": None}, numbered(2), schedules={"b": gm.each(2)})
    with pytest.raises(ValueError, match="model 'b' is frozen"):
        gm.Loop({"a": step, "b": None}, numbered(2), reads={"b": ["a"]})


def test_the_record_of_a_model_without_a_program_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"model 'a''s step is not a graphmod\.optimize step"):
        gm.provenance.capture(gm.Loop({"a": step, "b": None}, numbered(2)))


def test_schedules_without_named_models_are_refused():
    with pytest.raises(ValueError, match="pass the steps as a dict by model name"):
        gm.Loop(step, numbered(2), schedules={"a": gm.each(2)})


@pytest.mark.parametrize(("states", "message"), [
    ({"a": 0}, r"takes a dict of their states by name, got \['a'\]"),
    ({"a": 0, "b": 0, "c": 0}, r"got \['a', 'b', 'c'\]"),
    (0, "got int"),
    ({"a": 0, "b": None}, r"Loop.run\(state\['b'\]\): state is None"),
])
def test_a_state_dict_that_does_not_match_the_models_is_refused_before_any_event(
        states, message):
    events: list = []
    loop = gm.Loop({"a": step, "b": step}, numbered(2), plugins=[events.append])
    with pytest.raises((ValueError, TypeError), match=message):
        loop.run(states)
    assert events == []


def test_a_read_clashing_with_a_batch_field_is_refused():
    data = ArraySource({"x": np.ones((4, 1), np.float32), "b": np.ones((4, 1))}, 2)
    loop = gm.Loop({"a": lambda s, **kw: (s, {}), "b": step}, data, reads={"a": ["b"]})
    with pytest.raises(ValueError, match="model 'a' reads 'b', which is also a field"):
        loop.run({"a": 0, "b": 0})


def test_a_program_that_does_not_take_the_read_variables_is_refused(pair):
    loop = gm.Loop({"disc": pair.d_step, "gen": pair.g_step}, pair.source(),
                   reads={"disc": ["gen"]})  # gen's cost takes disc=, not given
    with pytest.raises(TypeError, match=r"model 'gen''s function g_cost takes 'disc', a "
                       r"model of this loop: declare reads=\{'gen': \['disc'\]\}"):
        loop.run(pair.states())


def test_plugins_of_one_model_refuse_a_loop_of_several_naming_the_fix(pair):
    check = Validation(pair.judge, ArraySource((pair.x[:4],), 4))
    loop = gm.Loop({"disc": pair.d_step, "gen": pair.g_step}, pair.source(),
                   reads={"disc": ["gen"], "gen": ["disc"]}, plugins=[check])
    with pytest.raises(gm.PluginError, match=r"Validation\(\.\.\., model='gen'\)"):
        loop.run(pair.states())
    wrong = Validation(pair.judge, ArraySource((pair.x[:4],), 4), model="critic")
    loop = gm.Loop({"disc": pair.d_step, "gen": pair.g_step}, pair.source(),
                   reads={"disc": ["gen"], "gen": ["disc"]}, plugins=[wrong])
    with pytest.raises(gm.PluginError, match="no such model; it has"):
        loop.run(pair.states())
    loop = gm.Loop({"a": step, "b": step}, numbered(2), plugins=[NaNGuard()])
    with pytest.raises(gm.PluginError, match="NaNGuard: the loop runs several models"):
        loop.run({"a": 0, "b": 0})


def test_read_variables_are_not_taken_for_batched_arguments(pair):
    # init's batch of one row matches the discriminator's bias (one row): not a batch size
    variables = pair.g_program.init(pair.x[:1], pair.z[:1], disc=pair.d_vars)
    state = pair.g_step.init(variables, jax.random.key(0))
    state, metrics = pair.g_step(state, pair.x[:8], pair.z[:8], disc=pair.d_vars)
    assert np.isfinite(float(metrics["loss"]))


def test_anneal_writes_the_hyperparameter_of_the_model_it_names():
    problem = Problem(dropout=gm.dynamic(0.5))
    rate = problem.dropout.hparam("rate")
    steps = {"a": problem.step, "b": problem.step}
    anneal = Anneal(rate, lambda t: 0.25, model="b")
    loop = gm.Loop(steps, problem.source(), steps=2, plugins=[anneal])
    states = loop.run({"a": problem.state(), "b": problem.state()})
    assert (float(rate.get(states["a"].variables)), float(rate.get(states["b"].variables))) \
        == (0.5, 0.25)
    loop = gm.Loop(steps, problem.source(), steps=2, plugins=[Anneal(rate, lambda t: 0.25)])
    with pytest.raises(gm.PluginError, match=r"Anneal\(\.\.\., model='b'\)"):
        loop.run({"a": problem.state(), "b": problem.state()})


def test_two_models_given_one_state_are_refused_before_a_step_donates_it(pair):
    state = pair.states()["disc"]
    loop = gm.Loop({"a": pair.d_step, "b": pair.d_step}, pair.source(), steps=2,
                   reads={"a": ["b"]})
    with pytest.raises(ValueError, match="models 'a' and 'b' share arrays"):
        loop.run({"a": state, "b": state})
    assert loop.time.step == 0
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))  # nothing donated
    # Steps of your own that donate nothing may share an array.
    shared = jnp.zeros(2)
    keep = lambda state, batch: (state, {})
    states = gm.Loop({"a": keep, "b": keep}, numbered(2)).run({"a": shared, "b": shared})
    assert states["a"] is shared and states["b"] is shared


def test_a_reader_whose_program_holds_the_read_models_parameters_is_refused(pair):
    both = nnx.Dict(gen=gm.bricks.Linear(3, 2, rngs=nnx.Rngs(1)),
                    disc=gm.bricks.Linear(2, 1, rngs=nnx.Rngs(0)))
    disc_program = gm.compile(lambda m, x: (m(x) ** 2).mean(), both["disc"])
    joint = gm.compile(lambda m, x, z, disc: (m["disc"](m["gen"](z)) ** 2).mean(), both)
    d_step = gm.optimize(disc_program, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"holds 'disc''s parameter /\.W \(as /disc\.W\)"):
        gm.Loop({"disc": d_step, "gen": gm.optimize(joint, optax.sgd(0.1))}, pair.source(),
                reads={"gen": ["disc"]})
    # Choosing what the reader trains is the user's say: leaving disc out is accepted.
    gm.Loop({"disc": d_step,
             "gen": gm.optimize(joint, optax.sgd(0.1), trainable=nnx.PathContains("gen"))},
            pair.source(), reads={"gen": ["disc"]})
