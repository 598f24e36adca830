"""Grain pipelines as loop, ``evaluate`` and ``Validation`` data (``GrainSource``): the
same training as ArraySource's, the iterator's state at the loop's position in checkpoints
and exact resumes from it, evaluation equal to ArraySource's, and bad pipelines refused."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphmod as gm
from graphmod import On, at
from graphmod.data import ArraySource, GrainSource
from graphmod.plugins import Checkpoint, Validation

grain = pytest.importorskip("grain")

ROWS, BATCH = 36, 6


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3)).astype(np.float32)
    return {"x": x, "y": (x @ rng.normal(size=(3, 1))).astype(np.float32)}


def rows() -> list[dict[str, np.ndarray]]:
    data = arrays()
    return [{k: v[i] for k, v in data.items()} for i in range(ROWS)]


def mapped(shuffle: bool = False) -> Any:
    ds = grain.MapDataset.source(rows())
    return (ds.shuffle(seed=4) if shuffle else ds).batch(BATCH, drop_remainder=True)


class Plus(grain.transforms.Map):
    def map(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"x": row["x"] + 1.0, "y": row["y"]}


def pipelines() -> dict[str, Any]:
    """Shuffled, mapped, batched pipelines of each kind (no worker processes: those are
    tests/loop/test_grain_resume.py's)."""
    ds = grain.MapDataset.source(rows()).shuffle(seed=4).map(Plus().map).batch(BATCH)
    loader = grain.DataLoader(
        data_source=rows(), operations=[Plus(), grain.transforms.Batch(BATCH)],
        sampler=grain.samplers.IndexSampler(ROWS, shuffle=True, seed=4, num_epochs=1,
                                            shard_options=grain.sharding.NoSharding()))
    return {"MapDataset": ds, "IterDataset": ds.to_iter_dataset(), "DataLoader": loader}


class Run:
    def __init__(self, mesh: Any = None) -> None:
        self.program = gm.compile(lambda m, x, y: ((m(x) - y) ** 2).mean(),
                                  gm.bricks.Linear(3, 1, rngs=nnx.Rngs(0)), mesh=mesh)
        self.step = gm.optimize(self.program, optax.adam(1e-2))
        data = arrays()
        self.first = self.step.init(self.program.init(data["x"][:2], data["y"][:2]),
                                    jax.random.key(0))

    def state(self) -> gm.TrainState:
        return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, self.first)


@pytest.fixture(scope="module")
def run() -> Run:
    return Run()


def leaves(state: gm.TrainState) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state.variables)]


def assert_same(a: gm.TrainState, b: gm.TrainState) -> None:
    assert int(a.step) == int(b.step)
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_grain_pipeline_trains_exactly_as_an_array_source_of_its_arrays(run: Run) -> None:
    by_grain = gm.Loop(run.step, mapped(), epochs=2).run(run.state())  # wrapped itself
    by_arrays = gm.Loop(run.step, ArraySource(arrays(), BATCH), epochs=2).run(run.state())
    assert int(by_grain.step) == 2 * ROWS // BATCH
    assert_same(by_grain, by_arrays)


def test_batches_go_on_the_mesh_of_a_one_device_program() -> None:
    one = Run(mesh=jax.make_mesh((1,), ("data",)))
    by_grain = gm.Loop(one.step, mapped(), epochs=1).run(one.state())
    by_arrays = gm.Loop(one.step, ArraySource(arrays(), BATCH), epochs=1).run(one.state())
    assert_same(by_grain, by_arrays)


def test_the_checkpointed_state_is_at_the_loops_position_not_its_read_ahead(run: Run) -> None:
    source = GrainSource(mapped(shuffle=True))
    loop = gm.Loop(run.step, source, epochs=1, steps_per_call=2)
    loop.on(On("step", step=at(3)), lambda event: event.loop.terminate())
    loop.run(run.state())
    record = loop.state_dict()["data"]
    assert loop.position == 3 and (record["epoch"], record["position"]) == (0, 3)
    # The loop read batches 3 and 4 ahead; the record is the iterator's before batch 3.
    assert json.loads(record["state"]) == {"next_index": 3}
    assert isinstance(record["state"], str) and record["encoding"] == "json"


@pytest.mark.parametrize("kind", ["MapDataset", "IterDataset", "DataLoader"])
def test_a_run_stopped_mid_epoch_resumes_on_the_batches_it_would_have_seen(
        run: Run, kind: str, tmp_path: pathlib.Path) -> None:
    seen: dict[str, list[tuple[int, float]]] = {"whole": [], "stopped": [], "resumed": []}

    def recorder(name: str) -> Any:
        def record(event: gm.Event) -> None:
            if event.type == "step":
                seen[name].append((event.time.step, float(event.metrics["loss"])))
        return record

    whole = gm.Loop(run.step, pipelines()[kind], epochs=2, plugins=[recorder("whole")]
                    ).run(run.state())
    checkpoint = Checkpoint(tmp_path, every=On("step", step=at(8)))
    stopped = gm.Loop(run.step, pipelines()[kind], epochs=2, plugins=[recorder("stopped"),
                                                                    checkpoint])
    stopped.on(On("step", step=at(8)), lambda event: event.loop.terminate())
    stopped.run(run.state())
    data = stopped.state_dict()["data"]
    assert (data["epoch"], data["position"]) == (1, 2) and json.loads(data["state"])
    resumed = gm.Loop.resume(str(tmp_path), run.step, pipelines()[kind],
                             plugins=[recorder("resumed")])
    assert [s for s, _ in seen["resumed"]] == list(range(9, 13))
    assert seen["stopped"] + seen["resumed"] == seen["whole"]  # bitwise, batch by batch
    assert_same(resumed, whole)


