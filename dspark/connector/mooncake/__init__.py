"""Mooncake, the live store: errors.py, wire.py (keys, packed layout), client.py, sink.py, reader.py.

May import dspark.connector's seams (base, config, manifest) and dspark's errors and fingerprint, never the CLI.
"""
