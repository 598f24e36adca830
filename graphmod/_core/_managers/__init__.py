"""Managers: the base class and its protocol, and the order of a chain.
"""