def test_evaluate_and_validation_over_grain_equal_those_over_arrays(run: Run) -> None:
    data = {k: v[:33] for k, v in arrays().items()}  # a short last batch: padded, masked
    pipeline = grain.MapDataset.source([{k: v[i] for k, v in data.items()} for i in range(33)]
                                       ).batch(8)
    variables, chosen = run.first.variables, {"metrics": ["mse", "mae"],
                                              "predict": lambda model, x: model(x)}
    by_grain = gm.evaluate(run.program, variables, pipeline, **chosen)
    by_arrays = gm.evaluate(run.program, variables, ArraySource(data, 8, drop_remainder=False),
                            **chosen)
    assert by_grain.metrics == by_arrays.metrics and by_grain.examples == 33
    predict = run.program.derive(lambda m, x: m(x))
    valid = Validation(predict, pipeline, metrics=["mse"]).evaluate(variables)
    assert valid == Validation(predict, ArraySource(data, 8, drop_remainder=False),
                               metrics=["mse"]).evaluate(variables)


def test_the_description_names_the_pipeline_its_seeds_and_its_first_batch() -> None:
    described = GrainSource(pipelines()["MapDataset"], name="train").describe()
    assert described["pipeline"][0] == "SourceMapDataset(source=list)"
    assert described["pipeline"][-1].startswith("BatchMapDataset(batch_size=6")
    assert any("map" in step for step in described["pipeline"])  # Grain's own names
    assert described["seeds"] == [4] and described["length"] == ROWS // BATCH
    assert described["shapes"] == [[BATCH, 3], [BATCH, 1]]
    assert json.loads(json.dumps(described)) == described  # JSON for provenance
    other = GrainSource(grain.MapDataset.source(rows()).shuffle(seed=5).map(Plus().map)
                        .batch(BATCH)).describe()
    assert other["first_batch_sha256"] != described["first_batch_sha256"]
    assert not hasattr(GrainSource(pipelines()["IterDataset"]), "__len__")  # unknown


class _Stateless(grain.DatasetIterator):
    def __init__(self) -> None:
        super().__init__()
        self._rows = iter(rows())

    def __next__(self) -> Any:
        return next(self._rows)

    def get_state(self) -> dict[str, Any]:
        raise NotImplementedError("no state")

    def set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("no state")


class _StatelessDataset(grain.IterDataset):
    def __iter__(self) -> _Stateless:
        return _Stateless()


def test_a_pipeline_that_cannot_report_its_state_is_refused_before_anything_runs(
        run: Run, tmp_path: pathlib.Path) -> None:
    checkpoint = Checkpoint(tmp_path / "run", every=On("step"))
    with pytest.raises(TypeError, match=r"GrainSource\(IterDataset\).*_Stateless.*cannot "
                                        r"report its state.*get_state"):
        gm.Loop(run.step, _StatelessDataset(), plugins=[checkpoint]).run(run.state())
    assert not (tmp_path / "run").exists()


def test_a_grain_object_of_another_kind_or_an_iterator_is_refused_naming_it(run: Run) -> None:
    source = grain.sources.RangeDataSource(0, 10, 1)
    with pytest.raises(TypeError, match=r"RangeDataSource is no pipeline.*grain\.MapDataset"):
        gm.Loop(run.step, source)
    with pytest.raises(TypeError, match="RangeDataSource"):
        gm.evaluate(run.program, run.first.variables, source, metrics=["mse"])
    with pytest.raises(TypeError, match=r"a Grain iterator \(\w+\) is used up by one pass"):
        gm.Loop(run.step, iter(mapped()))


def test_fit_trains_and_validates_on_grain_pipelines_as_on_array_sources() -> None:
    def cost(m, x, y):
        return ((m(x) - y) ** 2).mean()

    data, held = arrays(), {k: v[:20] for k, v in arrays().items()}
    held_rows = [{k: v[i] for k, v in held.items()} for i in range(20)]
    run = {"epochs": 2, "progress": False}
    by_grain = gm.fit(cost, gm.bricks.Linear(3, 1, rngs=nnx.Rngs(0)), mapped(),
                      validation=grain.MapDataset.source(held_rows).batch(8), **run)
    by_arrays = gm.fit(cost, gm.bricks.Linear(3, 1, rngs=nnx.Rngs(0)),
                       ArraySource(data, BATCH),
                       validation=ArraySource(held, 8, drop_remainder=False), **run)
    assert by_grain.steps_run == 2 * ROWS // BATCH
    assert_same(by_grain.state, by_arrays.state)
    assert by_grain.evaluation == by_arrays.evaluation and "valid/loss" in by_grain.evaluation
    assert by_grain.provenance["data"]["kind"] == "MapDataset"


def test_two_readers_of_one_epoch_each_read_every_batch_in_order() -> None:
    source = GrainSource(mapped(shuffle=True))
    want = [b["x"] for b in mapped(shuffle=True)]
    a, b = source.iter_epoch(0), source.iter_epoch(0, start=1)
    got_a, got_b = [next(a)], [next(b)]
    for _ in range(3):  # taking the live iterator from one another
        got_a.append(next(a))
        got_b.append(next(b))
    np.testing.assert_array_equal(np.stack([x["x"] for x in got_a]), np.stack(want[:4]))
    np.testing.assert_array_equal(np.stack([x["x"] for x in got_b]), np.stack(want[1:5]))
