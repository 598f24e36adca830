"""Checkpoints of a run: the train state (orbax) and a JSON record of everything else.

A checkpoint directory holds one sub-directory per saved step, written by orbax's
``CheckpointManager``: ``state`` (the train state's arrays; PRNG keys stored as their key
data) and ``meta`` (JSON: loop counters and timelines, data position, plugin states, the
state's leaf paths, shapes and dtypes, and the provenance record when there is one). Orbax
writes into a temporary directory and renames it when complete, so a save cut off half-way
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

FORMAT = 1


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def describe(state: Any) -> dict[str, list[Any]]:
    """``{leaf path: [shape, dtype]}`` of a state (keys described by their key data)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if _is_key(leaf):  # described by its key data, for arrays and abstract keys alike
            data = jax.eval_shape(jax.random.key_data, leaf)
            shape, dtype = list(data.shape), str(leaf.dtype)
        else:
            shape, dtype = list(np.shape(leaf)), str(jnp.result_type(leaf))
        out[jax.tree_util.keystr(path)] = [shape, dtype]
    return out


def storable(state: Any) -> Any:
    """The state as a tree of host NumPy arrays (keys as key data), safe to write later."""
    def host(leaf: Any) -> np.ndarray:
        if _is_key(leaf):
            leaf = jax.random.key_data(leaf)
        return np.array(leaf)  # a copy: the loop donates the state's buffers next step

    return jax.tree.map(host, state)


def _restored(template: Any, tree: Any) -> Any:
    def back(want: Any, got: Any) -> Any:
        if _is_key(want):  # the key's implementation is part of its dtype
            return jax.random.wrap_key_data(jnp.asarray(got), impl=want.dtype._impl)
        return jnp.asarray(got, dtype=want.dtype)

    return jax.tree.map(back, template, tree)


def _abstract(template: Any) -> Any:
    def leaf(x: Any) -> Any:
        if _is_key(x):
            data = jax.eval_shape(jax.random.key_data, x)
            return np.zeros(data.shape, data.dtype)
        return np.zeros(np.shape(x), jnp.result_type(x))

    return jax.tree.map(leaf, template)


def check_compatible(directory: str, saved: Mapping[str, Any], template: Any) -> None:
    """Raises naming the differing leaf paths if ``template`` is not the saved state's."""
    want = describe(template)
    differing = sorted(
        [f"{p} (missing in the checkpoint)" for p in want if p not in saved]
        + [f"{p} (only in the checkpoint)" for p in saved if p not in want]
        + [f"{p}: checkpoint {saved[p][0]} {saved[p][1]}, program {want[p][0]} {want[p][1]}"
           for p in want if p in saved and list(saved[p]) != list(want[p])]
    )
    if differing:
        raise ValueError(
            f"{directory} holds a checkpoint of another program's state; differing paths:\n  "
            + "\n  ".join(differing[:20])
            + (f"\n  ... and {len(differing) - 20} more" if len(differing) > 20 else "")
        )


class Checkpointer:
    """A thin wrapper of ``orbax.checkpoint.CheckpointManager`` for train states.

    Examples:
        >>> import tempfile, jax, jax.numpy as jnp
        >>> from graphmod._checkpoint import Checkpointer
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=2)
        >>> state = {"w": jnp.ones(2), "rng": jax.random.key(1)}
        >>> ckpt.save(3, state, {"note": "hi"})
        >>> ckpt.wait()
        >>> restored, meta = ckpt.restore(state)
        >>> meta["note"], bool((restored["w"] == 1).all())
        ('hi', True)
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3,
                 asynchronous: bool = True) -> None:
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep={keep!r}: must be a positive int or None (keep all)")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=asynchronous, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
        """Starts writing ``state`` and ``meta`` for ``step`` (returns before the write ends)."""
        record = {"format": FORMAT, "tree": describe(state), **meta}
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(storable(state)), meta=ocp.args.JsonSave(record)),
            force=True)

    def meta(self, step: int | None = None) -> dict[str, Any]:
        step = self._step(step)
        return self._manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def provenance(self, step: int | None = None) -> Any:
        """The provenance record saved at ``step`` (default: the latest), or None."""
        from graphmod.provenance._record import Provenance

        record = self.meta(step).get("provenance")
        return None if record is None else Provenance.from_dict(record)

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """The state saved at ``step`` (default: the latest) shaped like ``template``."""
        step = self._step(step)
        meta = self.meta(step)
        check_compatible(self.directory, meta.get("tree", {}), template)
        got = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(template))))["state"]
        return _restored(template, got), meta

    def _step(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is None:
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"saved steps: {steps}")
        return step

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
