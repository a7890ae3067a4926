"""Chat data: `dspark prepare` and its PreparedData (prepare.py), holdout.py, regenerate.py, the prompt sets
(prompts.py) and LongBench (longbench.py).

Imports: core, verifier, vllm_server (the vLLM child process regenerate starts).
"""
