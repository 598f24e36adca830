"""Shared helpers for graphmod's tests."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

# Eight virtual CPU devices for the multi-device tests (read when JAX's backend starts,
# which no import does): one device stays the default for every other test.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# The tests' programs are tiny: XLA's backend optimizations cost them more than they save
# (a third of the time of the tests that compile in their own process), the case JAX's
# flag is for. Set in the environment too, so that the runs tests start in subprocesses
# compute as the tests comparing with them do (JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the
# suite optimized). The notebooks (executed by the docs build) and the benchmarks keep
# XLA's defaults.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax

# Read by JAX at import; set here too in case a plugin imported JAX first.
if os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1":
    jax.config.update("jax_disable_most_optimizations", True)

# Tests build many programs that lower to the same XLA computations (a new jitted function
# per program, so JAX's in-memory caches miss): each test process keeps JAX's persistent
# compilation cache in its own fresh folder, removed at exit. Set by config, not the
# environment, so the subprocesses tests start compile for themselves (and no two
# processes share a folder: JAX writes its entries without a lock).
if not jax.config.jax_compilation_cache_dir:
    _CACHE = tempfile.mkdtemp(prefix="graphmod-tests-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

RANDOM_PRIMITIVES = {"random_bits", "random_seed", "random_wrap", "random_unwrap",
                     "threefry2x32", "random_fold_in", "random_split"}


def iter_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a (closed) jaxpr, recursing into sub-jaxprs (jit, scan, cond...)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    yield from iter_eqns(sub)


def primitives(jaxpr: Any) -> list[str]:
    """The primitive names of every equation, recursively."""
    return [eqn.primitive.name for eqn in iter_eqns(jaxpr)]


def has_random(jaxpr: Any) -> bool:
    return bool(RANDOM_PRIMITIVES & set(primitives(jaxpr)))


def load_docs_hook(name: str) -> ModuleType:
    """The docs build's hook ``docs/_hooks/<name>.py``, imported from its file (``docs/_hooks``
    is not a package)."""
    path = Path(__file__).resolve().parents[1] / "docs" / "_hooks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"docs_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
