"""Prefix-cache knowledge: block hashing of prompts and indexes of which endpoint caches what.

Kept free of scheduling imports: :mod:`epp.state.fleet` holds the indexes, and the scheduling
framework imports the fleet state.
"""
