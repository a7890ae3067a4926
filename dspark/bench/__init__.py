"""`dspark bench`: a running vLLM server measured from outside (client clocks) and inside (its counters).

Speaks HTTP only: may import settings, errors and jsonio, never torch, vLLM or the CLI.
"""
