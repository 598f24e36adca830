"""Where a record was made: library versions, platform and devices, times."""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import jax

from graphmod.typing import JSON

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


def platform_record() -> dict[str, JSON]:
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
        "x64": bool(_flag("jax_enable_x64")),
        "default_matmul_precision": (None if _flag("jax_default_matmul_precision") is None
                                     else str(_flag("jax_default_matmul_precision"))),
        "default_prng_impl": str(_flag("jax_default_prng_impl")),
    }


def _flag(name: str) -> object:
    """A JAX flag's current value (``jax.config`` sets its attributes at import, so a type
    checker does not know them)."""
    return getattr(jax.config, name)




def host() -> str:
    """The machine's network name."""
    return platform.node()
