"""Serving a trained drafter: `dspark serve-draft` (vLLM + drafter, serve_draft.py) and `dspark bench` (bench/).

May import kinds (the method a checkpoint serves under), export, decode's settings, data's prompt sets, eval's report
writer, verifier and the ground floor; never vLLM at import time, or the CLI.
"""
