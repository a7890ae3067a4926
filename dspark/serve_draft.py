"""`dspark serve-draft`: vLLM serving the verifier with an exported drafter, n-gram, or no speculation.

The speculative config is chosen from the drafter's own config, so a checkpoint is served the way
it was trained to draft:

- `sample_from_anchor: false` (DFlash's layout): `method: dflash`, on any vLLM (V1, CPU or GPU).
- `sample_from_anchor: true` (DSpark's): `method: dspark` with Model Runner V2, which needs a GPU.
  Without one, `auto` serves it as `dflash` with a loud warning: V1's DFlash proposer shifts every
  draft by one for this layout, and acceptance collapses (`dspark export` says the same).
- `ngram` (prompt lookup) and `none` (the verifier alone) take no drafter: the baselines.

An export names its verifier portably (`Org/Name`), which vLLM would look up on the hub: the drafter
is served from a temporary copy whose config names the local verifier folder (the export itself is
not touched), removed when the server stops. Everything after `--` is vLLM's, verbatim.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from dspark.settings import check_settings, setting
from dspark.decode.config import NGRAM_TOKENS, PromptLookupConfig
from dspark.errors import InputError
from dspark.export.serving import dflash_note, speculative_config
from dspark.vllm_server import cpu_env, health_url, offline_env, owned_flags, run_server

# vLLM flags serve-draft sets itself: refused after `--`.
OWNED_FLAGS = {"--model", "--speculative-config", "--host", "--port", "--dtype", "--max-model-len"}


@dataclass
class ServeDraftConfig:
    verifier: str = setting(help="The verifier: a local folder, or a hub id in the Hugging Face cache.")
    drafter: str | None = setting(
        None, "A `dspark export` folder or a checkpoint folder (RUN/latest); not with --method ngram or none.")
    method: Literal["auto", "dspark", "dflash", "eagle3", "ngram", "none"] = setting(
        "auto", "auto: the drafter decides (eagle3 for EAGLE-3; dflash for DFlash and --no-sample-from-anchor "
                "checkpoints; dspark on a GPU, else dflash with a warning); ngram: prompt lookup; none: the "
                "verifier alone.")
    num_speculative_tokens: int | None = setting(
        None, f"Drafts per step (default: the drafter's; ngram: {NGRAM_TOKENS}).", ge=1)
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


def choose(cfg: ServeDraftConfig, gpu: bool) -> tuple[str, int | None, str | None]:
    """(method, drafts per step, a warning to print or None)."""
    if cfg.method == "none":
        return "none", None, None
    if cfg.method == "ngram":
        return "ngram", cfg.num_speculative_tokens or NGRAM_TOKENS, None
    config = drafter_config(cfg.drafter)
    anchor = config.get("sample_from_anchor", True)
    tokens = (cfg.num_speculative_tokens
              or config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    kind = config.get("speculators_model_type", "dspark")
    auto = "eagle3" if kind == "eagle3" else "dspark" if anchor and gpu and kind == "dspark" else "dflash"
    method = cfg.method if cfg.method != "auto" else auto
    # the DFlash family's proposers read DSpark checkpoints too (dflash, shifted, with a warning); the rest is one kind
    if (kind == "eagle3") != (method == "eagle3") or (method == "dspark" and kind != "dspark"):
        raise InputError(f"--method {method} does not serve {cfg.drafter}, a {kind} drafter",
                         f"serve it with --method {auto} (what auto picks)")
    if method == "dspark" and not gpu:
        raise InputError("--method dspark needs a GPU: vLLM's Model Runner V2 and its Triton kernels",
                         "on a CPU, train with --no-sample-from-anchor and serve with --method dflash")
    warning = None
    if method == "dflash" and anchor:
        warning = (f"serving a sample_from_anchor checkpoint with method dflash (no GPU for method dspark): every "
                   f"draft is shifted by one and acceptance collapses. {dflash_note(True)}")
    return method, tokens, warning


def plan(cfg: ServeDraftConfig, vllm_flags: list[str], drafter_copy: str | None, gpu: bool) -> dict:
    """The server's argv, the environment it adds, its /health URL, the speculative config, and a warning."""
    clash = owned_flags(vllm_flags, OWNED_FLAGS)
    if clash:
        raise InputError(f"{', '.join(clash)} after `--` conflicts with what serve-draft sets",
                         "pass it as serve-draft's own option, before `--`")
    method, tokens, warning = choose(cfg, gpu)
    spec = None
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": tokens, **asdict(cfg.lookup)}
    elif method in ("dflash", "dspark", "eagle3"):
        spec = json.loads(speculative_config(drafter_copy or cfg.drafter, tokens, method))
    command = [cfg.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.verifier,
               "--host", cfg.host, "--port", str(cfg.port),
               *(["--dtype", cfg.dtype] if cfg.dtype else []),
               *(["--max-model-len", str(cfg.max_model_len)] if cfg.max_model_len else []),
               *(["--speculative-config", json.dumps(spec)] if spec else []), *vllm_flags]
    env = {**cpu_env(), **offline_env(cfg.verifier, None),
           **({"VLLM_USE_V2_MODEL_RUNNER": "1"} if method == "dspark" else {})}
    return {"command": command, "env": env, "health": health_url(cfg.host, cfg.port), "method": method,
            "speculative_config": spec, "warning": warning}


def serve_draft(cfg: ServeDraftConfig, vllm_flags: list[str], print_only: bool = False, warn=print) -> int:
    """Run vLLM until it exits or is stopped; its exit status."""
    from dspark.hub import local_model

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
        if p["warning"]:
            warn(p["warning"])
        what = {"none": "no speculative decoding", "ngram": "n-gram drafts"}.get(p["method"],
                                                                                f"{p['method']} drafter")
        return run_server(p["command"], p["env"], p["health"], cfg.health_timeout, ready=f"vLLM ({what}) ready")
