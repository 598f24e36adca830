"""Data sources for the loop and evaluation.

Examples:
    >>> import numpy as np
    >>> from graphmod.data import ArraySource
    >>> ArraySource(np.array([[1, 2], [3, 4]]), batch_size=1).size
    2
"""

from graphmod.data._array_source import ArraySource
from graphmod.data._grain import GrainSource
from graphmod.data._metadata import FieldInfo, Metadata
from graphmod.data._transforms import (
    Bin,
    Clip,
    FittedTransforms,
    MinMax,
    OneHot,
    Standardize,
    Transformation,
    Transforms,
    Vocabulary,
)

__all__ = [
    "ArraySource",
    "Bin",
    "Clip",
    "FieldInfo",
    "FittedTransforms",
    "GrainSource",
    "Metadata",
    "MinMax",
    "OneHot",
    "Standardize",
    "Transformation",
    "Transforms",
    "Vocabulary",
]
