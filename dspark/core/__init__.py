"""The ground floor every stage stands on: named errors (errors.py), typed settings and config files (settings.py),
the one plugin registry (registry.py), bounded reads (files.py, jsonio.py), atomic writes and locks (fsio.py,
outputs.py), validated records (records.py), report files (report.py), ports and readiness (net.py), codecs.

Imports: nothing.
"""
