"""Schedules: each(n) fires once per multiple crossed; boolean laws hold on ranges.
Templates: schedules fit their timeline, event types are ones something fires."""

from __future__ import annotations

import itertools
import re
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphmod as gm
from graphmod import On, Schedule, after, always, at, before, each, never
from graphmod._train._events import Event, Time
from tests.loop.conftest import Problem

small = st.integers(min_value=0, max_value=200)


@st.composite
def schedules(draw: st.DrawFn, depth: int = 2) -> Schedule:
    leaves = st.one_of(
        st.builds(each, st.integers(1, 20), st.integers(0, 30)),
        st.builds(lambda ts: at(*ts), st.lists(small, min_size=1, max_size=4)),
        st.builds(after, small), st.builds(before, small),
        st.sampled_from([always, never]),
    )
    if depth == 0:
        return draw(leaves)
    kind = draw(st.sampled_from(["leaf", "and", "or", "not"]))
    if kind == "leaf":
        return draw(leaves)
    a = draw(schedules(depth - 1))
    if kind == "not":
        return ~a
    b = draw(schedules(depth - 1))
    return a & b if kind == "and" else a | b


@st.composite
def batch_sizes(draw: st.DrawFn) -> list[int]:
    return draw(st.lists(st.integers(1, 300), min_size=1, max_size=40))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 500), st.integers(0, 100), batch_sizes())
def test_each_fires_exactly_once_per_multiple_crossed(n: int, start: int, sizes: list[int]):
    t, fired = 0, 0
    for size in sizes:
        if each(n, start)(t, t + size):
            fired += 1
            # Firing means at least one multiple lies in the range.
            assert any((p - start) % n == 0 for p in range(max(t + 1, start), t + size + 1))
        t += size
    crossed = sum(1 for p in range(1, t + 1) if p >= start and (p - start) % n == 0)
    multiples_per_range = [
        sum(1 for p in range(a + 1, b + 1) if p >= start and (p - start) % n == 0)
        for a, b in itertools.pairwise(itertools.accumulate([0, *sizes]))]
    assert fired == sum(1 for c in multiples_per_range if c)
    if n >= max(sizes):  # a range never holds two multiples: one firing per multiple
        assert fired == crossed


@settings(max_examples=300, deadline=None)
@given(schedules(), schedules(), small, st.integers(0, 60))
def test_boolean_laws_on_ranges(a: Schedule, b: Schedule, lo: int, width: int) -> None:
    hi = lo + width
    points = range(lo + 1, hi + 1)
    fires = lambda s: any(s(p) for p in points)  # the definition, point by point
    for s in (a, b, a & b, a | b, ~a, ~(a & b), ~a | ~b, ~~a):
        assert s(lo, hi) == fires(s)
    assert (~(a & b))(lo, hi) == (~a | ~b)(lo, hi)  # De Morgan
    assert (~(a | b))(lo, hi) == (~a & ~b)(lo, hi)
    assert (a | b)(lo, hi) == (a(lo, hi) or b(lo, hi))
    assert (a & ~a)(lo, hi) is False
    assert (a | ~a)(lo, hi) == (width > 0)


@settings(max_examples=300, deadline=None)
@given(schedules(), st.lists(st.integers(0, 400), min_size=1, max_size=20))
def test_point_by_point_path_agrees_with_the_vectorised_one(rule: Schedule,
                                                            points: list[int]) -> None:
    # Short integer ranges (a step) are checked in Python, longer ones with NumPy.
    assert [rule.holds_at(p) for p in points] == rule.holds(np.asarray(points)).tolist()
    for p in points:
        assert rule(p, p + 3) == bool(rule.holds(np.arange(p + 1, p + 4)).any())
        assert rule(p, p + 40) == any(rule.holds_at(q) for q in range(p + 1, p + 41))


def test_fractional_each_agrees_point_by_point() -> None:
    rule = each(2.5, start=1)
    points = list(range(0, 40))
    assert [rule.holds_at(p) for p in points] == rule.holds(np.asarray(points)).tolist()
    assert [p for p in points if rule.holds_at(p)] == [1, 6, 11, 16, 21, 26, 31, 36]


def test_float_timelines_fire_at_the_right_ranges() -> None:
    rule = each(60.0)
    assert rule(59.5, 60.2) and not rule(60.2, 119.9) and rule(119.9, 125.0)
    assert (~each(1.0))(0.5, 1.0)  # 0.75 is no multiple
    assert not (each(1.0) & ~each(1.0))(0.0, 10.0)
    assert (after(1.5) & before(1.6))(1.0, 2.0)


def test_bad_schedules_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"each\(n\): n must be > 0"):
        each(0)
    with pytest.raises(TypeError, match=r"each\(n\) must be a number, got '10'"):
        each("10")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="both sides must be schedules"):
        each(3) & 5  # type: ignore[operator]
    with pytest.raises(ValueError, match="at least one time"):
        at()


