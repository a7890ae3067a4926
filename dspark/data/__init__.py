"""Chat data: `dspark prepare` and its PreparedData (prepare.py), holdout.py, regenerate.py, the prompt sets
(prompts.py) and LongBench (longbench.py).

May import dspark.verifier, the vLLM child-process helper (vllm_server) and the ground floor; never the
connector, extract, train, decode or the CLI.
"""
