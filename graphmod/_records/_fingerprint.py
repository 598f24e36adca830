"""The graph fingerprint: a hash of a canonical jaxpr, stable across processes.

The canonical text is JAX's own printout without source locations, name stacks or colour,
with object addresses (``at 0x...``) removed; closed-over constants, which the printout
names but does not show, are hashed by dtype, shape and bytes. graphmod's trace-isolation
token is a JAX config state: it splits JAX's caches but never appears in a jaxpr. The
fingerprint may change with the JAX version (the record keeps the version beside it).
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

from graphmod._core._codec import hash_array, host_array

if TYPE_CHECKING:
    from jax.extend.core import ClosedJaxpr

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def canonical_text(jaxpr: ClosedJaxpr) -> str:
    """The printout of a closed jaxpr with what varies between processes removed.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from graphmod._records._fingerprint import canonical_text
        >>> print(canonical_text(jax.make_jaxpr(lambda x: x * 2)(jnp.ones(3))))
        { lambda ; a:f32[3]. let b:f32[3] = mul a 2.0:f32[] in (b,) }
    """
    text = jaxpr.pretty_print(use_color=False, source_info=False, name_stack=False)
    return _ADDRESS.sub("", text)


def fingerprint(jaxpr: ClosedJaxpr) -> str:
    """``"sha256:<hex>"`` of a closed jaxpr's canonical text and constants.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from graphmod._records._fingerprint import fingerprint
        >>> a = fingerprint(jax.make_jaxpr(lambda x: x * 2)(jnp.ones(3)))
        >>> a == fingerprint(jax.make_jaxpr(lambda y: y * 2)(jnp.zeros(3)))
        True
        >>> a == fingerprint(jax.make_jaxpr(lambda x: x * 3)(jnp.ones(3)))
        False
    """
    digest = hashlib.sha256(canonical_text(jaxpr).encode())
    for const in getattr(jaxpr, "consts", ()):
        host = host_array(const)
        hash_array(digest, host, f"{host.dtype.str}{host.shape}")
    return "sha256:" + digest.hexdigest()
