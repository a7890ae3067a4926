"""Named Blosc settings of the Zarr store for `dspark extract --codec`, chosen by measurement.

Plain data outside `dspark.connector` (importing that registers every sink), so the CLI lists
the names without loading torch, zarr or pydantic.
- zstd: the smallest lossless store (1.46x smaller than bf16 on production-shaped states) that
  still decodes at ~2 GB/s a core; the default.
- lz4: decodes ~2x faster and stores ~1.25x smaller: for readers that must outrun a fast GPU.
"""

CODECS = {
    "zstd": {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20},
    "lz4": {"cname": "lz4", "clevel": 9, "shuffle": "shuffle", "blocksize": 1 << 20},
}
DEFAULT_CODEC = "zstd"
