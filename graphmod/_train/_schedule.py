"""Schedules: rules over a timeline, evaluated on the range an event covers.

A schedule is a predicate on points of a timeline (steps, epochs, examples, seconds).
``schedule(t_prev, t_now)`` fires if the predicate holds at some point of the half-open range
``(t_prev, t_now]``, so a rule such as ``each(1000)`` on the examples timeline fires exactly
once per multiple of 1000 crossed, whatever the batch size. ``&``, ``|`` and ``~`` combine
predicates point by point (``each(10) & ~at(20)``: multiples of 10 except 20), so the
boolean laws hold on every range.

Integer ranges (steps, epochs, examples) are evaluated exactly; float ranges (seconds) at
the candidate points where a rule can change (its points, thresholds and the gaps between).

A rule placing points between the integers (``each(2.5)``, ``at(1.5)``) is made without
complaint: it is right on the seconds timelines, and a schedule does not know its timeline
until it is used. Where the timeline is known it is refused on an integer one, which never
or only partly meets it: attached to ``On(..., step=...)`` (or ``epoch=``, ``examples=``),
and called on a range whose ends are both ints. A bool is no time anywhere: to Python
``True`` is the int 1, so ``each(True)`` or ``rule(True, 3)`` would pass for a count.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import NoReturn

import numpy as np

_EXACT_LIMIT = 1 << 20  # integer ranges up to this size are checked point by point
_SCALAR_LIMIT = 16  # ranges this short (a step, an epoch) skip NumPy: ~1 µs, not ~5 µs


class Schedule:
    """Base class: a predicate on timeline points, combined with ``&``, ``|``, ``~``.

    Examples:
        >>> from graphmod import each, at
        >>> rule = each(10) & ~at(20)
        >>> rule(5, 10), rule(15, 25), rule(25, 30)
        (True, False, True)
        >>> rule(30)  # a single point: a plain predicate
        True
    """

    def holds(self, points: np.ndarray) -> np.ndarray:
        """Whether the rule holds at each point (vectorised)."""
        raise NotImplementedError

    def holds_at(self, point: int) -> bool:
        """Whether the rule holds at one integer point (the same as ``holds``, in Python:
        the loop asks this for every step of every scheduled plugin)."""
        return bool(self.holds(np.asarray([point]))[0])

    def points_in(self, lo: float, hi: float) -> list[float]:
        """The rule's own special points in ``(lo, hi]`` (where its value can change)."""
        return []

    def fractional(self) -> Schedule | None:
        """The first part of the rule placing points off the integers (``at(1.5)``,
        ``each(2.5)``), which an integer timeline never or only partly meets; else None.

        Examples:
            >>> from graphmod import each, at
            >>> (each(10) | at(2.5)).fractional(), each(2.0).fractional()
            (at(2.5), None)
        """
        return None

    @functools.cached_property
    def _off_integers(self) -> Schedule | None:
        return self.fractional()  # asked on every integer range: computed once per rule

    def __call__(self, t_prev: float, t_now: float | None = None) -> bool:
        if isinstance(t_prev, bool | np.bool_) or isinstance(t_now, bool | np.bool_):
            raise TypeError(f"{self!r}({t_prev!r}, {t_now!r}): times must be numbers, not "
                            "bools (to Python True is 1); pass the step, epoch, examples or "
                            "seconds")
        if t_now is None:
            return bool(self.holds(np.asarray([t_prev]))[0])
        integers = _is_int(t_prev) and _is_int(t_now)
        if integers and self._off_integers is not None:
            raise ValueError(
                f"{self!r}({t_prev}, {t_now}): {self._off_integers!r} places points between "
                "the integers, and a range of ints is evaluated at its integers (a step, "
                "epoch or examples timeline), where it fires never or off its rule. Use "
                "integers there (each(2), at(1, 2)), or pass float times (seconds)")
        if t_now <= t_prev:
            return False
        exact = integers and t_now - t_prev <= _EXACT_LIMIT
        if exact and t_now - t_prev <= _SCALAR_LIMIT:
            return any(self.holds_at(p) for p in range(int(t_prev) + 1, int(t_now) + 1))
        if exact:
            points = np.arange(int(t_prev) + 1, int(t_now) + 1, dtype=np.int64)
        else:
            points = self._candidates(float(t_prev), float(t_now))
        return bool(np.any(self.holds(points)))

    def _candidates(self, lo: float, hi: float) -> np.ndarray:
        special = sorted({p for p in self.points_in(lo, hi) if lo < p <= hi} | {hi})
        gaps = [(a + b) / 2 for a, b in zip([lo, *special], special, strict=False)]
        return np.asarray(sorted(set(special) | set(gaps)), dtype=np.float64)

    def __and__(self, other: Schedule) -> Schedule:
        return _And(self, _check(other, "&"))

    def __or__(self, other: Schedule) -> Schedule:
        return _Or(self, _check(other, "|"))

    def __invert__(self) -> Schedule:
        return _Not(self)

    @staticmethod
    def parse(text: str, *, field: str = "schedule") -> Schedule:
        """The schedule whose description (its ``repr``) is ``text``: the inverse of
        ``repr``, for descriptions a record keeps (a checkpoint's models).

        Only the schedule grammar is read: ``each(n)``, ``each(n, start=s)``,
        ``at(t, ...)``, ``after(t)``, ``before(t)``, ``always``, ``never``, with int or
        float literals, combined with ``&``, ``|``, ``~`` and parentheses (Python's
        precedence: ``~`` before ``&`` before ``|``). Nothing is evaluated or imported, so
        a crafted record cannot run code; anything else raises a ``ValueError`` naming
        ``field`` and the text.

        Examples:
            >>> import graphmod as gm
            >>> rule = gm.each(5, start=1) & ~gm.at(11, 2.5) | gm.after(100)
            >>> gm.Schedule.parse(repr(rule)) == rule, repr(gm.Schedule.parse("~always"))
            (True, '~always')
            >>> gm.Schedule.parse("__import__('os')", field="models[1].schedule")
            ... # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: models[1].schedule: "__import__('os')" is not a schedule: ...
        """
        return _Parser(text, field).schedule()


