"""Reading records back from run directories and JSON files."""

from __future__ import annotations

import os
import pathlib

from graphmod._records._record import Provenance, ProvenanceError
from graphmod._train._checkpoint import Checkpointer


def read(path: str | os.PathLike, *, step: int | None = None) -> Provenance:
    """The provenance record in ``path``: a run directory (the latest checkpoint's, or
    ``step``'s), a directory written by ``program.save``, or a JSON file.

    Examples:
        >>> import pathlib, tempfile, graphmod as gm
        >>> file = pathlib.Path(tempfile.mkdtemp()) / "prov.json"
        >>> _ = file.write_text(gm.Provenance("program", {"a": 1}).to_json())
        >>> gm.provenance.read(file)["a"]
        1
    """
    path = pathlib.Path(path)
    if path.is_file():
        try:
            return Provenance.from_json(path.read_bytes())
        except ProvenanceError as error:
            raise ProvenanceError(f"{path}: {error}") from None
    if not path.is_dir():
        raise FileNotFoundError(f"no provenance at {path}: neither a JSON file nor a run "
                                "directory")

    reader = Checkpointer(path, keep=None)
    try:
        meta = reader.meta(step)
    finally:
        reader.close()
    if "provenance" not in meta:
        why = meta.get("provenance_error", "its step was not a graphmod.optimize step")
        raise ValueError(f"{path}: the checkpoint holds no provenance record ({why})")
    try:
        return Provenance.from_dict(meta["provenance"])
    except ProvenanceError as error:
        raise ProvenanceError(f"{path} (step {step if step is not None else 'latest'}): "
                              f"{error}") from None
