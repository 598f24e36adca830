"""What programs and their variables look like in a terminal and in a notebook.

Shapes, dtypes, roles and sizes, never the values: a display never copies an array from the
device. Plain text fits 100 columns (long paths are cut in the middle, keeping both ends);
arrays are grouped under their module; an optimizer's copies of the variables (Adam's ``mu``
and ``nu``) fold into one row each. HTML tables are escaped, text left-aligned and numbers
right-aligned. Where treescope is installed (Flax's own display), a ``VariablesTable`` and a
``TrainState`` render through it too: the nested variables folded by module, each array
annotated with its role.

Roles are the program's: a ``TrainState`` or a checkpoint's variables carry none, so each
program that computes the roles of a variable tree remembers them here by the tree's
structure (:func:`remember_roles`), for a display to find.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypedDict, TypeGuard, TypeVar

import jax
import numpy as np

from graphmod._core._display._table import WIDTH, html_table, text_table
from graphmod._core._managers._order import ManagerOrder, declared_text
from graphmod._core._program._arguments import has_shape
from graphmod.typing import PyTree

if TYPE_CHECKING:  # Flax's display, imported where it renders; what a program shows
    from treescope.renderers import TreescopeSubtreeRenderer
    from treescope.rendering_parts import RenderableAndLineAnnotations

    from graphmod._core._managers._manager import Manager
    from graphmod._core._model._layout import Layout
    from graphmod._core._program._program_record import ProgramRecord
    from graphmod._core._tracing._rewrites import Rewrites

_REMEMBERED = 16  # variable trees whose roles are kept (programs of one session)
_ROLES: dict[Hashable, object] = {}  # tree structure: roles tree, the newest last
R = TypeVar("R")
Fold: TypeAlias = Callable[[object, tuple[str, ...]], bool]  # does a subtree come whole?
# One row of a VariablesTable (a folded copy of the variables: its shape is a sentence).
_Row = TypedDict("_Row", {"path": str, "role": str, "shape": "tuple[int, ...] | str",
                          "dtype": str, "size": int, "bytes": int, "devices": int,
                          "placement": str, "per device": int})


def remember_roles(variables: PyTree, roles: R) -> R:
    """Keeps ``roles`` (the tree of roles of ``variables``) for displays of trees of the
    same structure (a ``TrainState``'s variables); returns ``roles``."""
    structure = jax.tree.structure(variables)
    _ROLES.pop(structure, None)
    _ROLES[structure] = roles
    while len(_ROLES) > _REMEMBERED:
        del _ROLES[next(iter(_ROLES))]
    return roles


def known_roles(variables: PyTree) -> object:
    """The roles a program computed for a tree of the structure of ``variables``, or None."""
    return _ROLES.get(jax.tree.structure(variables))


def _joined(path: tuple[str, ...]) -> str:
    """A path as the tables write it: an owned variable's brick path ("/linear_layers/0",
    the root "/") joined once."""
    return "/".join(p for part in path if (p := part.strip("/")))


def _leaves(tree: object, roles: object = None, path: tuple[str, ...] = (),
            fold: Fold | None = None) -> Iterator[tuple[tuple[str, ...], object, str]]:
    """``(path, leaf, role name)`` of nested dicts, lists and tuples in order, with the
    role read from the same place of ``roles`` (a tree of the same nesting; "" if none);
    a subtree ``fold`` holds for comes whole, as one leaf."""
    if fold is not None and fold(tree, path):
        yield path, tree, ""
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaves(value, _child(roles, key), (*path, str(key)), fold)
    elif isinstance(tree, list | tuple) and not hasattr(tree, "shape"):
        names = getattr(tree, "_fields", None) or range(len(tree))  # a NamedTuple's fields
        for index, (name, value) in enumerate(zip(names, tree, strict=True)):
            yield from _leaves(value, _child(roles, index), (*path, str(name)), fold)
    elif tree is not None:
        yield path, tree, getattr(roles, "name", "")


def _shape(leaf: object) -> tuple[int, ...]:
    """A leaf's shape: its own, else NumPy's for it (a number's, ``()``)."""
    return np.shape(leaf)  # pyright: ignore[reportArgumentType, reportCallIssue]  # any leaf


def _mirrors(variables: PyTree) -> Fold:
    """Whether a subtree of an optimizer state holds a copy of (some of) ``variables``:
    arrays at their paths with their shapes (Adam's ``mu``, ``nu``)."""
    shapes = {_joined(path): _shape(leaf) for path, leaf, _ in _leaves(variables)}

    def mirrors(tree: object, path: tuple[str, ...]) -> bool:
        if not isinstance(tree, Mapping):
            return False
        leaves = list(_leaves(tree))
        return bool(leaves) and all(shapes.get(_joined(p), -1) == _shape(leaf)
                                    for p, leaf, _ in leaves)
    return mirrors


def _child(roles: object, key: Hashable) -> object:
    if isinstance(roles, Mapping):
        return roles.get(key)
    if isinstance(roles, list | tuple) and isinstance(key, int) and key < len(roles):
        return roles[key]
    return None


def size_text(count: float, unit: str = "") -> str:
    """A count with a short suffix: ``1.5K``, ``2.1M`` (``unit`` ``"B"``: bytes, 1024-based).

    Examples:
        >>> size_text(1536, "B"), size_text(69130), size_text(12)
        ('1.5 KiB', '69.1K', '12')
    """
    base, suffixes = (1024, (" B", " KiB", " MiB", " GiB")) if unit == "B" else (
        1000, ("", "K", "M", "G"))
    for suffix in suffixes[:-1]:
        if abs(count) < base:
            return f"{count:.0f}{suffix}" if suffix in ("", " B") else f"{count:.1f}{suffix}"
        count /= base
    return f"{count:.1f}{suffixes[-1]}"


class VariablesTable:
    """The variables of a tree (``program.init``'s dict, a ``TrainState``'s): path, role,
    shape, dtype, size and bytes per array, and the totals. Never the values.

    Arrays are listed under their module where there are several modules; with ``like``
    (the variables an optimizer state was made for) each copy of them in the tree (Adam's
    ``mu`` and ``nu``) is one folded row. In a notebook: an HTML table, or treescope's
    foldable tree (each array annotated with its role) where treescope renders it.

    Examples:
        >>> import jax.numpy as jnp, graphmod as gm
        >>> table = gm.VariablesTable({"model": {"W": jnp.ones((2, 3)), "b": jnp.ones(3)}})
        >>> table.size, table.nbytes
        (9, 36)
        >>> print(table)
        path     shape   dtype    size  bytes
        -------  ------  -------  ----  -----
        model/W  (2, 3)  float32  6     24 B
        model/b  (3,)    float32  3     12 B
        2 arrays, 9 values, 36 B
        >>> import optax  # Adam's moments: a row each, not one per parameter
        >>> variables = {"model": {"W": jnp.ones((2, 3)), "b": jnp.ones(3)}}
        >>> print(gm.VariablesTable(optax.adam(1e-3).init(variables), like=variables))
        path     shape                       dtype    size  bytes
        -------  --------------------------  -------  ----  -----
        0/count  ()                          int32    1     4 B
        0/mu     2 arrays, as the variables  float32  9     36 B
        0/nu     2 arrays, as the variables  float32  9     36 B
        5 arrays, 19 values, 76 B

    Args:
        tree: nested dicts, lists and tuples of arrays.
        roles: the tree of their roles (``program.roles(variables)``), for a role column.
        title: the HTML table's caption.
        placement: whether to show where the arrays live (default: when any spans
            several devices).
        like: the variables an optimizer state ``tree`` was made for: its copies of them
            fold into a row each.
    """

    def __init__(self, tree: PyTree, roles: PyTree = None, *, title: str = "variables",
                 placement: bool | None = None, like: PyTree = None) -> None:
        self.title = title
        self.tree, self.roles = tree, roles
        self.rows: list[_Row] = []
        self.folded: dict[str, int] = {}  # path of a folded copy of ``like``: its arrays
        for path, leaf, role in _leaves(tree, roles, fold=None if like is None
                                        else _mirrors(like)):
            if isinstance(leaf, Mapping):  # a copy of the variables, folded
                self._fold(_joined(path), leaf)
                continue
            shape = tuple(getattr(leaf, "shape", ()))
            dtype = getattr(leaf, "dtype", None)
            if dtype is None:  # a number's; NumPy's stubs take array-likes only
                dtype = np.result_type(leaf)  # pyright: ignore[reportArgumentType]
            size = int(np.prod(shape, dtype=np.int64))
            itemsize = getattr(dtype, "itemsize", 0)
            sharding = getattr(leaf, "sharding", None)
            spec = getattr(sharding, "spec", None)
            shard = sharding.shard_shape(shape) if sharding is not None else shape
            self.rows.append({"path": _joined(path), "role": role,
                              "shape": shape, "dtype": str(dtype), "size": size,
                              "bytes": size * itemsize,
                              "devices": len(sharding.device_set) if sharding else 1,
                              "placement": ("one device" if spec is None else
                                            "replicated" if not any(spec) else str(spec)),
                              "per device": int(np.prod(shard, dtype=np.int64)) * itemsize})
        self.size = sum(r["size"] for r in self.rows)
        self.nbytes = sum(r["bytes"] for r in self.rows)
        # Where the arrays live, shown when asked or when any spans several devices.
        self.placement = any(r["devices"] > 1 for r in self.rows) if placement is None \
            else placement

    def _fold(self, path: str, copy: Mapping[str, object]) -> None:
        """One row for ``copy`` (an optimizer's copy of the variables) at ``path``."""
        inner = VariablesTable(copy, placement=False)
        dtypes = sorted({r["dtype"] for r in inner.rows})
        self.folded[path] = len(inner.rows)
        self.rows.append({"path": path, "role": "", "shape": f"{len(inner.rows)} arrays, "
                          "as the variables", "dtype": dtypes[0] if len(dtypes) == 1
                          else "mixed", "size": inner.size, "bytes": inner.nbytes,
                          "devices": max(r["devices"] for r in inner.rows),
                          "placement": "as the variables",
                          "per device": sum(r["per device"] for r in inner.rows)})

    @property
    def arrays(self) -> int:
        """How many arrays the tree holds (a folded row counts its own)."""
        return len(self.rows) - len(self.folded) + sum(self.folded.values())

    @property
    def totals(self) -> str:
        spread = sum(r["per device"] for r in self.rows)
        return (f"{self.arrays} arrays, {size_text(self.size)} values, "
                f"{size_text(self.nbytes, 'B')}"
                + (f", {size_text(spread, 'B')} per device" if self.placement else ""))

    def _table(self) -> tuple[list[str], list[list[object]], list[tuple[int, str]]]:
        """Headers, cells and the modules' groups (``(first row, module path)``, where
        there are several modules and one has several arrays: a row then names its array
        in the module); no role column where no array has a role (an optimizer's)."""
        headers = ["path", "role", "shape", "dtype", "size", "bytes"]
        cells: list[list[object]] = [[r["path"], r["role"], r["shape"], r["dtype"], r["size"],
                                      size_text(r["bytes"], "B")] for r in self.rows]
        if self.placement:
            headers += ["placement", "per device"]
            for row, cell in zip(self.rows, cells, strict=True):
                cell += [row["placement"], size_text(row["per device"], "B")]
        if not any(r["role"] for r in self.rows):
            headers, cells = headers[:1] + headers[2:], [c[:1] + c[2:] for c in cells]
        modules = [r["path"].rpartition("/")[0] if r["path"] not in self.folded else None
                   for r in self.rows]
        groups: list[tuple[int, str]] = []
        if len(set(modules) - {None}) > 1 and len(modules) > len(set(modules)):
            for index, (module, cell) in enumerate(zip(modules, cells, strict=True)):
                if module is None:
                    continue
                if not groups or modules[groups[-1][0]] != module:
                    groups.append((index, f"{module}/" if module else "(top level)"))
                cell[0] = str(cell[0])[len(module) + 1:] if module else cell[0]
        return headers, cells, groups

    def __repr__(self) -> str:
        headers, cells, groups = self._table()
        titles = dict(groups)
        rows = []  # a module's line, then its arrays indented under it
        for index, cell in enumerate(cells):
            if index in titles:
                rows.append([titles[index], *[""] * (len(cell) - 1)])
            rows.append([f"  {cell[0]}" if groups and self.rows[index]["path"]
                         not in self.folded else cell[0], *cell[1:]])
        return f"{text_table(headers, rows)}\n{self.totals}"  # paths give way to fit

    def _repr_html_(self) -> str:
        headers, cells, groups = self._table()
        return html_table(headers, cells, f"{self.title}: {self.totals}", groups)

    def __treescope_repr__(self, path: str | None, subtree_renderer: TreescopeSubtreeRenderer
                           ) -> RenderableAndLineAnnotations:
        """Treescope's rendering (Flax's display): the tree folded by module, each array
        annotated with its role."""
        return treescope_tree(self.tree, self.roles, path, subtree_renderer,
                              f"{self.title}: {self.totals}")


def treescope_tree(tree: PyTree, roles: PyTree, path: str | None,
                   subtree_renderer: TreescopeSubtreeRenderer, comment: str = "",
                   like: PyTree = None) -> RenderableAndLineAnnotations:
    """A treescope rendering of nested dicts, lists and tuples of arrays: a foldable node
    per module (its size as a comment), each array by treescope's own renderer with its
    role as a comment; ``comment`` on the first line. With ``like`` (the variables an
    optimizer state was made for), each copy of them (Adam's ``mu``) is a collapsed node."""
    from treescope import rendering_parts as parts  # Flax's display: only where it renders

    mirrors = None if like is None else _mirrors(like)
    note = lambda text: parts.comment_color(parts.text(f"  # {text}"))
    comma = parts.siblings(",", parts.fold_condition(collapsed=parts.text(" ")))

    def node(value: object, role: object, at: str | None, first: str = ""
             ) -> RenderableAndLineAnnotations:
        if isinstance(value, Mapping):
            items = [(f"{key!r}: ", key, f"[{key!r}]", child) for key, child in value.items()]
            prefix, suffix = "{", "}"
        elif isinstance(value, list | tuple) and not hasattr(value, "shape"):
            fields = getattr(value, "_fields", None)  # a NamedTuple: ScaleByAdamState
            items = [(f"{fields[index]}=" if fields else "", index,
                      f".{fields[index]}" if fields else f"[{index}]", child)
                     for index, child in enumerate(value)]
            prefix = f"{type(value).__name__}(" if fields else "[" if isinstance(
                value, list) else "("
            suffix = ")" if fields or isinstance(value, tuple) else "]"
        else:
            shown = subtree_renderer(value, path=at)
            name = getattr(role, "name", "")
            return shown if not name else parts.RenderableAndLineAnnotations(
                shown.renderable, parts.siblings(shown.annotations, parts.fold_condition(
                    expanded=note(name))))
        table = VariablesTable(value)
        folded = mirrors is not None and mirrors(value, ())
        if not first:
            first = (f"{table.arrays} arrays, as the variables" if folded else
                     f"{table.arrays} arrays") + f", {size_text(table.size)} values"
        children = [parts.build_full_line_with_annotations(
            parts.siblings_with_annotations(label, node(
                child, _child(role, key), None if at is None else at + step)), comma)
            for label, key, step, child in items]
        return parts.build_foldable_tree_node_from_children(
            prefix=prefix, children=children, suffix=suffix, path=at,
            first_line_annotation=note(first),
            expand_state=parts.ExpandState.COLLAPSED if folded
            else parts.ExpandState.WEAKLY_COLLAPSED)

    return node(tree, roles, path, comment)


class _Program(Protocol):
    """What a display reads of a program (the program's modules import this one)."""

    @property
    def fn(self) -> Callable[..., object]: ...

    @property
    def layout(self) -> Layout: ...

    @property
    def managers(self) -> tuple[Manager, ...]: ...

    @property
    def rewrites(self) -> Rewrites: ...

    @property
    def record(self) -> ProgramRecord: ...


def program_lines(program: _Program) -> list[str]:
    """A program in a few lines of at most 100 columns: function, model, managers, traces."""
    fn = getattr(program.fn, "__qualname__", type(program.fn).__name__)
    layout = program.layout
    size = sum(int(np.prod(v.shape, dtype=np.int64)) for v in layout.variables)
    lines = [f"Program {fn}(model, ...) over {type(layout.model).__name__}: "
             f"{len(layout.variables)} arrays, {size_text(size)} values"]
    for order, manager in enumerate(program.managers):
        declared = declared_text(manager)  # kinds and constraints: why it sits here
        lines.append(f"  {order}. {manager.name}: {type(manager).__name__}, "
                     f"{_selects(manager, layout)}" + (f"; {declared}" if declared else ""))
    if not program.managers:
        lines.append("  no managers")
    order = program.managers if isinstance(program.managers, ManagerOrder) else None
    if order is not None and order.moves:  # a declared constraint reversed two managers
        lines.append(f"  order resolved from the listed {', '.join(order.listed)}:")
        lines.extend(f"    moved {move}" for move in order.moves)
    traced = program.rewrites.modes
    examples = program.record.examples
    shapes = ", ".join(f"{name}: {tuple(value.shape)} {value.dtype}"
                       for name, value in (examples or {}).items()
                       if _has_shape(value))
    lines.append(f"  traced: {', '.join(traced) or 'nothing yet'}"  # cut at its end below
                 + (f" (example {shapes})" if shapes else ""))
    return [line if len(line) <= WIDTH else line[:WIDTH - 1] + "…" for line in lines]


def program_html(program: _Program) -> str:
    """The program's model tree (bricks, their variables with roles), managers in chain
    order and traces, as HTML tables."""
    layout = program.layout
    head = html.escape(program_lines(program)[0])
    variables = [[info.path, info.role.name, info.shape, info.dtype]
                 for info in layout.variables]
    order = program.managers if isinstance(program.managers, ManagerOrder) else None
    moves = order.moves if order is not None else ()
    managers: list[list[object]] = [[index, m.name, type(m).__name__, _selects(m, layout),
                 declared_text(m) or "-",
                 "; ".join(str(c) for c in moves if m.name in (c.first, c.then)) or "-"]
                for index, m in enumerate(program.managers)]
    caption = "managers, outermost first" + (
        f" (resolved from the listed {', '.join(order.listed)})" if order and moves else "")
    parts = [f"<div><strong>{head}</strong></div>",
             html_table(["path", "role", "shape", "dtype"], variables, "model variables"),
             html_table(["order", "name", "class", "filter", "declares", "moved by"], managers,
                        caption if managers else "no managers"),
             f"<div>{html.escape(program_lines(program)[-1].strip())}</div>"]
    return "".join(parts)


class _Shaped(Protocol):
    shape: tuple[int, ...]
    dtype: object


def _has_shape(value: object) -> TypeGuard[_Shaped]:
    """Whether ``value`` is array-like (see ``has_shape``)."""
    return has_shape(value)


def _selects(manager: Manager, layout: Layout) -> str:
    """What a manager rewrites: its filter, or the program's function for one whose only
    hook wraps it (``wrap_program``: Selective Backprop)."""
    if not manager.applies_to_calls and manager.has_hook("wrap_program"):
        return "around the program's function"
    return manager.filter.as_text(layout.brick_path)