_TOKEN = re.compile(r"\s*(?:(?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
                    r"|(?P<name>[a-z]+)|(?P<op>[()&|~,=]))")
# A record's schedule is short: a longer or deeper one is crafted (and would nest past
# Python's recursion limit when evaluated).
_MAX_TEXT, _MAX_DEPTH = 10_000, 100
_GRAMMAR = ("a schedule reads as each(5), at(1, 2), after(3), before(4), always or never, "
            "combined with &, | and ~")


class _Parser:
    """Recursive descent over the schedule grammar of :meth:`Schedule.parse` (never eval)."""

    def __init__(self, text: object, field: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"{field}: expected a schedule's description (text), got "
                            f"{type(text).__name__}")
        self.text, self.field = text, field
        if len(text) > _MAX_TEXT:
            self.fail(f"longer than {_MAX_TEXT} characters")
        self.tokens: list[tuple[str, str, int]] = []
        at, end = 0, len(text.rstrip())
        while at < end:
            match = _TOKEN.match(text, at)
            if match is None or match.lastgroup is None:
                where = at + len(text[at:]) - len(text[at:].lstrip())
                self.fail(f"unexpected {text[where]!r} at {where}")
            kind = match.lastgroup
            self.tokens.append((kind, match[kind], match.start(kind)))
            at = match.end()
        if sum(value in "&|~" for kind, value, _ in self.tokens if kind == "op") > _MAX_DEPTH:
            self.fail(f"it combines more than {_MAX_DEPTH} rules")
        self.next = 0

    def fail(self, why: str) -> NoReturn:
        text = self.text if len(self.text) <= 200 else self.text[:200] + "..."
        raise ValueError(f"{self.field}: {text!r} is not a schedule: {why}; {_GRAMMAR}")

    def peek(self) -> str | None:
        return self.tokens[self.next][1] if self.next < len(self.tokens) else None

    def take(self, kind: str, value: str | None = None) -> str:
        wanted = repr(value) if value is not None else {"name": "a rule",
                                                        "number": "a number"}[kind]
        if self.next >= len(self.tokens):
            self.fail(f"it ends where {wanted} was expected")
        got_kind, got, where = self.tokens[self.next]
        if got_kind != kind or (value is not None and got != value):
            self.fail(f"{wanted} expected at {where}, got {got!r}")
        self.next += 1
        return got

    def schedule(self) -> Schedule:
        rule = self.either(0)
        if self.next < len(self.tokens):
            _, got, where = self.tokens[self.next]
            self.fail(f"unexpected {got!r} at {where}")
        return rule

    def either(self, depth: int) -> Schedule:
        rule = self.both(depth)
        while self.peek() == "|":
            self.next += 1
            rule = rule | self.both(depth)
        return rule

    def both(self, depth: int) -> Schedule:
        rule = self.unary(depth)
        while self.peek() == "&":
            self.next += 1
            rule = rule & self.unary(depth)
        return rule

    def unary(self, depth: int) -> Schedule:
        if depth > _MAX_DEPTH:
            self.fail(f"nested deeper than {_MAX_DEPTH}")
        if self.peek() == "~":
            self.next += 1
            return ~self.unary(depth + 1)
        if self.peek() == "(":
            self.next += 1
            rule = self.either(depth + 1)
            self.take("op", ")")
            return rule
        name = self.take("name")
        if name in ("always", "never"):
            return always if name == "always" else never
        if name not in _RULES:
            self.fail(f"{name!r} is no schedule (known: {', '.join(_RULES)}, always, never)")
        self.take("op", "(")
        numbers, start = [self.number()], None
        while self.peek() == ",":
            self.next += 1
            if self.peek() == "start" and name == "each" and start is None:
                self.next += 1
                self.take("op", "=")
                start = self.number()
            elif start is None:
                numbers.append(self.number())
            else:
                self.fail("start= comes last")
        self.take("op", ")")
        arguments = (*numbers, *(() if start is None else (start,)))
        if name in ("after", "before") and len(arguments) != 1:
            self.fail(f"{name}() takes one number")
        if name == "each" and len(arguments) > 2:
            self.fail("each() takes n and start")
        try:
            return _RULES[name](*arguments)
        except (TypeError, ValueError) as error:  # each(0), at(): the constructor's reason
            self.fail(str(error))

    def number(self) -> float:
        text = self.take("number")
        return float(text) if any(c in text for c in ".eE") else int(text)


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _integral(value: float) -> bool:
    return float(value).is_integer()


