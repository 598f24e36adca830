"""The provenance codec: one class per ``$tag``, each with its encode, decode and text.

Values are recorded as JSON, tagged where JSON has no type of its own (``{"$tuple": [...]}``,
``{"$callable": "jax.nn.relu"}``, ...; every tag is a :class:`Tag` subclass in this package,
registered in :data:`TAGS`). Bricks and managers encode their constructor arguments with
them at construction (``_construction``), records show them as text (``_records._summary``)
and ``graphmod.rebuild`` decodes them under its safety rules (``provenance._decoder``): all
three look the tag up here, so they cannot drift apart.

Sharp edges:

* Encoding tries :data:`ENCODERS` in order; the order matters (an ``IntEnum`` is an int, a
  ``np.float64`` a float, a brick a module, a bound method a callable).
* The core never resolves an import path: :class:`Decoding` asks its caller to, so the
  caller's rules decide what a record may name, and a check pass (``dry=True``) refuses a
  crafted record before anything is imported.
"""

from __future__ import annotations

from typing import Any

from graphmod._core._codec._arrays import (
    MAX_ARRAY,
    Array,
    Dtype,
    Float,
    Key,
    Rngs,
    hash_array,
    host_array,
    key_data_record,
)
from graphmod._core._codec._built import (
    Brick,
    BrickInstance,
    BrickPath,
    Dynamic,
    Filter,
    Opaque,
    Optimizer,
    construct,
    filter_fields,
    plain_filter,
)
from graphmod._core._codec._containers import Dict, Items, Tuple
from graphmod._core._codec._named import (
    Application,
    BoundApplicationTag,
    Call,
    Class,
    ClassApplicationTag,
    Enum,
    Function,
    Partial,
    Role,
)
from graphmod._core._codec._tag import (
    SKIP,
    TAGS,
    Decoding,
    Encoding,
    Kind,
    Tag,
    call_text,
    class_path,
    cut,
    join,
    opaque,
    short_repr,
)

__all__ = [
    "ENCODERS", "MAX_ARRAY", "SKIP", "TAGS", "Application", "Array", "BoundApplicationTag",
    "Brick", "BrickInstance", "BrickPath", "Call", "Class", "ClassApplicationTag", "Decoding",
    "Dict", "Dtype", "Dynamic", "Encoding", "Enum", "Filter", "Float", "Function", "Items",
    "Key", "Kind", "Opaque", "Optimizer", "Partial", "Rngs", "Role", "Tag", "Tuple",
    "call_text", "class_path", "construct", "cut", "filter_fields", "hash_array", "host_array",
    "import_paths", "join", "key_data_record", "opaque", "plain_filter", "short_repr"]

# The order in which tags are offered a value to encode (see "Sharp edges" above).
ENCODERS: tuple[Tag[Any], ...] = tuple(TAGS[tag.name] for tag in (
    Enum, Float, Role, Dynamic, Brick, Rngs, Filter, Key, Array, Dtype, Optimizer, Opaque,
    Tuple, Dict, Items, Class, BoundApplicationTag, Application, ClassApplicationTag,
    Partial, Function, Call))


class _Paths(Decoding):
    """A check pass that notes every import path instead of checking it."""

    def __init__(self) -> None:
        super().__init__(dry=True)
        self.found: list[tuple[object, Kind, str]] = []  # a crafted path may be no str

    def check(self, path: object, kind: Kind, where: str) -> None:
        self.found.append((path, kind, where))

    def lookup(self, path: object, kind: Kind, where: str) -> None:
        self.check(path, kind, where)


def import_paths(value: object, where: str = "value") -> list[tuple[object, Kind, str]]:
    """``(path, kind, where)`` of every import path a recorded value names, in the order a
    rebuild checks them (``kind``: ``"class"``, ``"function"``, ``"factory"`` or
    ``"partial"``). Imports nothing; raises ValueError naming the field of a malformed
    entry or of a value recorded as opaque, as the check pass does.

    Examples:
        >>> from graphmod._core._codec import import_paths
        >>> import_paths([{"$callable": "jax.nn.relu"}, {"$class": "graphmod.bricks.MLP"}])
        [('jax.nn.relu', 'function', 'value[0]'), ('graphmod.bricks.MLP', 'class', 'value[1]')]
    """
    paths = _Paths()
    paths(value, where)
    return paths.found
