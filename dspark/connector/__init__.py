"""Sinks and sources of per-sample hidden states (Zarr, Mooncake, live reads) and the vLLM connector.

May import dspark's settings, errors, files and codecs, never the CLI: vLLM workers load it alone.
"""
