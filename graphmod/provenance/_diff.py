"""``diff``: what differs between two provenance records, inputs first, derived apart."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping

from graphmod._core._display._table import WIDTH, html_table, shorten, text_table
from graphmod._records._frozen import Frozen, FrozenDict
from graphmod._records._record import Provenance, is_record
from graphmod._records._summary import readable

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MISSING = object()
_HEADERS = ("field", "a", "b")


def _join(prefix: str, key: str) -> str:
    if _IDENTIFIER.match(key):
        return f"{prefix}.{key}" if prefix else key
    return f"{prefix}[{key!r}]"


def _is_leaf_tag(value: object) -> bool:
    return (isinstance(value, Mapping) and len(value) == 1 and next(iter(value)).startswith("$")
            and "$dict" not in value)


def _flatten(value: Frozen, prefix: str, derived: bool,
             out: dict[str, tuple[bool, Frozen]]) -> None:
    if isinstance(value, FrozenDict) and is_record(value):
        out[_join(prefix, "kind")] = (derived, value["kind"])
        _flatten(value["inputs"], prefix, derived, out)
        _flatten(value["derived"], prefix, True, out)
    elif isinstance(value, Mapping) and "$dict" in value and len(value) == 1:
        _flatten(value["$dict"], prefix, derived, out)
    elif isinstance(value, Mapping) and value and not _is_leaf_tag(value):
        for key, item in value.items():
            _flatten(item, _join(prefix, key), derived, out)
    elif isinstance(value, tuple) and value:
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}[{index}]", derived, out)
    else:
        out[prefix] = (derived, value)


def flatten(prov: Provenance) -> dict[str, tuple[bool, Frozen]]:
    """Field path → ``(is derived, value)`` for every leaf of a record."""
    out: dict[str, tuple[bool, Frozen]] = {}
    _flatten(prov._frozen(), "", False, out)
    out.pop("format", None)
    return out


@dataclasses.dataclass(frozen=True)
class Difference:
    """One field whose value differs (``a`` or ``b`` is None where the field is absent:
    see ``in_a``/``in_b``).

    Examples:
        >>> from graphmod.provenance import Difference
        >>> Difference("managers.dropout.arguments.rate", 0.1, 0.2, derived=False).row()
        ('managers.dropout.arguments.rate', '0.1', '0.2')
    """

    field: str
    a: Frozen
    b: Frozen
    derived: bool
    in_a: bool = True
    in_b: bool = True

    def row(self, field_width: int = 1000, value_width: int = 48) -> tuple[str, str, str]:
        return (shorten(self.field, field_width),
                readable(self.a, value_width) if self.in_a else "(absent)",
                readable(self.b, value_width) if self.in_b else "(absent)")


def _text_table(differences: tuple[Difference, ...]) -> str:
    """The differences as a table of at most 100 columns: long fields cut from the left,
    values from the right."""
    field = min(max(len(d.field) for d in differences), 40)
    value = (WIDTH - field - 4) // 2
    return text_table(_HEADERS, [d.row(field, value) for d in differences])


@dataclasses.dataclass(frozen=True)
class Differences:
    """The result of :func:`diff`: differing input fields, and derived ones apart.

    Prints as two tables (HTML in notebooks); ``fields`` lists the differing input fields.

    Examples:
        >>> import graphmod as gm
        >>> d = gm.provenance.diff(gm.Provenance("program", {"seed": 1}, {"t": 1}),
        ...                        gm.Provenance("program", {"seed": 2}, {"t": 2}))
        >>> d.fields, d.derived_fields, len(d), bool(d)
        (['seed'], ['t'], 2, True)
    """

    inputs: tuple[Difference, ...]
    derived: tuple[Difference, ...]

    @property
    def fields(self) -> list[str]:
        """The differing input fields."""
        return [d.field for d in self.inputs]

    @property
    def derived_fields(self) -> list[str]:
        """The differing derived fields (fingerprint, times, counts, ...)."""
        return [d.field for d in self.derived]

    def __iter__(self) -> Iterator[Difference]:
        return iter(self.inputs + self.derived)

    def __len__(self) -> int:
        return len(self.inputs) + len(self.derived)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.derived)

    def _caption(self) -> str:
        n, m = len(self.inputs), len(self.derived)
        return (f"{n} input field{'' if n == 1 else 's'} and {m} derived "
                f"field{'' if m == 1 else 's'} differ")

    def __str__(self) -> str:
        parts = [self._caption()]
        if self.inputs:
            parts += ["", "input fields", _text_table(self.inputs)]
        if self.derived:
            parts += ["", "derived fields", _text_table(self.derived)]
        return "\n".join(parts)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return (f"<p>{self._caption()}</p>"
                + html_table(_HEADERS, [d.row() for d in self.inputs], "input fields")
                + html_table(_HEADERS, [d.row() for d in self.derived], "derived fields"))


def diff(a: Provenance, b: Provenance) -> Differences:
    """What differs between two provenance records: input fields first, derived apart.

    Fields are named by their path in the record (``managers.dropout.arguments.rate``,
    ``bricks['/linear_layers/0'].arguments.out_features``); a nested record (the model of an
    evaluation) is flattened in place, its derived fields counted as derived.

    Args:
        a, b: two records (or JSON texts of records).

    Returns:
        :class:`Differences`: ``.fields`` (input fields), ``.derived_fields``, ``.inputs``
        and ``.derived`` (each a tuple of :class:`Difference`); prints as tables.

    Examples:
        >>> import graphmod as gm
        >>> a = gm.Provenance("program", {"managers": {"dropout": {"rate": 0.1}}},
        ...                   {"fingerprint": "sha256:aa"})
        >>> b = gm.Provenance("program", {"managers": {"dropout": {"rate": 0.2}}},
        ...                   {"fingerprint": "sha256:bb"})
        >>> d = gm.provenance.diff(a, b)
        >>> d.fields, d.derived_fields
        (['managers.dropout.rate'], ['fingerprint'])
        >>> print(d)
        1 input field and 1 derived field differ
        <BLANKLINE>
        input fields
        field                  a    b
        ---------------------  ---  ---
        managers.dropout.rate  0.1  0.2
        <BLANKLINE>
        derived fields
        field        a            b
        -----------  -----------  -----------
        fingerprint  'sha256:aa'  'sha256:bb'
    """
    records = []
    for label, record in (("a", a), ("b", b)):
        if isinstance(record, str | bytes):
            record = Provenance.from_json(record)
        if not isinstance(record, Provenance):
            raise TypeError(f"diff(a, b): {label} must be a Provenance (or its JSON), got "
                            f"{type(record).__name__}")
        records.append(flatten(record))
    left, right = records
    inputs: list[Difference] = []
    derived: list[Difference] = []
    for field in list(left) + [f for f in right if f not in left]:
        x, y = left.get(field, (None, _MISSING)), right.get(field, (None, _MISSING))
        if x[1] is not _MISSING and y[1] is not _MISSING and x[1] == y[1] \
                and type(x[1]) is type(y[1]):
            continue
        is_derived = x[0] if x[1] is not _MISSING else y[0]
        entry = Difference(field, None if x[1] is _MISSING else x[1],
                           None if y[1] is _MISSING else y[1], bool(is_derived),
                           x[1] is not _MISSING, y[1] is not _MISSING)
        (derived if is_derived else inputs).append(entry)
    return Differences(tuple(inputs), tuple(derived))
