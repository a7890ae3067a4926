"""The Zarr store: format.py (layout, index records, chunk files), reader.py, writer.py, verify.py (its report
and repair notes). Its settings are config.py's ZarrConfig; registry.py names its sink and source factories.

May import dspark.connector's seams (base, config, manifest, encoding, checksum, buffers) and dspark's files, fsio,
errors.
"""
