"""Extraction: the engine seam, its engines (transformers, vLLM), the resumable runner, `dspark serve`, launcher.

Imports: connector (the sinks it writes to), core, data (prepared samples), verifier, vllm_server.
"""
