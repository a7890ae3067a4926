"""`dspark bench`: a running vLLM server measured from outside (client clocks) and inside (its counters).

Speaks HTTP to the server: may import settings, errors, the prompt sets (data.prompts, prepare's tokenizer) and
eval's report writer; never vLLM or the CLI.
"""