@pytest.mark.parametrize("timeline", ["step", "epoch", "examples"])
@pytest.mark.parametrize(("rule", "culprit"), [
    (at(1.5), "at(1.5)"), (each(2.5), "each(2.5)"), (each(3, start=0.5), "each(3, start=0.5)"),
    (each(10) | at(2, 7.5), "at(2, 7.5)"), (~each(0.5) & after(3), "each(0.5)"),
], ids=["at", "each", "start", "or", "not"])
def test_fractional_points_on_an_integer_timeline_are_refused(rule: Schedule, culprit: str,
                                                              timeline: str) -> None:
    with pytest.raises(ValueError, match=rf"On\('step', {timeline}=.*\): {re.escape(culprit)} "
                                         rf"places points between the integers of the "
                                         rf"{timeline} timeline.*Use integers.*seconds"):
        On("step", **{timeline: rule})


@pytest.mark.parametrize("rule", [each(2.5), at(1.5), each(10) | at(2.5), ~each(0.5)],
                         ids=repr)
def test_a_fractional_rule_called_on_a_range_of_ints_is_refused(rule: Schedule) -> None:
    # The range (0, 3] of ints was read at 1, 2 and 3 only: each(2.5)(0, 3) was False, yet
    # each(2.5)(0, 2**21), read at candidate points, True.
    for hi in (3, 1 << 21):
        with pytest.raises(ValueError, match=rf"\(0, {hi}\): .* places points between the "
                                             r"integers.*or pass float times \(seconds\)"):
            rule(0, hi)
    assert rule(0.0, 3.0) and rule(0, 3.0)  # a float end: the seconds timeline
    assert isinstance(rule(2), bool)  # a single point is a plain predicate


@pytest.mark.parametrize("call", [
    lambda: each(2)(True, 3), lambda: each(2)(0, np.bool_(True)), lambda: at(1)(True),
], ids=["t_prev", "numpy t_now", "a point"])
def test_a_bool_time_is_refused(call: Any) -> None:
    with pytest.raises(TypeError, match=r"times must be numbers, not bools"):
        call()


@pytest.mark.parametrize("call", [
    lambda: each(True), lambda: each(2, start=False), lambda: at(1, True), lambda: after(True),
    lambda: before(False),
], ids=["each", "start", "at", "after", "before"])
def test_a_bool_in_a_rule_is_refused(call: Any) -> None:
    with pytest.raises(TypeError, match=r"must be a number, got (True|False): pass an int or a "
                                        r"float \(a bool is no time"):
        call()


def test_fractions_fit_wall_clock_timelines_and_integral_floats_fit_integer_ones() -> None:
    On("step", seconds=each(2.5), train_seconds=at(0.5))
    template = On("step", step=each(2.0) & ~at(4.0))
    fired = [s for s in range(1, 9)
             if template.matches(Event("step", None, Time(step=s), Time(step=s - 1), None))]
    assert fired == [2, 6, 8]


def test_a_misspelt_event_type_is_refused_at_run_before_anything_changes(
        problem: Problem) -> None:
    calls: list[str] = []

    class Watch(gm.Plugin):
        def setup(self, loop: gm.Loop) -> None:
            calls.append("setup")

    state = problem.state()
    before = jax.tree.map(np.array, state)
    loop = gm.Loop(problem.step, problem.source(32), steps=2, plugins=[Watch()])
    loop.on(On("step") | On("stpe", step=each(2)), lambda e: calls.append(e.type))
    with pytest.raises(ValueError, match=r"plugin '<lambda>' listens for 'stpe' events .*"
                                         r"\(did you mean 'step'\?\)\. Known:.*"
                                         r"fires = \('stpe',\)"):
        loop.run(state)
    assert calls == [] and loop.time.step == 0
    jax.tree.map(np.testing.assert_array_equal, state, before)  # not donated


def test_custom_event_types_are_declared_by_the_plugins_that_fire_them(
        problem: Problem) -> None:
    class Announce(gm.Plugin):
        fires = ("announced",)

        def on_step(self, event: gm.Event) -> None:
            event.loop.fire("announced", value=event.time.step)

    def shout(event: gm.Event) -> None:
        event.loop.fire("shouted")

    shout.fires = "shouted"  # type: ignore[attr-defined]
    seen: list[tuple[str, int]] = []
    loop = gm.Loop(problem.step, problem.source(32), steps=2, plugins=[Announce()])
    loop.on("step", shout)
    loop.on(On("announced") | On("shouted"), lambda e: seen.append((e.type, e.time.step)))
    loop.on(On("validated"), lambda e: None)  # a standard type: fireable by hand
    loop.run(problem.state())
    assert seen == [("announced", 1), ("shouted", 1), ("announced", 2), ("shouted", 2)]
    undeclared = gm.Loop(problem.step, problem.source(32), steps=1)
    undeclared.on("step", lambda e: e.loop.fire("whispered"))
    undeclared.on("whispered", lambda e: None)
    with pytest.raises(ValueError, match=r"'whispered' events.*Known: begin, end, epoch_begin"):
        undeclared.run(problem.state())