def _check(other: object, op: str) -> Schedule:
    if not isinstance(other, Schedule):
        raise TypeError(f"schedule {op} {other!r}: both sides must be schedules "
                        "(each, at, after, before, always, never)")
    return other


def _number(value: object, argument: str) -> float:
    """``value`` as a Python int or float (a NumPy scalar as its Python number), checked."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{argument} must be a number, got {value!r}: pass an int or a "
                        "float (a bool is no time, though Python counts True as 1)")
    if not math.isfinite(value):
        raise ValueError(f"{argument} must be finite, got {value!r}")
    return value if isinstance(value, int | float) else value.item()


@dataclasses.dataclass(frozen=True)
class _Each(Schedule):
    n: float
    start: float = 0

    def holds(self, points: np.ndarray) -> np.ndarray:
        offset = points - self.start
        if _is_int(self.n) and _is_int(self.start) and points.dtype.kind in "iu":
            return (offset >= 0) & (offset % self.n == 0)
        ratio = offset / self.n
        return (offset >= 0) & np.isclose(ratio, np.round(ratio), rtol=0, atol=1e-9)

    def holds_at(self, point: int) -> bool:
        offset = point - self.start
        if _is_int(self.n) and _is_int(self.start):
            return offset >= 0 and offset % self.n == 0
        ratio = offset / self.n
        return offset >= 0 and abs(ratio - round(ratio)) <= 1e-9

    def points_in(self, lo: float, hi: float) -> list[float]:
        first = max(math.floor((lo - self.start) / self.n) + 1, 0)
        last = math.floor((hi - self.start) / self.n)
        return [self.start + k * self.n for k in range(first, min(last, first + 4096) + 1)]

    def fractional(self) -> Schedule | None:
        return None if _integral(self.n) and _integral(self.start) else self

    def __repr__(self) -> str:
        return f"each({self.n}" + (f", start={self.start})" if self.start else ")")


@dataclasses.dataclass(frozen=True)
class _At(Schedule):
    times: tuple[float, ...]

    def holds(self, points: np.ndarray) -> np.ndarray:
        return np.isin(points, np.asarray(self.times))

    def holds_at(self, point: int) -> bool:
        return point in self.times

    def points_in(self, lo: float, hi: float) -> list[float]:
        return [t for t in self.times if lo < t <= hi]

    def fractional(self) -> Schedule | None:
        return None if all(map(_integral, self.times)) else self

    def __repr__(self) -> str:
        return f"at({', '.join(map(str, self.times))})"


@dataclasses.dataclass(frozen=True)
class _After(Schedule):
    t: float

    def holds(self, points: np.ndarray) -> np.ndarray:
        return points > self.t

    def holds_at(self, point: int) -> bool:
        return point > self.t

    def points_in(self, lo: float, hi: float) -> list[float]:
        return [self.t]

    def __repr__(self) -> str:
        return f"after({self.t})"


@dataclasses.dataclass(frozen=True)
class _Before(Schedule):
    t: float

    def holds(self, points: np.ndarray) -> np.ndarray:
        return points < self.t

    def holds_at(self, point: int) -> bool:
        return point < self.t

    def points_in(self, lo: float, hi: float) -> list[float]:
        return [self.t]

    def __repr__(self) -> str:
        return f"before({self.t})"


@dataclasses.dataclass(frozen=True)
class _Constant(Schedule):
    """``always`` holds everywhere (fires on every non-empty range), ``never`` nowhere.

    Examples:
        >>> from graphmod import always, never
        >>> always(3, 4), always(4, 4), never(0, 100)
        (True, False, False)
    """

    value: bool

    def holds(self, points: np.ndarray) -> np.ndarray:
        return np.full(np.shape(points), self.value)

    def holds_at(self, point: int) -> bool:
        return self.value

    def __repr__(self) -> str:
        return "always" if self.value else "never"


@dataclasses.dataclass(frozen=True)
class _And(Schedule):
    a: Schedule
    b: Schedule

    def holds(self, points: np.ndarray) -> np.ndarray:
        return self.a.holds(points) & self.b.holds(points)

    def holds_at(self, point: int) -> bool:
        return self.a.holds_at(point) and self.b.holds_at(point)

    def points_in(self, lo: float, hi: float) -> list[float]:
        return self.a.points_in(lo, hi) + self.b.points_in(lo, hi)

    def fractional(self) -> Schedule | None:
        return self.a.fractional() or self.b.fractional()

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


@dataclasses.dataclass(frozen=True)
class _Or(_And):
    def holds(self, points: np.ndarray) -> np.ndarray:
        return self.a.holds(points) | self.b.holds(points)

    def holds_at(self, point: int) -> bool:
        return self.a.holds_at(point) or self.b.holds_at(point)

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


@dataclasses.dataclass(frozen=True)
class _Not(Schedule):
    a: Schedule

    def holds(self, points: np.ndarray) -> np.ndarray:
        return ~self.a.holds(points)

    def holds_at(self, point: int) -> bool:
        return not self.a.holds_at(point)

    def points_in(self, lo: float, hi: float) -> list[float]:
        return self.a.points_in(lo, hi)

    def fractional(self) -> Schedule | None:
        return self.a.fractional()

    def __repr__(self) -> str:
        return f"~{self.a!r}"


def each(n: float, start: float = 0) -> Schedule:
    """Holds at ``start, start + n, start + 2n, ...``.

    ``n`` and ``start`` are numbers, never bools. A fraction (``each(2.5)``) is accepted
    for the seconds timelines; on an integer timeline (``On(..., step=each(2.5))``, a call
    on a range of ints) it is refused, naming the rule.

    Examples:
        >>> from graphmod import each
        >>> each(100)(0, 128), each(100)(128, 256), each(100, start=50)(0, 49)
        (True, True, False)
    """
    if _number(n, "each(n)") <= 0:
        raise ValueError(f"each(n): n must be > 0, got {n!r}")
    return _Each(n, _number(start, "each(start=...)"))


def at(*times: float) -> Schedule:
    """Holds at the given points.

    Each time is a number, never a bool; a fraction (``at(1.5)``) is accepted for the
    seconds timelines and refused on an integer one, as for :func:`each`.

    Examples:
        >>> from graphmod import at
        >>> at(3, 7)(2, 3), at(3, 7)(3, 6)
        (True, False)
    """
    if not times:
        raise ValueError("at(*times): give at least one time")
    return _At(tuple(_number(t, "at(...)") for t in times))


def after(t: float) -> Schedule:
    """Holds at every point strictly after ``t``.

    Examples:
        >>> from graphmod import after
        >>> after(10)(5, 10), after(10)(5, 11)
        (False, True)
    """
    return _After(_number(t, "after(t)"))


def before(t: float) -> Schedule:
    """Holds at every point strictly before ``t``.

    Examples:
        >>> from graphmod import before
        >>> before(10)(5, 20), before(10)(10, 20)
        (True, False)
    """
    return _Before(_number(t, "before(t)"))


always: Schedule = _Constant(True)
"""Holds everywhere: fires on every non-empty range."""

never: Schedule = _Constant(False)
"""Holds nowhere."""

# The constructors a schedule's description may name (Schedule.parse): an allow list.
_RULES = {"each": each, "at": at, "after": after, "before": before}
