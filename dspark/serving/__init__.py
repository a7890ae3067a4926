"""Serving a trained drafter: `dspark serve-draft` (vLLM + drafter, serve_draft.py) and `dspark bench` (bench/).

vLLM is never imported at import time.

Imports: core, data (prompt sets), decode (its settings), export, kinds (the method a checkpoint serves under),
verifier, vllm_server.
"""
