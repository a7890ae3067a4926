"""Sinks and sources of per-sample hidden states; importing this registers every one of them."""

from dspark.connector import live, mooncake, zarr_store  # noqa: F401  (registration side effect)
