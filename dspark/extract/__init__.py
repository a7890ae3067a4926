"""Extraction: the engine seam, its engines (transformers, vLLM), the resumable runner, `dspark serve`, launcher.

May import dspark.connector (the sinks it writes to), prepare, the verifier modules, settings; never train or the CLI.
"""
