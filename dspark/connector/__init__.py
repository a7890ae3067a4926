"""Sinks and sources of per-sample hidden states; importing this registers every sink."""

from dspark.connector import mooncake, zarr_store  # noqa: F401  (registration side effect)
