"""Speculative decoding with a trained drafter: settings, drafters, the decode loop and its report.

Imports: core, data, extract (the layer capture), kinds, tracking, train, verifier.
"""
