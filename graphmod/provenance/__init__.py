"""Provenance: immutable records of how programs, runs and evaluations came to be.

Examples:
    >>> import graphmod as gm
    >>> gm.provenance.Provenance is gm.Provenance, gm.provenance.rebuild is gm.rebuild
    (True, True)
"""

from graphmod._records._collect import capture
from graphmod._records._optimizer import optimizer
from graphmod._records._record import Provenance, ProvenanceError
from graphmod.provenance._diff import Difference, Differences, diff
from graphmod.provenance._files import read
from graphmod.provenance._names import (
    DEFAULT_ALLOWED,
    DEFAULT_FACTORIES,
    RebuildError,
    default_names,
)
from graphmod.provenance._rebuild import Rebuilt, rebuild, rebuild_models
from graphmod.provenance._transforms import transforms

__all__ = [
    "DEFAULT_ALLOWED",
    "DEFAULT_FACTORIES",
    "Difference",
    "Differences",
    "Provenance",
    "ProvenanceError",
    "RebuildError",
    "Rebuilt",
    "capture",
    "default_names",
    "diff",
    "optimizer",
    "read",
    "rebuild",
    "rebuild_models",
    "transforms",
]
