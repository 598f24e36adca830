"""Bricks and applications: the ``Brick`` base, ``@application`` and what it declares, unmodified
Flax modules as applications, constructor capture and Flax's array leaves.
"""
