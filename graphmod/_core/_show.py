"""What programs and their variables look like in a terminal and in a notebook.

Shapes, dtypes, roles and sizes, never the values: a display never copies an array from the
device. Plain text fits 100 columns (long paths are shortened from the left); HTML tables
are escaped.
"""

from __future__ import annotations

import html
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from graphmod._core._arguments import has_shape
from graphmod._core._order import declared_text
from graphmod._core._table import WIDTH, html_table, text_table


def _leaves(tree: Any, roles: Any = None, path: tuple[str, ...] = ()
            ) -> Iterator[tuple[tuple[str, ...], Any, str]]:
    """``(path, leaf, role name)`` of nested dicts, lists and tuples in order, with the
    role read from the same place of ``roles`` (a tree of the same nesting; "" if none)."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaves(value, _child(roles, key), (*path, str(key)))
    elif isinstance(tree, list | tuple) and not hasattr(tree, "shape"):
        names = getattr(tree, "_fields", None) or range(len(tree))  # a NamedTuple's fields
        for index, (name, value) in enumerate(zip(names, tree, strict=True)):
            yield from _leaves(value, _child(roles, index), (*path, str(name)))
    elif tree is not None:
        yield path, tree, getattr(roles, "name", "")


def _child(roles: Any, key: Any) -> Any:
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
    """

    def __init__(self, tree: Any, roles: Any = None, *, title: str = "variables",
                 placement: bool | None = None) -> None:
        self.title = title
        self.rows: list[dict[str, Any]] = []
        for path, leaf, role in _leaves(tree, roles):
            shape = tuple(getattr(leaf, "shape", ()))
            dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
            size = int(np.prod(shape, dtype=np.int64))
            itemsize = getattr(dtype, "itemsize", 0)
            sharding = getattr(leaf, "sharding", None)
            spec = getattr(sharding, "spec", None)
            shard = sharding.shard_shape(shape) if sharding is not None else shape
            # an owned variable's brick path ("/linear_layers/0", the root "/") joined once
            self.rows.append({"path": "/".join(p for part in path if (p := part.strip("/"))),
                              "role": role,
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

    @property
    def totals(self) -> str:
        spread = sum(r["per device"] for r in self.rows)
        return (f"{len(self.rows)} arrays, {size_text(self.size)} values, "
                f"{size_text(self.nbytes, 'B')}"
                + (f", {size_text(spread, 'B')} per device" if self.placement else ""))

    def _table(self) -> tuple[list[str], list[list[Any]]]:
        """Headers and cells; no role column where no array has a role (an optimizer's)."""
        headers = ["path", "role", "shape", "dtype", "size", "bytes"]
        cells = [[r["path"], r["role"], r["shape"], r["dtype"], r["size"],
                  size_text(r["bytes"], "B")] for r in self.rows]
        if self.placement:
            headers += ["placement", "per device"]
            for row, cell in zip(self.rows, cells, strict=True):
                cell += [row["placement"], size_text(row["per device"], "B")]
        if not any(r["role"] for r in self.rows):
            headers, cells = headers[:1] + headers[2:], [c[:1] + c[2:] for c in cells]
        return headers, cells

    def __repr__(self) -> str:
        return f"{text_table(*self._table())}\n{self.totals}"  # paths give way to fit

    def _repr_html_(self) -> str:
        return html_table(*self._table(), f"{self.title}: {self.totals}")


def program_lines(program: Any) -> list[str]:
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
    moves = getattr(program.managers, "moves", ())
    if moves:  # a declared constraint reversed two managers of the listed order
        lines.append(f"  order resolved from the listed {', '.join(program.managers.listed)}:")
        lines.extend(f"    moved {move}" for move in moves)
    traced = program.rewrites.modes
    examples = program.record.examples
    shapes = ", ".join(f"{name}: {tuple(value.shape)} {value.dtype}"
                       for name, value in (examples or {}).items()
                       if has_shape(value))
    lines.append(f"  traced: {', '.join(traced) or 'nothing yet'}"  # cut at its end below
                 + (f" (example {shapes})" if shapes else ""))
    return [line if len(line) <= WIDTH else line[:WIDTH - 1] + "…" for line in lines]


def program_html(program: Any) -> str:
    """The program's model tree (bricks, their variables with roles), managers in chain
    order and traces, as HTML tables."""
    layout = program.layout
    head = html.escape(program_lines(program)[0])
    variables = [[info.path, info.role.name, info.shape, info.dtype]
                 for info in layout.variables]
    moves = getattr(program.managers, "moves", ())
    managers = [[order, m.name, type(m).__name__, _selects(m, layout),
                 declared_text(m) or "-",
                 "; ".join(str(c) for c in moves if m.name in (c.first, c.then)) or "-"]
                for order, m in enumerate(program.managers)]
    caption = "managers, outermost first" + (
        f" (resolved from the listed {', '.join(program.managers.listed)})" if moves else "")
    parts = [f"<div><strong>{head}</strong></div>",
             html_table(["path", "role", "shape", "dtype"], variables, "model variables"),
             html_table(["order", "name", "class", "filter", "declares", "moved by"], managers,
                        caption if managers else "no managers"),
             f"<div>{html.escape(program_lines(program)[-1].strip())}</div>"]
    return "".join(parts)


def _selects(manager: Any, layout: Any) -> str:
    """What a manager rewrites: its filter, or the program's function for one whose only
    hook wraps it (``wrap_program``: Selective Backprop)."""
    if not manager.applies_to_calls and manager.has_hook("wrap_program"):
        return "around the program's function"
    return manager.filter.as_text(layout.brick_path)
