"""Speculative decoding with a trained drafter: settings, drafters, the decode loop and its report.

May import what sits below it (train, eval, export, extract, data, verifier, kinds, settings); never the CLI.
"""
