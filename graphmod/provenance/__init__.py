"""Provenance: immutable records of how programs, runs and evaluations came to be.

Examples:
    >>> import graphmod as gm
    >>> gm.provenance.Provenance is gm.Provenance, gm.provenance.rebuild is gm.rebuild
    (True, True)
"""

from graphmod.provenance._collect import capture
from graphmod.provenance._diff import Difference, Differences, diff
from graphmod.provenance._files import read
from graphmod.provenance._names import DEFAULT_ALLOWED, RebuildError
from graphmod.provenance._optimizer import optimizer
from graphmod.provenance._rebuild import Rebuilt, rebuild
from graphmod.provenance._record import Provenance

__all__ = [
    "DEFAULT_ALLOWED",
    "Difference",
    "Differences",
    "Provenance",
    "RebuildError",
    "Rebuilt",
    "capture",
    "diff",
    "optimizer",
    "read",
    "rebuild",
]
