"""`dspark bench`: a running vLLM server measured from outside (client clocks) and inside (its counters)."""
