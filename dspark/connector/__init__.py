"""Sinks and sources of per-sample hidden states (Zarr, Mooncake, live reads) and the vLLM connector.

The rest of dspark opens stores through `base.open_store` and sinks through `config.SinkConfig.open` (the
backends by name: registry.py), and asks a backend's descriptor rather than its name: nothing outside this
package imports a backend's modules or compares a backend name (tests/test_architecture.py checks).

Imports: core, verifier (vLLM workers load it alone: nothing of the pipeline above it).
"""
