"""The rewrite trace: which manager rewrote which variable, in the order it happened."""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Iterator, Mapping, Sequence, Set
from typing import TYPE_CHECKING

import jax

from graphmod._core._display._table import html_table, text_table
from graphmod._core._managers._order import ManagerOrder
from graphmod._core._program._arguments import spec

if TYPE_CHECKING:
    from treescope.renderers import TreescopeSubtreeRenderer
    from treescope.rendering_parts import RenderableAndLineAnnotations

    from graphmod._core._managers._manager import Manager
    from graphmod._core._selection._filter import Tag


def shape_and_dtype(value: object) -> tuple[tuple[int, ...], str]:
    """The shape and dtype of an array-like value, for records (a pytree: its leaves')."""
    leaves = jax.tree.leaves(value)
    if len(leaves) == 1:
        return spec(leaves[0])
    return (), f"pytree[{len(leaves)}]"


_HEADERS = ("#", "manager", "path", "application", "call", "role", "variable", "shape", "dtype")


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One rewrite of one tagged variable by one manager, or (role ``CALL``, no variable)
    one application call wrapped by a manager whose only hook is ``wrap`` (``Remat``)."""

    manager: str
    path: str
    application: str
    call_id: int
    role: str
    name: str
    shape_in: tuple[int, ...]
    dtype_in: str
    shape_out: tuple[int, ...]
    dtype_out: str

    @classmethod
    def of(cls, by: str, tag: Tag, before: object, after: object) -> Rewrite:
        """``by``'s rewrite of tagged variable ``tag`` from ``before`` to ``after``."""
        return cls(by, tag.brick_path, tag.application, tag.call_id, tag.role.name, tag.label,
                   *shape_and_dtype(before), *shape_and_dtype(after))

    @classmethod
    def wrap(cls, by: str, path: str, application: str, call_id: int) -> Rewrite:
        """``by``'s wrap around call ``call_id`` of ``application`` at ``path``."""
        return cls(by, path, application, call_id, "CALL", "", (), "", (), "")

    @property
    def shape(self) -> str:
        """The ``shape`` column: ``shape_in``, or ``shape_in->shape_out`` where they differ."""
        return _change(self.shape_in, self.shape_out)

    @property
    def dtype(self) -> str:
        """The ``dtype`` column: ``dtype_in``, or ``dtype_in->dtype_out`` where they differ
        (a cast: ``float32->bfloat16``)."""
        return _change(self.dtype_in, self.dtype_out)

    def row(self, index: int) -> tuple[int | str, ...]:
        if self.role == "CALL":
            return (index, self.manager, self.path, self.application, self.call_id,
                    self.role, "-", "-", "-")
        return (index, self.manager, self.path, self.application, self.call_id, self.role,
                self.name, self.shape, self.dtype)


def _change(before: object, after: object) -> str:
    return str(before) if before == after else f"{before}->{after}"


