"""dspark: verifier + chat data -> vLLM-servable DSpark drafter."""

__version__ = "0.1.0"
