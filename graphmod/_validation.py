"""Checks of what users pass to programs, with errors that name the culprit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from graphmod._layout import Key


def flat_keys(tree: Any, prefix: Key = ()) -> set[Key]:
    """The key paths of the leaves of a nested dict."""
    if not isinstance(tree, Mapping):
        return {prefix}
    keys: set[Key] = set()
    for key, value in tree.items():
        keys |= flat_keys(value, (*prefix, key))
    return keys


def tree_difference(expected: set[Key], actual: set[Key]) -> tuple[list[str], list[str]]:
    """``(missing, extra)`` key paths, as readable strings, sorted."""
    show = lambda keys: sorted("/".join(map(str, k)) for k in keys)
    return show(expected - actual), show(actual - expected)


def _canonical(dtype: Any) -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def check_arguments(examples: dict[str, Any], actual: dict[str, Any]) -> None:
    """Compares traced arguments with ``init``'s examples: ranks, feature sizes, dtypes.

    The leading (batch) dimension and the middle ones (time, space) may differ; the rank,
    the last (feature) dimension and the canonical dtype must match.
    """
    for name, example in examples.items():
        if name not in actual:
            continue
        got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(actual[name])
        want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(example)
        if got_tree != want_tree:
            raise ValueError(
                f"argument {name!r}: expected the structure of init's example {want_tree}, "
                f"got {got_tree}"
            )
        for (path, got), (_, want) in zip(got_leaves, want_leaves, strict=True):
            where = f"argument {name!r}{jax.tree_util.keystr(path)}"
            got_shape, want_shape = tuple(np.shape(got)), tuple(want.shape)
            got_dtype, want_dtype = _canonical(jax.numpy.result_type(got)), _canonical(want.dtype)
            fits = (len(got_shape) == len(want_shape) and got_dtype == want_dtype
                    and (len(want_shape) < 2 or got_shape[-1] == want_shape[-1]))
            if not fits:
                expected = _expected_shape(want_shape)
                raise ValueError(
                    f"{where}: expected shape {expected} and dtype {want_dtype} (as in "
                    f"init's example), got shape {got_shape} and dtype {got_dtype}"
                )


def _expected_shape(shape: tuple[int, ...]) -> str:
    """``(batch, *, 4)``: the leading and middle dimensions may vary, the last may not."""
    if not shape:
        return "()"
    middle = ", *" * (len(shape) - 2)
    last = f", {shape[-1]}" if len(shape) >= 2 else ""
    return f"(batch{middle}{last})"
