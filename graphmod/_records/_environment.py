"""Where a record was made: library versions, platform and devices, times."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any

import jax

_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "graphmod")


def versions() -> dict[str, str | None]:
    """Versions of Python and the libraries a result depends on.

    Examples:
        >>> from graphmod._records._environment import versions
        >>> sorted(versions())[:3]
        ['flax', 'graphmod', 'jax']
    """
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _DISTRIBUTIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            module = sys.modules.get(name.replace("-", "."))
            out[name] = getattr(module, "__version__", None)
    return out


def platform_record() -> dict[str, Any]:
    """Operating system, machine, JAX backend, device kinds and numerics settings."""
    devices = jax.devices()
    return {
        "system": platform.system(),
        "machine": platform.machine(),
        "python_implementation": platform.python_implementation(),
        "backend": jax.default_backend(),
        "device_kinds": sorted({d.device_kind for d in devices}),
        "device_count": len(devices),
        "process_count": jax.process_count(),
        "x64": bool(jax.config.jax_enable_x64),
        "default_matmul_precision": (None if jax.config.jax_default_matmul_precision is None
                                     else str(jax.config.jax_default_matmul_precision)),
        "default_prng_impl": str(jax.config.jax_default_prng_impl),
    }




def host() -> str:
    """The machine's network name."""
    return platform.node()
