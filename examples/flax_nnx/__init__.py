"""Flax's own example models, copied unmodified from google/flax (Apache-2.0).

graphmod's managers regularize these without a line of them edited (tests/integration/
test_flax_examples.py, benchmarks/flax_models.py, the notebooks). Each module says the
google/flax file and commit it comes from; Copyright The Flax Authors, licensed under the
Apache License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0).

``mnist``
    ``CNN``: the NNX MNIST CNN of ``examples/mnist/train.py`` (``nnx.Conv``,
    ``nnx.BatchNorm``, ``nnx.Dropout``, ``nnx.Linear``).
``lm1b``
    ``TransformerLM`` and ``TransformerConfig``: the NNX lm1b decoder-only Transformer of
    ``examples/lm1b_nnx/models.py`` (``nnx.MultiHeadAttention``, ``nnx.Embed`` tied through
    ``attend``, ``nnx.LayerNorm``, ``nnx.Dropout``, the decode cache).
``gemma``
    ``transformer.Transformer``: Gemma's text decoder of ``examples/gemma`` (a package here:
    ``nnx.Einsum`` projections, grouped-query sliding-window and global attention, a
    key-value cache passed in and returned, ``nnx.Embed`` tied through ``attend``), its
    sibling imports made relative.
``scan_over_layers``
    ``ScanMLP`` of ``Block``: the scan-over-layers MLP of
    ``examples/nnx_toy_examples/06_scan_over_layers.py`` (``nnx.vmap`` at construction,
    ``nnx.scan`` in ``__call__``).

>>> from examples.flax_nnx import lm1b, mnist, scan_over_layers
>>> mnist.CNN.__doc__
'A simple CNN model.'
"""
