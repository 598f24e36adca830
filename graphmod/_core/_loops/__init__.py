"""Loops JAX traces once: ``graphmod.scan``/``remat`` and the per-iteration keys and owned
variables of their bodies (markers, resolution, the jaxpr interpreter).
"""
