"""The verifier: what dspark knows of its folder (info.py), the checks before building it (check.py), its content
hashes (fingerprint.py), hub ids (hub.py), `dspark verifier import` (importer.py) and the toy one (toy.py).

Every stage reads the verifier, so it sits below them all.

Imports: core.
"""
