"""Speculative decoding with a trained drafter: settings, prompt sets, drafters, the decode loop and its report.

May import what sits below it (train, eval, export, extract, prepare, settings); never the CLI.
"""
