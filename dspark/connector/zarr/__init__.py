"""The Zarr store: format.py (layout, index records, chunk files), reader.py, writer.py, verify.py.

May import dspark.connector's seams (base, manifest, encoding, checksum, buffers) and dspark's files, fsio, errors.
"""
