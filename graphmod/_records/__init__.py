"""Provenance records: assembled from what the core and the training layer expose.

Builds the immutable :class:`~graphmod.Provenance` records of programs, train steps, runs
and evaluations (bricks, parameters, managers, optimizer, data, seeds, environment,
fingerprint). Imports the core only, so the training layer can record what it does; reading
records back and rebuilding models from them is the public ``graphmod.provenance`` package.
"""