@dataclasses.dataclass(frozen=True)
class RewriteTrace:
    """The rewrites of the latest trace of one mode, in order; prints as a table. Beside
    them ``unchanged``: per manager, how many variables of calls it matched and left as they
    were (L2 reads a weight for its cost, dropout leaves its inputs at inference).

    Examples:
        >>> from graphmod._core._tracing._rewrites import Rewrite, RewriteTrace
        >>> r = Rewrite("dropout", "/", "apply", 0, "INPUT", "input_", (2,), "float32",
        ...             (2,), "float32")
        >>> print(RewriteTrace("train", (r,)))
        train: 1 rewrite
        #  manager  path  application  call  role   variable  shape  dtype
        -  -------  ----  -----------  ----  -----  --------  -----  -------
        0  dropout  /     apply        0     INPUT  input_    (2,)   float32
    """

    mode: str
    rewrites: tuple[Rewrite, ...] = ()
    unchanged: tuple[tuple[str, int], ...] = ()
    # The chain's resolved order and what moved it, when a declared constraint reversed two
    # managers of the listed order (see graphmod._core._managers._order), as lines of text.
    order: tuple[str, ...] = ()

    @classmethod
    def traced(cls, mode: str, rewrites: Sequence[Rewrite],
               unchanged: Mapping[str, Set[tuple[str, str, int, str]]],
               managers: Sequence[Manager] = ()) -> RewriteTrace:
        """The trace of ``mode`` from a frame's rewrites, the variables left by manager and
        the managers in their resolved order (a ``ManagerOrder``, whose ``lines()`` say
        which constraint moved what)."""
        lines = managers.lines() if isinstance(managers, ManagerOrder) else []
        return cls(mode, tuple(rewrites),
                   tuple((by, len(left)) for by, left in unchanged.items()), tuple(lines))

    def __iter__(self) -> Iterator[Rewrite]:
        return iter(self.rewrites)

    def __len__(self) -> int:
        return len(self.rewrites)

    def __getitem__(self, index: int) -> Rewrite:
        return self.rewrites[index]

    def same_as(self, other: RewriteTrace) -> bool:
        """Whether ``other`` (another mode's) rewrote, left and ordered the same."""
        return (self.rewrites, self.unchanged, self.order) == (
            other.rewrites, other.unchanged, other.order)

    def _caption(self, modes: Sequence[str] = ()) -> str:
        n = len(self.rewrites)
        left = ", ".join(f"{by} {count}" for by, count in self.unchanged)
        return (f"{' and '.join(modes or (self.mode,))}: {n} rewrite{'' if n == 1 else 's'}"
                + (f"; variables matched and left as they were: {left}" if left else ""))

    def _text(self, modes: Sequence[str] = ()) -> str:
        """The table under a caption naming ``modes`` (default: this trace's)."""
        rows = [r.row(i) for i, r in enumerate(self.rewrites)]
        order = "".join(f"{line}\n" for line in self.order)
        return self._caption(modes) + "\n" + order + text_table(_HEADERS, rows)

    def __str__(self) -> str:
        return self._text()

    def _html(self, modes: Sequence[str] = ()) -> str:
        order = "".join(f"<div>{html.escape(line)}</div>" for line in self.order)
        return order + html_table(_HEADERS, [r.row(i) for i, r in enumerate(self.rewrites)],
                                  self._caption(modes))

    def _repr_html_(self) -> str:
        return self._html()

    def _treescope(self, modes: Sequence[str] = ()) -> RenderableAndLineAnnotations:
        """Treescope's rendering: the caption, then a foldable node per brick path whose
        lines are its rewrites (manager, application and call, role, variable, shape,
        dtype)."""
        from treescope import rendering_parts as parts  # Flax's display: where it renders

        by_path: dict[str, list[Rewrite]] = {}
        for rewrite in self.rewrites:
            by_path.setdefault(rewrite.path, []).append(rewrite)
        line = lambda r: parts.siblings(" ".join(str(c) for c in (
            r.manager, f"{r.application}[{r.call_id}]", *r.row(0)[5:]) if c != "-"),
            parts.fold_condition(collapsed=parts.text("; ")))
        nodes = [parts.build_foldable_tree_node_from_children(
            prefix=f"{path}: ", children=[line(r) for r in rewrites], suffix="",
            first_line_annotation=parts.comment_color(parts.text(
                f"  # {len(rewrites)} rewrite{'' if len(rewrites) == 1 else 's'}")))
            for path, rewrites in by_path.items()]
        return parts.build_foldable_tree_node_from_children(
            prefix=f"{self._caption(modes)}", children=nodes, suffix="",
            expand_state=parts.ExpandState.EXPANDED)

    def __treescope_repr__(self, path: str | None, subtree_renderer: TreescopeSubtreeRenderer
                           ) -> RenderableAndLineAnnotations:
        return self._treescope()


_MODES = ("init", "train", "infer")


class Rewrites:
    """``program.rewrites``: the latest rewrite trace per mode (``train``, ``infer``, ``init``).

    A mode not traced yet gives an empty trace; ``in`` and iteration see the traced modes.

    Examples:
        >>> from graphmod._core._tracing._rewrites import Rewrites
        >>> Rewrites()["train"].rewrites, "train" in Rewrites(), list(Rewrites())
        ((), False, [])
    """

    def __init__(self) -> None:
        self._by_mode: dict[str, RewriteTrace] = {}

    def store(self, trace: RewriteTrace) -> None:
        self._by_mode[trace.mode] = trace

    def __getitem__(self, mode: str) -> RewriteTrace:
        if mode not in _MODES:
            raise KeyError(f"program.rewrites[{mode!r}]: the modes are {', '.join(_MODES)}")
        return self._by_mode.get(mode, RewriteTrace(mode))

    def __contains__(self, mode: object) -> bool:
        return mode in self._by_mode

    def __iter__(self) -> Iterator[str]:  # else Python would index it 0, 1, 2, ... forever
        return iter(self.modes)

    def __len__(self) -> int:
        return len(self._by_mode)

    @property
    def train(self) -> RewriteTrace:
        return self["train"]

    @property
    def infer(self) -> RewriteTrace:
        return self["infer"]

    @property
    def modes(self) -> list[str]:
        """The modes traced so far, of ``init``, ``train`` and ``infer``."""
        return [m for m in _MODES if m in self._by_mode]

    def _shown(self) -> list[tuple[RewriteTrace, list[str]]]:
        """Each trace shown once, with the modes that traced the same (``init`` and
        ``train`` mostly do: one table for both)."""
        shown: list[tuple[RewriteTrace, list[str]]] = []
        for mode in self.modes:
            trace = self._by_mode[mode]
            same = next((modes for first, modes in shown if first.same_as(trace)), None)
            if same is None:
                shown.append((trace, [mode]))
            else:
                same.append(mode)
        return shown

    def __str__(self) -> str:
        shown = [trace._text(modes) for trace, modes in self._shown()]
        return "\n\n".join(shown) if shown else "no trace yet"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return "".join(trace._html(modes) for trace, modes in self._shown()
                       ) or "<p>no trace yet</p>"

    def __treescope_repr__(self, path: str | None, subtree_renderer: TreescopeSubtreeRenderer
                           ) -> RenderableAndLineAnnotations:
        """Treescope's rendering: each mode's trace (once for modes that agree)."""
        from treescope import rendering_parts as parts  # Flax's display: where it renders

        return parts.build_foldable_tree_node_from_children(
            prefix="program.rewrites(", suffix=")", expand_state=parts.ExpandState.EXPANDED,
            children=[trace._treescope(modes) for trace, modes in self._shown()]
            or [parts.text("no trace yet")])
